"""An fp8 engine with packed linear weights (engine/packed_weights.py, models/layers/fp8_linear.py)
serves what the emulated one (dequantised values, EngineConfig.packed_fp8=False) serves, keeps
doing so across weight updates written in place, and holds its linears in a byte per parameter;
the same for routed experts packed in fp8 or fp4 (EngineConfig.packed_experts, packed_experts.py)."""

import pytest
import torch

from lockstep.dist.manifest import build_manifest
from lockstep.engine import WeightUpdateError
from lockstep.engine import value_checks as vc
from lockstep.engine.packed_weights import unpacked_state_dict, weight_bytes
from lockstep.models.layers.packed_experts import PackedExperts
from lockstep.models.layers.fp8_linear import Fp8Linear, packed_weights
from lockstep.quant.formats import Storage
from lockstep.quant.serving_format import serving_storage

from conftest import (DEVICE, full_sequence_log_softmax, greedy, make_engine, prompts, requests, same_outputs,
                      sampled, tiny_dsv4)
from launches import count_launches
from test_weight_update import trainer_weights

# the tiny config (every weight under 128 rows: fused fp8 stacks of unaligned weights), and one
# whose q_lora_rank and shared-expert width are a whole 128-row block
CONFIGS = {"tiny": {}, "aligned": dict(q_lora_rank=128, moe_intermediate_size=128)}


# packed vs emulated: bitwise on CPU (the same GEMMs on the same values); on a GPU (fp32) cuBLAS may
# pick another kernel for the packed engine's unfused shapes, so there: the same tokens, logprobs
# within 1e-5
EXACT = DEVICE == "cpu"


def params(i):
    return greedy(max_new_tokens=8) if i % 2 else sampled(seed=i, max_new_tokens=8)


