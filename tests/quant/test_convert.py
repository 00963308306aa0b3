import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from lockstep.quant import QuantFormatError, dequantize_fp4_block, dequantize_fp8_block, quantize_fp8_block
from lockstep.quant.convert import convert_checkpoint, updated_config
from lockstep.quant.formats import Storage
from lockstep.quant.safetensors_io import SafetensorsWriter, TensorSpec

E8M0 = torch.float8_e8m0fnu


def _tiny_checkpoint():
    """Official-layout tensors of a 1-layer toy DeepSeek-V4, bf16 / fp32 / int64 as save_pretrained writes them."""
    g = torch.Generator().manual_seed(0)

    def r(*shape, scale=0.05):
        return (torch.randn(*shape, generator=g) * scale).bfloat16()

    return {
        "embed.weight": r(64, 256),
        "layers.0.attn.wq_a.weight": r(200, 256),  # 200 rows: a partial 128-row block
        "layers.0.attn.wkv.weight": r(64, 256),
        "layers.0.attn.compressor.wkv.weight": r(64, 256),
        "layers.0.attn.compressor.ape": torch.randn(4, 64, generator=g),
        "layers.0.attn.attn_sink": torch.randn(4, generator=g),
        "layers.0.attn_norm.weight": torch.ones(256),  # fp32 in, bf16 out
        "layers.0.hc_attn_fn": torch.randn(24, 1024, generator=g),
        "layers.0.ffn.gate.weight": r(8, 256),
        "layers.0.ffn.gate.bias": torch.randn(8, generator=g),
        "layers.0.ffn.gate.tid2eid": torch.randint(0, 8, (64, 2), generator=g),  # int64 in, int32 out
        "layers.0.ffn.experts.0.w1.weight": r(96, 256),
        "layers.0.ffn.experts.0.w2.weight": r(256, 96),
        "layers.0.ffn.shared_experts.w2.weight": r(256, 96),
        "head.weight": r(64, 256),
    }


def _write_dir(path, tensors, shards=2, config=None):
    path.mkdir(parents=True, exist_ok=True)
    names = list(tensors)
    if shards == 1:
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i in range(shards):
            fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: tensors[n] for n in names[i::shards]}
            save_file(part, str(path / fname), metadata={"format": "pt"})
            weight_map |= dict.fromkeys(part, fname)
        (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps(config or {"model_type": "deepseek_v4", "hidden_size": 256}))
    (path / "tokenizer.json").write_text('{"model": "toy"}')
    return path


def _load_dir(path):
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out |= load_file(str(f))
    return out


