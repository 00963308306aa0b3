"""Seconds per GRPO step: lockstep against TRL 1.16's GRPOTrainer, measured in the same run.

Both sides get the same DeepSeek-V4 config and initial weights, the same prompts (token ids;
TRL sees them through a word-level tokenizer whose token i is the string "t{i}"), the same
number of completions per prompt and lengths, the same reward (fraction of even token ids in
the completion), GRPO advantages (group mean / std), PPO clip 0.2, token-level loss, one AdamW
step per generation batch, no KL term. One GRPO step is:

    lockstep   Engine.generate (n samples per prompt) -> reward -> advantages
               -> Trainer.train_step -> Engine.update_weights(trainer.named_weights(), version)
    TRL        GRPOTrainer step: transformers' generate -> reward -> advantages -> loss/backward/AdamW
               (no weight push: generation runs on the trained model itself)

Step time is wall time between consecutive step ends, after `--warmup` steps. On a CPU shared
with other jobs, OpenMP's spinning worker threads make every op wait for a descheduled sibling
(a 2-thread step can run 100x slower); run with OMP_WAIT_POLICY=PASSIVE or `--threads 1` there.

    python benchmarks/grpo_step.py --config cpu-tiny              # 2 CPU cores, fp32
    python benchmarks/grpo_step.py --config gpu-848m              # one H200, bf16 compute

Configs (reference TRL figures from DESIGN.md):
    cpu-tiny   1.24M-param DSV4 (vocab 300, hidden 64, 4 layers, 20 experts top-2; the reference's
               1.26M config is not recorded, this is the nearest round one), 4 prompts x 8
               completions of exactly 8 tokens, prompts of 8 tokens, fp32         TRL ~0.59 s/step
    gpu-848m   8 layers, hidden 1024, 64 experts top-6, vocab 300 (852M params), 8 prompts x 8
               completions of up to 128 tokens (EOS stops), prompts of 16 tokens, bf16   TRL ~7.5 s/step
TRL settings: bf16 autocast on GPU only, gradient checkpointing off (lockstep recompute off too),
`min_new_tokens` = max length where lengths are fixed, router aux loss off (lockstep has none). TRL needs `config.num_experts` on the
DeepseekV4 config (it reads it for MoE models), so it is set to n_routed_experts.
gpu-848m keeps V4's HCA compress rate 128: lockstep's full-sequence forward currently fails on a
batch shorter than 128 tokens (compressor with zero blocks), so responses must not all stop early.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from dataclasses import dataclass

import torch

from lockstep.models.deepseek_v4 import DeepseekV4ForCausalLM
from lockstep.models.deepseek_v4_config import CSA, HCA, SLIDING, DeepseekV4Config
from lockstep.models.deepseek_v4_init import init_deepseek_v4_, tiny_config
from lockstep.models.layers.kernel_switch import TRAINER_ONLY, trainer_kernels

EOS = 1


@dataclass(frozen=True)
class Bench:
    model: DeepseekV4Config
    num_prompts: int
    n: int  # completions per prompt
    prompt_len: int
    max_new_tokens: int
    fixed_length: bool
    device: str
    dtype: str
    steps: int
    warmup: int


def _configs() -> dict[str, Bench]:
    cpu = tiny_config(vocab_size=300, hidden_size=64, moe_intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=4, head_dim=32, q_lora_rank=32, n_routed_experts=20,
                      num_experts_per_tok=2, o_lora_rank=32, index_head_dim=16)
    gpu = DeepseekV4Config(vocab_size=300, hidden_size=1024, moe_intermediate_size=512, num_hidden_layers=8,
                           num_attention_heads=16, head_dim=128, q_lora_rank=512, num_experts_per_tok=6,
                           n_routed_experts=64, o_groups=4, o_lora_rank=256, index_n_heads=16, index_head_dim=64,
                           index_topk=64, sliding_window=64, max_position_embeddings=4096,
                           layer_types=(SLIDING, CSA, HCA, CSA, HCA, CSA, HCA, CSA),
                           mlp_layer_types=("hash_moe",) * 2 + ("moe",) * 6)
    return {
        "cpu-tiny": Bench(cpu, num_prompts=4, n=8, prompt_len=8, max_new_tokens=8, fixed_length=True,
                          device="cpu", dtype="float32", steps=10, warmup=2),
        "gpu-848m": Bench(gpu, num_prompts=8, n=8, prompt_len=16, max_new_tokens=128, fixed_length=False,
                          device="cuda", dtype="bfloat16", steps=5, warmup=2),
    }


def make_model(bench: Bench) -> DeepseekV4ForCausalLM:
    model = DeepseekV4ForCausalLM(bench.model)
    init_deepseek_v4_(model, seed=0)
    return model


def make_prompts(bench: Bench, total: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(2, bench.model.vocab_size, (total, bench.prompt_len), generator=g).tolist()


def reward(ids) -> float:
    ids = list(ids)
    return sum(1 for t in ids if t % 2 == 0) / max(len(ids), 1)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# ---- lockstep ---------------------------------------------------------------------------------


def _engine(bench: Bench, model):
    from lockstep.config import EngineConfig
    from lockstep.engine.engine import Engine

    return Engine(model, EngineConfig(
        max_num_seqs=bench.num_prompts * bench.n, max_model_len=bench.prompt_len + bench.max_new_tokens + 1,
        max_prefill_tokens=max(2048, bench.num_prompts * bench.prompt_len), dtype=bench.dtype,
        device=bench.device, eos_token_ids=(EOS,), true_on_policy=False))  # as _train_config says


def _train_config(bench: Bench, compile_backend: str | None = None, kernels: tuple[str, ...] | None = None,
                  cuda_graphs: bool = False):
    from lockstep.train.config import TrainConfig

    # the default forward on both sides, as the ratio to TRL has been measured since the first run
    # (on CUDA `lockstep train` now runs the true-on-policy forward unless --no-true-on-policy:
    # README, its cost as ratios)
    return TrainConfig(lr=1e-6, clip_grad=1.0, dtype=bench.dtype, temperature=1.0, compile_backend=compile_backend,
                       **({} if kernels is None else trainer_kernels(kernels)),  # None: the defaults
                       max_tokens_per_gpu=bench.num_prompts * bench.n * (bench.prompt_len + bench.max_new_tokens),
                       true_on_policy=False, train_cuda_graphs=cuda_graphs)


def _rollout(engine, bench: Bench, batch: list[list[int]], step: int, seeded: bool, advantage_fn: str) -> list:
    """One rollout: sample, reward, GRPO advantages. `seeded`: request j of step s draws from seed
    base(s) + j * n (its samples from base + j * n + i), so two runs sample the same tokens from equal weights."""
    import dataclasses as dc

    from lockstep.config import SamplingParams
    from lockstep.engine.request import GenerateRequest
    from lockstep.rl.advantages import compute_advantages

    sampling = SamplingParams(temperature=1.0, max_new_tokens=bench.max_new_tokens, n=bench.n,
                              ignore_eos=bench.fixed_length, seed=None)
    requests = [GenerateRequest(p, dc.replace(sampling, seed=1_000_003 * step + j * bench.n) if seeded else sampling,
                                group_id=j) for j, p in enumerate(batch)]
    samples = engine.generate(requests)
    for s in samples:
        s.reward = reward(s.response_ids.tolist())
    adv = compute_advantages(advantage_fn, torch.tensor([s.reward for s in samples]),
                             group_ids=[s.group_id for s in samples])
    for s, a in zip(samples, adv.tolist()):
        s.advantages = a
    return samples


def _batch(bench: Bench, prompts: list[list[int]], step: int) -> list[list[int]]:
    return prompts[step * bench.num_prompts:(step + 1) * bench.num_prompts]


def _record(metrics: dict, samples: list) -> dict:
    """What two runs of the same steps are compared on: the rollout's reward and the train/rollout gap."""
    return {"reward": statistics.mean(s.reward for s in samples),
            "abs_diff": metrics["train/train_rollout_logprob_abs_diff"]}


