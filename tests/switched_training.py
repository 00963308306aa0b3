"""A kernel switch's whole-model check: a tiny DeepSeek-V4 trained one step with the switch off and
on must give the same loss and gradients: to fp32 rounding in fp32 under the interpreter (the CPU
tests), to bf16 rounding in bf16 on a GPU (where the trainer's kernels take bf16 only)."""

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
    """Train the tiny config on the test device (fp32 on the CPU, bf16 on a GPU) on random ids of
    `shape` with `switch` off, then on; assert equal losses and gradients (fp32: to fp32 rounding;
    bf16: the loss within 1%, each gradient within 5% of its norm); return the gradients (switched off)."""
    config = tiny_config()  # C4 at rate 2, C128-style at 4: many compressed entries in a few dozen positions
    model = DeepseekV4ForCausalLM(config)
    init_deepseek_v4_(model, seed)
    model.to(DEVICE)
    bf16 = DEVICE != "cpu"
    if bf16:
        cast_model(model, torch.bfloat16)
    ids = torch.randint(2, config.vocab_size, shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE)
    loss0, grads0 = _loss_and_grads(model, ids, KernelSwitches(**{switch: False}))
    loss1, grads1 = _loss_and_grads(model, ids, KernelSwitches(**{switch: True}))
    assert grads0.keys() == grads1.keys()
    if bf16:
        torch.testing.assert_close(loss1, loss0, rtol=1e-2, atol=0.0)
        for k in grads0:
            assert (grads1[k] - grads0[k]).norm() <= 5e-2 * grads0[k].norm() + 1e-6, k
        return grads0
    torch.testing.assert_close(loss1, loss0, rtol=1e-6, atol=1e-6)
    for k in grads0:
        torch.testing.assert_close(grads1[k], grads0[k], rtol=1e-4, atol=1e-5 * grads0[k].abs().max().item() + 1e-9,
                                   msg=k)
    return grads0
