"""Kernel switches (models/layers/kernel_switch.py): settings handed to the model from outside,
the environment overriding them when set, and the layers asking them at every decode step. The
Triton kernels themselves run only on CUDA (or under the interpreter in their own tests), so
here the decisions are checked: what each layer asks, and the gate's answer."""

from types import SimpleNamespace

import pytest
import torch

from lockstep.models.deepseek_v4 import DeepseekV4ForCausalLM, StepBatch
from lockstep.models.deepseek_v4_init import init_deepseek_v4_, tiny_config
from lockstep.models.layers import attention, hyper_connection, moe
from lockstep.models.layers.kernel_switch import (ENV, KernelSwitches, Switched, forward_kernel_allowed,
                                                  set_kernel_switches)


@pytest.fixture(autouse=True)
def no_overrides(monkeypatch):
    for variable in ENV.values():
        monkeypatch.delenv(variable, raising=False)


def test_the_environment_wins_when_set(monkeypatch):
    off = KernelSwitches(triton_moe=False, triton_hc=False, compile_hc=False)
    assert KernelSwitches().on("triton_moe") and not off.on("triton_moe")
    monkeypatch.setenv("LOCKSTEP_TRITON_MOE", "1")
    assert off.on("triton_moe") and not off.on("triton_hc")
    monkeypatch.setenv("LOCKSTEP_TRITON_HC", "0")
    assert not KernelSwitches().on("triton_hc")
    monkeypatch.setenv("LOCKSTEP_COMPILE", "0")
    assert not KernelSwitches().on("compile_hc")
    assert KernelSwitches().describe() == (
        "triton_moe on (LOCKSTEP_TRITON_MOE=1), triton_hc off (LOCKSTEP_TRITON_HC=0), triton_attention on, "
        "triton_router on, triton_compressor on, triton_sampler on, compile_hc off (LOCKSTEP_COMPILE=0), "
        "true_on_policy off, "
        "fixed_order on CUDA, triton_index off, "
        "compile_rows on CUDA, flash_attention on CUDA, triton_norm on CUDA, triton_rope on CUDA, "
        "triton_combine on CUDA, fused_logprobs on CUDA")


def test_true_on_policy_switches_the_side_specific_kernels_off(monkeypatch):
    on = KernelSwitches(true_on_policy=True)
    assert on.on("true_on_policy") and not any(on.on(k) for k in ("triton_moe", "triton_hc", "triton_attention",
                                                                      "triton_compressor", "triton_sampler",
                                                                      "compile_hc"))
    assert not KernelSwitches(triton_router=True, true_on_policy=True).on("triton_router")
    monkeypatch.setenv("LOCKSTEP_TRITON_MOE", "1")  # the environment cannot bring one back either
    assert not on.on("triton_moe")
    monkeypatch.setenv("LOCKSTEP_TRUE_ON_POLICY", "1")
    assert KernelSwitches().on("true_on_policy") and not KernelSwitches().on("triton_hc")


def test_the_gate_needs_the_switch_cuda_and_no_gradient():
    w = torch.zeros(2, 2, requires_grad=True)
    assert not forward_kernel_allowed(True, torch.zeros(2, 2), w)  # CPU: never
    assert not forward_kernel_allowed(False, torch.zeros(2, 2, device="meta"))
    if torch.cuda.is_available():
        x = torch.zeros(2, 2, device="cuda")
        assert forward_kernel_allowed(True, x) and not forward_kernel_allowed(False, x)
        assert not forward_kernel_allowed(True, x, w.cuda())  # a gradient wanted


def _decode_step_asks(model, monkeypatch) -> dict[str, set]:
    """Run one decode step (one new token per row) and record what each switched layer asked."""
    asked = {"triton_moe": set(), "triton_hc": set(), "triton_attention": set(), "compile_hc": set()}
    triton_experts, triton_mixes, coefficients = moe.triton_experts, hyper_connection._triton_mixes, \
        hyper_connection.hc_coefficients
    step_attention_runs = attention.step_attention_triton.runs

    def experts_spy(x, gate_up, down, enabled):
        asked["triton_moe"].add(enabled)
        return triton_experts(x, gate_up, down, enabled)

    def mixes_spy(streams, fn, enabled):
        asked["triton_hc"].add(enabled)
        return triton_mixes(streams, fn, enabled)

    def attention_spy(q, enabled):
        asked["triton_attention"].add(enabled)
        return step_attention_runs(q, enabled)

    def coefficients_spy(*args, compiled):
        asked["compile_hc"].add(compiled)
        return coefficients(*args, compiled=compiled)

    monkeypatch.setattr(moe, "triton_experts", experts_spy)
    monkeypatch.setattr(hyper_connection, "_triton_mixes", mixes_spy)
    monkeypatch.setattr(hyper_connection, "hc_coefficients", coefficients_spy)
    monkeypatch.setattr(attention.step_attention_triton, "runs", attention_spy)
    cache = model.new_cache(num_slots=2, max_len=8)
    with torch.no_grad():
        model.forward_step(torch.tensor([[3], [5]]), StepBatch(slots=torch.tensor([0, 1]), start_pos=torch.tensor([0, 0]),
                                                                num_new=torch.tensor([1, 1])), cache)
    return asked


