"""MasterAdamW's update as one multi-tensor Triton kernel (`TrainConfig.triton_adamw`).

The default update (optimizer.MasterAdamW._adamw) is three multi-tensor passes for a bf16 model:
the bf16 gradients cast into fp32 copies, torch's fused AdamW over master, moments and those
copies, and the masters rounded back into the bf16 parameters. Per parameter that moves 2 + 4
(cast), 4 x 4 + 3 x 4 (AdamW: w, g, m, v read; w, m, v written) and 4 + 2 (write-back) = 40 bytes;
here one pass reads g in its own dtype and w, m, v, and writes w, m, v and the bf16 parameter: 28.
On the 1b config (918M parameters) the three passes took ~10.5 ms of a 105 ms graphed step on an
H200 (profile, 2026-12-02); this kernel's bytes at that machine's copy bandwidth are ~5.5 ms.

One launch updates a group of tensors (`multi_adamw_`), as torch's multi-tensor kernels do: the
first form, one launch per parameter (~400 on the 1b config), measured no faster than the three
passes in the graphed step (150,192 against 150,691 tok/s, one H200, 2026-12-03): the optimiser runs
eagerly after the replayed graphs, and ~400 launches from Python cost more host time than the
bytes saved. The kernel reads each tensor's address from a table (int64 addresses, cast to typed
pointers in the kernel) and each program updates one CHUNK of one tensor (the chunk table, by the
tensors' sizes only, is built once per set of sizes and kept on the device; the gradients'
addresses change every step and are sent with it). The tensors whose addresses and sizes are all
multiples of 16 go in a launch that says so (ALIGN, lockstep/tensor_tables.py): a pointer
read from a table is of unknown alignment, and without the hint every access moved 4 bytes (2 for
bf16) at a time (sm_90 PTX); the rest (odd sizes) in a second launch.

Per element, in fp32, torch's fused AdamW's order of operations (ADAMW mode):
    g = grad / inv_scale                       (the clipping, as its grad_scale)
    w = w - lr * weight_decay * w
    m = beta1 m + (1 - beta1) g,   v = beta2 v + (1 - beta2) g g
    w = w - step_size * m / (sqrt(v) / sqrt(bias_correction2) + eps),   step_size = lr / bias_correction1
    p = w rounded to p's dtype                 (where the master is a copy)
nothing written where found_inf is 1 (the skipped step), as torch's kernel. The divisions and the
square root correctly rounded, as torch's (Triton's `/` is an approximate division on a GPU). Equal
to torch's to fp32 rounding (tests/train/test_optimizer.py, under the interpreter on the CPU and on
an H200, where the two order and contract the operations differently: masters up to 10 fp32 ulps of
their scale apart after three steps).
"""

from __future__ import annotations

import functools
import math

import torch

from lockstep.models.layers import grouped_gemm_triton as _gt
from lockstep.tensor_tables import address_table, alignment
from lockstep.triton_support import interpreted, trainer_kernel_runs

triton = _gt.triton
if triton is not None:
    import triton.language as tl

BLOCK = 2048  # elements per step of a program
CHUNK = 16 * BLOCK  # elements per program: the 1b config's 918M parameters in ~28k programs
DTYPES = (torch.bfloat16, torch.float32)  # of gradients and parameters


def runs(param: torch.Tensor, enabled: bool | None) -> bool:
    """Where the kernel takes this parameter's update (TrainConfig.triton_adamw): Triton present, and
    the trainer kernels' rule (None: on CUDA; True: also under the interpreter; False: never)."""
    return triton is not None and trainer_kernel_runs(param, enabled)


