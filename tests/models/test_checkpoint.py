"""Checkpoint directories: round trips through transformers 5.23, sharding, quantised loads, errors."""

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from lockstep.cli import main
from lockstep.models import CheckpointError, load_pretrained, load_state_dict, save_pretrained, save_state_dict
from lockstep.models.deepseek_v4_config import DeepseekV4Config
from lockstep.models.llama import LlamaForCausalLM
from lockstep.models.llama_config import LlamaConfig

from test_key_maps import tiny_hf_dsv4


def randomised(model, seed=0):
    """Every tensor random (HF's init leaves zeros and equal rows that would hide mix-ups)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in model.state_dict().values():
            if t.is_floating_point():
                t.copy_(torch.randn(t.shape, generator=g) * 0.1)
            else:
                t.copy_(torch.randint(0, 4, t.shape, generator=g))
    return model


@pytest.fixture(scope="module")
def dsv4():
    hf = randomised(tiny_hf_dsv4())
    return hf, DeepseekV4Config.from_hf_dict(hf.config.to_dict())


def assert_same(got: dict, want: dict):
    assert set(got) == set(want), set(got) ^ set(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k


def hf_state(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()


@pytest.mark.parametrize("layout", ["transformers", "official"])
@pytest.mark.parametrize("shard", ["5GB", "8KB"])
def test_dsv4_written_by_us_reads_back_identically(dsv4, tmp_path, layout, shard):
    hf, config = dsv4
    want = hf.state_dict()
    save_state_dict(want, config, tmp_path, max_shard_size=shard, layout=layout)
    assert (tmp_path / "model.safetensors.index.json").exists() == (shard == "8KB")
    assert_same(load_state_dict(tmp_path), want)
    assert_same(hf_state(tmp_path), want)


def test_dsv4_written_by_transformers_loads_and_mtp_is_skipped(dsv4, tmp_path):
    hf, _ = dsv4
    hf.save_pretrained(tmp_path)
    save_file({"mtp.0.e_proj.weight": torch.zeros(2, 2)}, str(tmp_path / "mtp.safetensors"))
    assert_same(load_state_dict(tmp_path, "deepseek_v4"), hf.state_dict())


@pytest.fixture
def one_thread():
    """Many small ops: a second intra-op thread only waits on a shared 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_dsv4_lockstep_model_round_trip(tmp_path, one_thread):
    ds = pytest.importorskip("lockstep.models.deepseek_v4")
    from lockstep.models.deepseek_v4_init import init_deepseek_v4_, tiny_config

    ours = ds.DeepseekV4ForCausalLM(tiny_config()).eval()
    init_deepseek_v4_(ours, 0)
    save_pretrained(ours, tmp_path, max_shard_size="64KB")
    assert_same(hf_state(tmp_path), ours.state_dict())
    back = load_pretrained(tmp_path)
    ids = torch.randint(0, ours.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(back(ids), ours(ids))
    bf16 = load_pretrained(tmp_path, dtype=torch.bfloat16)
    dtypes = {k: v.dtype for k, v in bf16.state_dict().items()}
    assert dtypes["model.layers.0.attn_hc.fn"] == dtypes["model.layers.0.self_attn.sinks"] == torch.float32
    assert dtypes["model.layers.0.self_attn.q_a_proj.weight"] == torch.bfloat16
    assert dtypes["model.layers.0.mlp.gate.tid2eid"] == ours.model.layers[0].mlp.gate.tid2eid.dtype


def test_dsv4_fp8_fp4_checkpoint_is_dequantised(dsv4, tmp_path):
    from lockstep.quant.convert import convert_checkpoint

    hf, config = dsv4
    bf16 = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in hf.state_dict().items()}
    save_state_dict(bf16, config, tmp_path / "bf16")
    assert main(["convert", "quant", str(tmp_path / "bf16"), str(tmp_path / "q"), "--to", "fp8-fp4"]) == 0
    convert_checkpoint(tmp_path / "q", tmp_path / "back", to="bf16", progress=False)
    on_disk = load_file(str(tmp_path / "q" / "model.safetensors"))
    assert on_disk["model.layers.1.attn.wq_a.weight"].dtype == torch.float8_e4m3fn
    assert on_disk["model.layers.1.ffn.experts.0.w1.weight"].dtype in (torch.int8, torch.uint8)
    got = load_state_dict(tmp_path / "q", dtype=torch.bfloat16)
    want = load_state_dict(tmp_path / "back", dtype=torch.bfloat16)
    assert_same(got, want)
    assert got["model.layers.1.attn_hc.fn"].dtype == torch.float32  # the model's keep-in-fp32 names
    name = "model.layers.1.mlp.experts.gate_up_proj"
    err = (got[name].float() - bf16[name].float()).abs().max() / bf16[name].float().abs().max()
    assert 0 < err < 0.2  # quantised, not garbage


