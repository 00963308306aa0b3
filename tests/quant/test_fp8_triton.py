"""The Triton re-quantisation kernels (quant/fp8_triton.py, fp4_triton.py) against the PyTorch
reference (fp8.quantize_fp8_block, fp4.quantize_fp4_block), bit for bit. On CPU they run under
TRITON_INTERPRET=1 (tests/conftest.py); with LOCKSTEP_TEST_DEVICE=cuda they are compiled (owed: that
run on a GPU). Covered: partial edge blocks, all-zero blocks, values beyond e4m3's 448, -0.0, NaN
and inf (ue8m0 / fp4: the push's formats), e4m3 and e2m1 ties, subnormal scales, e8m0 / uint8
storage, and that quantize_fp8_block / quantize_fp4_block route CUDA tensors (here: faked) to them."""


import pytest
import torch

pytest.importorskip("triton")

from lockstep import tensor_tables  # noqa: E402
from lockstep.quant import fp8_triton  # noqa: E402
from lockstep.quant.fp4 import quantize_fp4_block  # noqa: E402
from lockstep.quant.fp4_triton import quantize_fp4_into  # noqa: E402
from lockstep.quant.fp8 import fp8_scale_shape, quantize_fp8_block  # noqa: E402
from lockstep.quant.fp8_triton import quantize_fp8_into  # noqa: E402
from devices import DEVICE
from launches import count_launches, launch_arguments

E8M0 = torch.float8_e8m0fnu
NAN, NEG_NAN = (torch.tensor([b], dtype=torch.int64).to(torch.int32).view(torch.float32).item()
                for b in (0x7FC00000, 0xFFC00000 - 2**32))


def _u8(t):
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _same(a, b):
    for x, y in zip(a, b):
        assert x.shape == y.shape
        assert torch.equal(_u8(x).cpu(), _u8(y).cpu()), (_u8(x) != _u8(y)).nonzero()[:5].tolist()


def _fp8_kernel(w, block=(128, 128), fmt="ue8m0", scale_dtype=torch.float32, q_dtype=torch.float8_e4m3fn):
    w = w.to(DEVICE)
    q = torch.empty(w.shape, dtype=q_dtype, device=DEVICE)
    s = torch.empty(fp8_scale_shape(tuple(w.shape), block), dtype=scale_dtype, device=DEVICE)
    quantize_fp8_into(w, q, s, block, fmt)
    return q, s


