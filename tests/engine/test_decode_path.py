"""Which path serves the engine (engine/decode_path.py): a compile or capture failure is an error
naming its stage unless EngineConfig.compile_fallback; the startup line says what serves and which
kernels are on. On the CPU the decode graphs run their stand-in (no capture), compiled with the
"eager" backend, so the same start-up code runs as on a GPU."""

import dataclasses

import pytest
import torch

from lockstep.engine.cuda_graph import StageError
from lockstep.engine.decode_path import describe, start_graphs
from lockstep.models import compiled_layers
from lockstep.models.deepseek_v4_config import SLIDING
from lockstep.models.layers.kernel_switch import Switched

from conftest import DEVICE, make_engine, tiny_dsv4


def _start(engine, **config):
    config = dataclasses.replace(engine.config, **config)
    start_graphs(engine.adapter, config, capture=False, compile_backend="eager")
    return describe(engine.adapter, engine.kernels)


def _failing_compile(*args, **kwargs):
    raise RuntimeError("no compiler here")


def test_a_failed_compilation_is_an_error_naming_its_stage(monkeypatch):
    engine = make_engine(seed=1)
    monkeypatch.setattr(compiled_layers.torch, "compile", _failing_compile)
    with pytest.raises(StageError, match="compiling the decoder layers failed: RuntimeError: no compiler here") as e:
        _start(engine)
    assert e.value.stage == "compiling the decoder layers" and "compile_fallback" in str(e.value)


def test_a_failed_prefill_compilation_names_the_prefill(monkeypatch):
    engine = make_engine(seed=2)

    def failing_call(self, *args, **kwargs):
        raise RuntimeError("inductor crashed")

    monkeypatch.setattr(compiled_layers.CompiledLayers, "__call__", failing_call)
    with pytest.raises(StageError, match="compiling the prefill step failed: RuntimeError: inductor crashed"):
        _start(engine)


def test_with_the_fallback_it_warns_and_serves_eagerly(monkeypatch):
    engine = make_engine(seed=3)
    monkeypatch.setattr(compiled_layers.torch, "compile", _failing_compile)
    with pytest.warns(RuntimeWarning, match="compiling the decoder layers failed.*capturing the eager forward"):
        path = _start(engine, compile_fallback=True)
    assert path.startswith("decode: eager + graph stand-in (no capture); prefill: eager;")
    assert engine.adapter.graphs is not None and engine.adapter.graphs.compiled_layers is None


def test_when_the_eager_graphs_fail_too_the_fallback_decodes_without_graphs(monkeypatch):
    engine = make_engine(seed=4)
    monkeypatch.setattr(compiled_layers.torch, "compile", _failing_compile)
    monkeypatch.setattr(engine.adapter, "warm_up_prefill", _failing_compile)  # fails in both attempts
    with pytest.warns(RuntimeWarning) as record:
        path = _start(engine, compile_fallback=True)
    assert [str(w.message).split(";")[-1].strip() for w in record] == [
        "EngineConfig.compile_fallback: capturing the eager forward", "EngineConfig.compile_fallback: decoding eagerly"]
    assert engine.adapter.graphs is None and path.startswith("decode: eager; prefill: eager;")


def test_compile_decode_off_and_the_environment_override(monkeypatch):
    # the two starts that compile trace every layer kind: one layer (window-only, the cheapest kind)
    # and 2 Sinkhorn iterations keep them short (37 s -> 10 s); which path starts is model-independent
    model = tiny_dsv4(5, num_hidden_layers=1, layer_types=(SLIDING,), mlp_layer_types=("hash_moe",),
                      hc_sinkhorn_iters=2)
    engine = make_engine(model=model)
    assert _start(engine).startswith("decode: compiled (eager) + graph stand-in (no capture); prefill: compiled;")
    assert _start(engine, compile_decode=False).startswith("decode: eager + graph stand-in")
    monkeypatch.setenv("LOCKSTEP_COMPILE", "1")  # the environment wins when set
    assert _start(engine, compile_decode=False).startswith("decode: compiled (eager)")
    monkeypatch.setenv("LOCKSTEP_COMPILE", "0")
    assert _start(engine).startswith("decode: eager + graph stand-in")


def test_the_engine_hands_its_kernel_switches_to_the_model(monkeypatch):
    monkeypatch.delenv("LOCKSTEP_TRITON_MOE", raising=False)
    monkeypatch.delenv("LOCKSTEP_TRITON_HC", raising=False)
    monkeypatch.delenv("LOCKSTEP_COMPILE", raising=False)
    engine = make_engine(seed=6, triton_moe=False, compile_hc=False)
    switched = [m for m in engine.model.modules() if isinstance(m, Switched)]
    kinds = {type(m).__name__ for m in switched}
    assert kinds == {"HyperConnection", "HyperHead", "DeepseekV4Attention", "Experts", "RMSNorm", "Compressor",
                     "CSACompressor", "Indexer", "Router"}, kinds
    assert all(m.kernels is engine.kernels for m in switched)
    assert engine.sampler.draw_kernels  # the engine's own switch, handed to its sampler
    assert engine.serving_path == ("decode: eager; prefill: eager; kernels: triton_moe off, triton_hc on, "
                                   "triton_attention on, triton_router on, triton_compressor on, triton_sampler on, "
                                   "compile_hc off, "
                                   "true_on_policy off, fixed_order on CUDA, triton_index off, compile_rows on CUDA")
    monkeypatch.setenv("LOCKSTEP_TRITON_HC", "0")
    assert "triton_hc off (LOCKSTEP_TRITON_HC=0)" in describe(engine.adapter, engine.kernels)
    with torch.no_grad():  # still serves
        assert engine.model(torch.tensor([[1, 2, 3]], device=DEVICE)).shape[-1] == engine.model.config.vocab_size
