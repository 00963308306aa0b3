import pytest
import torch

from lockstep.quant import QuantFormatError, dequantize_fp8_block, quantize_fp8_block, scale_from_e8m0, scale_to_e8m0
from lockstep.quant.fp8 import fp8_scale_shape

E8M0 = torch.float8_e8m0fnu


def _f(q):
    return q.float()


def test_ue8m0_scale_rounds_up_to_power_of_two():
    w = torch.zeros(128, 128)
    w[5, 7] = 448 * 3  # amax / 448 = 3 -> scale 4
    w[0, 0] = -100.0
    q, s = quantize_fp8_block(w)
    assert s.shape == (1, 1) and s.dtype == torch.float32
    assert s.item() == 4.0
    # 1344 / 4 = 336 is a tie between e4m3's 320 (mantissa 010) and 352 (011): even wins.
    assert _f(q)[5, 7].item() == 320.0
    assert _f(q)[0, 0].item() == -24.0  # -100 / 4 = -25 -> tie of 24 and 26 -> 24 (even)
    assert dequantize_fp8_block(q, s, torch.float32)[5, 7].item() == 1280.0


def test_fp32_scale_is_amax_over_448():
    w = torch.zeros(128, 128)
    w[5, 7] = 448 * 3
    w[1, 1] = 30.0
    q, s = quantize_fp8_block(w, scale_fmt="fp32")
    assert s.item() == 3.0
    assert _f(q)[5, 7].item() == 448.0 and _f(q)[1, 1].item() == 10.0


def test_amax_just_above_448_gets_scale_2_and_never_exceeds_448():
    w = torch.zeros(128, 128)
    w[0, 0] = 449.0
    w[0, 1] = 448.0  # exactly 448: scale 1 would do for this one alone
    q, s = quantize_fp8_block(w)
    assert s.item() == 2.0
    assert _f(q)[0, 0].item() == 224.0 and _f(q)[0, 1].item() == 224.0
    w = torch.randn(256, 384) * torch.logspace(-8, 8, 384)
    q, s = quantize_fp8_block(w)
    assert _f(q).abs().max().item() <= 448 and not torch.isnan(_f(q)).any()
    m, _ = torch.frexp(s)
    assert (m == 0.5).all()  # every scale a power of two


def test_zero_block_gets_scale_one():
    w = torch.zeros(256, 128)
    w[200, 3] = 1.0
    q, s = quantize_fp8_block(w)
    assert s.tolist() == [[1.0], [2.0**-8]]  # 1/448 -> 2**-8 (1/256 >= 1/448 > 1/512)
    assert (_f(q)[:128] == 0).all()


def test_partial_edge_blocks():
    w = torch.zeros(130, 260)
    w[129, 259] = 448.0 * 16  # the bottom-right block is 2 x 4 elements
    w[0, 0] = 448.0
    w[0, 200] = 448.0 / 4
    q, s = quantize_fp8_block(w)
    assert q.shape == (130, 260) and s.shape == (2, 3) == fp8_scale_shape((130, 260))
    assert s.tolist() == [[1.0, 0.25, 1.0], [1.0, 1.0, 16.0]]
    assert torch.equal(dequantize_fp8_block(q, s, torch.float32), w)


def test_small_custom_block_hand_checked():
    w = torch.tensor([[1.0, 2.0, 100.0, 0.5], [-3.0, 7.0, 0.0, -1.0]])
    q, s = quantize_fp8_block(w, block=(1, 2))
    # row-blocks: amax 2 -> 2/448 -> 2**-7; 100 -> 2**-2; 7 -> 2**-6; 1 -> 2**-8
    assert s.tolist() == [[2.0**-7, 2.0**-2], [2.0**-6, 2.0**-8]]
    # 100 / 2**-2 = 400: a tie of 384 (mantissa 100) and 416 (101) -> 384
    assert _f(q).tolist() == [[128.0, 256.0, 384.0, 2.0], [-192.0, 448.0, 0.0, -256.0]]


def test_leading_dims_quantise_each_matrix():
    w = torch.randn(3, 130, 70)
    q, s = quantize_fp8_block(w)
    assert s.shape == (3, 2, 1)
    for e in range(3):
        qe, se = quantize_fp8_block(w[e])
        assert torch.equal(_f(q[e]), _f(qe)) and torch.equal(s[e], se)
    assert torch.equal(dequantize_fp8_block(q, s)[1], dequantize_fp8_block(q[1], s[1]))


