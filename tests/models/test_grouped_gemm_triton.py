"""The Triton grouped GEMMs of the routed experts (grouped_gemm_triton.py) against the
definitions: grouped_mm_reference in fp32 rounded once, and eager bf16 swiglu_clamped. They run
under Triton's interpreter here (TRITON_INTERPRET=1, set in conftest.py); LOCKSTEP_TEST_DEVICE=cuda
runs the same tests on a GPU."""

import os

import pytest
import torch

from lockstep.models.layers import grouped_gemm_triton as gt
from lockstep.models.layers import moe
from lockstep.models.layers.grouped_gemm import grouped_mm_reference, triton_experts

needs_triton = pytest.mark.skipif(gt.triton is None, reason="triton is not installed")
DEVICE = "cuda" if os.environ.get("LOCKSTEP_TEST_DEVICE") == "cuda" else "cpu"
# aot_eager traces the ops' bodies on fake tensors, which interpreted kernels (CPU) cannot run on
COMPILE_BACKENDS = ["eager", "aot_eager"] if DEVICE == "cuda" else ["eager"]

# first and last groups empty, one empty in between, one of 40 rows (3 tiles of BLOCK_M = 16)
COUNTS = [0, 3, 40, 0, 7, 1, 0]
# N and K not multiples of the blocks (48 = 32 + 16 columns, 72 = 2 x 32 + 8), then the default
# config (BLOCK_N = 64 > N, BLOCK_K = 64 = K: the unmasked K loop)
SHAPES = [(48, 72, dict(block_n=32, block_k=32)), (48, 64, {})]


