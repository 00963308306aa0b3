"""models/precision.py: which tensors stay fp32, matched the way transformers 5.23 matches them."""

import pytest
import torch
import transformers

from lockstep.models.checkpoint import load_pretrained
from lockstep.models.precision import cast_model, fp32_patterns, keeps_fp32

TINY = "lockstep/assets/tiny-dsv4"


@pytest.fixture(scope="module", params=[torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def hf_loaded(request):
    return request.param, transformers.AutoModelForCausalLM.from_pretrained(TINY, dtype=request.param)


def test_rule_reproduces_transformers_on_its_own_class(hf_loaded):
    """transformers' DeepSeek-V4 declares both lists (strict and fp16-only): applied to that class,
    the rule gives every stored tensor the dtype from_pretrained gave it, at bf16 and at fp16."""
    dtype, hf = hf_loaded
    for name, t in hf.state_dict().items():
        if t.is_floating_point():
            want = t.dtype == torch.float32
            assert keeps_fp32(type(hf), name, dtype) == want, (name, t.dtype)


def test_lockstep_dsv4_matches_transformers_bf16():
    hf = transformers.AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.bfloat16)
    ours = cast_model(load_pretrained(TINY), torch.bfloat16).state_dict()
    for name, t in hf.state_dict().items():
        assert ours[name].dtype == t.dtype, name


class _Globbed(torch.nn.Module):
    _keep_in_fp32_modules_strict = ("layers.*.attn_hc",)
    _keep_in_fp32_modules = ("kv_proj",)


def test_patterns_are_searched_regexes_with_glob_stars():
    # a substring test of "layers.*.attn_hc" never matched; transformers (and the loader) always did
    assert keeps_fp32(_Globbed, "model.layers.3.attn_hc.fn")
    assert not keeps_fp32(_Globbed, "model.attn_hc.fn")
    # `_keep_in_fp32_modules` only guards fp16 (transformers: it has no effect at bf16)
    assert keeps_fp32(_Globbed, "model.layers.0.self_attn.kv_proj.weight", torch.float16)
    assert not keeps_fp32(_Globbed, "model.layers.0.self_attn.kv_proj.weight", torch.bfloat16)
    assert fp32_patterns(_Globbed, torch.float32) == ()


def test_model_type_names_the_registered_class():
    assert keeps_fp32("deepseek_v4", "model.layers.0.attn_hc.fn")
    assert not keeps_fp32("deepseek_v4", "model.layers.0.self_attn.q_a_proj.weight")
    assert fp32_patterns("llama", torch.bfloat16) == ()


def test_non_persistent_buffers_keep_their_dtype():
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(2))
            self.register_buffer("inv_freq", torch.ones(2), persistent=False)

    m = cast_model(M(), torch.bfloat16)
    assert m.w.dtype == torch.bfloat16 and m.inv_freq.dtype == torch.float32