def run_lockstep(bench: Bench, prompts: list[list[int]], profile: bool = False,
                 compile_backend: str | None = None, seeded: bool = False, kernels: tuple[str, ...] | None = None,
                 cuda_graphs: bool = False) -> dict:
    from lockstep.train.trainer import Trainer

    model = make_model(bench).to(bench.device)
    engine = _engine(bench, copy.deepcopy(model))
    cfg = _train_config(bench, compile_backend, kernels, cuda_graphs)
    trainer = Trainer(model, cfg)
    times, parts, steps = [], {"rollout": [], "train": [], "sync": []}, []
    last = time.perf_counter()
    for step in range(bench.warmup + bench.steps):
        t0 = time.perf_counter()
        samples = _rollout(engine, bench, _batch(bench, prompts, step), step, seeded, cfg.advantage_fn)
        t1 = time.perf_counter()
        steps.append(_record(trainer.train_step(samples), samples))
        _sync(bench.device)
        t2 = time.perf_counter()
        engine.update_weights(trainer.named_weights(), version=step + 1)
        _sync(bench.device)
        now = time.perf_counter()
        if step >= bench.warmup:
            times.append(now - last)
            for k, v in (("rollout", t1 - t0), ("train", t2 - t1), ("sync", now - t2)):
                parts[k].append(v)
        last = now
    if profile:  # one more rollout under the profiler, on the trained weights
        from kernel_profile import host_profile, profile_generate
        from lockstep.config import SamplingParams
        from lockstep.engine.request import GenerateRequest

        sampling = SamplingParams(temperature=1.0, max_new_tokens=bench.max_new_tokens, n=bench.n,
                                  ignore_eos=bench.fixed_length)
        print(profile_generate(engine, [GenerateRequest(p, sampling, group_id=j)
                                        for j, p in enumerate(_batch(bench, prompts, step))]))
        # the host's side of one whole step: what the rollout's and the eager train step's wall
        # time beyond their device time is spent on
        print(host_profile(lambda: trainer.train_step(_rollout(engine, bench, _batch(bench, prompts, step), step,
                                                               seeded, cfg.advantage_fn))))
    peak = torch.cuda.max_memory_allocated() if bench.device.startswith("cuda") else None
    return {"step": times, **{k: statistics.median(v) for k, v in parts.items()},
            "train_range": (min(parts["train"]), max(parts["train"])),  # a compile or a recording shows here
            "tokens": sum(s.response_len for s in samples), "steps": steps, "peak_bytes": peak}