def test_the_switches_set_from_outside_reach_every_layer(monkeypatch):
    model = DeepseekV4ForCausalLM(tiny_config())
    init_deepseek_v4_(model, 0)
    assert _decode_step_asks(model.eval(), monkeypatch) == {"triton_moe": {True}, "triton_hc": {True},
                                                            "triton_attention": {True},
                                                            "compile_hc": {True}}  # nobody configured it
    switches = KernelSwitches(triton_moe=False, triton_hc=False, triton_attention=False, compile_hc=False)
    set_kernel_switches(model, switches)
    assert all(m.kernels is switches for m in model.modules() if isinstance(m, Switched))
    assert _decode_step_asks(model, monkeypatch) == {"triton_moe": {False}, "triton_hc": {False},
                                                     "triton_attention": {False}, "compile_hc": {False}}
    monkeypatch.setenv("LOCKSTEP_TRITON_MOE", "1")
    assert _decode_step_asks(model, monkeypatch)["triton_moe"] == {True}



def test_fixed_order_defaults_to_cuda_only(monkeypatch):
    # whole rows (whole_rows.py) where the fixed-order kernels run compiled; the interpreter only on request
    monkeypatch.delenv("LOCKSTEP_FIXED_ORDER", raising=False)
    cpu, cuda = torch.zeros(1), SimpleNamespace(is_cuda=True)
    assert KernelSwitches().on_for("fixed_order", cuda) and not KernelSwitches().on_for("fixed_order", cpu)
    assert KernelSwitches(fixed_order=True).on_for("fixed_order", cpu)
    assert not KernelSwitches(fixed_order=False).on_for("fixed_order", cuda)
    monkeypatch.setenv("LOCKSTEP_FIXED_ORDER", "0")
    assert not KernelSwitches().on_for("fixed_order", cuda)
    monkeypatch.setenv("LOCKSTEP_FIXED_ORDER", "1")
    assert KernelSwitches().on_for("fixed_order", cpu)
    assert "fixed_order on (LOCKSTEP_FIXED_ORDER=1)" in KernelSwitches().describe()
    # compile_rows belongs to the true-on-policy forward (both sides alike): not switched off by it
    monkeypatch.delenv("LOCKSTEP_COMPILE_ROWS", raising=False)
    assert KernelSwitches(true_on_policy=True, compile_rows=True).on("compile_rows")
    # on CUDA by default (inductor); on the CPU only on request (dynamo's trace, no code generation)
    assert KernelSwitches().on_for("compile_rows", cuda) and not KernelSwitches().on_for("compile_rows", cpu)
    assert not KernelSwitches(compile_rows=False).on_for("compile_rows", cuda)
    monkeypatch.setenv("LOCKSTEP_COMPILE_ROWS", "1")
    assert KernelSwitches().on_for("compile_rows", cpu)
    monkeypatch.setenv("LOCKSTEP_COMPILE_ROWS", "0")
    assert not KernelSwitches().on_for("compile_rows", cuda)


def test_true_on_policy_left_to_the_default_is_on_for_deepseek_v4_on_cuda_only():
    """EngineConfig / TrainConfig.true_on_policy None: on CUDA where the model has the forward and the
    config rules nothing out; a setting wins (decided without a GPU: only the device's type is read)."""
    from lockstep.models.layers.kernel_switch import decide_true_on_policy
    from lockstep.models.llama import LlamaForCausalLM
    from lockstep.models.llama_config import LlamaConfig

    dsv4 = DeepseekV4ForCausalLM(tiny_config())
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    assert decide_true_on_policy(None, dsv4, "cuda", None)
    assert decide_true_on_policy(None, dsv4, torch.device("cuda:1"), None)
    assert not decide_true_on_policy(None, dsv4, "cpu", None)
    assert not decide_true_on_policy(None, llama, "cuda", None)
    assert not decide_true_on_policy(None, dsv4, "cuda", "packed_fp8")
    assert decide_true_on_policy(True, dsv4, "cpu", None) and not decide_true_on_policy(False, dsv4, "cuda", None)
