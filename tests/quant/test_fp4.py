import pytest
import torch

from lockstep.quant import QuantFormatError, dequantize_fp4_block, pack_e2m1, quantize_fp4_block, unpack_e2m1
from lockstep.quant.fp4 import e2m1_to_float, float_to_e2m1

E8M0 = torch.float8_e8m0fnu


def test_round_to_nearest_even_on_the_grid():
    x = torch.tensor([0.25, 0.26, 0.75, 1.25, 1.75, 2.5, 2.6, 3.5, 5.0, 5.1, 7.0, -0.1, -6.0, 0.0])
    assert e2m1_to_float(float_to_e2m1(x)).tolist() == [0, 0.5, 1, 1, 2, 2, 3, 4, 4, 6, 6, -0.0, -6, 0]
    assert float_to_e2m1(torch.tensor([-0.1, -6.0, 6.0, 1.5])).tolist() == [8, 15, 7, 3]


def test_pack_low_nibble_first():
    codes = torch.tensor([[1, 10, 7, 0, 15, 8]], dtype=torch.uint8)
    packed = pack_e2m1(codes)
    assert packed.dtype == torch.uint8 and packed.tolist() == [[0xA1, 0x07, 0x8F]]
    assert torch.equal(unpack_e2m1(packed), codes)
    assert torch.equal(unpack_e2m1(packed.view(torch.int8)), codes)


def test_quantise_known_row_gives_known_bytes_and_scales():
    w = torch.zeros(2, 64)
    w[0, :4] = torch.tensor([0.5, -1.0, 6.0, 0.0])  # block 0: amax 6 -> scale 1
    w[0, 32:36] = torch.tensor([12.0, 3.0, -2.0, 5.0])  # block 1: amax 12 -> scale 2: codes 6, 1.5, -1, 2.5->2
    w[1, 0] = 7.0  # 7/6 -> scale 2; 7/2 = 3.5 -> tie -> 4 (even)
    w[1, 32] = 3.0  # 3/6 = 0.5 -> scale 0.5; 3/0.5 = 6
    packed, scale = quantize_fp4_block(w)
    assert packed.shape == (2, 32) and packed.dtype == torch.uint8
    assert scale.shape == (2, 2) and scale.dtype == E8M0
    assert scale.float().tolist() == [[1.0, 2.0], [2.0, 0.5]]
    assert packed[0, :2].tolist() == [0xA1, 0x07]
    assert packed[0, 16:18].tolist() == [0x37, 0x4A]  # (6->7, 1.5->3), (-1->0xA, 2.5->2 rounds to 2->4)
    assert packed[1, 0].item() == 0x06 and packed[1, 16].item() == 0x07
    d = dequantize_fp4_block(packed, scale, torch.float32)
    assert d[0, 32:36].tolist() == [12.0, 3.0, -2.0, 4.0]
    assert d[1, 0].item() == 8.0 and d[1, 32].item() == 3.0


def test_zero_block_and_partial_block():
    w = torch.zeros(3, 40)  # last block holds 8 values
    w[2, 39] = -0.75
    packed, scale = quantize_fp4_block(w, scale_dtype=torch.float32)
    assert scale.tolist() == [[1, 1], [1, 1], [1, 0.125]]
    assert dequantize_fp4_block(packed, scale, torch.float32)[2, 39].item() == -0.75


@pytest.mark.parametrize("shape", [(0, 64), (2, 0, 64), (4, 0)])
def test_empty_tensors_quantise_to_empty_bytes_and_scales(shape):
    """No rows (an expert block with no experts) or no columns: empty outputs of the packed shapes."""
    packed, scale = quantize_fp4_block(torch.zeros(shape, dtype=torch.bfloat16))
    assert packed.shape == (*shape[:-1], shape[-1] // 2) and scale.shape == (*shape[:-1], -(-shape[-1] // 32))
    assert dequantize_fp4_block(packed, scale, torch.bfloat16).shape == shape


def _representable(shape):
    torch.manual_seed(0)
    v = e2m1_to_float(torch.randint(0, 16, shape, dtype=torch.uint8))
    s = 2.0 ** torch.randint(-12, 6, (*shape[:-1], shape[-1] // 32)).float()
    return (v.reshape(*shape[:-1], -1, 32) * s[..., None]).reshape(shape).bfloat16()


@pytest.mark.parametrize("shape", [(64, 128), (4, 16, 96)])
def test_dequant_quant_is_exact_on_representable_values(shape):
    x = _representable(shape)
    packed, scale = quantize_fp4_block(x)
    assert torch.equal(dequantize_fp4_block(packed, scale, torch.bfloat16), x)
    assert torch.equal(dequantize_fp4_block(packed.view(torch.int8), scale.float(), torch.bfloat16), x)


def test_quant_dequant_returns_same_bytes_and_scales():
    torch.manual_seed(3)
    packed, scale = quantize_fp4_block(torch.randn(32, 256))
    codes = unpack_e2m1(packed)
    codes[:, ::32] = 7  # every block holds a 6, so its scale is determined (see fp4.py docstring)
    packed = pack_e2m1(codes)
    p2, s2 = quantize_fp4_block(dequantize_fp4_block(packed, scale, torch.bfloat16))
    assert torch.equal(p2, packed)
    assert torch.equal(s2.view(torch.uint8), scale.view(torch.uint8))


def test_fp4_error_messages():
    packed = torch.zeros(8, 64, dtype=torch.uint8)
    with pytest.raises(QuantFormatError) as err:
        dequantize_fp4_block(packed, torch.ones(8, 2, dtype=E8M0), name="layers.1.ffn.experts.0.w1.weight")
    assert str(err.value) == (
        "layers.1.ffn.experts.0.w1.scale: shape (8, 2) does not fit packed fp4 weight (8, 64) "
        "(unpacked (8, 128)) with 1x32 blocks; expected (8, 4)"
    )
    with pytest.raises(QuantFormatError, match=r"^layers\.1\.ffn\.experts\.0\.w1\.weight: dtype torch\.float32"):
        dequantize_fp4_block(packed.float(), torch.ones(8, 4), name="layers.1.ffn.experts.0.w1.weight")
    with pytest.raises(QuantFormatError, match="scale: dtype torch.bfloat16"):
        dequantize_fp4_block(packed, torch.ones(8, 4, dtype=torch.bfloat16), name="x.weight")
    with pytest.raises(QuantFormatError, match="odd"):
        quantize_fp4_block(torch.randn(2, 33), name="x.weight")