def _tokenizer(vocab_size: int):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token=f"t{EOS}", unk_token="t0")


def _hf_model(bench: Bench):
    from transformers import DeepseekV4Config as HFConfig
    from transformers import DeepseekV4ForCausalLM as HFModel

    hf_config = HFConfig(**bench.model.to_hf_dict())
    hf_config.num_experts = bench.model.n_routed_experts  # TRL 1.16 reads it on MoE models
    hf_config._attn_implementation = "eager"
    hf = HFModel(hf_config)
    missing, unexpected = hf.load_state_dict(make_model(bench).state_dict(), strict=False)
    assert not unexpected and all("inv_freq" in k for k in missing), (missing, unexpected)
    return hf


def run_trl(bench: Bench, prompts: list[list[int]]) -> dict:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.ends = [time.perf_counter()]

        def on_step_end(self, args, state, control, **kwargs):
            _sync(bench.device)
            self.ends.append(time.perf_counter())

    def reward_fn(prompts, completions, completion_ids, **kwargs):
        return [reward(ids) for ids in completion_ids]

    completions = bench.num_prompts * bench.n
    total_steps = bench.warmup + bench.steps
    data = Dataset.from_list([{"prompt": " ".join(f"t{t}" for t in p)} for p in prompts[:total_steps * bench.num_prompts]])
    gen_kwargs = {"min_new_tokens": bench.max_new_tokens} if bench.fixed_length else {}
    args = GRPOConfig(
        output_dir="/tmp/grpo_step_trl", per_device_train_batch_size=completions, num_generations=bench.n,
        max_completion_length=bench.max_new_tokens, max_steps=total_steps, learning_rate=1e-6, beta=0.0,
        temperature=1.0, loss_type="dapo", gradient_checkpointing=False, bf16=bench.dtype == "bfloat16",
        use_cpu=bench.device == "cpu", report_to=[], save_strategy="no", logging_steps=10_000,
        shuffle_dataset=False, generation_kwargs=gen_kwargs, disable_tqdm=True, seed=0, router_aux_loss_coef=0.0)
    timer = StepTimer()
    trainer = GRPOTrainer(model=_hf_model(bench), reward_funcs=[reward_fn], args=args, train_dataset=data,
                          processing_class=_tokenizer(bench.model.vocab_size), callbacks=[timer])
    timer.ends = [time.perf_counter()]
    trainer.train()
    steps = [b - a for a, b in zip(timer.ends, timer.ends[1:])]
    return {"step": steps[bench.warmup:]}