@functools.lru_cache(maxsize=8)
def _chunks(numels: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tensor index int32 [C], first element int64 [C]) of each program's chunk, and the tensors'
    sizes int64 [T], on the device: by the sizes only, so made once per set of sizes."""
    counts = torch.tensor([-(-n // CHUNK) for n in numels])
    tensor = torch.repeat_interleave(torch.arange(len(numels)), counts)
    first = torch.cat([torch.arange(c) for c in counts.tolist()]) * CHUNK if len(numels) else torch.zeros(0)
    return (tensor.to(device, torch.int32), first.to(device, torch.int64),
            torch.tensor(numels, dtype=torch.int64, device=device))


@torch.no_grad()
def multi_adamw_(ws: list[torch.Tensor], gs: list[torch.Tensor], ms: list[torch.Tensor], vs: list[torch.Tensor],
                 ps: list[torch.Tensor] | None, *, step: int, lr: float, betas: tuple[float, float], eps: float,
                 weight_decay: float, inv_scale: torch.Tensor | None, found_inf: torch.Tensor) -> None:
    """The update of a group of parameters in place, one launch: ws, ms, vs fp32 (contiguous), gs
    their gradients (all bf16 or all fp32), ps the parameters to write each w into when the w are
    copies (all of one dtype), None when the w are the parameters."""
    live = [i for i, w in enumerate(ws) if w.numel()]
    if not live:
        return
    held = [w if ps is None else ps[i] for i, w in enumerate(ws)]
    if not all(t.is_contiguous() for i in live for t in (ws[i], ms[i], vs[i], held[i])):
        raise ValueError("TrainConfig.triton_adamw: the kernel writes parameters and optimiser state as flat "
                         "contiguous tensors; a parameter is not (set it to False)")
    grads = [gs[i].contiguous() for i in live]  # referenced until the launch is queued
    g_dtype, p_dtype = grads[0].dtype, held[live[0]].dtype
    if g_dtype not in DTYPES or p_dtype not in DTYPES or any(g.dtype != g_dtype for g in grads) \
            or any(held[i].dtype != p_dtype for i in live):
        raise ValueError(f"TrainConfig.triton_adamw: one launch takes gradients of one dtype and parameters of "
                         f"one dtype, each bf16 or fp32; got {sorted({str(g.dtype) for g in grads})} and "
                         f"{sorted({str(held[i].dtype) for i in live})}")
    groups: dict[int, list] = {}  # alignment -> (numel, the 5 addresses) of its tensors: w, g, m, v, p
    for i, g in zip(live, grads):
        addrs = [t.data_ptr() for t in (ws[i], g, ms[i], vs[i], held[i])]
        groups.setdefault(alignment(addrs, [ws[i].numel()]), []).append((ws[i].numel(), addrs))
    beta1, beta2 = betas
    bias_correction1, bias_correction2 = 1 - beta1 ** step, 1 - beta2 ** step
    device = ws[live[0]].device
    for align, group in groups.items():
        addresses = address_table([[addrs[k] for _, addrs in group] for k in range(5)], device)
        tensor, first, numel = _chunks(tuple(n for n, _ in group), device)
        _adamw_kernel[(tensor.numel(),)](
            addresses, numel, tensor, first, len(group), found_inf, found_inf if inv_scale is None else inv_scale,
            lr, beta1, beta2, eps, weight_decay, lr / bias_correction1, math.sqrt(bias_correction2),
            HAS_P=ps is not None, SCALED=inv_scale is not None, G_BF16=g_dtype == torch.bfloat16,
            P_BF16=p_dtype == torch.bfloat16, INTERPRETED=interpreted(), BLOCK=BLOCK, CHUNK=CHUNK, ALIGN=align,
            num_warps=8)


if triton is not None:
    _bf16 = _gt._bf16  # by name: a module alias does not resolve inside a kernel
    from lockstep.tensor_tables import table_int, table_pointer

    @triton.jit
    def _adamw_kernel(addr_ptr, numel_ptr, tensor_ptr, first_ptr, T, found_inf_ptr, inv_scale_ptr, lr, beta1,
                      beta2, eps, weight_decay, step_size, bias_correction2_sqrt, HAS_P: tl.constexpr,
                      SCALED: tl.constexpr, G_BF16: tl.constexpr, P_BF16: tl.constexpr,
                      INTERPRETED: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr, ALIGN: tl.constexpr):
        """One CHUNK of tensor t = tensor[program]: addr_ptr holds rows w, g, m, v, p of T addresses.
        ALIGN: every address (bytes) and size of the launch a multiple of it (tensor_tables.alignment),
        which lets each load and store move 16 bytes."""
        t = tl.load(tensor_ptr + tl.program_id(0))
        first = table_int(first_ptr + tl.program_id(0), ALIGN)  # a multiple of CHUNK
        n = tl.where(tl.load(found_inf_ptr) == 0.0, table_int(numel_ptr + t, ALIGN), 0)  # skipped: writes nothing
        w_ptr = table_pointer(addr_ptr + t, 2, ALIGN)
        m_ptr = table_pointer(addr_ptr + 2 * T + t, 2, ALIGN)
        v_ptr = table_pointer(addr_ptr + 3 * T + t, 2, ALIGN)
        g_ptr = table_pointer(addr_ptr + T + t, 0 if G_BF16 else 2, ALIGN)
        p_ptr = table_pointer(addr_ptr + 4 * T + t, 0 if P_BF16 else 2, ALIGN)
        for i in range(0, CHUNK, BLOCK):
            offs = first + i + tl.arange(0, BLOCK)
            ok = offs < n
            g = tl.load(g_ptr + offs, mask=ok, other=0.0).to(tl.float32)
            if SCALED:
                g = tl.math.div_rn(g, tl.load(inv_scale_ptr))
            w = tl.load(w_ptr + offs, mask=ok, other=0.0)
            w = w - lr * weight_decay * w
            m = beta1 * tl.load(m_ptr + offs, mask=ok, other=0.0) + (1 - beta1) * g
            v = beta2 * tl.load(v_ptr + offs, mask=ok, other=0.0) + (1 - beta2) * g * g
            w = w - tl.math.div_rn(step_size * m, tl.math.div_rn(tl.sqrt_rn(v), bias_correction2_sqrt) + eps)
            tl.store(w_ptr + offs, w, mask=ok)
            tl.store(m_ptr + offs, m, mask=ok)
            tl.store(v_ptr + offs, v, mask=ok)
            if HAS_P:
                if P_BF16:
                    tl.store(p_ptr + offs, _bf16(w, INTERPRETED), mask=ok)
                else:
                    tl.store(p_ptr + offs, w, mask=ok)
