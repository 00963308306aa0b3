"""One fp32 rule (models/precision.py): a bf16 engine, a bf16 trainer and a bf16 checkpoint load
of the same checkpoint hold every tensor in the same dtype, the one transformers gives it."""

import pytest
import torch
import transformers

from lockstep.config import EngineConfig
from lockstep.engine import Engine
from lockstep.models import load_pretrained, save_pretrained
from lockstep.models.deepseek_v4 import DeepseekV4ForCausalLM
from lockstep.models.llama import LlamaForCausalLM
from lockstep.models.llama_config import LlamaConfig
from lockstep.train.config import TrainConfig
from lockstep.train.trainer import Trainer

TINY = "lockstep/assets/tiny-dsv4"


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _dtypes(model) -> dict[str, torch.dtype]:
    return {n: t.dtype for n, t in model.state_dict().items()}


def three_ways(path) -> dict[str, dict[str, torch.dtype]]:
    """Tensor dtypes of a bf16 load, a bf16 engine and a bf16 trainer built from checkpoint `path`."""
    return {
        "loader": _dtypes(load_pretrained(path, dtype=torch.bfloat16)),
        "engine": _dtypes(Engine(load_pretrained(path), EngineConfig(dtype="bfloat16", max_model_len=64)).model),
        "trainer": _dtypes(Trainer(load_pretrained(path), TrainConfig(dtype="bfloat16")).model),
    }


def assert_agree(ways: dict[str, dict[str, torch.dtype]], want: dict[str, torch.dtype]):
    for side, got in ways.items():
        diff = {n: (got[n], want[n]) for n in want if got[n] != want[n]}
        assert not diff, (side, diff)


def test_dsv4_engine_trainer_and_loader_agree_with_transformers():
    want = _dtypes(transformers.AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.bfloat16))
    ways = three_ways(TINY)
    assert_agree(ways, want)
    assert ways["engine"]["model.layers.0.attn_hc.fn"] == torch.float32
    assert ways["engine"]["model.layers.0.self_attn.q_a_proj.weight"] == torch.bfloat16


def test_llama_engine_trainer_and_loader_agree_with_transformers(tmp_path):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    save_pretrained(LlamaForCausalLM(config), tmp_path)
    want = _dtypes(transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16))
    assert set(want.values()) == {torch.bfloat16}
    assert_agree(three_ways(tmp_path), want)


def test_strict_list_and_globs_are_honoured_on_every_side(monkeypatch):
    """The trainer (and engine) used to ignore `_keep_in_fp32_modules_strict` and match patterns
    as substrings, so a strict or globbed name was bf16 there and fp32 in the loader."""
    # (not an input projection: the engine fuses those, layers/fused_linear.py)
    extra = ("lm_head", "layers.*.mlp.shared_experts.down_proj")
    strict = getattr(DeepseekV4ForCausalLM, "_keep_in_fp32_modules_strict", ())
    monkeypatch.setattr(DeepseekV4ForCausalLM, "_keep_in_fp32_modules_strict", (*strict, *extra), raising=False)
    ways = three_ways(TINY)
    want = ways["loader"]
    assert want["lm_head.weight"] == want["model.layers.2.mlp.shared_experts.down_proj.weight"] == torch.float32
    assert want["model.layers.2.mlp.shared_experts.up_proj.weight"] == torch.bfloat16
    assert_agree(ways, want)
