"""The engine and the trainer are the same policy: their logprobs agree, before and after a
weight push, and the quantisation-aware forward closes the gap that fp8 serving opens."""

import pytest
import torch

from lockstep.align.compare import compare
from lockstep.commands.sft import _new_embedded_model
from lockstep.config import EngineConfig, SamplingParams
from lockstep.engine.engine import Engine
from lockstep.engine.request import GenerateRequest
from lockstep.rl.arithmetic import arithmetic_prompts
from lockstep.prompt_encoding import encode_prompt
from lockstep.train.config import TrainConfig
from lockstep.train.trainer import Trainer


def build(serving_format="bf16", quant_aware=None, seed=0):
    model, tok = _new_embedded_model(seed)
    twin, _ = _new_embedded_model(seed)
    engine = Engine(model, EngineConfig(serving_format=serving_format, batch_invariant=True, max_num_seqs=16,
                                        max_model_len=64), tokenizer=tok)
    trainer = Trainer(twin, TrainConfig(lr=1e-2, quant_aware_forward=quant_aware))
    prompts = [encode_prompt(tok, p.prompt, True) for p in arithmetic_prompts(8, seed=3)]
    return engine, trainer, prompts


SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=6, seed=11)


def test_float32_batch_invariant_first_step_and_after_push():
    engine, trainer, prompts = build()
    first = compare(engine, trainer, prompts, SAMPLING)
    assert first.num_tokens > 20
    assert first.mean_abs_diff < 1e-5, first.as_dict()

    # one real update, pushed into the engine: both sides must move together
    samples = engine.generate([GenerateRequest(prompt_ids=p, sampling=SAMPLING, group_id=i // 4)
                               for i, p in enumerate(prompts)])
    for i, s in enumerate(samples):
        s.advantages = 1.0 if i % 2 else -1.0
    before = [p.detach().clone() for _, p in trainer.named_weights()]
    metrics = trainer.train_step(samples)
    assert metrics["train/train_rollout_logprob_abs_diff"] < 1e-5
    assert any(not torch.equal(a, b) for a, (_, b) in zip(before, trainer.named_weights()))
    engine.update_weights(trainer.named_weights(), version=1)
    after = compare(engine, trainer, prompts, SAMPLING)
    assert after.mean_abs_diff < 1e-5, after.as_dict()


@pytest.mark.parametrize("fmt", ["fp8", "fp8-fp4"])
def test_quant_aware_forward_closes_the_serving_gap(fmt):
    engine, plain, prompts = build(serving_format=fmt)
    gap = compare(engine, plain, prompts, SAMPLING).mean_abs_diff
    _, aware, _ = build(serving_format=fmt, quant_aware=fmt)
    closed = compare(engine, aware, prompts, SAMPLING).mean_abs_diff
    assert gap > 1e-4, gap  # fp8 / fp4 weights really change the policy ...
    assert closed < 1e-5, closed  # ... and the trainer that sees them agrees again


def test_layer_drift_is_float32_noise_on_every_layer():
    from lockstep.align.layers import layer_drift

    model, tok = _new_embedded_model(0)
    ids = encode_prompt(tok, "What is 12 + 34? Then add 56 and 78.", True)
    for chunk in (1, 5):
        drift = layer_drift(model.eval(), ids, chunk=chunk)
        assert [d.layer for d in drift] == list(range(model.config.num_hidden_layers))
        assert max(d.max_abs for d in drift) < 1e-3, drift  # a cache or chunking bug gives O(1)


def test_align_command_prints_the_report(capsys):
    from lockstep.cli import main

    assert main(["align", "--num-prompts", "4", "--max-new-tokens", "4", "--layers", "--json"]) == 0
    import json
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["mean_abs_diff"] < 1e-5 and len(report["layers"]) == 4
