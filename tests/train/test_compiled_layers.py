"""The trainer with compiled decoder layers (TrainConfig.compile_backend) trains as the eager
layers do. On CPU the "eager" backend runs the traced region as traced (by hand, "aot_eager",
which traces the backward too, agreed as well: 4 minutes, too slow for CI); inductor's kernels
are for GPUs (the engine's are compared there by tests/engine/test_cuda_graph.py)."""

from __future__ import annotations

import copy

import pytest
import torch

from lockstep.train.config import TrainConfig
from lockstep.train.trainer import Trainer
from tests.train.trainer_fixtures import make_samples, small_config, tiny_model


def test_compiled_layers_train_like_eager_layers():
    from lockstep.models.compiled_layers import _layer_with_experts

    # tracing costs per op, not per element: 2 Sinkhorn iterations (a column, a row, a column step)
    # trace the same ops as the default 20, unrolled 10x fewer times
    cfg = small_config(hc_sinkhorn_iters=2)
    samples = make_samples(6, routing_shape=(cfg.num_hidden_layers, cfg.num_experts_per_tok),
                           n_experts=cfg.n_routed_experts)
    model = tiny_model(config=cfg)
    torch._dynamo.reset()
    # routing replay: forced experts enter the region; 40 tokens per micro-batch: several shapes
    base = dict(max_tokens_per_gpu=40, use_rollout_routing_replay=True)
    eager = Trainer(copy.deepcopy(model), TrainConfig(**base))
    compiled = Trainer(model, TrainConfig(compile_backend="eager", **base))
    assert compiled.model.model.call_layer is not None and eager.model.model.call_layer is None
    for step in range(2):
        a, b = eager.train_step(samples), compiled.train_step(samples)
        for key in ("train/loss", "train/grad_norm", "train/train_rollout_logprob_abs_diff"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), (step, key)
    for (name, x), (_, y) in zip(eager.named_weights(), compiled.named_weights()):
        assert torch.allclose(x, y, atol=1e-6), name
    # compiled, and in few enough variants (layer kinds x shape classes) that dynamo never hits
    # its recompile limit, past which it would silently run the layers eagerly
    variants = torch._dynamo.eval_frame._debug_get_cache_entry_list(_layer_with_experts.__code__)
    assert 1 <= len(variants) < torch._dynamo.config.recompile_limit


def test_compile_backend_is_validated():
    for extra in ({"recompute_activations": True}, {"quant_aware_forward": "fp8"}):
        with pytest.raises(ValueError, match="compile_backend"):
            TrainConfig(compile_backend="inductor", **extra)