# ---- main -------------------------------------------------------------------------------------


def main() -> None:
    configs = _configs()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", choices=list(configs), default="cpu-tiny")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--skip-trl", action="store_true", help="time the lockstep side only")
    parser.add_argument("--profile", action="store_true",
                        help="CUDA: print the kernels of one more rollout and the host profile of one more step")
    parser.add_argument("--compile-trainer", action="store_true",
                        help="the trainer's decoder layers compiled with inductor (TrainConfig.compile_backend)")
    parser.add_argument("--train-cuda-graphs", action="store_true",
                        help="the trainer's forward and backward replayed from CUDA graphs per shape bucket "
                             "(TrainConfig.train_cuda_graphs)")
    parser.add_argument("--trainer-kernels", nargs="+", default=None, choices=("none",) + TRAINER_ONLY,
                        help="exactly these TrainConfig kernel switches on (the trainer's Triton attention, RMSNorm, "
                             "RoPE, MoE combine, logprobs; none: the eager ops); default: all (TrainConfig's)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--device", default=None, help="override the config's device (cpu, cuda)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None, help="override the config's dtype")
    parser.add_argument("--disaggregated", action="store_true",
                        help="also run the steps as a trainer process + an engine process (weights pushed over "
                             "torch.distributed; disaggregated_step.py) and compare rewards and the train/rollout "
                             "gap with the in-process run (both seeded), and peak memory with `lockstep plan`")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    bench = configs[args.config]
    overrides = {k: v for k in ("steps", "warmup", "device", "dtype") if (v := getattr(args, k)) is not None}
    bench = Bench(**{**bench.__dict__, **overrides})
    if args.profile and not bench.device.startswith("cuda"):
        parser.error("--profile reads CUDA kernel times: use a CUDA config or --device cuda")
    torch.manual_seed(0)
    n_params = sum(p.numel() for p in make_model(bench).parameters())
    print(f"config {args.config}: {n_params / 1e6:.2f}M params, {bench.num_prompts} prompts x {bench.n} completions, "
          f"prompt {bench.prompt_len}, up to {bench.max_new_tokens} new tokens, {bench.device} {bench.dtype}, "
          f"torch threads {torch.get_num_threads()}")
    prompts = make_prompts(bench, (bench.warmup + bench.steps) * bench.num_prompts)
    t = time.perf_counter()
    ours = run_lockstep(bench, prompts, profile=args.profile,
                        compile_backend="inductor" if args.compile_trainer else None, seeded=args.disaggregated,
                        kernels=None if args.trainer_kernels is None
                        else tuple(k for k in args.trainer_kernels if k != "none"), cuda_graphs=args.train_cuda_graphs)
    ours_s = statistics.median(ours["step"])
    print(f"lockstep  {ours_s:.3f} s/step (median of {len(ours['step'])}; rollout {ours['rollout']:.3f}, "
          f"train {ours['train']:.3f} ({ours['train_range'][0]:.3f}-{ours['train_range'][1]:.3f}), "
          f"weight sync {ours['sync']:.3f}; whole run with compilation "
          f"{time.perf_counter() - t:.0f} s)")
    if args.disaggregated:
        _disaggregated(bench, prompts, ours)
    if args.skip_trl:
        return
    trl = run_trl(bench, prompts)
    trl_s = statistics.median(trl["step"])
    print(f"TRL 1.16  {trl_s:.3f} s/step (median of {len(trl['step'])})")
    print(f"ratio TRL / lockstep = {trl_s / ours_s:.2f}x")


def _disaggregated(bench: Bench, prompts: list[list[int]], ours: dict) -> None:
    from disaggregated_step import compare, planned_vs_measured, run_disaggregated

    if ours["peak_bytes"] is not None:
        print(f"in-process peak memory (trainer + engine): {ours['peak_bytes'] / 1e9:.2f} GB")
    t = time.perf_counter()
    disagg = run_disaggregated(bench, prompts)
    print(f"disaggregated: trainer on {disagg['devices'][0]}, engine on {disagg['devices'][1]}, "
          f"{disagg['backend']}; whole run {time.perf_counter() - t:.0f} s")
    for line in compare(ours, disagg, bench.warmup) + planned_vs_measured(bench, disagg):
        print(line)


if __name__ == "__main__":
    main()
