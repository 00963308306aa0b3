import pytest

from lockstep.quant import ServingFormat, Storage, storage_for
from lockstep.quant.formats import UnknownTensorError, local_name, scale_names

B, F8, F4, F32, I32 = Storage.BF16, Storage.FP8, Storage.FP4, Storage.FP32, Storage.INT32

# name -> storage in (bf16, fp8, fp8-fp4)
CASES = {
    "layers.3.attn.wq_a.weight": (B, F8, F8),
    "layers.3.attn.wq_b.weight": (B, F8, F8),
    "layers.3.attn.wkv.weight": (B, F8, F8),
    "layers.3.attn.wo_a.weight": (B, F8, F8),
    "layers.3.attn.wo_b.weight": (B, F8, F8),
    "layers.3.attn.compressor.wkv.weight": (B, B, B),
    "layers.3.attn.compressor.wgate.weight": (B, B, B),
    "layers.3.attn.compressor.ape": (F32, F32, F32),
    "layers.3.attn.compressor.norm.weight": (B, B, B),
    "layers.3.attn.indexer.wq_b.weight": (B, F8, F8),
    "layers.3.attn.indexer.compressor.wgate.weight": (B, B, B),
    "layers.3.attn.indexer.compressor.wkv.weight": (B, B, B),
    "layers.3.attn.indexer.compressor.ape": (F32, F32, F32),
    "layers.3.attn.indexer.weights_proj.weight": (B, B, B),
    "layers.3.attn.attn_sink": (F32, F32, F32),
    "layers.3.attn.q_norm.weight": (B, B, B),
    "layers.3.attn.kv_norm.weight": (B, B, B),
    "layers.3.ffn.experts.7.w1.weight": (B, F8, F4),
    "layers.3.ffn.experts.255.w2.weight": (B, F8, F4),
    "layers.3.ffn.shared_experts.w2.weight": (B, F8, F8),
    "layers.3.ffn.gate.weight": (B, B, B),
    "layers.3.ffn.gate.bias": (F32, F32, F32),
    "layers.0.ffn.gate.tid2eid": (I32, I32, I32),
    "layers.3.attn_norm.weight": (B, B, B),
    "layers.3.ffn_norm.weight": (B, B, B),
    "layers.3.hc_attn_fn": (F32, F32, F32),
    "layers.3.hc_ffn_scale": (F32, F32, F32),
    "hc_head_base": (F32, F32, F32),
    "embed.weight": (B, B, B),
    "head.weight": (B, B, B),
    "norm.weight": (B, B, B),
    "mtp.0.e_proj.weight": (B, F8, F8),
    "mtp.0.hnorm.weight": (B, B, B),
    "mtp.0.ffn.experts.3.w3.weight": (B, F8, F4),
    # save_pretrained's layout: official names with a model. prefix
    "model.layers.1.attn.wq_a.weight": (B, F8, F8),
    "model.layers.1.ffn.experts.0.w1.weight": (B, F8, F4),
    "model.layers.1.hc_attn_fn": (F32, F32, F32),
    "model.layers.1.ffn.gate.bias": (F32, F32, F32),
    "model.embed.weight": (B, B, B),
    # transformers' in-memory names
    "model.layers.3.self_attn.q_a_proj.weight": (B, F8, F8),
    "model.layers.3.self_attn.kv_proj.weight": (B, F8, F8),
    "model.layers.3.self_attn.compressor.kv_proj.weight": (B, B, B),
    "model.layers.3.self_attn.compressor.indexer.gate_proj.weight": (B, B, B),
    "model.layers.3.self_attn.compressor.indexer.q_b_proj.weight": (B, F8, F8),
    "model.layers.3.self_attn.compressor.indexer.scorer.weights_proj.weight": (B, B, B),
    "model.layers.3.self_attn.compressor.position_bias": (F32, F32, F32),
    "model.layers.3.self_attn.sinks": (F32, F32, F32),
    "model.layers.3.mlp.experts.gate_up_proj": (B, F8, F4),
    "model.layers.3.mlp.experts.down_proj": (B, F8, F4),
    "model.layers.3.mlp.shared_experts.up_proj.weight": (B, F8, F8),
    "model.layers.3.mlp.gate.e_score_correction_bias": (F32, F32, F32),
    "model.layers.0.mlp.gate.tid2eid": (I32, I32, I32),
    "model.layers.3.attn_hc.scale": (F32, F32, F32),
    "model.layers.3.post_attention_layernorm.weight": (B, B, B),
    "model.hc_head.hc_fn": (F32, F32, F32),
    "model.embed_tokens.weight": (B, B, B),
    "lm_head.weight": (B, B, B),
}


@pytest.mark.parametrize("name", list(CASES))
def test_storage_rule(name):
    got = tuple(storage_for(name, fmt) for fmt in ("bf16", "fp8", "fp8-fp4"))
    assert got == CASES[name]


def test_unknown_names_raise_and_formats_parse():
    with pytest.raises(UnknownTensorError, match="layers.3.attn.mystery.weight"):
        storage_for("layers.3.attn.mystery.weight", "fp8")
    with pytest.raises(UnknownTensorError):
        storage_for("layers.3.attn.compressor.wq_a.weight", "fp8")
    assert ServingFormat.parse("FP8_FP4") is ServingFormat.FP8_FP4
    with pytest.raises(ValueError, match="serving format"):
        ServingFormat.parse("int4")


def test_helpers():
    assert local_name("model.layers.12.attn.wkv.weight") == "attn.wkv.weight"
    assert local_name("mtp.0.e_proj.weight") == "e_proj.weight"
    assert scale_names("layers.0.attn.wkv.weight") == ("layers.0.attn.wkv.scale", "layers.0.attn.wkv.weight_scale_inv")
    assert scale_names("model.layers.0.mlp.experts.down_proj") == ("model.layers.0.mlp.experts.down_proj_scale_inv",)