def _as_f4(src, dst):
    """A copy of checkpoint `src` whose packed fp4 weights are stored as safetensors F4
    (float4_e2m1fn_x2: the header counts e2m1 values, twice the bytes) instead of I8."""
    import shutil

    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    fp4 = {n for n, t in tensors.items() if t.dtype == torch.int8 and n.replace(".weight", ".scale") in tensors}
    assert fp4
    save_file({n: t.view(torch.float4_e2m1fn_x2) if n in fp4 else t for n, t in tensors.items()},
              str(dst / "model.safetensors"), metadata={"format": "pt"})
    return fp4


def test_f4_headers_read_alike_by_loader_and_convert(dsv4, tmp_path):
    """The loader read F4 (fp4 e2m1 packed) headers as unknown and refused the tensors; the
    reader convert uses handled them. Now one reader serves both."""
    from lockstep.quant.convert import convert_checkpoint
    from lockstep.quant.safetensors_io import read_headers

    hf, config = dsv4
    save_state_dict({k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in hf.state_dict().items()},
                    config, tmp_path / "bf16")
    convert_checkpoint(tmp_path / "bf16", tmp_path / "i8", to="fp8-fp4", progress=False)
    fp4 = _as_f4(tmp_path / "i8", tmp_path / "f4")
    i8, _ = read_headers(tmp_path / "i8")
    f4, _ = read_headers(tmp_path / "f4")
    for name in fp4:  # torch's view of both: bytes along the last dim
        assert (f4[name].dtype, f4[name].shape) == (torch.float4_e2m1fn_x2, i8[name].shape)
    assert_same(load_state_dict(tmp_path / "f4", dtype=torch.bfloat16),
                load_state_dict(tmp_path / "i8", dtype=torch.bfloat16))
    convert_checkpoint(tmp_path / "f4", tmp_path / "back", to="bf16", progress=False)
    assert_same(load_state_dict(tmp_path / "back"), load_state_dict(tmp_path / "i8"))


def _index_of_shards(path) -> str:
    """The index text for the shards an index names, rebuilt from their headers alone."""
    from lockstep.quant.safetensors_io import read_headers

    headers, _ = read_headers(path)
    weight_map = {n: h.file.name for n, h in headers.items()}
    tensors = {n: load_file(str(path / f))[n] for n, f in weight_map.items()}
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    return json.dumps({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
                      indent=2, sort_keys=True) + "\n"


def test_save_pretrained_and_convert_write_one_index_format(dsv4, tmp_path):
    from lockstep.quant.convert import convert_checkpoint

    hf, config = dsv4
    save_state_dict(hf.state_dict(), config, tmp_path / "saved", max_shard_size="8KB")
    convert_checkpoint(tmp_path / "saved", tmp_path / "converted", to="fp8-fp4", progress=False)
    for d in ("saved", "converted"):
        text = (tmp_path / d / "model.safetensors.index.json").read_text()
        assert text == _index_of_shards(tmp_path / d), d


def test_convert_reads_the_index_as_the_loader_does(tmp_path):
    """A tensor the index lists but its shard lacks: convert used to skip it silently."""
    from lockstep.quant.convert import convert_checkpoint

    save_pretrained(tiny_llama(), tmp_path / "src", max_shard_size="20KB")
    file = tmp_path / "src" / "model.safetensors.index.json"
    index = json.loads(file.read_text())
    shard = index["weight_map"]["model.norm.weight"]
    index["weight_map"]["model.layers.0.mlp.extra.weight"] = shard
    file.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=f"model.layers.0.mlp.extra.weight .*{shard}"):
        convert_checkpoint(tmp_path / "src", tmp_path / "dst", to="bf16", strict=False, progress=False)


