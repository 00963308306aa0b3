"""A kernel switch's whole-model check: a tiny DeepSeek-V4 trained one step with the switch off and
on must give the same loss and gradients: to fp32 rounding in fp32 under the interpreter (the CPU
tests); in bf16 on a GPU (where the trainer's kernels take bf16 only), no further from the fp32
run than the eager bf16 ops are."""

import torch

from devices import DEVICE
from lockstep.models.deepseek_v4 import DeepseekV4ForCausalLM
from lockstep.models.deepseek_v4_init import init_deepseek_v4_, tiny_config
from lockstep.models.layers.kernel_switch import KernelSwitches, set_kernel_switches
from lockstep.models.precision import cast_model


def _loss_and_grads(model, ids, switches: KernelSwitches):
    set_kernel_switches(model, switches)
    model.zero_grad()
    logits = model(ids).float()
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    return loss.detach(), {k: p.grad.float().clone() for k, p in model.named_parameters() if p.grad is not None}


def assert_switch_changes_nothing(switch: str, seed: int, shape: tuple[int, int]) -> dict:
    """Train the tiny config on the test device on random ids of `shape` with `switch` off, then on,
    and assert the kernels change nothing but rounding. On the CPU (fp32, the interpreter): equal
    losses and gradients to fp32 rounding. On a GPU (bf16, where the trainer's kernels take bf16
    only) the eager bf16 ops round differently from a kernel that sums in fp32, so both runs are
    measured against the same model in fp32 (switch off): the kernel's loss and each of its
    gradients no further from it than twice the eager bf16 run's distance (plus 1% of the norm).
    Returns the gradients with the switch off."""
    config = tiny_config()  # C4 at rate 2, C128-style at 4: many compressed entries in a few dozen positions
    model = DeepseekV4ForCausalLM(config)
    init_deepseek_v4_(model, seed)
    model.to(DEVICE)
    ids = torch.randint(2, config.vocab_size, shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE)
    if DEVICE != "cpu":
        return _assert_bf16_no_worse(model, ids, switch)
    loss0, grads0 = _loss_and_grads(model, ids, KernelSwitches(**{switch: False}))
    loss1, grads1 = _loss_and_grads(model, ids, KernelSwitches(**{switch: True}))
    assert grads0.keys() == grads1.keys()
    torch.testing.assert_close(loss1, loss0, rtol=1e-6, atol=1e-6)
    for k in grads0:
        torch.testing.assert_close(grads1[k], grads0[k], rtol=1e-4, atol=1e-5 * grads0[k].abs().max().item() + 1e-9,
                                   msg=k)
    return grads0


def _assert_bf16_no_worse(model, ids, switch: str) -> dict:
    loss_ref, grads_ref = _loss_and_grads(model, ids, KernelSwitches(**{switch: False}))  # fp32: the kernels stay out
    cast_model(model, torch.bfloat16)
    loss0, grads0 = _loss_and_grads(model, ids, KernelSwitches(**{switch: False}))
    loss1, grads1 = _loss_and_grads(model, ids, KernelSwitches(**{switch: True}))
    assert grads0.keys() == grads1.keys() == grads_ref.keys()
    assert (loss1 - loss_ref).abs() <= 2 * (loss0 - loss_ref).abs() + 1e-2 * loss_ref.abs(), (loss_ref, loss0, loss1)
    for k, ref in grads_ref.items():
        eager, kernel = (grads0[k] - ref).norm(), (grads1[k] - ref).norm()
        assert kernel <= 2 * eager + 1e-2 * ref.norm() + 1e-6, (k, kernel.item(), eager.item(), ref.norm().item())
    return grads0