def _fp4_kernel(w, scale_dtype=E8M0):
    w = w.to(DEVICE)
    p = torch.empty(*w.shape[:-1], w.shape[-1] // 2, dtype=torch.uint8, device=DEVICE)
    s = torch.empty(*w.shape[:-1], -(-w.shape[-1] // 32), dtype=scale_dtype, device=DEVICE)
    quantize_fp4_into(w, p, s, 32)
    return p, s


def _wide(shape, dtype, seed=0, span=6):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * torch.logspace(-span, span, shape[-1])).to(dtype)


@pytest.mark.parametrize("fmt", ["ue8m0", "fp32"])
@pytest.mark.parametrize("shape,dtype", [((200, 300), torch.bfloat16), ((2, 130, 260), torch.float32),
                                         ((3, 5), torch.float16)])
def test_fp8_matches_reference_with_partial_edge_blocks(shape, dtype, fmt):
    w = _wide(shape, dtype, span=3 if dtype == torch.float16 else 6)
    _same(_fp8_kernel(w, fmt=fmt), quantize_fp8_block(w, scale_fmt=fmt))


def test_fp8_small_blocks_zero_subnormal_and_special_scales():
    w = torch.randn(32, 64)
    w[:4] = 0.0  # all-zero block: scale 1
    w[4:8] = 0.0
    w[4, 0] = 1e-40  # fp32-subnormal amax / 448 below 2**-127: scale 2**-127
    w[8:12] = 0.0
    w[8, 1] = -448 * 2**-126.5  # amax / 448 between 2**-127 and 2**-126
    w[12:16] = 0.0
    w[12, 0] = 1e-45  # amax / 448 underflows to 0: frexp's exponent 0, scale 1 (not the zero rule)
    w[16, 0] = 448 * 3  # scale 4; 1344 / 4 = 336, a tie of 320 and 352: 320 (even)
    w[16, 1] = -(2**-20)  # rounds to -0.0, keeping its sign
    w[20, 3] = -0.0
    w[24:28] = 0.0
    w[24, 5] = -0.0  # an all-(signed-)zero block
    for fmt in ("ue8m0", "fp32"):
        _same(_fp8_kernel(w, (4, 64), fmt), quantize_fp8_block(w, (4, 64), fmt))
    q, s = _fp8_kernel(w, (4, 64))
    assert s.flatten()[:5].tolist() == [1.0, 2.0**-127, 2.0**-126, 1.0, 4.0]
    assert q.view(torch.uint8)[20, 3].item() == 0x80 and q.float()[16, 0].item() == 320.0


def test_fp8_every_e4m3_value_midpoint_and_neighbour_rounds_as_the_reference():
    grid = torch.arange(0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448
    mid = (grid[:-1] + grid[1:]) / 2  # ties: exact in fp32
    vals = torch.cat([grid, mid, torch.nextafter(mid, torch.zeros(())), torch.nextafter(mid, grid[-1:] * 2)])
    vals = torch.cat([vals, -vals, torch.tensor([448.0])])
    w = torch.zeros(8 * 128)
    w[: vals.numel()] = vals
    w = w.reshape(8, 128)
    _same(_fp8_kernel(w, (8, 128)), quantize_fp8_block(w, (8, 128)))
    big = w * 2.0**70  # the same codes at scale 2**70; and at 2**-130 (subnormal fp32 inputs)
    _same(_fp8_kernel(big, (8, 128)), quantize_fp8_block(big, (8, 128)))
    tiny = w * 2.0**-130
    _same(_fp8_kernel(tiny, (8, 128)), quantize_fp8_block(tiny, (8, 128)))


def test_fp8_beyond_448_nan_inf_and_storage_dtypes():
    w = _wide((136, 140), torch.float32, seed=1) * 1e3  # far beyond 448: scales > 1
    w[0, 0], w[1, 1], w[2, 2] = NAN, NEG_NAN, -float("inf")  # block (0, 0): scale 1, 448-saturated
    w[130, 135] = float("inf")  # edge block (1, 1)
    w[129, 3] = NEG_NAN  # edge block (1, 0)
    ref = quantize_fp8_block(w, scale_fmt="ue8m0")
    _same(_fp8_kernel(w), ref)
    assert ref[1].flatten().tolist() == [1.0, ref[1][0, 1].item(), 1.0, 1.0]
    _same(_fp8_kernel(w, scale_dtype=E8M0, q_dtype=torch.uint8), quantize_fp8_block(w, scale_dtype=E8M0))
    _same(_fp8_kernel(w, scale_dtype=torch.uint8), quantize_fp8_block(w, scale_dtype=E8M0))


@pytest.mark.parametrize("shape,dtype", [((7, 100), torch.bfloat16), ((2, 3, 64), torch.float32), ((1, 6), torch.float32),
                                         ((5, 520), torch.float32)])
def test_fp4_matches_reference(shape, dtype):
    w = _wide(shape, dtype, seed=2)
    _same(_fp4_kernel(w), quantize_fp4_block(w))
    _same(_fp4_kernel(w, torch.float32), quantize_fp4_block(w, scale_dtype=torch.float32))


def test_fp4_ties_zero_blocks_nan_and_subnormal_scales():
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0, 0.2, 0.3, 5.1])
    w = torch.zeros(6, 96)
    w[0, :12], w[0, 12:24] = ties, -ties
    w[0, 40] = 6.0  # second block: amax 6, scale 1
    w[0, 41:48] = ties[:7] * 1.0001
    w[1, 33] = -0.0  # zero and -0 blocks: scale 1, codes 0 / 8
    w[2, :3] = torch.tensor([NAN, NEG_NAN, 3.0])  # a NaN block: scale 1, NaN codes 0 / 8
    w[2, 40] = float("inf")
    w[3, 0], w[3, 32], w[3, 64] = 1e-40, 1e-45, 6 * 2**-126.5  # fp32-subnormal amax / 6
    w[4] = _wide((96,), torch.float32, seed=3) * 1e30
    w[5] = torch.arange(96) * 0.125 - 6
    _same(_fp4_kernel(w), quantize_fp4_block(w))


def test_many_tensors_in_one_launch_per_group_equal_the_reference_each(monkeypatch):
    """quantize_fp8_many_into: tensors of several shapes (edge blocks, a 3-D experts tensor, one
    empty, one read through a transposed view), two w dtypes and both scale storages; one launch
    per (w dtype, scale storage) group, each tensor bitwise its own reference."""
    ws = [_wide((200, 300), torch.bfloat16, seed=11), _wide((3, 130, 260), torch.bfloat16, seed=12),
          _wide((256, 128), torch.float32, seed=13), torch.zeros(0, 128, dtype=torch.bfloat16),
          _wide((140, 96), torch.bfloat16, seed=14).t(), _wide((5, 3), torch.bfloat16, seed=15)]
    storages = [torch.float32, E8M0, torch.float32, torch.float32, torch.float32, torch.uint8]
    refs = [quantize_fp8_block(w, scale_dtype=E8M0 if st != torch.float32 else torch.float32) for w, st in
            zip(ws, storages)]
    outs = [(torch.full(w.shape, 7, dtype=torch.uint8, device=DEVICE).view(torch.float8_e4m3fn),
             torch.full(fp8_scale_shape(tuple(w.shape)), 3, dtype=st, device=DEVICE)) for w, st in zip(ws, storages)]
    launches = count_launches(monkeypatch, fp8_triton, "_fp8_many_kernel")
    fp8_triton.quantize_fp8_many_into([w.to(DEVICE) for w in ws], outs, (128, 128), "ue8m0")
    assert len(launches) == 3  # bf16 + fp32 scales, bf16 + e8m0 bytes, fp32 + fp32 scales
    for out, ref in zip(outs, refs):
        _same(out, ref)


def test_many_fp4_tensors_in_one_launch_per_group_equal_the_reference_each(monkeypatch):
    """quantize_fp4_many_into: tensors of several shapes (a 3-D experts tensor, one narrower than a
    tile, one read through a transposed view), two w dtypes and both scale storages; one
    launch per (w dtype, scale storage, tile) group, each tensor bitwise its own reference."""
    from lockstep.quant import fp4_triton

    ws = [_wide((3, 40, 288), torch.bfloat16, seed=21), _wide((70, 64), torch.bfloat16, seed=22),
          _wide((33, 512), torch.float32, seed=23), _wide((96, 40), torch.bfloat16, seed=24).t(),
          _wide((5, 288), torch.bfloat16, seed=25)]
    storages = [E8M0, E8M0, E8M0, E8M0, torch.float32]
    refs = [quantize_fp4_block(w, scale_dtype=st) for w, st in zip(ws, storages)]
    outs = [(torch.full(r[0].shape, 7, dtype=torch.uint8, device=DEVICE),
             torch.full(r[1].shape, 3, dtype=torch.uint8, device=DEVICE).view(E8M0) if st == E8M0
             else torch.full(r[1].shape, 3.0, device=DEVICE)) for r, st in zip(refs, storages)]
    launches = count_launches(monkeypatch, fp4_triton, "_fp4_many_kernel")
    fp4_triton.quantize_fp4_many_into([w.to(DEVICE) for w in ws], outs, 32)
    # bf16 + e8m0 at 256 columns (ws 0), 64 (ws 1) and 128 (ws 3: 96 columns); fp32 w (ws 2); bf16 +
    # fp32 scales (ws 4)
    assert len(launches) == 5, launches
    for out, ref in zip(outs, refs):
        _same(out, ref)


def test_aligned_and_unaligned_tensors_launch_apart_each_equal_to_the_reference(monkeypatch):
    """A tensor whose address and rows are multiples of 16 goes in a launch that tells the compiler
    so (ALIGN 16: 16-byte loads and stores on a GPU); one read 2 bytes past an aligned address, or
    with rows of 130 values, in a launch of its own (ALIGN 1). Each bitwise its reference, fp8 and
    fp4."""
    from lockstep.quant import fp4_triton

    big = _wide((65, 128), torch.bfloat16, seed=31).to(DEVICE)
    ws = [_wide((256, 384), torch.bfloat16, seed=30), None, _wide((3, 128, 256), torch.bfloat16, seed=32),
          _wide((64, 130), torch.bfloat16, seed=33)]
    ws = [w.to(DEVICE) if w is not None else big.view(-1)[1:1 + 64 * 128].view(64, 128) for w in ws]
    assert [tensor_tables.alignment([w.data_ptr()], [w.shape[-1]]) for w in ws] == [16, 1, 16, 1]
    refs = [quantize_fp8_block(w.cpu()) for w in ws]
    outs = [(torch.empty(w.shape, dtype=torch.float8_e4m3fn, device=DEVICE),
             torch.empty(fp8_scale_shape(tuple(w.shape)), device=DEVICE)) for w in ws]
    launches = launch_arguments(monkeypatch, fp8_triton, "_fp8_many_kernel")
    fp8_triton.quantize_fp8_many_into(ws, outs, (128, 128), "ue8m0")
    aligns = [kwargs["ALIGN"] for _, kwargs in launches]
    assert sorted(aligns) == [1, 16]
    for out, ref in zip(outs, refs):
        _same(out, ref)
    ws4 = ws[:3] + [_wide((64, 136), torch.bfloat16, seed=34).to(DEVICE)]  # fp4 packs pairs: even rows
    refs = [quantize_fp4_block(w.cpu(), scale_dtype=E8M0) for w in ws4]
    outs = [(torch.empty(r[0].shape, dtype=torch.uint8, device=DEVICE), torch.empty(r[1].shape, dtype=E8M0,
                                                                                     device=DEVICE)) for r in refs]
    launches = launch_arguments(monkeypatch, fp4_triton, "_fp4_many_kernel")
    fp4_triton.quantize_fp4_many_into(ws4, outs, 32)
    aligns = [kwargs["ALIGN"] for _, kwargs in launches]
    assert 1 in aligns and 16 in aligns, aligns
    for out, ref in zip(outs, refs):
        _same(out, ref)


def _counted(monkeypatch, module, name: str) -> list:
    calls, real = [], getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a: calls.append(1) or real(*a))
    return calls