def _random_representable(shape, block=(128, 128)):
    """A tensor that is exactly q * 2**k per block: what dequantising an ue8m0 checkpoint produces."""
    torch.manual_seed(0)
    q = (torch.randn(shape) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = 2.0 ** torch.randint(-20, 4, fp8_scale_shape(shape, block)).float()
    return dequantize_fp8_block(q, s, torch.bfloat16, block=block)


@pytest.mark.parametrize("shape", [(256, 384), (200, 130), (2, 129, 257)])
def test_dequant_quant_is_exact_on_representable_values(shape):
    x = _random_representable(shape)
    q, s = quantize_fp8_block(x)
    assert torch.equal(dequantize_fp8_block(q, s, torch.bfloat16), x)
    q, s = quantize_fp8_block(x, scale_dtype=E8M0)
    assert torch.equal(dequantize_fp8_block(q, s, torch.bfloat16), x)


def test_quant_dequant_returns_same_q_and_ue8m0_scale():
    torch.manual_seed(1)
    q, s = quantize_fp8_block(torch.randn(300, 260) * 0.02, scale_dtype=E8M0)
    # Make every block's max |q| 448 so the block's scale is determined (see fp8.py docstring).
    qf = _f(q)
    qf[::128, ::128] = 448.0
    q = qf.to(torch.float8_e4m3fn)
    q2, s2 = quantize_fp8_block(dequantize_fp8_block(q, s, torch.bfloat16), scale_dtype=E8M0)
    assert s2.dtype == E8M0 and torch.equal(s2.view(torch.uint8), s.view(torch.uint8))
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8))


def test_block_whose_max_rounds_to_224_comes_back_halved_with_same_values():
    w = torch.zeros(128, 128)
    w[0, 0] = 225.0 * 4  # amax 900 -> scale 4 (900/448 = 2.01 -> 4); 225 rounds to 224 in e4m3
    w[0, 1] = 3.0
    q, s = quantize_fp8_block(w)
    assert s.item() == 4.0 and _f(q)[0, 0].item() == 224.0
    x = dequantize_fp8_block(q, s, torch.float32)
    q2, s2 = quantize_fp8_block(x)
    assert s2.item() == 2.0 and torch.equal(_f(q2), 2 * _f(q))
    assert torch.equal(dequantize_fp8_block(q2, s2, torch.float32), x)


def test_fp32_scales_round_trip_in_float32():
    torch.manual_seed(2)
    q, s = quantize_fp8_block(torch.randn(256, 384) * 3e-3, scale_fmt="fp32")
    x = dequantize_fp8_block(q, s, torch.float32)
    q2, s2 = quantize_fp8_block(x, scale_fmt="fp32")
    assert torch.equal(s2, s) and torch.equal(q2.view(torch.uint8), q.view(torch.uint8))


def test_e8m0_conversion_is_exact_and_rejects_non_powers_of_two():
    s = torch.tensor([4.0, 0.5, 2.0**-127, 2.0**127, 1.0])
    e = scale_to_e8m0(s)
    assert e.dtype == E8M0
    assert e.view(torch.uint8).tolist() == [129, 126, 0, 254, 127]
    assert torch.equal(scale_from_e8m0(e), s)
    with pytest.raises(QuantFormatError, match="not powers of two"):
        scale_to_e8m0(torch.tensor([1.0, 3.0]), name="layers.0.attn.wq_a.scale")
    with pytest.raises(QuantFormatError):
        scale_to_e8m0(torch.tensor([2.0**-128]))
    w = torch.randn(130, 300)
    q1, s1 = quantize_fp8_block(w)
    q2, s2 = quantize_fp8_block(w, scale_dtype=E8M0)
    assert torch.equal(s2.float(), s1) and torch.equal(_f(q1), _f(q2))
    assert torch.equal(dequantize_fp8_block(q1, s1), dequantize_fp8_block(q2, s2))


def test_scale_shape_error_names_the_tensor():
    q = torch.zeros(256, 512).to(torch.float8_e4m3fn)
    with pytest.raises(QuantFormatError) as err:
        dequantize_fp8_block(q, torch.ones(2, 3), name="layers.3.attn.wq_a.weight")
    assert str(err.value) == (
        "layers.3.attn.wq_a.scale: shape (2, 3) does not fit weight (256, 512) with 128x128 blocks; expected (2, 4)"
    )
    assert isinstance(err.value, ValueError)


def test_dtype_errors_name_the_tensor():
    q = torch.zeros(256, 512).to(torch.float8_e4m3fn)
    with pytest.raises(QuantFormatError, match=r"^layers\.3\.attn\.wq_a\.scale: dtype torch\.int32"):
        dequantize_fp8_block(q, torch.ones(2, 4, dtype=torch.int32), name="layers.3.attn.wq_a.weight")
    with pytest.raises(QuantFormatError, match=r"^layers\.3\.attn\.wq_a\.weight: dtype torch\.bfloat16"):
        dequantize_fp8_block(torch.zeros(256, 512, dtype=torch.bfloat16), torch.ones(2, 4), name="layers.3.attn.wq_a.weight")
    with pytest.raises(ValueError):
        quantize_fp8_block(torch.randn(4, 4), scale_fmt="fp32", scale_dtype=E8M0)
