"""A kernel switch's whole-model check: a tiny DeepSeek-V4 trained one step with the switch off and
on must give the same loss and gradients to fp32 rounding (the trainer's Triton kernels' tests)."""

import pytest
import torch

from devices import DEVICE
from lockstep.models.deepseek_v4 import DeepseekV4ForCausalLM
from lockstep.models.deepseek_v4_init import init_deepseek_v4_, tiny_config
from lockstep.models.layers.kernel_switch import KernelSwitches, set_kernel_switches


def _loss_and_grads(model, ids, switches: KernelSwitches):
    set_kernel_switches(model, switches)
    model.zero_grad()
    logits = model(ids).float()
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    return loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def assert_switch_changes_nothing(switch: str, seed: int, shape: tuple[int, int]) -> dict:
    """Train the tiny config (fp32, on the test device) on random ids of `shape` with `switch` off,
    then on; assert equal losses and gradients; return the gradients (switched off). The interpreter's
    check: on a GPU the kernels take bf16 only, where train_throughput.py's first-step gradient norms
    (each kernel row against transformers) compare the whole model."""
    if DEVICE != "cpu":
        pytest.skip("fp32 whole-model check: the trainer's kernels take bf16 only on a GPU")
    config = tiny_config()  # C4 at rate 2, C128-style at 4: many compressed entries in a few dozen positions
    model = DeepseekV4ForCausalLM(config)
    init_deepseek_v4_(model, seed)
    model.to(DEVICE)
    ids = torch.randint(2, config.vocab_size, shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE)
    loss0, grads0 = _loss_and_grads(model, ids, KernelSwitches())
    loss1, grads1 = _loss_and_grads(model, ids, KernelSwitches(**{switch: True}))
    torch.testing.assert_close(loss1, loss0, rtol=1e-6, atol=1e-6)
    assert grads0.keys() == grads1.keys()
    for k in grads0:
        torch.testing.assert_close(grads1[k], grads0[k], rtol=1e-4, atol=1e-5 * grads0[k].abs().max().item() + 1e-9,
                                   msg=k)
    return grads0
