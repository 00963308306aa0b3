"""Parameter counts against hand arithmetic, the transformers reference and the spec's totals."""

import json

import pytest

from lockstep.plan.hf_config import load_model, spec_from_config
from lockstep.plan.model import DEEPSEEK_V4_FLASH, SMOLLM2_135M, ModelSpec
from lockstep.plan.params import active_params, all_groups, buffer_bytes, layer_groups, total_params


def test_tiny_v4_counts_by_hand(tiny_v4):
    H, hc = 64, (2 + 2) * 2
    attn = 64 * 16 + 16 * 4 * 32 + 64 * 32 + 4 * 32 * 8 + 2 * 8 * 64 + 4 + (16 + 32)
    mhc = 2 * (hc * 2 * H + hc + 3)
    moe = 8 * 64 + 8 * 3 * 64 * 16 + 3 * 64 * 16
    common = attn + mhc + 2 * H + moe
    c4 = 2 * 64 * 2 * 32 + (4 * 2 * 32 + 32) + 2 * 64 * 2 * 8 + (4 * 2 * 8 + 8) + 16 * 2 * 8 + 64 * 2
    c128 = 2 * 64 * 32 + (128 * 32 + 32)
    model = 2 * 100 * 64 + 64 + (2 * 2 * 64 + 2 + 1)
    assert sum(g.count for g in layer_groups(tiny_v4, 0)) == common
    assert sum(g.count for g in layer_groups(tiny_v4, 2)) == common + c4
    assert sum(g.count for g in layer_groups(tiny_v4, 3)) == common + c128
    # 182,643 is also what transformers 5.23's DeepseekV4ForCausalLM reports for this config.
    assert total_params(tiny_v4) == 4 * common + c4 + c128 + model == 182_643
    assert active_params(tiny_v4) == 182_643 - 4 * 8 * 3 * 64 * 16 * (1 - 2 / 8)


def test_tiny_llama_counts_by_hand(tiny_llama):
    per_layer = 64 * 64 + 2 * 64 * 2 * 16 + 64 * 64 + 3 * 64 * 128 + 2 * 64
    assert sum(g.count for g in layer_groups(tiny_llama, 0)) == per_layer == 36_992
    assert total_params(tiny_llama) == 4 * per_layer + 2 * 1000 * 64 + 64 == 276_032
    assert active_params(tiny_llama) == total_params(tiny_llama)


def test_v4_flash_totals_match_the_spec():
    # 284B total / ~13B active (DSV4_SPEC.md); the exact total equals transformers' meta-device count.
    assert total_params(DEEPSEEK_V4_FLASH) == 284_332_230_231
    experts = sum(g.count for g in all_groups(DEEPSEEK_V4_FLASH) if g.shard == "expert")
    assert experts == 43 * 256 * 3 * 4096 * 2048 == 277_025_390_592
    assert active_params(DEEPSEEK_V4_FLASH) == 13_799_622_231
    assert DEEPSEEK_V4_FLASH.compress_ratios.count(4) == 21
    assert DEEPSEEK_V4_FLASH.compress_ratios.count(128) == 20
    # tid2eid int32 [129280, 6] on 3 hash layers + fp32 router bias [256] on the other 40.
    assert buffer_bytes(DEEPSEEK_V4_FLASH) == 3 * 129280 * 6 * 4 + 40 * 256 * 4


def test_smollm2_total():
    assert total_params(SMOLLM2_135M) == 134_515_008


def _flash_config():
    return {
        "model_type": "deepseek_v4", "hidden_size": 4096, "num_hidden_layers": 43, "vocab_size": 129280,
        "n_routed_experts": 256, "num_experts_per_tok": 6, "moe_intermediate_size": 2048, "n_shared_experts": 1,
        "num_attention_heads": 64, "head_dim": 512, "q_lora_rank": 1024, "o_groups": 8, "o_lora_rank": 1024,
        "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512, "hc_mult": 4, "sliding_window": 128,
        "num_hash_layers": 3,
    }


def test_v4_config_json_forms_agree_with_preset(tmp_path):
    released = {**_flash_config(), "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0]}  # 44th = MTP
    names = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}
    hf = {**_flash_config(), "layer_types": [names[r] for r in DEEPSEEK_V4_FLASH.compress_ratios]}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(released))
    for spec in (load_model(str(path)), load_model(str(tmp_path)), spec_from_config(hf)):
        assert spec.compress_ratios == DEEPSEEK_V4_FLASH.compress_ratios
        assert total_params(spec) == total_params(DEEPSEEK_V4_FLASH)


def test_llama_config_json():
    cfg = {"hidden_size": 576, "num_hidden_layers": 30, "vocab_size": 49152, "num_attention_heads": 9,
           "num_key_value_heads": 3, "intermediate_size": 1536, "tie_word_embeddings": True}
    assert total_params(spec_from_config(cfg)) == 134_515_008


def test_bad_configs_name_the_field():
    with pytest.raises(ValueError, match="q_lora_rank: missing"):
        spec_from_config({k: v for k, v in _flash_config().items() if k != "q_lora_rank"})
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        spec_from_config({**_flash_config(), "num_experts_per_tok": 300})
    with pytest.raises(ValueError, match="compress_ratios"):
        spec_from_config({**_flash_config(), "compress_ratios": [0, 3] * 22})
    with pytest.raises(ValueError, match="num_kv_heads"):
        ModelSpec(name="x", family="llama", hidden_size=8, num_layers=1, vocab_size=8, num_attention_heads=3,
                  head_dim=2, num_kv_heads=2, intermediate_size=8)
    with pytest.raises(ValueError, match="neither a preset"):
        load_model("no-such-model")
