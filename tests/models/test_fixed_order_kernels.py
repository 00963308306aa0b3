"""The fixed-order (batch-invariant) kernels of issue 16 against their PyTorch references, and
bitwise batch invariance: a row computed alone, or inside batches of 1, 3, 16 and 37 rows at the
first, a middle and the last position, among garbage rows (huge values, inf, NaN), in a strided
view of a larger buffer, gives the same bits. Under Triton's interpreter here (TRITON_INTERPRET=1,
conftest.py); LOCKSTEP_TEST_DEVICE=cuda runs the same tests on a GPU."""


import pytest
import torch

from lockstep.models.layers import fixed_order_linear as fol
from lockstep.models.layers import fixed_order_log_softmax as fls
from lockstep.models.layers import fixed_order_rmsnorm as fon
from lockstep.models.layers.norm import RMSNorm, rms_norm
from devices import DEVICE

needs_triton = pytest.mark.skipif(fol.triton is None, reason="triton is not installed")
# aot_eager traces the ops' bodies on fake tensors, which interpreted kernels (CPU) cannot run on
COMPILE_BACKENDS = ["eager", "aot_eager"] if DEVICE == "cuda" else ["eager"]
BATCHES = (1, 3, 16, 37)
BF16_ULP = 2**-7  # relative spacing of bf16 values, at most
# garbage rows hold inf and NaN on purpose
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered", "ignore:overflow encountered")


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _eighths(g, shape):
    # small multiples of 1/8: every fp32 partial sum (of products, of squares) is exact
    return torch.randint(-8, 9, shape, generator=g) / 8