@pytest.mark.parametrize("fmt", ["fp8", "fp8-fp4"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_packed_engine_serves_the_emulated_policy(config, fmt):
    """Same tokens and bitwise the same logprobs (CPU fp32: the same GEMMs on the same values)."""
    packed = make_engine(model=tiny_dsv4(40, **CONFIGS[config]), serving_format=fmt, packed_fp8=True)
    emulated = make_engine(model=tiny_dsv4(40, **CONFIGS[config]), serving_format=fmt, packed_fp8=False)
    names = packed_weights(packed.model)
    fp8_names = [n for n in emulated.model.state_dict() if serving_storage(n, fmt) is Storage.FP8
                 and ".experts." not in n]
    assert sorted(names) == sorted(fp8_names)
    # per layer q_a, q_b, kv, o_a (grouped), o_b, shared gate / up / down; the C4 layers' indexer q_b
    assert len(names) == 4 * 8 + 2 and "model.layers.3.self_attn.compressor.indexer.q_b_proj.weight" in names
    assert not packed_weights(emulated.model)
    sd = packed.model.state_dict()
    for name, module in names.items():
        assert sd[name].dtype == torch.float8_e4m3fn
        assert torch.equal(module.dequantized(torch.float32), emulated.model.state_dict()[name]), name
    for layer in packed.model.model.layers:  # every fused stack is the linears' own storage
        assert layer.mlp.fused_fp8_weight.dtype == torch.float8_e4m3fn
        assert layer.self_attn.fused_fp8_weight.shape[0] == layer.self_attn.q_a_proj.out_features + 16
    ps = prompts(5, seed=41)
    same_outputs(packed.generate(requests(ps, params)), emulated.generate(requests(ps, params)), exact=EXACT)


def _storage_ptrs(engine):
    return {n: (m.weight.data_ptr(), m.weight_scale.data_ptr()) for n, m in packed_weights(engine.model).items()}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_update_writes_packed_storage_in_place(config):
    """After update_weights the packed engine equals a fresh packed engine built on the new weights:
    bytes, scales and outputs; the storage is the same memory (CUDA graphs read it in place)."""
    kw = CONFIGS[config]
    ps = prompts(4, seed=42)
    engine = make_engine(model=tiny_dsv4(43, **kw), serving_format="fp8", packed_fp8=True)
    before_ptrs = _storage_ptrs(engine)
    before = engine.generate(requests(ps, params))
    new = {k: v.to(torch.bfloat16) if v.is_floating_point() and v.dim() >= 2 else v.clone()
           for k, v in tiny_dsv4(44, **kw).state_dict().items()}
    engine.update_weights(new, version=1)
    assert _storage_ptrs(engine) == before_ptrs
    fresh_model = tiny_dsv4(0, **kw)
    fresh_model.load_state_dict({k: v.to(fresh_model.state_dict()[k].dtype) for k, v in new.items()})
    fresh = make_engine(model=fresh_model, serving_format="fp8", packed_fp8=True)
    for (name, m), m_fresh in zip(packed_weights(engine.model).items(), packed_weights(fresh.model).values()):
        assert torch.equal(m.weight, m_fresh.weight) and torch.equal(m.weight_scale, m_fresh.weight_scale), name
    after = engine.generate(requests(ps, params))
    assert any(a.response_ids.tolist() != b.response_ids.tolist() for a, b in zip(after, before))
    same_outputs(after, fresh.generate(requests(ps, params)), exact=True)


@pytest.mark.parametrize("fmt", ["fp8", "fp8-fp4"])
def test_update_quantises_every_packed_weight_in_few_kernel_launches(monkeypatch, fmt):
    """The push's re-quantisation (weight_update.write_served): every packed weight of a storage
    format in one call of its many-tensor kernel (quant/fp8_triton.py, fp4_triton.py; here under
    the interpreter, `eligible` faked as on a GPU): fp8 linears and experts in one launch; fp4
    experts in one launch per tile shape (the tiny model's gate_up and down rows are as wide: one).
    Bitwise what the per-weight reference writes."""
    pytest.importorskip("triton")
    from lockstep.quant import fp4_triton, fp8_triton

    new = {k: v.to(torch.bfloat16) if v.is_floating_point() and v.dim() >= 2 else v.clone()
           for k, v in tiny_dsv4(48).state_dict().items()}

    def updated(kernel: bool):
        engine = make_engine(model=tiny_dsv4(47), serving_format=fmt, packed_fp8=True, packed_experts=True)
        launches = {"fp8": [], "fp4": []}
        if kernel:
            monkeypatch.setattr(fp8_triton, "eligible", lambda t: True)
            launches = {"fp8": count_launches(monkeypatch, fp8_triton, "_fp8_many_kernel"),
                        "fp4": count_launches(monkeypatch, fp4_triton, "_fp4_many_kernel")}
        engine.update_weights(new, version=1)
        monkeypatch.undo()
        return engine, launches

    batched, launches = updated(kernel=True)
    reference, _ = updated(kernel=False)
    stores = packed_weights(batched.model)
    kinds = {n: p.packed_target()[0] for n, p in stores.items()}
    experts = {kinds[n] for n in stores if ".experts." in n}
    assert experts == {"fp8" if fmt == "fp8" else "fp4"} and len(stores) > 20, kinds
    assert {kind: len(grids) for kind, grids in launches.items()} == {"fp8": 1, "fp4": int(fmt == "fp8-fp4")}, launches
    ref_stores = packed_weights(reference.model)
    for name, p in stores.items():
        for got, want in zip(p.packed_target()[1], ref_stores[name].packed_target()[1]):
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), name


@pytest.mark.parametrize("fmt", ["fp8", "fp8-fp4"])
def test_a_second_update_of_a_layout_takes_its_kept_launch(monkeypatch, fmt):
    """A push every step sends one layout from the same tensors (the trainer's): from the second update
    on, the packed weights' per-weight checks are skipped and the kept launch is found by the layout
    and the addresses (host time the device waits on). Its bytes are the reference's; a strided
    source (same address and shape) takes the full path, whose launch reads its strides."""
    pytest.importorskip("triton")
    from lockstep.quant import fp4, fp8, fp8_triton

    def bf16(seed):  # on the engine's device, as a trainer's (a host tensor is copied to a new address each update)
        return {k: (v.to(torch.bfloat16) if v.is_floating_point() and v.dim() >= 2 else v.clone()).to(DEVICE)
                for k, v in tiny_dsv4(seed).state_dict().items()}

    second = bf16(49)
    reference = make_engine(model=tiny_dsv4(47), serving_format=fmt, packed_fp8=True, packed_experts=True)
    reference.update_weights(second, version=1)  # the per-weight path (no kernel on the CPU)
    engine = make_engine(model=tiny_dsv4(47), serving_format=fmt, packed_fp8=True, packed_experts=True)
    monkeypatch.setattr(fp8_triton, "eligible", lambda t: True)
    source = bf16(48)
    engine.update_weights(source, version=1)
    checks = []
    for module in (fp8, fp4):
        monkeypatch.setattr(module, "_check_out", lambda *a, real=module._check_out: checks.append(a) or real(*a))
    for name, t in source.items():  # the trainer's step: new values in the same tensors
        t.copy_(second[name])
    engine.update_weights(source, version=2)
    assert checks == []
    stores, ref_stores = packed_weights(engine.model), packed_weights(reference.model)

    def same_bytes():
        return all(torch.equal(got.view(torch.uint8), want.view(torch.uint8)) for name, p in stores.items()
                   for got, want in zip(p.packed_target()[1], ref_stores[name].packed_target()[1]))

    assert same_bytes()
    name = next(n for n in stores if second[n].dim() >= 2 and second[n].shape[-1] == second[n].shape[-2])
    strided = source[name].transpose(-1, -2)  # the kept launch's address and shape, not its strides
    reference.update_weights({**second, name: strided.contiguous()}, version=2)
    engine.update_weights({**source, name: strided}, version=3)
    assert checks  # the full path
    assert same_bytes()


def test_partial_update_of_one_packed_weight():
    """A bucket holding one fused fp8 weight rewrites that weight's rows and scales only."""
    engine = make_engine(seed=45, serving_format="fp8", packed_fp8=True)
    name = "model.layers.2.self_attn.kv_proj.weight"
    attn = engine.model.model.layers[2].self_attn
    fused_before = attn.fused_fp8_weight.clone()
    w = trainer_weights(46)[name]
    engine.update_weights({name: w}, version=1, partial=True)
    rows = attn.q_a_proj.out_features
    assert torch.equal(attn.fused_fp8_weight[:rows], fused_before[:rows])
    assert not torch.equal(attn.fused_fp8_weight[rows:], fused_before[rows:])
    assert torch.equal(attn.kv_proj.dequantized(torch.float32),
                       make_engine(model=_with(tiny_dsv4(45), name, w), serving_format="fp8",
                                   packed_fp8=False).model.state_dict()[name])


def _with(model, name, w):
    model.state_dict()[name].copy_(w)
    return model


def test_weight_bytes_of_packed_fp8_linears():
    """On a config whose linears dominate (attention ranks of 1024 / 512 over hidden 512; routed
    experts, which stay unpacked, of width 32; 2 mHC streams), fp8 holds <= 0.55x the bf16 engine's
    weight bytes; unpacked_weight_bytes gives the bf16 engine's figure without building it."""
    kw = dict(hidden_size=512, q_lora_rank=1024, head_dim=64, num_attention_heads=32, o_lora_rank=512,
              moe_intermediate_size=32, n_routed_experts=2, num_experts_per_tok=1, index_n_heads=4,
              index_head_dim=32, hc_mult=2, vocab_size=64, max_position_embeddings=128)
    fp8 = make_engine(model=tiny_dsv4(47, **kw), serving_format="fp8", packed_fp8=True, dtype="bfloat16", max_model_len=64,
                      cuda_graph=False)
    bf16 = make_engine(model=tiny_dsv4(47, **kw), serving_format="bf16", dtype="bfloat16", max_model_len=64,
                       cuda_graph=False)
    n_bf16 = bf16.weight_bytes()
    assert fp8.unpacked_weight_bytes() == n_bf16 == weight_bytes(bf16.model)
    assert n_bf16 == sum(t.numel() * t.element_size() for t in bf16.model.state_dict().values())
    ratio = fp8.weight_bytes() / n_bf16
    packed = sum(m.weight.numel() for m in packed_weights(fp8.model).values())
    print(f"weight bytes fp8 {fp8.weight_bytes()} of bf16 {n_bf16}: {ratio:.3f} ({packed} packed parameters)")
    assert ratio <= 0.55
    # what was saved is one byte per packed parameter, less the scales and scale-row tables
    scales = sum(t.numel() * t.element_size() for m in packed_weights(fp8.model).values() for t in m.buffers()
                 if t.dtype != torch.float8_e4m3fn)
    assert n_bf16 - fp8.weight_bytes() <= packed and n_bf16 - fp8.weight_bytes() >= packed - 2 * scales
    assert all(isinstance(m, Fp8Linear) for m in packed_weights(fp8.model).values())


@pytest.mark.parametrize("fmt", ["fp8", "fp8-fp4"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_packed_experts_serve_the_emulated_policy(config, fmt):
    kw = CONFIGS[config]
    packed = make_engine(model=tiny_dsv4(48, **kw), serving_format=fmt, packed_fp8=True, packed_experts=True)
    emulated = make_engine(model=tiny_dsv4(48, **kw), serving_format=fmt, packed_fp8=False)
    experts = [layer.mlp.experts for layer in packed.model.model.layers]
    assert all(isinstance(e, PackedExperts) for e in experts)
    e = experts[1]
    if fmt == "fp8":
        assert e.gate_up_proj.dtype == torch.float8_e4m3fn and e.gate_up_proj.shape == e.shapes["gate_up_proj"]
    else:
        assert e.gate_up_proj.dtype == torch.uint8 and e.gate_up_proj.shape[-1] * 2 == e.shapes["gate_up_proj"][-1]
    for name in ("model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"):
        attr = name.rpartition(".")[2]
        assert torch.equal(e.expert_weights()[attr == "down_proj"], emulated.model.state_dict()[name]), name
    served = unpacked_state_dict(packed.model, torch.float32)  # the served values, every tensor
    assert all(torch.equal(served[n], t) for n, t in emulated.model.state_dict().items())
    ps = prompts(5, seed=49)
    same_outputs(packed.generate(requests(ps, params)), emulated.generate(requests(ps, params)), exact=EXACT)
    # update in place, then equal to a fresh packed engine on the new weights
    ptrs = [(x.gate_up_proj.data_ptr(), x.down_scale.data_ptr()) for x in experts]
    new = {k: v.to(torch.bfloat16) if v.is_floating_point() and v.dim() >= 2 else v.clone()
           for k, v in tiny_dsv4(50, **kw).state_dict().items()}
    packed.update_weights(new, version=1)
    assert [(x.gate_up_proj.data_ptr(), x.down_scale.data_ptr()) for x in experts] == ptrs
    fresh_model = tiny_dsv4(0, **kw)
    fresh_model.load_state_dict({k: v.to(fresh_model.state_dict()[k].dtype) for k, v in new.items()})
    fresh = make_engine(model=fresh_model, serving_format=fmt, packed_fp8=True, packed_experts=True)
    for x, y in zip(experts, (layer.mlp.experts for layer in fresh.model.model.layers)):
        assert all(torch.equal(a, b) for a, b in zip(x.buffers(), y.buffers()))
    same_outputs(packed.generate(requests(ps, params)), fresh.generate(requests(ps, params)), exact=True)
    # a disaggregated push's manifest from the engine's model is the trainer's (unpacked shapes)
    trainer_side = build_manifest(tiny_dsv4(0, **kw), torch.bfloat16, 1 << 20)
    assert build_manifest(packed.model, torch.bfloat16, 1 << 20).hash == trainer_side.hash
    with pytest.raises(Exception, match="gate_up_proj"):  # checked against the unpacked shape
        packed.update_weights({"model.layers.1.mlp.experts.gate_up_proj": e.gate_up_proj[..., :2].float()},
                              version=2, partial=True)


@pytest.mark.parametrize("fmt,bound", [("fp8", 0.53), ("fp8-fp4", 0.32)])
def test_weight_bytes_of_packed_experts(fmt, bound):
    """On a config whose routed experts dominate (16 of width 256 over hidden 128; 2 mHC streams), in
    bf16, with linears and experts packed: fp8 (1 byte per parameter) <= 0.53x bf16's bytes, fp8-fp4
    (experts 0.5 byte + 1/32) <= 0.32x."""
    kw = dict(hidden_size=128, moe_intermediate_size=256, n_routed_experts=16, hc_mult=2)
    packed = make_engine(model=tiny_dsv4(51, **kw), serving_format=fmt, packed_fp8=True, packed_experts=True, dtype="bfloat16",
                         cuda_graph=False)
    bf16 = make_engine(model=tiny_dsv4(51, **kw), serving_format="bf16", dtype="bfloat16", cuda_graph=False)
    assert packed.unpacked_weight_bytes() == bf16.weight_bytes()
    ratio = packed.weight_bytes() / bf16.weight_bytes()
    print(f"weight bytes {fmt} {packed.weight_bytes()} of bf16 {bf16.weight_bytes()}: {ratio:.3f}")
    assert ratio <= bound


@pytest.mark.skipif(DEVICE != "cuda", reason="the fp8 / fp4 kernels serve bf16 on GPUs (LOCKSTEP_TEST_DEVICE=cuda)")
@pytest.mark.parametrize("fmt,packing", [("fp8", {}), ("fp8", {"packed_experts": True}),
                                         ("fp8-fp4", {"packed_experts": True})])
def test_gpu_kernels_serve_the_emulated_policy(fmt, packing):
    """bf16 on a GPU, decode graphs captured (compiled layers): the packed engine's kernels. Each
    token's logprob is its own model's full forward (the trainer's view), and that full forward is
    the emulated model's up to bf16 GEMM rounding (the kernels sum in another order)."""
    kw = CONFIGS["aligned"]
    packed = make_engine(model=tiny_dsv4(53, **kw), serving_format=fmt, dtype="bfloat16", packed_fp8=True, **packing)
    emulated = make_engine(model=tiny_dsv4(53, **kw), serving_format=fmt, dtype="bfloat16", packed_fp8=False)
    assert packed_weights(packed.model) and not packed_weights(emulated.model)
    worst_self = worst_emulated = 0.0
    ps = prompts(7, lo=3, hi=50, seed=52)
    for i, s in enumerate(packed.generate(requests(ps, params))):
        t = params(i).temperature
        lp = full_sequence_log_softmax(packed.model, s, t)
        chosen = lp.gather(1, s.response_ids.unsqueeze(1)).squeeze(1)
        worst_self = max(worst_self, (s.rollout_logprobs - chosen).abs().max().item())
        worst_emulated = max(worst_emulated, (lp - full_sequence_log_softmax(emulated.model, s, t)).abs().max().item())
    print(f"{fmt}: max |packed engine - its full forward| {worst_self:.2e}, "
          f"max |packed - emulated full forward| {worst_emulated:.2e}")
    assert worst_self <= 2e-2 and worst_emulated <= 2e-2


@pytest.mark.parametrize("fmt", ["fp8", "fp8-fp4"])
def test_a_packed_update_is_written_gated_on_its_checks(monkeypatch, fmt):
    """Where the byte copy and the packed weights' kernels write every tensor of an update, the write
    is launched gated on its value checks, before they are read: a NaN in one weight leaves every
    byte as it was (each kernel saw the gate closed); a clean update then writes the bytes of the
    per-weight path."""
    pytest.importorskip("triton")
    from lockstep.quant import fp4_triton, fp8_triton
    from launches import launch_arguments

    reference = make_engine(model=tiny_dsv4(52), serving_format=fmt, packed_fp8=True, packed_experts=True)
    engine = make_engine(model=tiny_dsv4(52), serving_format=fmt, packed_fp8=True, packed_experts=True)
    targets = engine.update_targets()
    weights = {n: (t.to(DEVICE) if n in targets.packed else t.to(targets.dest[n]))  # the engine's dtypes
               for n, t in tiny_dsv4(53).state_dict().items()}
    reference.update_weights(weights, version=1)  # the per-weight path (no kernel on the CPU)
    monkeypatch.setattr(vc, "INTERPRETED_KERNELS", True)
    monkeypatch.setattr(fp8_triton, "eligible", lambda t: True)
    launches = [launch_arguments(monkeypatch, fp8_triton, "_fp8_many_kernel"),
                launch_arguments(monkeypatch, fp4_triton, "_fp4_many_kernel")]
    name = next(n for n in targets.packed if n.endswith("q_a_proj.weight"))
    bad = {**weights, name: weights[name].clone()}
    bad[name][0, 0] = float("nan")
    snapshot = _served_bytes(engine)
    with pytest.raises(WeightUpdateError, match=rf"{name}: 1 non-finite"):
        engine.update_weights(bad, version=1)
    gates = [args[-1].item() for recorded in launches for args, _ in recorded]
    assert gates and set(gates) == {1}  # every quantisation launched, its gate closed
    assert all(torch.equal(t, snapshot[n]) for n, t in _served_bytes(engine).items())
    engine.update_weights(weights, version=1)
    ref = _served_bytes(reference)
    assert all(torch.equal(t, ref[n]) for n, t in _served_bytes(engine).items())


def _served_bytes(engine) -> dict[str, torch.Tensor]:
    """The bytes of every tensor the engine serves from, its packed storage and scales included."""
    out = {n: t.reshape(-1).view(torch.uint8).clone() for n, t in engine.model.state_dict().items()}
    for name, p in packed_weights(engine.model).items():
        for i, t in enumerate(p.packed_target()[1]):
            out[f"{name} packed {i}"] = t.reshape(-1).view(torch.uint8).clone()
    return out
