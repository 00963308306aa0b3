"""Key maps: every DeepSeek-V4 layout and the Llama / GGUF tables, checked against transformers 5.23."""

import pytest
import torch
import transformers

from lockstep.models.deepseek_v4_config import CSA, HCA, SLIDING, DeepseekV4Config
from lockstep.models.key_maps import KEY_MAPS, Mapped

DSV4 = KEY_MAPS["deepseek_v4"]


def tiny_hf_dsv4():
    config = DeepseekV4Config(
        vocab_size=64, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=4, num_attention_heads=4,
        head_dim=16, q_lora_rank=16, num_experts_per_tok=2, n_routed_experts=4, o_groups=2, o_lora_rank=8,
        index_n_heads=2, index_head_dim=8, index_topk=2, sliding_window=8, partial_rotary_factor=0.25,
        layer_types=(SLIDING, CSA, HCA, CSA), mlp_layer_types=("hash_moe", "moe", "moe", "moe"),
        compress_rates={CSA: 2, HCA: 4})
    return transformers.DeepseekV4ForCausalLM(transformers.DeepseekV4Config(**config.to_hf_dict()))


@pytest.fixture(scope="module")
def hf_dsv4():
    torch.manual_seed(0)
    return tiny_hf_dsv4()


def test_saved_names_equal_what_transformers_writes(hf_dsv4, tmp_path):
    from safetensors import safe_open

    hf_dsv4.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        written = set(f.keys())
    ours = {n for k, v in hf_dsv4.state_dict().items() for n, _ in DSV4.to_checkpoint(k, v)}
    assert ours == written


@pytest.mark.parametrize("layout", ["transformers", "official"])
def test_every_name_round_trips(hf_dsv4, layout):
    for name, t in hf_dsv4.state_dict().items():
        assert DSV4.to_lockstep(name) == Mapped(name)  # in-memory names load as themselves
        for ckpt_name, part in DSV4.to_checkpoint(name, t, layout):
            mapped = DSV4.to_lockstep(ckpt_name)
            assert mapped is not None and mapped.name == name, (ckpt_name, mapped)


@pytest.mark.parametrize("ckpt, expected", [
    ("embed.weight", Mapped("model.embed_tokens.weight")),
    ("head.weight", Mapped("lm_head.weight")),
    ("norm.weight", Mapped("model.norm.weight")),
    ("hc_head_fn", Mapped("model.hc_head.hc_fn")),
    ("layers.0.attn.wq_a.weight", Mapped("model.layers.0.self_attn.q_a_proj.weight")),
    ("layers.0.attn.norm.weight", Mapped("model.layers.0.self_attn.kv_norm.weight")),
    ("layers.0.attn_norm.weight", Mapped("model.layers.0.input_layernorm.weight")),
    ("layers.2.hc_attn_fn", Mapped("model.layers.2.attn_hc.fn")),
    ("layers.2.attn.attn_sink", Mapped("model.layers.2.self_attn.sinks")),
    ("layers.1.attn.compressor.ape", Mapped("model.layers.1.self_attn.compressor.position_bias")),
    ("layers.1.attn.indexer.compressor.wgate.weight",
     Mapped("model.layers.1.self_attn.compressor.indexer.gate_proj.weight")),
    ("layers.1.attn.indexer.weights_proj.weight",
     Mapped("model.layers.1.self_attn.compressor.indexer.scorer.weights_proj.weight")),
    ("layers.0.ffn.gate.tid2eid", Mapped("model.layers.0.mlp.gate.tid2eid")),
    ("model.layers.5.ffn.gate.bias", Mapped("model.layers.5.mlp.gate.e_score_correction_bias")),
    ("layers.3.ffn.experts.7.w1.weight", Mapped("model.layers.3.mlp.experts.gate_up_proj", 7, "gate")),
    ("model.layers.3.ffn.experts.7.w3.weight", Mapped("model.layers.3.mlp.experts.gate_up_proj", 7, "up")),
    ("layers.3.ffn.experts.12.w2.weight", Mapped("model.layers.3.mlp.experts.down_proj", 12, "down")),
    ("layers.3.ffn.shared_experts.w3.weight", Mapped("model.layers.3.mlp.shared_experts.up_proj.weight")),
])
def test_official_names(ckpt, expected):
    assert DSV4.to_lockstep(ckpt) == expected


def test_mtp_and_rotary_are_skipped_and_unknown_is_none():
    assert DSV4.is_skipped("mtp.0.e_proj.weight") and DSV4.is_skipped("model.mtp.0.norm.weight")
    assert DSV4.is_skipped("model.rotary_emb.main_inv_freq")
    assert DSV4.to_lockstep("layers.0.attn.bogus.weight") is None


def test_experts_split_gate_rows_first():
    E, F, D = 3, 4, 5
    gate_up = torch.arange(E * 2 * F * D, dtype=torch.float32).view(E, 2 * F, D)
    parts = dict(DSV4.to_checkpoint("model.layers.1.mlp.experts.gate_up_proj", gate_up, "official"))
    assert sorted(parts) == sorted(f"layers.1.ffn.experts.{e}.{w}.weight" for e in range(E) for w in ("w1", "w3"))
    assert torch.equal(parts["layers.1.ffn.experts.2.w1.weight"], gate_up[2, :F])
    assert torch.equal(parts["layers.1.ffn.experts.2.w3.weight"], gate_up[2, F:])
    down = torch.randn(E, D, F)
    parts = dict(DSV4.to_checkpoint("model.layers.1.mlp.experts.down_proj", down))
    assert torch.equal(parts["model.layers.1.ffn.experts.1.w2.weight"], down[1])


def test_llama_and_gguf_tables():
    llama = KEY_MAPS["llama"]
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.3.self_attn.k_proj.bias",
                 "model.layers.0.self_attn.q_norm.weight", "model.layers.1.mlp.down_proj.weight"):
        assert llama.to_lockstep(name) == Mapped(name)
        assert llama.to_checkpoint(name, torch.zeros(1))[0][0] == name
    assert llama.is_skipped("model.layers.0.self_attn.rotary_emb.inv_freq")
    gguf = KEY_MAPS["gguf_llama"]
    assert gguf.to_lockstep("token_embd.weight").name == "model.embed_tokens.weight"
    assert gguf.to_lockstep("blk.7.attn_output.weight").name == "model.layers.7.self_attn.o_proj.weight"
    assert gguf.to_lockstep("blk.0.ffn_gate.weight").name == "model.layers.0.mlp.gate_proj.weight"
    assert gguf.to_lockstep("blk.2.attn_k_norm.weight").name == "model.layers.2.self_attn.k_norm.weight"
    assert gguf.to_lockstep("output_norm.weight").name == "model.norm.weight"
