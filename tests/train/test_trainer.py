"""Trainer seam: learning direction, mismatch metric, non-finite skip, checkpoints, weights, replay."""

from __future__ import annotations

import copy

import pytest
import torch

from lockstep.train.config import TrainConfig
from lockstep.train.trainer import Trainer
from tests.train.trainer_fixtures import make_samples, small_config, tiny_model


def _with_own_logprobs(trainer: Trainer, samples):
    for s, lp in zip(samples, trainer.logprobs(samples)):
        s.rollout_logprobs = lp
    return samples


def test_positive_advantage_samples_gain_logprob():
    trainer = Trainer(tiny_model(), TrainConfig(lr=3e-3, max_tokens_per_gpu=32))
    samples = make_samples(6)
    before = trainer.logprobs(samples)
    for _ in range(3):
        metrics = trainer.train_step(samples)
        assert metrics["train/skipped"] == 0.0
    after = trainer.logprobs(samples)
    for s, b, a in zip(samples, before, after):
        change = float(((a - b) * s.loss_mask).sum())
        assert change > 0 if s.advantages > 0 else change < 0
    assert trainer.num_steps == 3


def test_abs_diff_is_zero_against_own_logprobs():
    trainer = Trainer(tiny_model(), TrainConfig(use_tis=True, max_tokens_per_gpu=24))
    samples = _with_own_logprobs(trainer, make_samples(5))
    metrics = trainer.train_step(samples)
    assert metrics["train/train_rollout_logprob_abs_diff"] == 0.0
    assert metrics["train/train_rollout_kl"] == 0.0
    assert metrics["train/tis"] == 1.0 and metrics["train/tis_clipfrac"] == 0.0
    assert metrics["train/ppo_kl"] == 0.0 and metrics["train/pg_clipfrac"] == 0.0
    # the weights moved: the next step sees a mismatch
    assert trainer.train_step(samples)["train/train_rollout_logprob_abs_diff"] > 0.0


def test_metric_names():
    trainer = Trainer(tiny_model(), TrainConfig(use_tis=True, dual_clip_c=3.0))
    metrics = trainer.train_step(make_samples(3))
    for name in ("train/pg_loss", "train/pg_clipfrac", "train/ppo_kl", "train/entropy", "train/grad_norm",
                 "train/train_rollout_logprob_abs_diff", "train/train_rollout_kl", "train/tis",
                 "train/tis_clipfrac", "train/ess", "train/skipped", "train/skipped_nonfinite", "train/loss",
                 "train/dual_clipfrac"):
        assert name in metrics, name
    assert all(isinstance(v, float) for v in metrics.values())


def test_nonfinite_loss_skips_step_and_keeps_weights():
    trainer = Trainer(tiny_model(), TrainConfig(lr=1e-2))
    samples = make_samples(4)
    samples[1].advantages = float("nan")
    weights = {n: t.clone() for n, t in trainer.named_weights()}
    metrics = trainer.train_step(samples)
    assert metrics["train/skipped_nonfinite"] == 1.0 and metrics["train/skipped"] == 1.0
    assert trainer.num_steps == 0 and trainer.optimizer.step_count == 0
    for n, t in trainer.named_weights():
        assert torch.equal(t, weights[n]), n
    assert all(p.grad is None for p in trainer.model.parameters())
    samples[1].advantages = 1.0
    assert trainer.train_step(samples)["train/skipped_nonfinite"] == 0.0


@pytest.fixture
def restore_determinism():
    """TrainConfig(deterministic=True) switches torch's global deterministic mode on; undo it."""
    enabled, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    yield
    torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


@pytest.mark.parametrize("extra", [{}, dict(quant_aware_forward="fp8-fp4", recompute_activations=True, dtype="bfloat16")])
def test_save_load_gives_identical_next_step(tmp_path, extra, restore_determinism):
    cfg = TrainConfig(lr=1e-3, weight_decay=0.1, max_tokens_per_gpu=30, deterministic=True, **extra)
    samples = make_samples(5)
    a = Trainer(tiny_model(0), cfg)
    a.train_step(samples)
    a.save(tmp_path / "ckpt")
    expected = a.train_step(samples)
    b = Trainer(tiny_model(7), cfg)  # different initial weights: everything must come from the checkpoint
    b.load(tmp_path / "ckpt")
    assert b.num_steps == 1 and b.optimizer.step_count == 1
    got = b.train_step(samples)
    assert got == expected
    for (n, x), (m, y) in zip(a.named_weights(), b.named_weights()):
        assert n == m and torch.equal(x, y), n


def test_named_weights_include_policy_buffers():
    model = tiny_model()
    names = list(model.state_dict())
    trainer = Trainer(model, TrainConfig(quant_aware_forward="fp8-fp4", recompute_activations=True))
    got = dict(trainer.named_weights())
    assert list(got) == names
    assert "model.layers.0.mlp.gate.tid2eid" in got and got["model.layers.0.mlp.gate.tid2eid"].any()
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in got
    # the master (unquantised) values, not the served ones
    ref = tiny_model()
    for n, t in ref.state_dict().items():
        assert torch.equal(got[n], t), n
    # the walk is kept (models/live_state.py) and still reads the weights live
    name = "lm_head.weight"
    param = dict(model.named_parameters())[name]
    param.data = torch.full_like(param, 0.5)
    again = dict(trainer.named_weights())
    assert torch.equal(again[name], torch.full_like(param, 0.5)) and list(again) == names