@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_a_repeated_call_launches_what_it_prepared_once(monkeypatch, fmt):
    """The many-tensor calls keep their launches by their tensors (tensor_tables.PreparedLaunches):
    the same tensors with new values are not prepared again and come out as the new values'
    reference; another output tensor is prepared anew; a w read through a contiguous copy (a
    transposed view) is prepared every time (its copy's address is the call's only)."""
    from lockstep.quant import fp4_triton

    if fmt == "fp8":
        module, prepare = fp8_triton, "_fp8_launches"
        reference = quantize_fp8_block
        call = lambda ws, outs: fp8_triton.quantize_fp8_many_into(ws, outs, (128, 128), "ue8m0")  # noqa: E731

        def outputs(ws):
            return [(torch.empty(w.shape, dtype=torch.float8_e4m3fn, device=DEVICE),
                     torch.empty(fp8_scale_shape(tuple(w.shape)), device=DEVICE)) for w in ws]
    else:
        module, prepare = fp4_triton, "_fp4_launches"
        reference = quantize_fp4_block
        call = lambda ws, outs: fp4_triton.quantize_fp4_many_into(ws, outs, 32)  # noqa: E731

        def outputs(ws):
            return [(torch.empty(*w.shape[:-1], w.shape[-1] // 2, dtype=torch.uint8, device=DEVICE),
                     torch.empty(*w.shape[:-1], w.shape[-1] // 32, dtype=E8M0, device=DEVICE)) for w in ws]
    prepared = _counted(monkeypatch, module, prepare)
    ws = [_wide((256, 384), torch.bfloat16, seed=40).to(DEVICE), _wide((3, 128, 256), torch.bfloat16, seed=41).to(DEVICE)]
    outs = outputs(ws)
    call(ws, outs)
    for w in ws:
        w.mul_(-3.0)  # new values, same tensors: a push's next weights
    call(ws, outs)
    assert len(prepared) == 1
    for w, out in zip(ws, outs):
        _same(out, reference(w.cpu()))
    outs[1] = outputs(ws[1:])[0]  # another storage
    call(ws, outs)
    assert len(prepared) == 2
    _same(outs[1], reference(ws[1].cpu()))
    transposed = [_wide((128, 256), torch.bfloat16, seed=42).to(DEVICE).t()]
    for _ in range(2):
        out = outputs(transposed)
        call(transposed, out)
        _same(out[0], reference(transposed[0].cpu()))
    assert len(prepared) == 4
    # transposed experts: fp4's rows by reshape are a copy (read after it was freed, they were garbage)
    experts = [_wide((2, 128, 128), torch.bfloat16, seed=43).to(DEVICE).transpose(-1, -2)]
    for _ in range(2):
        out = outputs(experts)
        call(experts, out)
        _same(out[0], reference(experts[0].cpu()))
    assert len(prepared) == 6  # each call reads its own copy: not kept


def test_quantize_functions_route_cuda_tensors_to_the_kernels(monkeypatch):
    """quantize_fp8_block / quantize_fp4_block take the kernels where `eligible` says (CUDA tensors;
    faked on CPU), into `out` storage in place, bitwise the CPU reference; CPU keeps the reference."""
    w = _wide((2, 136, 264), torch.bfloat16, seed=4)
    ref8, ref4 = quantize_fp8_block(w), quantize_fp4_block(w)
    calls = []
    real8, real4 = fp8_triton.quantize_fp8_into, quantize_fp4_into
    monkeypatch.setattr(fp8_triton, "quantize_fp8_into", lambda *a: calls.append(8) or real8(*a))
    from lockstep.quant import fp4_triton
    monkeypatch.setattr(fp4_triton, "quantize_fp4_into", lambda *a: calls.append(4) or real4(*a))
    _same(quantize_fp8_block(w), ref8)  # CPU: the reference, no kernel
    _same(quantize_fp4_block(w), ref4)
    assert calls == []
    if DEVICE == "cpu":
        monkeypatch.setattr(fp8_triton, "eligible", lambda t: True)
    w = w.to(DEVICE)
    _same(quantize_fp8_block(w), ref8)
    out = (torch.zeros(w.shape, dtype=torch.float8_e4m3fn, device=DEVICE), torch.zeros(ref8[1].shape, device=DEVICE))
    res = quantize_fp8_block(w, out=out)
    assert res[0] is out[0] and res[1] is out[1]
    _same(out, ref8)
    _same(quantize_fp4_block(w), ref4)
    out4 = tuple(torch.zeros(r.shape, dtype=torch.uint8, device=DEVICE) for r in ref4)
    _same(quantize_fp4_block(w, out=out4), ref4)
    assert calls == [8, 8, 4, 4]


def test_out_storage_on_the_reference_path_is_written_as_bytes():
    w = _wide((130, 70), torch.float32, seed=5)
    ref8, ref4 = quantize_fp8_block(w, scale_dtype=E8M0), quantize_fp4_block(w)
    out = (torch.zeros(w.shape, dtype=torch.uint8), torch.zeros(ref8[1].shape, dtype=torch.uint8))
    _same(quantize_fp8_block(w, out=out), ref8)
    out4 = (torch.zeros(ref4[0].shape, dtype=torch.int8), torch.zeros(ref4[1].shape, dtype=torch.uint8))
    _same(quantize_fp4_block(w, out=out4), ref4)
    with pytest.raises(ValueError, match="out scale"):
        quantize_fp8_block(w, out=(out[0], torch.zeros(3, 3)))