def _setup(seed, n_out, K, values=None):
    """x [M, K], w [G, n_out, K] bf16 on DEVICE, counts (CPU, for the reference), offs int32."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.tensor(COUNTS)
    M, G = int(counts.sum()), len(COUNTS)
    if values is None:
        x, w = torch.randn(M, K, generator=g), torch.randn(G, n_out, K, generator=g)
    else:
        x, w = values(g, (M, K)), values(g, (G, n_out, K))
    offs = counts.cumsum(0).to(torch.int32)
    return x.bfloat16().to(DEVICE), w.bfloat16().to(DEVICE), counts, offs.to(DEVICE)


def _reference(x, w, counts):
    return grouped_mm_reference(x.float(), w.float(), counts).bfloat16()


def _assert_within_ulps(out, ref, ulps, atol=1e-5):
    # a bf16 ulp is 2^-7 of the value or less: fp32 sums in another order round to a neighbour
    assert out.shape == ref.shape and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), rtol=ulps * 2**-7, atol=atol)


def _eighths(g, shape):
    # small multiples of 1/8: every fp32 partial sum is exact, whatever the order
    return torch.randint(-8, 9, shape, generator=g) / 8


@needs_triton
@pytest.mark.parametrize("N,K,cfg", SHAPES)
def test_grouped_mm_equals_the_reference(N, K, cfg):
    x, w, counts, offs = _setup(0, N, K)
    assert gt.available(x, w)
    _assert_within_ulps(gt.grouped_mm(x, w, offs, **cfg), _reference(x, w, counts), 1)
    # exact sums: rounded once, the same bf16 values
    x, w, counts, offs = _setup(1, N, K, _eighths)
    assert torch.equal(gt.grouped_mm(x, w, offs, **cfg), _reference(x, w, counts))


@needs_triton
@pytest.mark.parametrize("N,K,cfg", SHAPES)
def test_fused_swiglu_equals_the_eager_composition(N, K, cfg):
    x, w, counts, offs = _setup(2, 2 * N, K)
    w = w * 2  # gate and up of ~N(0, 16): both clamps at 7 bite
    gate, up = _reference(x, w, counts).chunk(2, -1)
    assert (gate > 7).any() and (up.abs() > 7).any()
    ref = moe.swiglu_clamped(gate, up, 7.0)
    # gate and up may each be 1 ulp off (summation order), and the ulp carries through
    _assert_within_ulps(gt.grouped_swiglu(x, w, offs, 7.0, **cfg), ref, 4)


@needs_triton
@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # numpy's, at gate = -100
def test_fused_swiglu_rounds_as_eager_bf16():
    # Each row of x has two ones, at j and j + K/2, and w[g, n, j] + w[g, n, j + K/2] = v[g, n, j],
    # an fp32 of 16 significant bits split into two bf16s: gate and up are exactly these v in
    # fp32, so every rounding of the epilogue is compared bit for bit, over values spanning
    # silu's range and both clamps (7.03 is not a bf16: torch's clamp rounds it to 7.03125)
    def values(g, shape):
        half = shape[-1] // 2
        if len(shape) == 2:
            j = torch.randint(0, half, shape[:1], generator=g)
            return torch.nn.functional.one_hot(j, shape[1]) + torch.nn.functional.one_hot(j + half, shape[1])
        v = (torch.rand(*shape[:-1], half, generator=g) - 0.5) * 50
        v = (v.view(torch.int32) & ~0x7F).view(torch.float32)  # 16 significant bits
        specials = torch.tensor([7.03125, 7.0, -7.03125, -100.0, -88.5, 90.0, -0.0, 2.0**-100])
        v.view(-1)[torch.randperm(v.numel(), generator=g)[:1024]] = specials.repeat(128)
        hi = v.bfloat16().float()
        lo = v - hi
        assert torch.equal(lo.bfloat16().float(), lo)
        return torch.cat([hi, lo], -1)

    x, w, counts, offs = _setup(3, 2 * 48, 64, values)
    gate, up = _reference(x, w, counts).chunk(2, -1)
    assert (gate == -100).any() and (gate == 7.03125).any() and (up == -7.03125).any()
    ref = moe.swiglu_clamped(gate, up, 7.03)
    assert torch.equal(gt.grouped_swiglu(x, w, offs, 7.03), ref)


@needs_triton
@pytest.mark.parametrize("backend", COMPILE_BACKENDS)
def test_ops_trace_whole_under_torch_compile(backend):
    x, w_gate_up, counts, offs = _setup(4, 2 * 48, 64)
    w_down = torch.randn(len(COUNTS), 64, 48, generator=torch.Generator().manual_seed(5)).bfloat16().to(DEVICE)

    def experts(x, offs):
        return gt.grouped_mm(gt.grouped_swiglu(x, w_gate_up, offs, 7.0), w_down, offs)

    torch._dynamo.reset()
    compiled = torch.compile(experts, backend=backend, fullgraph=True, dynamic=True)
    assert torch.equal(compiled(x, offs), experts(x, offs))


@needs_triton
def test_experts_take_the_triton_path_at_decode_only(monkeypatch):
    torch.manual_seed(6)
    experts = moe.Experts(len(COUNTS), 64, 48, 7.0).to(DEVICE, torch.bfloat16)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x, _, counts, _ = _setup(7, 1, 64)  # the rows only
    with torch.no_grad():
        assert triton_experts(x, experts.gate_up_proj, experts.down_proj, True) == (DEVICE == "cuda")
        assert not triton_experts(x, experts.gate_up_proj, experts.down_proj, False)  # switched off
    assert not triton_experts(x, experts.gate_up_proj, experts.down_proj, True)  # gradients wanted

    counts = counts.to(DEVICE)
    with torch.no_grad():
        monkeypatch.setattr(moe, "triton_experts", lambda *args: False)
        native = experts.mlp(x, counts, decode=True)
        monkeypatch.setattr(moe, "triton_experts", lambda *args: True)
        fused = experts.mlp(x, counts, decode=True)
        assert torch.equal(experts.mlp(x, counts), native)  # not a decode step: CUTLASS's
        torch._dynamo.reset()
        compiled = torch.compile(experts.mlp, backend="eager", fullgraph=True)
        assert torch.equal(compiled(x, counts, decode=True), fused)
    # an ulp off in the activation moves sums that may cancel: tolerance on the output's scale
    _assert_within_ulps(fused, native, 4, atol=2**-7 * native.abs().max().item())


def test_grouped_mm_under_autocast_casts_as_a_linear_does():
    # torch._grouped_mm has no autocast rule: bf16 rows met fp32 expert weights in `lockstep sft`'s
    # bf16 autocast on the GPU ("expected mat1 and mat2 to have the same dtype")
    from lockstep.models.layers.grouped_gemm import grouped_mm

    g = torch.Generator().manual_seed(0)
    x, w, counts = torch.randn(6, 16, generator=g), torch.randn(2, 8, 16, generator=g), torch.tensor([4, 2])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = grouped_mm(x.to(torch.bfloat16), w, counts)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, grouped_mm(x.to(torch.bfloat16), w.to(torch.bfloat16), counts))


@needs_triton
@pytest.mark.parametrize("T", [1, 16, 37])
def test_shared_groups_take_the_shared_weight(T):
    # the shared expert's T rows after the routed ones, split into groups of at most BLOCK_M rows
    x, w, counts, offs = _setup(8, 48, 64, _eighths)
    g = torch.Generator().manual_seed(9)
    xs = _eighths(g, (T, 64)).bfloat16().to(DEVICE)
    shared_up, shared_down = (_eighths(g, (2 * 48, 64)).bfloat16().to(DEVICE), _eighths(g, (48, 64)).bfloat16().to(DEVICE))
    ext = gt.with_shared_groups(offs, T)
    assert ext[:len(COUNTS)].tolist() == offs.tolist() and ext[-1].item() == offs[-1].item() + T
    assert len(ext) == len(COUNTS) + gt.SHARED_GROUPS and (ext.diff()[len(COUNTS) - 1:] <= -(-T // gt.SHARED_GROUPS)).all()
    rows = torch.cat([x, xs])
    # exact sums: the routed rows as without the shared groups, the shared rows as one more group
    out = gt.grouped_mm(rows, w, ext, shared=shared_down)
    assert torch.equal(out[:len(x)], _reference(x, w, counts))
    assert torch.equal(out[len(x):], _reference(xs, shared_down[None], torch.tensor([T])))
    w_gate_up = torch.cat([w, w.flip(0)], 1)
    act = gt.grouped_swiglu(rows, w_gate_up, ext, 7.0, shared=shared_up)
    assert torch.equal(act[:len(x)], gt.grouped_swiglu(x, w_gate_up, offs, 7.0))
    gate, up = _reference(xs, shared_up[None], torch.tensor([T])).chunk(2, -1)
    assert torch.equal(act[len(x):], moe.swiglu_clamped(gate, up, 7.0))
    # the same rows read through an index (a decode step's dispatch: no gathered copy), in another order
    perm = torch.randperm(len(rows), generator=g).to(DEVICE)
    source = torch.empty_like(rows).index_copy_(0, perm, rows)  # source[perm[i]] = rows[i]
    assert torch.equal(gt.grouped_swiglu(source, w_gate_up, ext, 7.0, shared=shared_up, rows=perm), act)


@needs_triton
def test_a_shared_weight_laid_out_unlike_an_expert_is_refused():
    x, w, counts, offs = _setup(10, 48, 64)
    with pytest.raises(ValueError, match=r"shared expert's weight \(64, 48\).*\(48, 64\)"):
        gt.grouped_mm(x, w, gt.with_shared_groups(offs, 4), shared=w[0].t().contiguous())


@needs_triton
def test_a_decode_step_folds_the_shared_expert_into_the_expert_kernels(monkeypatch):
    # MoE at a decode step with the engine's fused gate/up: the shared expert rides the routed
    # experts' kernels (no GEMM of its own), and the output is the unfolded one's to rounding
    from lockstep.models.deepseek_v4_init import tiny_config
    from lockstep.models.layers.fused_linear import fuse_linears

    cfg = tiny_config()
    torch.manual_seed(11)
    layer = moe.MoE(cfg, cfg.num_hidden_layers - 1).to(DEVICE, torch.bfloat16)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(5, 1, cfg.hidden_size, device=DEVICE).bfloat16()
    monkeypatch.setattr(moe, "triton_experts", lambda *args: True)  # the CPU interpreter's kernels
    with torch.no_grad():
        unfolded, chosen = layer(x, None)
        assert layer._foldable_shared(x.view(5, -1)) is None  # gate and up not fused: no matrix to read
        fuse_linears(layer, layer.input_linears())
        gemms, project = [], moe.project
        monkeypatch.setattr(moe, "project", lambda *a: gemms.append(a) or project(*a))
        monkeypatch.setattr(moe.dispatch_order_triton, "runs", lambda flat: False)  # the torch ops
        folded, chosen_folded = layer(x, None)
        assert not gemms and torch.equal(chosen_folded, chosen)
        _assert_within_ulps(folded, unfolded, 4, atol=2**-7 * unfolded.abs().max().item())
        # the dispatch and the combine as one kernel each (CUDA's path): the same bits
        monkeypatch.setattr(moe.dispatch_order_triton, "runs", lambda flat: True)
        combines, combine_step = [], moe.moe_combine_triton.combine_step
        monkeypatch.setattr(moe.moe_combine_triton, "combine_step", lambda *a: combines.append(a) or combine_step(*a))
        assert torch.equal(layer(x, None)[0], folded) and len(combines) == 1
        # with the block's mHC streams: the combine kernel does hc_combine too where FUSED_HC says so
        from lockstep.models.layers.hyper_connection import hc_combine
        n = 4
        streams = torch.randn(5, 1, n, cfg.hidden_size, device=DEVICE).bfloat16()
        post, comb = torch.rand(5, 1, n, device=DEVICE) * 2, torch.rand(5, 1, n, n, device=DEVICE)
        want = hc_combine(streams, folded, post, comb)
        monkeypatch.setattr(moe.moe_combine_triton, "FUSED_HC", False)  # hc_combine after the kernel
        assert torch.equal(layer(x, None, hc=(streams, post, comb))[0], want) and len(combines) == 2
        monkeypatch.setattr(moe.moe_combine_triton, "FUSED_HC", True)  # the default
        fused = layer(x, None, hc=(streams, post, comb))[0]
        assert len(combines) == 3 and fused.shape == streams.shape
        _assert_within_ulps(fused, want, 2, atol=2**-7 * want.abs().max().item())
        layer(x.expand(5, 2, -1).contiguous(), None)  # not a decode step: the shared expert's own GEMM
        assert len(gemms) == 1
        monkeypatch.setattr(moe, "triton_experts", lambda *args: False)
        assert layer._foldable_shared(x.view(5, -1)) is None  # kernels off: the shared expert's own GEMMs


@needs_triton
def test_packed_fp8_experts_fold_a_packed_shared_expert(monkeypatch):
    # the engine serving fp8 with packed experts: the shared expert's packed gate/up (fused) and down
    # ride the fp8 grouped kernels; 128-aligned sizes, as the fp8 blocks need
    from lockstep.models.deepseek_v4_init import tiny_config
    from lockstep.models.layers import packed_experts
    from lockstep.models.layers.fp8_linear import Fp8Linear
    from lockstep.models.layers.fused_linear import fuse_linears

    cfg = tiny_config(hidden_size=128, moe_intermediate_size=128)
    torch.manual_seed(12)
    layer = moe.MoE(cfg, cfg.num_hidden_layers - 1).to(DEVICE, torch.bfloat16)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.1)
    layer.experts = packed_experts.PackedExperts(layer.experts, "fp8")
    shared = layer.shared_experts
    for name in ("gate_proj", "up_proj", "down_proj"):
        setattr(shared, name, Fp8Linear.packing(getattr(shared, name)))
    x = torch.randn(5, 1, cfg.hidden_size, device=DEVICE).bfloat16()
    monkeypatch.setattr(packed_experts, "forward_kernel_allowed", lambda *args: True)  # the interpreter's
    with torch.no_grad():
        unfolded, _ = layer(x, None)
        fuse_linears(layer, layer.input_linears())
        assert layer._foldable_shared(x.view(5, -1)) is not None
        gemms, project = [], moe.project
        monkeypatch.setattr(moe, "project", lambda *a: gemms.append(a) or project(*a))
        monkeypatch.setattr(moe.dispatch_order_triton, "runs", lambda flat: False)  # the torch ops
        folded, _ = layer(x, None)
        assert not gemms
        _assert_within_ulps(folded, unfolded, 4, atol=2**-7 * unfolded.abs().max().item())
        monkeypatch.setattr(moe.dispatch_order_triton, "runs", lambda flat: True)  # one kernel each
        assert torch.equal(layer(x, None)[0], folded)
        # the SwiGLU inside the fp8 gate_up kernel: eager's roundings, so the same bits
        monkeypatch.setattr(packed_experts.grouped_gemm_fp8, "FUSED_SWIGLU", True)
        fused_calls, fused = [], packed_experts.grouped_gemm_fp8.grouped_swiglu_fp8
        monkeypatch.setattr(packed_experts.grouped_gemm_fp8, "grouped_swiglu_fp8",
                            lambda *a, **k: fused_calls.append(a) or fused(*a, **k))
        assert torch.equal(layer(x, None)[0], folded) and len(fused_calls) == 1
        layer.experts.storage = "fp4"  # the fp4 kernel takes no shared expert
        assert layer._foldable_shared(x.view(5, -1)) is None