def test_routing_replay_forces_response_experts():
    cfg = small_config()
    L, k = cfg.num_hidden_layers, cfg.num_experts_per_tok
    samples = make_samples(4, routing_shape=(L, k), n_experts=cfg.n_routed_experts)
    model = tiny_model()
    free = Trainer(copy.deepcopy(model), TrainConfig())
    replay = Trainer(model, TrainConfig(use_rollout_routing_replay=True, max_tokens_per_gpu=20))
    got = replay.routed_experts(samples)
    for s, e in zip(samples, got):
        assert torch.equal(e, s.routed_experts)
    own = free.routed_experts(samples)
    assert any(not torch.equal(e, s.routed_experts) for s, e in zip(samples, own))
    # replay changes the logprobs, and a train step runs with it (recompute too)
    assert any(not torch.equal(a, b) for a, b in zip(replay.logprobs(samples), free.logprobs(samples)))
    replay2 = Trainer(tiny_model(), TrainConfig(use_rollout_routing_replay=True, recompute_activations=True))
    assert replay2.train_step(samples)["train/skipped"] == 0.0


def test_kl_loss_and_entropy_bonus():
    model = tiny_model()
    trainer = Trainer(model, TrainConfig(lr=1e-3, kl_loss_coef=0.1, entropy_coef=0.01),
                      ref_model=copy.deepcopy(model))
    samples = make_samples(4)
    first = trainer.train_step(samples)
    assert first["train/kl_loss"] == 0.0  # policy == reference
    assert first["train/loss"] == pytest.approx(first["train/pg_loss"] - 0.01 * first["train/entropy"], abs=1e-6)
    second = trainer.train_step(samples)
    assert second["train/kl_loss"] > 0.0
    with pytest.raises(ValueError, match="ref_model"):
        Trainer(tiny_model(), TrainConfig(kl_loss_coef=0.1))


@pytest.mark.parametrize("overrides", [
    dict(advantage_estimator="gspo", eps_clip=3e-4, eps_clip_high=4e-4),
    dict(mis="sequence", mis_mode="truncate", veto_threshold=1e-4),
    dict(use_rollout_logprobs=True, loss_agg="dr_grpo", rollout_max_response_len=8),
])
def test_loss_variants_run(overrides):
    trainer = Trainer(tiny_model(), TrainConfig(**overrides))
    samples = make_samples(4)
    old = trainer.logprobs(samples)
    metrics = trainer.train_step(samples, old_logprobs=old)
    assert metrics["train/skipped"] == 0.0
    for v in metrics.values():
        assert v == v  # no NaN


def test_bfloat16_trains_with_fp32_masters():
    trainer = Trainer(tiny_model(), TrainConfig(dtype="bfloat16", lr=1e-3))
    model = trainer.model
    assert model.model.layers[0].self_attn.q_a_proj.weight.dtype == torch.bfloat16
    assert model.model.layers[0].attn_hc.fn.dtype == torch.float32  # kept in fp32
    slot = trainer.optimizer.slots["model.layers.0.self_attn.q_a_proj.weight"]
    assert slot.master.dtype == torch.float32
    ref = tiny_model().model.layers[0].self_attn.q_a_proj.weight
    assert torch.equal(slot.master, ref)  # masters start from the fp32 values, not the bf16 rounding
    metrics = trainer.train_step(make_samples(3))
    assert metrics["train/skipped"] == 0.0
    assert torch.equal(slot.param, slot.master.to(torch.bfloat16))


def test_config_validation():
    with pytest.raises(ValueError, match="eps_clip"):
        TrainConfig(eps_clip=0.0)
    with pytest.raises(ValueError, match="mis"):
        TrainConfig(use_tis=True, mis="token")
    with pytest.raises(ValueError, match="quant_aware_forward"):
        TrainConfig(quant_aware_forward="int4")
    with pytest.raises(TypeError):
        TrainConfig(0.1)  # keyword-only
    assert TrainConfig(eps_clip=0.2).clip_high == 0.2
    assert TrainConfig(advantage_estimator="reinforce_plus_plus").advantage_fn == "reinforce_pp"


def test_engine_rollouts_replayed_and_quant_aware():
    """Samples from the real engine serving fp8-fp4: the quantisation-aware trainer with routing
    replay routes like the engine and reproduces its logprobs; the plain trainer does not."""
    from lockstep.config import EngineConfig, SamplingParams
    from lockstep.engine.engine import Engine
    from lockstep.engine.request import GenerateRequest

    model = tiny_model()
    engine = Engine(copy.deepcopy(model), EngineConfig(max_num_seqs=4, max_model_len=32, serving_format="fp8-fp4"))
    sampling = SamplingParams(max_new_tokens=6, n=2, seed=3, return_routed_experts=True, ignore_eos=True)
    samples = engine.generate([GenerateRequest([5, 9, 17, 3], sampling, group_id=0),
                               GenerateRequest([7, 2, 40], sampling, group_id=1)])
    for s in samples:
        s.advantages = 1.0 if s.group_id else -1.0
    aligned = Trainer(copy.deepcopy(model), TrainConfig(quant_aware_forward="fp8-fp4", use_rollout_routing_replay=True))
    for s, experts in zip(samples, aligned.routed_experts(samples)):
        assert torch.equal(experts, s.routed_experts)
    plain = Trainer(copy.deepcopy(model), TrainConfig())
    aligned_diff = aligned.train_step(samples)["train/train_rollout_logprob_abs_diff"]
    plain_diff = plain.train_step(samples)["train/train_rollout_logprob_abs_diff"]
    assert aligned_diff < 1e-6 < 1e-4 < plain_diff