def _garbage(g, shape, dtype):
    """Rows no batch should leak from: large values with inf and NaN sprinkled in."""
    x = torch.randn(shape, generator=g) * 1e4
    x.view(-1)[torch.randperm(x.numel(), generator=g)[: max(1, x.numel() // 20)]] = float("nan")
    x.view(-1)[torch.randperm(x.numel(), generator=g)[: max(1, x.numel() // 20)]] = float("inf")
    return x.to(dtype)


def _assert_batch_invariant(run, row, others=(), seed=0):
    """run(x, *companions) -> per-row results [M, ...]; row: [1, ...] input; others: pairs
    (the row's companion [1] (ids, temperatures), fill(g, M) -> [M] valid values for other rows)."""
    alone = run(row, *(o for o, _ in others))
    g = _gen(seed)
    for M in BATCHES:
        for p in sorted({0, M // 2, M - 1}):
            # a view two rows into a larger buffer: other pointer alignment, garbage all around
            buf = _garbage(g, (M + 3, *row.shape[1:]), row.dtype).to(row.device)
            buf[2 + p] = row[0]
            companions = []
            for o, fill in others:
                c = fill(g, M).to(o.device, o.dtype)
                c[p] = o[0]
                companions.append(c)
            got = run(buf[2:2 + M], *companions)[p:p + 1]
            assert torch.equal(got, alone), f"M={M}, position {p}"


# ---- fixed_order_linear ----------------------------------------------------------------------

# default configs: BLOCK_N 64 > N = 40 and K = 72 = 64 + 8 (masked tail); 32 x 64 exact tiles;
# an override with two K tiles of 32 and two column tiles; split K: 7 tiles of 32 in splits of
# 3, 3 and 1 tiles, the last one masked (K = 200)
SPLIT = (40, 200, dict(block_k=32, split_k=3))
LINEAR_SHAPES = [(40, 72, {}), (32, 64, {}), (48, 64, dict(block_n=32, block_k=32)), SPLIT]


def _linear_inputs(seed, N, K, dtype, values=None):
    g = _gen(seed)
    make = values or (lambda g, shape: torch.randn(shape, generator=g))
    return make(g, (23, K)).to(DEVICE, dtype), make(g, (N, K)).to(DEVICE, dtype)


@needs_triton
@pytest.mark.parametrize("N,K,cfg", LINEAR_SHAPES)
def test_linear_equals_the_reference(N, K, cfg):
    x, w = _linear_inputs(0, N, K, torch.bfloat16)
    assert fol.kernel_applies(x, w)
    out, ref = torch.ops.lockstep.fixed_order_linear(x, w, **cfg), fol.fixed_order_linear_reference(x, w)
    # fp32 sums in another order round to a bf16 neighbour at most
    torch.testing.assert_close(out.float(), ref.float(), rtol=BF16_ULP, atol=1e-5)
    x, w = _linear_inputs(1, N, K, torch.bfloat16, _eighths)  # exact sums: the same bf16 values
    assert torch.equal(torch.ops.lockstep.fixed_order_linear(x, w, **cfg), fol.fixed_order_linear_reference(x, w))
    x, w = _linear_inputs(2, N, K, torch.float32)
    # fp32 (no TF32): the sums' order only, |error| <= K * 2^-24 * sum |x w| (~ 1e-5 here)
    torch.testing.assert_close(torch.ops.lockstep.fixed_order_linear(x, w, **cfg), x @ w.T, rtol=1e-5, atol=1e-5)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_linear_adds_its_k_splits_first_to_last(dtype):
    """Split K: each split's fp32 sum is the unsplit kernel's over that slice of K, and the splits
    are added first to last, then rounded once (bitwise)."""
    N, K, cfg = SPLIT
    x, w = _linear_inputs(9, N, K, dtype)
    k_per_split, splits = fol.split_extent(K, cfg["block_k"], cfg["split_k"])
    assert (k_per_split, splits) == (96, 3)
    parts = [torch.ops.lockstep.fixed_order_linear(x[:, k:k + k_per_split], w[:, k:k + k_per_split],
                                                    block_k=cfg["block_k"], split_k=1, fp32_out=True)
             for k in range(0, K, k_per_split)]
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    assert torch.equal(torch.ops.lockstep.fixed_order_linear(x, w, **cfg), total.to(dtype))
    assert torch.equal(torch.ops.lockstep.fixed_order_linear(x, w, fp32_out=True, **cfg), total)


@needs_triton
def test_linear_config_splits_k_by_the_weight_shape_only():
    """Narrow weights (the router, wkv: few column tiles, a decode step's few programs) split K, a
    split keeping MIN_SPLIT_TILES K tiles at least; wider ones do not (the split's fp32 partials cost
    a prefill more than it saves); the row count is not an argument at all."""
    assert fol.launch_config(64, 1024)["SPLIT_K"] == fol.MAX_SPLIT == 4
    assert fol.launch_config(128, 1024)["SPLIT_K"] == 4
    assert fol.launch_config(128, 128)["SPLIT_K"] == 1  # 2 K tiles: nothing to split
    for N, K in [(512, 1024), (256, 512), (32768, 1024)]:
        assert fol.launch_config(N, K)["SPLIT_K"] == 1
    for N, K in [(64, 1024), (16, 200), (40, 72)]:
        cfg = fol.launch_config(N, K)
        assert cfg["SPLIT_K"] == 1 or -(-K // cfg["BLOCK_K"]) // cfg["SPLIT_K"] >= fol.MIN_SPLIT_TILES


@needs_triton
def test_linear_config_gives_the_head_wide_tiles():
    """The LM head (N >= WIDE_N, the vocabulary) takes 64 x 128 tiles, unsplit; others 16 rows."""
    assert fol.launch_config(32768, 1024)["BLOCK_M"] == 64 and fol.launch_config(fol.WIDE_N, 64)["BLOCK_N"] == 128
    assert fol.launch_config(fol.WIDE_N, 4096)["SPLIT_K"] == 1
    assert fol.launch_config(fol.WIDE_N - 1, 1024)["BLOCK_M"] == 16


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rows_per_tile_follow_the_row_count_and_leave_the_bits_alone(dtype):
    """Decode's few rows take 16-row tiles, prefill's and training's many 64 (the head 64 always);
    the sums' order (BLOCK_N, BLOCK_K, split) does not move with M, and the rows come out the same
    bits whichever tile holds them."""
    small, many = fol.launch_config(512, 1024, 64), fol.launch_config(512, 1024, fol.MANY_ROWS)
    assert (small["BLOCK_M"], many["BLOCK_M"]) == (16, 64)
    assert {k: v for k, v in small.items() if k != "BLOCK_M"} == {k: v for k, v in many.items() if k != "BLOCK_M"}
    assert fol.launch_config(32768, 1024, 1)["BLOCK_M"] == 64
    g = _gen(3)
    x = torch.randn(fol.MANY_ROWS, 160, generator=g).to(DEVICE, dtype)
    w = torch.randn(72, 160, generator=g).to(DEVICE, dtype)
    rows = torch.ops.lockstep.fixed_order_linear(x, w)  # 64-row tiles (on Hopper: wgmma, not mma.sync)
    assert torch.equal(rows[:5], torch.ops.lockstep.fixed_order_linear(x[:5], w))  # 16-row tiles
    assert torch.equal(rows, torch.ops.lockstep.fixed_order_linear(x, w, block_m=16))


@needs_triton
@pytest.mark.parametrize("N,K,cfg,dtype", [(40, 72, {}, torch.bfloat16), (*SPLIT, torch.float32),
                                           (48, 64, dict(block_m=64, block_n=32), torch.bfloat16)])
def test_grouped_linear_equals_a_launch_per_group(N, K, cfg, dtype):
    """x [M, G, K] through w [G, N, K] in one launch (DeepSeek-V4's wo_a): each group's rows equal its
    own [N, K] GEMM's bitwise, in a strided view too; batch-invariant like the plain GEMM."""
    G = 3
    g = _gen(10)
    x = torch.randn(23, G, K + 5, generator=g).to(DEVICE, dtype)[..., 2:K + 2]  # strided rows
    w = torch.randn(G, N, K, generator=g).to(DEVICE, dtype)
    out = torch.ops.lockstep.fixed_order_linear(x, w, **cfg)
    assert out.shape == (23, G, N)
    for i in range(G):
        assert torch.equal(out[:, i], torch.ops.lockstep.fixed_order_linear(x[:, i], w[i], **cfg)), f"group {i}"
    _assert_batch_invariant(lambda x: torch.ops.lockstep.fixed_order_linear(x, w, **cfg), x[:1], seed=11)
    assert torch.equal(fol.fixed_order_linear(x[:6].reshape(2, 3, G, K), w).flatten(0, 1), fol.fixed_order_linear(x[:6], w))


@needs_triton
def test_linear_fp32_out_keeps_the_bf16_products_sum_unrounded():
    """fp32_out (the LM head's logits): bf16 inputs, the fp32 sum not rounded to bf16; exact sums equal
    the fp32 GEMM of the upcast inputs bitwise, others to fp32 rounding; batch-invariant too."""
    N, K, cfg = LINEAR_SHAPES[0]
    x, w = _linear_inputs(1, N, K, torch.bfloat16, _eighths)
    out = torch.ops.lockstep.fixed_order_linear(x, w, fp32_out=True)
    assert out.dtype == torch.float32 and torch.equal(out, fol.fixed_order_linear_reference(x, w, fp32_out=True))
    x, w = _linear_inputs(2, N, K, torch.bfloat16)
    out = fol.fixed_order_linear(x, w, fp32_out=True)
    torch.testing.assert_close(out, x.float() @ w.float().T, rtol=1e-5, atol=1e-5)
    assert not torch.equal(out, out.bfloat16().float())  # not rounded to bf16
    _assert_batch_invariant(lambda x: fol.fixed_order_linear(x, w, fp32_out=True), x[:1], seed=5)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("N,K,cfg", LINEAR_SHAPES[::2] + [SPLIT])
def test_linear_is_batch_invariant(N, K, cfg, dtype):
    x, w = _linear_inputs(3, N, K, dtype)
    _assert_batch_invariant(lambda x: torch.ops.lockstep.fixed_order_linear(x, w, **cfg), x[:1], seed=4)
    # leading dimensions fold into rows: one row of a [2, 3, K] activation is the same row alone
    x3 = x[:6].view(2, 3, K)
    assert torch.equal(fol.fixed_order_linear(x3, w)[1, 2], fol.fixed_order_linear(x[5:6], w)[0])


@needs_triton
@pytest.mark.skipif(DEVICE == "cuda", reason="a GPU's IEEE fp32 tl.dot adds the products k by k whatever BLOCK_K: "
                    "the control needs the interpreter's per-tile sums")
def test_the_invariance_check_catches_an_m_dependent_split():
    # the check's control: BLOCK_K chosen by M (as a cuBLAS heuristic might) changes the sums' order
    x, w = _linear_inputs(8, 48, 64, torch.float32)
    with pytest.raises(AssertionError):
        _assert_batch_invariant(
            lambda x: torch.ops.lockstep.fixed_order_linear(x, w, block_k=16 if x.shape[0] > 8 else 64), x[:1])


@needs_triton
def test_linear_falls_back_to_the_reference(monkeypatch):
    x, w = _linear_inputs(5, 40, 72, torch.bfloat16)
    ref = fol.fixed_order_linear_reference(x, w)
    assert not fol.kernel_applies(x.requires_grad_(), w)  # a gradient wanted: forward-only kernel
    assert torch.equal(fol.fixed_order_linear(x, w), ref)
    x = x.detach()
    assert not fol.kernel_applies(x.half(), w.half())
    monkeypatch.setattr(fol, "triton", None)  # no Triton
    assert not fol.kernel_applies(x, w) and torch.equal(fol.fixed_order_linear(x, w), ref)


@needs_triton
@pytest.mark.parametrize("backend", COMPILE_BACKENDS)
def test_linear_traces_whole_under_torch_compile(backend):
    x, w = _linear_inputs(6, 40, 72, torch.bfloat16)
    w2 = _linear_inputs(7, 72, 40, torch.bfloat16)[1]

    def mlp(x):
        return fol.fixed_order_linear(torch.relu(fol.fixed_order_linear(x, w)), w2)

    torch._dynamo.reset()
    compiled = torch.compile(mlp, backend=backend, fullgraph=True, dynamic=True)
    with torch.no_grad():
        assert torch.equal(compiled(x), mlp(x))


# ---- fixed_order_rms_norm --------------------------------------------------------------------

# three tiles of 32 with a masked tail; one default tile (BLOCK 64 > D = 48, masked); one exact
NORM_SHAPES = [(72, 32), (48, 0), (64, 0)]


def _norm_inputs(seed, D, dtype, values=None):
    """x [23, D] on DEVICE and an RMSNorm(D) whose fp32 weight is random."""
    g = _gen(seed)
    make = values or (lambda g, shape: torch.randn(shape, generator=g) * 3)
    norm = RMSNorm(D, eps=1e-5).to(DEVICE)
    with torch.no_grad():
        norm.weight.copy_(make(g, (D,)))
    return make(g, (23, D)).to(DEVICE, dtype), norm


def _within_fp32_ulps(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(((a - b).abs() <= b.abs() * 4 * 2**-23).all())  # the ulp moves through rsqrt and the weight


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("D,block", NORM_SHAPES)
def test_rms_norm_equals_the_module(D, block, dtype):
    op = torch.ops.lockstep.fixed_order_rms_norm
    x, norm = _norm_inputs(10, D, dtype)
    assert fon.kernel_applies(x, norm.weight.detach())
    with torch.no_grad():
        out, ref = op(x, norm.weight, norm.eps, block), norm(x)
        # the sum of squares in another order: an ulp of x's dtype at most (bf16), a few (fp32)
        rtol = BF16_ULP if dtype == torch.bfloat16 else 4 * 2**-23
        torch.testing.assert_close(out, ref, rtol=rtol, atol=1e-6)
        torch.testing.assert_close(op(x, None, norm.eps, block), rms_norm(x, norm.eps), rtol=rtol, atol=1e-6)
        # exact sums of squares: every other step rounds as eager does, bit for bit (on a GPU in fp32 up
        # to a few ulps: torch's CUDA mean multiplies by 1 / D where the kernel divides by D)
        x, norm = _norm_inputs(11, D, dtype, _eighths)
        same = torch.equal if DEVICE == "cpu" or dtype == torch.bfloat16 else _within_fp32_ulps
        assert same(op(x, norm.weight, norm.eps, block), norm(x))
        assert same(op(x, None, norm.eps, block), rms_norm(x, norm.eps))
        assert torch.equal(norm(x), fon.rms_norm_reference(x, norm.weight, norm.eps))


@needs_triton
@pytest.mark.parametrize("D,block,dtype", [(72, 32, torch.bfloat16), (48, 0, torch.float32)])
def test_rms_norm_is_batch_invariant(D, block, dtype):
    x, norm = _norm_inputs(12, D, dtype)
    w = norm.weight.detach()
    _assert_batch_invariant(lambda x: torch.ops.lockstep.fixed_order_rms_norm(x, w, 1e-5, block), x[:1], seed=13)
    x3 = x[:6].view(2, 3, D)
    assert torch.equal(fon.fixed_order_rms_norm(x3, w, 1e-5)[1, 2], fon.fixed_order_rms_norm(x[5:6], w, 1e-5)[0])


@needs_triton
def test_rms_norm_falls_back_to_the_reference(monkeypatch):
    x, norm = _norm_inputs(14, 48, torch.bfloat16)
    ref = norm(x)
    assert not fon.kernel_applies(x, norm.weight)  # the module's weight wants a gradient
    assert torch.equal(fon.fixed_order_rms_norm(x, norm.weight, norm.eps), ref)
    monkeypatch.setattr(fon, "triton", None)
    assert torch.equal(fon.fixed_order_rms_norm(x, norm.weight.detach(), norm.eps), ref)


@needs_triton
@pytest.mark.parametrize("backend", COMPILE_BACKENDS)
def test_rms_norm_traces_whole_under_torch_compile(backend):
    x, norm = _norm_inputs(15, 48, torch.bfloat16)
    w = norm.weight.detach()

    def block(x):
        return fon.fixed_order_rms_norm(x + fon.fixed_order_rms_norm(x, w, 1e-5), None, 1e-5)

    torch._dynamo.reset()
    compiled = torch.compile(block, backend=backend, fullgraph=True, dynamic=True)
    assert torch.equal(compiled(x), block(x))


# ---- fixed_order_token_logprobs / fixed_order_log_softmax -------------------------------------

# four tiles of 32 with a masked tail; one default tile (BLOCK 128 > V = 100); one exact
SOFTMAX_SHAPES = [(100, 32), (100, 0), (64, 0)]


def _softmax_inputs(seed, V, dtype, M=12):
    """logits [M, V] spanning ~ +-20 (a peaked row among them), ids [M], temperatures [M]."""
    g = _gen(seed)
    logits = torch.randn(M, V, generator=g) * 5
    logits[0, 3] = 40.0
    ids = torch.randint(0, V, (M,), generator=g)
    temps = torch.rand(M, generator=g) + 0.5
    return logits.to(DEVICE, dtype), ids.to(DEVICE), temps.to(DEVICE)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("V,block", SOFTMAX_SHAPES)
def test_log_softmax_equals_the_reference(V, block, dtype):
    logits, ids, temps = _softmax_inputs(20, V, dtype)
    assert fls.kernel_applies(logits)
    ones = torch.ones_like(temps)
    for t_kernel, t_ref in ((ones, 1.0), (temps, temps)):
        rows = torch.ops.lockstep.fixed_order_log_softmax(logits, t_kernel, block)
        lp = torch.ops.lockstep.fixed_order_token_logprobs(logits, ids, t_kernel, block)
        assert rows.dtype == lp.dtype == torch.float32
        # the sum's order and exp / log an ulp apart: <= 2e-6 seen (fp32 ulp 4e-6 at |logp| ~ 48)
        torch.testing.assert_close(rows, fls.log_softmax_reference(logits, t_ref), rtol=1e-6, atol=4e-6)
        torch.testing.assert_close(lp, fls.token_logprobs_reference(logits, ids, t_ref), rtol=1e-6, atol=4e-6)
        assert torch.equal(lp, rows.gather(1, ids[:, None])[:, 0])  # the same arithmetic, bit for bit
    # the definition's temperature division, per row (train/logprobs.py, engine/sampler.py)
    assert torch.equal(fls.log_softmax_reference(logits, temps), torch.log_softmax(logits.float() / temps[:, None], -1))
    bad = ids.clone()
    bad[1], bad[2] = -100, V  # ids outside the vocabulary: NaN, the other rows untouched
    lp_bad = torch.ops.lockstep.fixed_order_token_logprobs(logits, bad, temps, block)
    assert lp_bad[1:3].isnan().all() and torch.equal(lp_bad[3:], lp[3:])


@needs_triton
@pytest.mark.parametrize("V,block,dtype", [(100, 32, torch.bfloat16), (100, 0, torch.float32)])
def test_log_softmax_is_batch_invariant(V, block, dtype):
    logits, ids, temps = _softmax_inputs(21, V, dtype)
    ids_fill = (ids[:1], lambda g, M: torch.randint(0, V, (M,), generator=g))
    temps_fill = (temps[:1], lambda g, M: torch.rand(M, generator=g) + 0.5)
    _assert_batch_invariant(lambda z, i, t: torch.ops.lockstep.fixed_order_token_logprobs(z, i, t, block),
                            logits[:1], (ids_fill, temps_fill), seed=22)
    _assert_batch_invariant(lambda z, t: torch.ops.lockstep.fixed_order_log_softmax(z, t, block),
                            logits[:1], (temps_fill,), seed=23)
    # leading dimensions and a float temperature, through the public functions
    z3, i3 = logits[:6].view(2, 3, V), ids[:6].view(2, 3)
    assert torch.equal(fls.fixed_order_token_logprobs(z3, i3, 0.7)[1, 2],
                       fls.fixed_order_token_logprobs(logits[5:6], ids[5:6], 0.7)[0])
    assert torch.equal(fls.fixed_order_log_softmax(z3, temps[:6].view(2, 3, 1))[1, 2],
                       fls.fixed_order_log_softmax(logits[5:6], temps[5:6])[0])


@needs_triton
def test_log_softmax_falls_back_to_the_reference(monkeypatch):
    logits, ids, temps = _softmax_inputs(24, 100, torch.bfloat16)
    ref = fls.token_logprobs_reference(logits, ids, temps)
    z = logits.clone().requires_grad_()
    assert not fls.kernel_applies(z)  # a gradient wanted: forward-only kernel
    assert torch.equal(fls.fixed_order_token_logprobs(z, ids, temps), ref)
    monkeypatch.setattr(fls, "triton", None)
    assert torch.equal(fls.fixed_order_token_logprobs(logits, ids, temps), ref)
    assert torch.equal(fls.fixed_order_log_softmax(logits, 0.7), fls.log_softmax_reference(logits, 0.7))


@needs_triton
@pytest.mark.parametrize("backend", COMPILE_BACKENDS)
def test_log_softmax_traces_whole_under_torch_compile(backend):
    logits, ids, temps = _softmax_inputs(25, 100, torch.bfloat16)

    def logprobs(z, ids, t):
        return fls.fixed_order_token_logprobs(z, ids, t), fls.fixed_order_log_softmax(z, 1.0)

    torch._dynamo.reset()
    compiled = torch.compile(logprobs, backend=backend, fullgraph=True, dynamic=True)
    for got, want in zip(compiled(logits, ids, temps), logprobs(logits, ids, temps)):
        assert torch.equal(got, want)