# ---- Llama ----------------------------------------------------------------------------------------

def tiny_llama(**overrides):
    kw = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**{**kw, **overrides})).eval()


def test_llama_sharded_save_load_and_transformers(tmp_path):
    model = tiny_llama()
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text("{}")
    save_pretrained(model, tmp_path / "ckpt", max_shard_size="20KB", tokenizer_dir=tmp_path / "tok")
    index = json.loads((tmp_path / "ckpt" / "model.safetensors.index.json").read_text())
    assert "lm_head.weight" not in index["weight_map"]  # tied: stored once, as transformers does
    assert len(set(index["weight_map"].values())) > 1 and (tmp_path / "ckpt" / "tokenizer.json").exists()
    back = load_pretrained(tmp_path / "ckpt")
    assert back.lm_head.weight is back.model.embed_tokens.weight
    assert_same(back.state_dict(), model.state_dict())
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", dtype=torch.float32)
    ids = torch.randint(0, 97, (2, 9))
    with torch.no_grad():
        assert (hf(ids).logits - model(ids)).abs().max() <= 1e-4
    half = load_pretrained(tmp_path / "ckpt", dtype=torch.bfloat16)
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}


# ---- errors: each names the tensor and the file ---------------------------------------------------

@pytest.fixture
def llama_dir(tmp_path):
    save_pretrained(tiny_llama(tie_word_embeddings=False), tmp_path)
    return tmp_path


def rewrite(path, edit):
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def expect_error(path, *words):
    with pytest.raises(CheckpointError) as info:
        load_pretrained(path)
    for w in words:
        assert str(w) in str(info.value), (w, str(info.value))


def test_missing_tensor(llama_dir):
    rewrite(llama_dir, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    expect_error(llama_dir, "missing tensor model.layers.1.mlp.up_proj.weight", llama_dir)


def test_unexpected_tensor(llama_dir):
    rewrite(llama_dir, lambda t: t.update({"model.layers.0.self_attn.bogus.weight": torch.zeros(1)}))
    expect_error(llama_dir, "unexpected tensor model.layers.0.self_attn.bogus.weight", "model.safetensors")
    rewrite(llama_dir, lambda t: (t.pop("model.layers.0.self_attn.bogus.weight"),
                                  t.update({"model.layers.7.mlp.up_proj.weight": torch.zeros(1)})))
    expect_error(llama_dir, "unexpected tensor model.layers.7.mlp.up_proj.weight", "model.safetensors")


def test_wrong_shape(llama_dir):
    rewrite(llama_dir, lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": torch.zeros(16, 64)}))
    expect_error(llama_dir, "model.layers.0.self_attn.k_proj.weight", "model.safetensors", "[32, 64]", "[16, 64]")


def test_truncated_file(llama_dir):
    file = llama_dir / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-100])
    expect_error(llama_dir, file)


def test_index_points_to_missing_shard(tmp_path):
    save_pretrained(tiny_llama(), tmp_path, max_shard_size="20KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    name, shard = next(iter(index["weight_map"].items()))
    (tmp_path / shard).unlink()
    expect_error(tmp_path, shard, name, "model.safetensors.index.json")


def test_index_lists_tensor_absent_from_its_shard(tmp_path):
    save_pretrained(tiny_llama(), tmp_path, max_shard_size="20KB")
    file = tmp_path / "model.safetensors.index.json"
    index = json.loads(file.read_text())
    shard = index["weight_map"]["model.norm.weight"]
    index["weight_map"]["model.layers.0.mlp.extra.weight"] = shard
    file.write_text(json.dumps(index))
    expect_error(tmp_path, "model.layers.0.mlp.extra.weight", shard)


def test_missing_expert_names_expert_and_file(dsv4, tmp_path):
    hf, config = dsv4
    save_state_dict(hf.state_dict(), config, tmp_path)
    rewrite(tmp_path, lambda t: t.pop("model.layers.2.ffn.experts.3.w3.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor model\.layers\.2\.ffn\.experts\.3\.w3\.weight"):
        load_state_dict(tmp_path, config)