def test_bf16_to_fp8_fp4(tmp_path):
    src = _write_dir(tmp_path / "bf16", _tiny_checkpoint())
    res = convert_checkpoint(src, tmp_path / "fp4", "fp8-fp4", progress=False)
    dst = tmp_path / "fp4"
    out = _load_dir(dst)
    ref = _tiny_checkpoint()
    assert res.storage["layers.0.ffn.experts.0.w1.weight"] == Storage.FP4
    assert len(res.files) == 2

    wq = out["layers.0.attn.wq_a.weight"]
    assert wq.dtype == torch.float8_e4m3fn and out["layers.0.attn.wq_a.scale"].dtype == E8M0
    assert out["layers.0.attn.wq_a.scale"].shape == (2, 2)
    q, s = quantize_fp8_block(ref["layers.0.attn.wq_a.weight"], scale_dtype=E8M0)
    assert torch.equal(wq.view(torch.uint8), q.view(torch.uint8)) and torch.equal(out["layers.0.attn.wq_a.scale"].float(), s.float())
    assert out["layers.0.attn.wkv.weight"].dtype == torch.float8_e4m3fn
    assert out["layers.0.ffn.shared_experts.w2.scale"].shape == (2, 1)

    w1, s1 = out["layers.0.ffn.experts.0.w1.weight"], out["layers.0.ffn.experts.0.w1.scale"]
    assert w1.dtype == torch.int8 and w1.shape == (96, 128) and s1.shape == (96, 8) and s1.dtype == E8M0
    err = (dequantize_fp4_block(w1, s1, torch.float32) - ref["layers.0.ffn.experts.0.w1.weight"].float()).abs()
    assert err.max() <= ref["layers.0.ffn.experts.0.w1.weight"].float().abs().max() / 4

    for name in ("embed.weight", "head.weight", "layers.0.attn.compressor.wkv.weight", "layers.0.ffn.gate.weight"):
        assert out[name].dtype == torch.bfloat16 and torch.equal(out[name], ref[name])
        assert name.replace(".weight", ".scale") not in out
    assert out["layers.0.attn_norm.weight"].dtype == torch.bfloat16
    for name in ("layers.0.hc_attn_fn", "layers.0.attn.attn_sink", "layers.0.attn.compressor.ape", "layers.0.ffn.gate.bias"):
        assert out[name].dtype == torch.float32 and torch.equal(out[name], ref[name])
    assert out["layers.0.ffn.gate.tid2eid"].dtype == torch.int32
    assert torch.equal(out["layers.0.ffn.gate.tid2eid"].long(), ref["layers.0.ffn.gate.tid2eid"])

    index = json.loads((dst / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(out)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in out.values())
    for name, fname in index["weight_map"].items():  # a scale lives in its weight's shard
        if name.endswith(".scale"):
            assert index["weight_map"][name[: -len(".scale")] + ".weight"] == fname
    qc = json.loads((dst / "config.json").read_text())["quantization_config"]
    assert qc == {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
        "expert_dtype": "fp4",
        "scale_fmt": "ue8m0",
    }
    assert (dst / "tokenizer.json").read_text() == '{"model": "toy"}'


def test_back_to_bf16_and_round_trip_is_a_fixed_point(tmp_path):
    src = _write_dir(tmp_path / "a", _tiny_checkpoint())
    convert_checkpoint(src, tmp_path / "b", "fp8-fp4", progress=False)
    convert_checkpoint(tmp_path / "b", tmp_path / "c", "bf16", progress=False)
    convert_checkpoint(tmp_path / "c", tmp_path / "d", "fp8-fp4", progress=False)
    convert_checkpoint(tmp_path / "d", tmp_path / "e", "bf16", progress=False)
    b, c, e = _load_dir(tmp_path / "b"), _load_dir(tmp_path / "c"), _load_dir(tmp_path / "e")
    assert not any(n.endswith(".scale") for n in c)
    assert set(c) == set(_tiny_checkpoint())
    assert c["layers.0.ffn.experts.0.w1.weight"].shape == (96, 256)
    assert c["layers.0.ffn.experts.0.w1.weight"].dtype == torch.bfloat16
    assert torch.equal(
        c["layers.0.attn.wq_a.weight"],
        dequantize_fp8_block(b["layers.0.attn.wq_a.weight"], b["layers.0.attn.wq_a.scale"], torch.bfloat16),
    )
    for name in c:
        assert torch.equal(c[name], e[name]), name  # dequantised values survive another quantise / dequantise
    cfg = json.loads((tmp_path / "c" / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["model_type"] == "deepseek_v4"


def test_already_quantised_weights_are_copied_bit_exactly(tmp_path):
    convert_checkpoint(_write_dir(tmp_path / "a", _tiny_checkpoint()), tmp_path / "b", "fp8-fp4", progress=False)
    # Re-store fp4 as uint8 and ue8m0 scales as float32: still recognised and copied unchanged.
    b = _load_dir(tmp_path / "b")
    alt = dict(b)
    alt["layers.0.ffn.experts.0.w1.weight"] = b["layers.0.ffn.experts.0.w1.weight"].view(torch.uint8)
    alt["layers.0.attn.wq_a.scale"] = b["layers.0.attn.wq_a.scale"].float()
    _write_dir(tmp_path / "alt", alt, shards=1, config=json.loads((tmp_path / "b" / "config.json").read_text()))
    convert_checkpoint(tmp_path / "alt", tmp_path / "c", "fp8-fp4", progress=False)
    c = _load_dir(tmp_path / "c")
    assert set(c) == set(b)
    for name in b:
        assert c[name].dtype == b[name].dtype and torch.equal(c[name].view(torch.uint8), b[name].view(torch.uint8)), name
    assert not (tmp_path / "c" / "model.safetensors.index.json").exists()


def test_fp8_fp4_to_fp8_requantises_routed_experts(tmp_path):
    convert_checkpoint(_write_dir(tmp_path / "a", _tiny_checkpoint()), tmp_path / "b", "fp8-fp4", progress=False)
    convert_checkpoint(tmp_path / "b", tmp_path / "c", "fp8", scale_fmt="fp32", progress=False)
    b, c = _load_dir(tmp_path / "b"), _load_dir(tmp_path / "c")
    w1, s1 = c["layers.0.ffn.experts.0.w1.weight"], c["layers.0.ffn.experts.0.w1.scale"]
    assert w1.dtype == torch.float8_e4m3fn and w1.shape == (96, 256) and s1.dtype == torch.float32 and s1.shape == (1, 2)
    x4 = dequantize_fp4_block(b["layers.0.ffn.experts.0.w1.weight"], b["layers.0.ffn.experts.0.w1.scale"], torch.float32)
    x8 = dequantize_fp8_block(w1, s1, torch.float32)
    assert (x8 - x4).abs().max() <= x4.abs().max() / 16
    # fp8 weights keep their bytes; their ue8m0 scales are now stored as float32
    assert torch.equal(c["layers.0.attn.wq_a.weight"].view(torch.uint8), b["layers.0.attn.wq_a.weight"].view(torch.uint8))
    assert torch.equal(c["layers.0.attn.wq_a.scale"], b["layers.0.attn.wq_a.scale"].float())
    qc = json.loads((tmp_path / "c" / "config.json").read_text())["quantization_config"]
    assert qc["expert_dtype"] == "fp8" and "scale_fmt" not in qc


def test_errors_name_tensor_and_file(tmp_path):
    t = _tiny_checkpoint()
    t["layers.0.attn.wq_a.weight"] = torch.zeros(256, 512).to(torch.float8_e4m3fn)
    t["layers.0.attn.wq_a.scale"] = torch.ones(2, 3)
    src = _write_dir(tmp_path / "bad", t, shards=1)
    with pytest.raises(QuantFormatError) as err:
        convert_checkpoint(src, tmp_path / "out", "bf16", progress=False)
    msg = str(err.value)
    assert "model.safetensors" in msg and "layers.0.attn.wq_a.scale: shape (2, 3) does not fit weight (256, 512)" in msg


def test_unknown_tensors_strict_and_lenient(tmp_path):
    t = _tiny_checkpoint()
    t["layers.0.attn.mystery.weight"] = torch.randn(4, 4).bfloat16()
    src = _write_dir(tmp_path / "a", t)
    with pytest.raises(QuantFormatError, match=r"model-0000\d-of-00002\.safetensors: layers\.0\.attn\.mystery\.weight"):
        convert_checkpoint(src, tmp_path / "b", "fp8", progress=False)
    res = convert_checkpoint(src, tmp_path / "c", "fp8", strict=False, progress=True)
    assert res.storage["layers.0.attn.mystery.weight"] is None
    assert torch.equal(_load_dir(tmp_path / "c")["layers.0.attn.mystery.weight"], t["layers.0.attn.mystery.weight"])


def test_v3_style_scale_names_and_fp32_scales_are_requantised_to_ue8m0(tmp_path):
    w = (torch.randn(256, 256) * 0.1).bfloat16()
    q, s = quantize_fp8_block(w, scale_fmt="fp32")
    t = {"model.layers.0.attn.wo_b.weight": q, "model.layers.0.attn.wo_b.weight_scale_inv": s}
    convert_checkpoint(_write_dir(tmp_path / "a", t, shards=1), tmp_path / "b", "fp8", progress=False)
    out = _load_dir(tmp_path / "b")
    assert set(out) == set(t) and out["model.layers.0.attn.wo_b.weight_scale_inv"].dtype == E8M0
    x = dequantize_fp8_block(q, s, torch.float32)
    y = dequantize_fp8_block(out["model.layers.0.attn.wo_b.weight"], out["model.layers.0.attn.wo_b.weight_scale_inv"], torch.float32)
    assert (x - y).abs().max() <= x.abs().max() / 16


def test_updated_config_keeps_other_fields():
    cfg = {"hidden_size": 8, "expert_dtype": "fp4", "quantization_config": {"quant_method": "fp8", "modules_to_not_convert": ["x"]}}
    out = updated_config(cfg, "fp8", "fp32", (64, 64))
    assert out["expert_dtype"] == "fp8" and out["quantization_config"]["modules_to_not_convert"] == ["x"]
    assert out["quantization_config"]["weight_block_size"] == [64, 64]
    assert updated_config(cfg, "bf16") == {"hidden_size": 8}
    assert cfg["expert_dtype"] == "fp4"  # input untouched


def test_streaming_writer_checks_plan(tmp_path):
    specs = [TensorSpec("a", torch.bfloat16, (2, 3)), TensorSpec("b", E8M0, (4,)), TensorSpec("c", torch.int32, ())]
    a, b, c = torch.randn(2, 3).bfloat16(), torch.tensor([1.0, 2.0, 4.0, 0.5]).to(E8M0), torch.tensor(7, dtype=torch.int32)
    with SafetensorsWriter(tmp_path / "x.safetensors", specs, {"format": "pt", "k": "v"}) as w:
        for t in (a, b, c):
            w.write(t)
    with safe_open(str(tmp_path / "x.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt", "k": "v"}
        assert torch.equal(f.get_tensor("a"), a) and torch.equal(f.get_tensor("b").float(), b.float())
        assert f.get_tensor("c").item() == 7
    w = SafetensorsWriter(tmp_path / "y.safetensors", specs)
    with pytest.raises(ValueError, match="a: planned"):
        w.write(torch.zeros(3, 2).bfloat16())
    with pytest.raises(ValueError, match="wrote 0 of 3"):
        w.close()
