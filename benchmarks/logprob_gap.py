"""Train/rollout log-probability gap of lockstep on one device, measured, not assumed.

For a model config, the engine samples completions in each serving format and the trainer
re-scores them (with and without the quantisation-aware forward); prints the mean and max
|logp_train - logp_rollout| per setting, and the ratio against the public baseline the
project starts from (0.09 mean, the ROCm bring-up of DeepSeek-V4-Flash; DSV4_SPEC.md).

    python benchmarks/logprob_gap.py --config 1b --device cuda --dtype bfloat16
    python benchmarks/logprob_gap.py ... --no-compile-decode      # the engine's decode uncompiled
    python benchmarks/logprob_gap.py --model DIR ...              # a saved model (e.g. `lockstep sft --preset`)
    python benchmarks/logprob_gap.py --model DIR --reinit ...     # its config at random init: the baseline
    python benchmarks/logprob_gap.py ... --true-on-policy 0 1     # also with the true-on-policy forward

--true-on-policy 1 runs engine and trainer through the true-on-policy forward
(models/deepseek_v4_rows.py): its rows must print mean 0 and exact 1.000 (JSON "true_on_policy": true).

With --model the prompts are the model's tokenizer's chat encoding of held-out ("eval" split)
arithmetic problems of --task-digits digits, the task the presets train on, so a trained model's
completions are its own confident ones; otherwise they are random token ids, of lengths drawn
between --prompt-len / 2 and --prompt-len (requests of different lengths: prefill chunks and decode
rows mix, sequences finish apart).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rollout_throughput import bench_config  # noqa: E402  (same configs as the throughput benchmark)

from lockstep.align.compare import compare
from lockstep.config import EngineConfig, SamplingParams
from lockstep.engine.engine import Engine
from lockstep.models.deepseek_v4 import DeepseekV4ForCausalLM
from lockstep.models import load_pretrained
from lockstep.models.deepseek_v4_init import init_deepseek_v4_
from lockstep.models.tokenizer import load_tokenizer
from lockstep.prompt_encoding import encode_prompt
from lockstep.rl.arithmetic import arithmetic_prompts
from lockstep.train.config import TrainConfig
from lockstep.train.trainer import Trainer

BASELINE_MEAN_ABS_DIFF = 0.09


def make_model(args, seed: int) -> DeepseekV4ForCausalLM:
    """--model's saved model (its config at random init with --reinit), else --config's at random init."""
    model = load_pretrained(args.model) if args.model else DeepseekV4ForCausalLM(bench_config(args.config))
    if args.reinit or not args.model:
        init_deepseek_v4_(model, seed)  # every parameter redrawn: the saved weights are gone
    return model


def make_prompts(args, vocab: int) -> list[list[int]]:
    if not args.model:
        g = torch.Generator().manual_seed(1)
        lengths = torch.randint(max(args.prompt_len // 2, 1), args.prompt_len + 1, (args.batch,), generator=g)
        return [torch.randint(2, vocab, (int(n),), generator=g).tolist() for n in lengths]
    tok = load_tokenizer(args.model)
    held_out = arithmetic_prompts(args.batch, digits=args.task_digits, split="eval")
    return [encode_prompt(tok, p.prompt) for p in held_out]


def run_setting(state, prompts, args, fmt, qat, invariant, replay, true_on_policy=False):
    engine_model, train_model = make_model(args, 0), make_model(args, 0)
    engine_model.load_state_dict(state)
    train_model.load_state_dict(state)
    engine = Engine(engine_model, EngineConfig(dtype=args.dtype, device=args.device, serving_format=fmt,
                                               batch_invariant=invariant, max_num_seqs=args.batch,
                                               max_model_len=max(map(len, prompts)) + args.new_tokens + 8,
                                               compile_decode=args.compile_decode, true_on_policy=true_on_policy,
                                               **args.engine_option))
    # the quant-aware parametrisation does not trace: those settings keep eager trainer layers
    compiled = args.compile_trainer and qat is None and not true_on_policy
    trainer = Trainer(train_model.to(args.device), TrainConfig(dtype=args.dtype, quant_aware_forward=qat,
                                                                use_rollout_routing_replay=replay,
                                                                compile_backend="inductor" if compiled else None,
                                                                max_tokens_per_gpu=16384,
                                                                true_on_policy=true_on_policy))
    sampling = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, seed=5, ignore_eos=True,
                              return_routed_experts=replay)
    start = time.perf_counter()
    report = compare(engine, trainer, prompts, sampling)
    return {**report.as_dict(), "serving_format": fmt, "quant_aware_forward": qat, "batch_invariant": invariant,
            "routing_replay": replay, "true_on_policy": true_on_policy, "compiled_trainer": compiled, "engine_path": engine.serving_path,
            "seconds": time.perf_counter() - start}


def _option(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep:
        raise SystemExit(f"--engine-option {text!r}: expected FIELD=VALUE")
    return key, json.loads(value)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", choices=["tiny", "1b"], default="tiny")
    ap.add_argument("--model", default="", help="a saved model directory instead of --config at random init")
    ap.add_argument("--reinit", action="store_true", help="with --model: its config, randomly initialised")
    ap.add_argument("--task-digits", type=int, default=4,
                    help="with --model: digits of the held-out arithmetic prompts (default: 4, the gpu preset's)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--formats", nargs="*", default=["bf16", "fp8", "fp8-fp4"])
    ap.add_argument("--batch-invariant", nargs="*", type=int, default=[0, 1])
    ap.add_argument("--routing-replay", nargs="*", type=int, default=[0, 1])
    ap.add_argument("--true-on-policy", nargs="*", type=int, default=[0],
                    help="0: the default forward, 1: the true-on-policy forward (engine and trainer); both: 0 1")
    ap.add_argument("--compile-trainer", action="store_true",
                    help="the trainer's decoder layers compiled with inductor, as the engine's decode step is "
                         "(settings without the quant-aware forward)")
    ap.add_argument("--compile-decode", action=argparse.BooleanOptionalAction, default=True,
                    help="EngineConfig.compile_decode: the engine's decoder layers compiled before the decode "
                         "graphs are captured (the default); --no-compile-decode captures the eager forward")
    ap.add_argument("--engine-option", action="append", default=[], metavar="FIELD=VALUE",
                    help="another EngineConfig field for every setting, VALUE as JSON (e.g. cuda_graph=false, "
                         "triton_moe=false): to find which part of the engine's path a gap comes from")
    ap.add_argument("--bf16-reduced-precision-reduction", action=argparse.BooleanOptionalAction, default=None,
                    help="torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction for both sides "
                         "(default: torch's)")
    args = ap.parse_args()
    args.engine_option = dict(_option(o) for o in args.engine_option)
    if args.bf16_reduced_precision_reduction is not None:
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = args.bf16_reduced_precision_reduction
    print(f"engine options {args.engine_option}, allow_bf16_reduced_precision_reduction "
          f"{torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction}")
    model = make_model(args, 0)
    state, prompts = model.state_dict(), make_prompts(args, model.config.vocab_size)
    print(f"config {args.model + (' (reinit)' if args.reinit else '') if args.model else args.config}  device {args.device}  dtype {args.dtype}  batch {args.batch}")
    print(f"{'serving':8s} {'qat':8s} {'inv':4s} {'rr':3s} {'top':3s} {'mean|d|':>10s} {'max|d|':>9s} {'exact':>6s} {'vs 0.09':>8s}")
    for fmt, inv, rr, top in itertools.product(args.formats, args.batch_invariant, args.routing_replay,
                                               args.true_on_policy):
        # true on policy serves fp8 with the quantisation-aware forward only (that is its contract)
        for qat in ([None] if fmt == "bf16" else [fmt] if top else [None, fmt]):
            r = run_setting(state, prompts, args, fmt, qat, bool(inv), bool(rr), bool(top))
            print(f"{fmt:8s} {str(qat):8s} {inv:<4d} {rr:<3d} {top:<3d} {r['mean_abs_diff']:10.3e} {r['max_abs_diff']:9.3e} "
                  f"{r['exact_fraction']:6.3f} {r['mean_abs_diff'] / BASELINE_MEAN_ABS_DIFF:8.4f}", flush=True)
            print("JSON " + json.dumps(r))


if __name__ == "__main__":
    main()
