"""--true-on-policy end to end (issue 16): the engine samples with continuous batching (requests of
different lengths joining and leaving mid-decode, chunked prefill), the trainer re-scores the same
tokens, and every logprob has the same bits; train_rollout_logprob_abs_diff is exactly 0 at every
step and after every weight push, in bf16 and fp32, in bf16 serving and in fp8 / fp8-fp4 serving with
the quantisation-aware forward. (models/deepseek_v4_rows.py is the forward both sides run.)"""

import copy

import pytest
import torch

from lockstep.config import EngineConfig, SamplingParams
from lockstep.engine.engine import Engine
from lockstep.engine.request import GenerateRequest
from lockstep.models.deepseek_v4_config import CSA, SLIDING
from lockstep.models.deepseek_v4_init import tiny_config
from lockstep.models.llama import LlamaForCausalLM
from lockstep.models.llama_config import LlamaConfig
from lockstep.train.config import TrainConfig
from lockstep.train.trainer import Trainer
from train.trainer_fixtures import tiny_model
from devices import DEVICE  # cuda: engine (CUDA graphs, multi-step decode) and trainer on a GPU

ABS_DIFF = "train/train_rollout_logprob_abs_diff"


def rollouts(engine: Engine, seed: int):
    """5 requests on 3 slots, prompts of 3-13 tokens, 4-11 new tokens: sequences finish at different
    steps and waiting ones join the running decode."""
    g = torch.Generator().manual_seed(seed)
    requests = []
    for i, (prompt_len, new) in enumerate([(3, 11), (13, 4), (7, 9), (5, 6), (10, 8)]):
        prompt = torch.randint(2, engine.model.config.vocab_size, (prompt_len,), generator=g).tolist()
        sampling = SamplingParams(max_new_tokens=new, temperature=1.0, seed=seed + i, ignore_eos=True)
        requests.append(GenerateRequest(prompt, sampling, group_id=i % 2))
    samples = engine.generate(requests)
    for s in samples:
        s.advantages = 1.0 if s.group_id else -1.0
    return samples


@pytest.mark.parametrize("dtype,serving_format", [("float32", "bf16"), ("bfloat16", "bf16"), ("bfloat16", "fp8"),
                                                  ("bfloat16", "fp8-fp4")])
def test_rollout_and_training_logprobs_are_identical_across_weight_pushes(dtype, serving_format):
    model = tiny_model(config=tiny_config(max_position_embeddings=64))
    engine = Engine(copy.deepcopy(model), EngineConfig(
        max_num_seqs=3, max_model_len=32, max_prefill_tokens=5, dtype=dtype, serving_format=serving_format,
        device=DEVICE, true_on_policy=True))
    quant = None if serving_format == "bf16" else serving_format
    trainer = Trainer(model.to(DEVICE), TrainConfig(dtype=dtype, quant_aware_forward=quant, true_on_policy=True, lr=1e-3))
    for step in range(2):
        samples = rollouts(engine, seed=step)
        for s, logp in zip(samples, trainer.logprobs(samples)):
            logp = logp.cpu()
            assert torch.equal(logp, s.rollout_logprobs), (step, (logp - s.rollout_logprobs).abs().max())
        assert trainer.train_step(samples)[ABS_DIFF] == 0.0
        engine.update_weights(trainer.named_weights(), step + 1)  # the next step samples the new policy


def test_compiled_trainer_layers_keep_the_values_exact():
    # the compiled layers serve the gradient's forward only; the loss reads the row-block values
    # (two layers, two kinds: each kind compiles once; 2 Sinkhorn iterations trace the same ops as
    # 20 in a tenth of the loop, and tracing costs per op)
    model = tiny_model(config=tiny_config(max_position_embeddings=64, num_hidden_layers=2, layer_types=(SLIDING, CSA),
                                          mlp_layer_types=("hash_moe", "moe"), hc_sinkhorn_iters=2))
    engine = Engine(copy.deepcopy(model), EngineConfig(max_num_seqs=3, max_model_len=32, device=DEVICE,
                                                       true_on_policy=True))
    trainer = Trainer(model.to(DEVICE), TrainConfig(true_on_policy=True, compile_backend="eager"))
    samples = rollouts(engine, seed=5)
    metrics = trainer.train_step(samples)
    assert metrics[ABS_DIFF] == 0.0 and metrics["train/grad_norm"] > 0


def test_true_on_policy_refuses_what_it_cannot_serve():
    with pytest.raises(ValueError, match="packed_fp8"):
        EngineConfig(serving_format="fp8", packed_fp8=True, true_on_policy=True)
    with pytest.raises(ValueError, match="true_on_policy"):
        TrainConfig(true_on_policy=True, expert_model_parallel_size=2)
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8))
    with pytest.raises(ValueError, match="LlamaForCausalLM has no true-on-policy forward"):
        Trainer(llama, TrainConfig(true_on_policy=True))
    with pytest.raises(ValueError, match="LlamaForCausalLM has no true-on-policy forward"):
        Engine(copy.deepcopy(llama), EngineConfig(true_on_policy=True))
    # left to the default (None), where it does not apply it is off, not an error
    assert Trainer(copy.deepcopy(llama), TrainConfig()).config.true_on_policy is False
    assert Engine(copy.deepcopy(llama), EngineConfig()).config.true_on_policy is False
    assert EngineConfig(serving_format="fp8", packed_fp8=True).true_on_policy_excluded_by() == "packed_fp8"


def test_left_to_the_default_both_sides_decide_alike_by_device():
    """TrainConfig / EngineConfig.true_on_policy None: DeepSeek-V4 runs the true-on-policy forward on
    CUDA (its cost there measured at 0.83-0.89x) and the default forward on the CPU (row blocks)."""
    model = tiny_model(config=tiny_config(max_position_embeddings=64))
    engine = Engine(copy.deepcopy(model), EngineConfig(max_num_seqs=3, max_model_len=32, device=DEVICE))
    trainer = Trainer(model.to(DEVICE), TrainConfig())
    on_cuda = DEVICE == "cuda"
    assert engine.config.true_on_policy is on_cuda and trainer.config.true_on_policy is on_cuda
    assert engine.model.true_on_policy is on_cuda and trainer.model.true_on_policy is on_cuda
    samples = rollouts(engine, seed=7)
    if on_cuda:
        assert trainer.train_step(samples)[ABS_DIFF] == 0.0
