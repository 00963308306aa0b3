"""Linear layers served from packed fp8 weights: e4m3 bytes and 128x128 UE8M0 block scales, read
by a GEMM that dequantises in registers (weight-only fp8, "W8A16").

The engine's emulated fp8 (quant/serving_format.py) holds dequant(quant(w)) in bf16: the served
values, at bf16's memory and time. Here a LINEAR weight is held as quantize_fp8_block leaves it:

    weight        float8_e4m3fn [out, in]   1 byte per parameter (the state-dict name and shape of
                                            the nn.Linear it replaces, so weight updates find it)
    weight_scale  float32 [ceil(out/128), ceil(in/128)]   one power-of-two scale per block
    scale_row     int32 [out]: the row of weight_scale that output row n reads (n // 128 here;
                  fused matrices, fused_linear.py, stack several weights' tables)

and `fp8_linear(x, q, scale, scale_row)` = x @ dequant(q, scale).T, the values the emulation
serves, so the trainer's quantisation-aware forward (train/quant_aware.py) reproduces both.

The GEMM: on CUDA in bf16 without gradients, a Triton kernel (below) whose program owns a
BLOCK_M x BLOCK_N output tile and walks K in BLOCK_K steps (BLOCK_K divides 128, so one scale per
row per step): it loads the e4m3 tile as bytes and bitcasts it (`.to(tl.float8e4nv, bitcast=True)`,
which Triton's interpreter runs too), multiplies by each row's block scale in fp32 -- exact: e4m3
times a power of two is a bf16 value -- converts to bf16 and runs a bf16 tl.dot with fp32
accumulation, rounding the result once to bf16. It differs from the dequantise-then-matmul
reference (`fp8_linear_reference`, used on CPU, in fp32 and with gradients) by summation order
only: 1 bf16 ulp, exact where the sums are exact. Interpreter details (its bf16 dot and its
rounding) as in grouped_gemm_triton.py, whose helpers it shares.

Grouped weights (DeepSeek-V4's wo_a, attention.GroupedLinear): x [..., G, in] and weight
[G * out_g, in], group g's rows g*out_g ... multiplying x[..., g, :]; scale rows follow the
weight's rows, so a 128-row block may span groups (as quantize_fp8_block blocks the whole matrix).

`pack_fp8_linears(model, is_fp8)` swaps the model's nn.Linear / GroupedLinear modules whose
weight name `is_fp8` says for packed ones quantised from their weights; `packed_weights(model)`
maps each packed weight's state-dict name to its module, whose `load_(w)` quantises a new weight
into the same storage in place (CUDA graphs read it there).
"""

from __future__ import annotations

import os
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from lockstep.quant import fp4, fp8
from lockstep.quant.fp4 import quantize_fp4_blocks_into
from lockstep.quant.fp8 import FP8_BLOCK, fp8_scale_shape, quantize_fp8_blocks_into
from lockstep.quant.serving_format import FP8_SCALE_FMT

from . import grouped_gemm_triton as _gt

triton = _gt.triton
if triton is not None:
    import triton.language as tl

FP8 = torch.float8_e4m3fn
BLOCK_ROWS, BLOCK_COLS = FP8_BLOCK


@torch.no_grad()
def quantise_packed(kind: str, ws: list[torch.Tensor], outs: list[tuple[torch.Tensor, torch.Tensor]],
                    layout=None, gate: torch.Tensor | None = None) -> None:
    """ws into packed storage outs [(bytes, scales)] of `kind`, in place: "fp8", e4m3 with FP8_SCALE_FMT
    128x128 block scales; "fp4", e2m1 with e8m0 scales per FP4_BLOCK. Many weights at once (on CUDA
    one kernel launch per group): the one rule for every packed weight's load_ and for a weight
    update's writes (engine/weight_update.write_served, which passes its plan's `layout`:
    quant/fp8.quantize_fp8_blocks_into says what for, and a `gate` where `gatable`)."""
    if kind == "fp8":
        quantize_fp8_blocks_into(ws, outs, scale_fmt=FP8_SCALE_FMT, layout=layout, gate=gate)
    elif kind == "fp4":
        quantize_fp4_blocks_into(ws, outs, layout=layout, gate=gate)
    else:
        raise ValueError(f"packed storage is fp8 or fp4, got {kind!r}")


def gatable(kind: str, ws: list[torch.Tensor]) -> bool:
    """quantise_packed takes a `gate` for these weights: its kernel quantises every one."""
    return (fp8 if kind == "fp8" else fp4).kernel_takes_all(ws)


def block_scale_rows(out_features: int, first: int = 0) -> torch.Tensor:
    """scale_row of an [out, in] weight whose scale table starts at row `first` of a larger one."""
    return (torch.arange(out_features) // BLOCK_ROWS + first).to(torch.int32)


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, scale_row: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q [N, K] e4m3 * scale[scale_row[n], k // 128] -> dtype [N, K], the product in fp32 (as
    dequantize_fp8_block: equal to it where scale_row = n // 128)."""
    K = q.shape[1]
    s = scale[scale_row.long()].repeat_interleave(BLOCK_COLS, dim=1)[:, :K]
    return (q.float() * s).to(dtype)


def fp8_linear_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, scale_row: torch.Tensor) -> torch.Tensor:
    """Dequantise, then matmul: x [..., K] @ w.T (w in x's dtype, as the emulation holds it)."""
    w = dequantize_rows(q, scale, scale_row, x.dtype)
    return F.linear(x, w)


def fp8_grouped_reference(x: torch.Tensor, q, scale, scale_row, n_groups: int) -> torch.Tensor:
    """x [..., G, K] -> [..., G, N]: group g through rows [g N, (g+1) N) (GroupedLinear.forward's einsum)."""
    w = dequantize_rows(q, scale, scale_row, x.dtype)
    return torch.einsum("...gi,goi->...go", x, w.view(n_groups, -1, w.shape[-1]))


def kernel_applies(x: torch.Tensor, q: torch.Tensor) -> bool:
    """The Triton kernel computes this product: Triton present, CUDA (or the interpreter, for its
    tests), bf16 activations, no gradient wanted."""
    if triton is None or x.dtype != torch.bfloat16 or q.dtype != FP8:
        return False
    if torch.is_grad_enabled() and x.requires_grad:
        return False
    return x.is_cuda


def fp8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, scale_row: torch.Tensor,
               n_groups: int = 0) -> torch.Tensor:
    """x @ dequant(q).T over packed storage: [..., K] -> [..., N] (n_groups 0), or grouped
    [..., G, K] -> [..., G, N / G] (n_groups G). The kernel where it applies, else the reference."""
    if not kernel_applies(x, q):
        if n_groups:
            return fp8_grouped_reference(x, q, scale, scale_row, n_groups)
        return fp8_linear_reference(x, q, scale, scale_row)
    return fp8_gemm(x, q, scale, scale_row, n_groups)


def fp8_gemm(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, scale_row: torch.Tensor,
             n_groups: int = 0, **launch: int) -> torch.Tensor:
    """The Triton kernel on any x dtype the caller vouches for (tests: bf16 under the interpreter).
    `launch`: block_n, block_k, block_m, num_warps, num_stages overriding launch_config's
    (benchmarks/fp8_linear.py --sweep)."""
    G = max(n_groups, 1)
    lead = x.shape[:-2] if n_groups else x.shape[:-1]
    x3 = x.reshape(-1, G, x.shape[-1])
    out = torch.ops.lockstep.fp8_linear(x3, q.view(torch.uint8), scale, scale_row, G, **launch)
    N = q.shape[0] // G
    return out.view(*lead, G, N) if n_groups else out.view(*lead, N)


def launch_config(N: int, K: int) -> dict:
    """By the weight's shape only, so a row's result never depends on the other rows (as
    grouped_gemm_triton.launch_config): 16 rows per tile (tl.dot's minimum; a decode step has a few
    dozen rows, and small tiles give an H200's 132 SMs enough programs), 16 output columns up to 512
    of them, else 32, 128 of K per step (one scale column), smaller for small dimensions. No autotune
    (it would benchmark during CUDA-graph capture); prefill re-reads weight tiles from L2 per 16 rows.
    Swept on one H200 (benchmarks/fp8_linear.py --sweep, the 1b config's six shapes, batch 64):
    the calls are bound by latency, not bytes (3.4-5.2 us each, cuBLAS on the bf16 weights 3.6-4.5);
    16 columns took 3.95 / 3.62 us against 32's 4.29 / 3.98 on [512 | 128, 1024], 32 was fastest on
    the larger ones; the step's 67 fp8 linears 263 us against bf16's 271."""
    return dict(BLOCK_M=16, BLOCK_N=16 if N <= 512 else 32,
                BLOCK_K=min(BLOCK_COLS, max(16, triton.next_power_of_2(K))), num_warps=4, num_stages=3)


if triton is not None:
    # by name, not as _gt._dot: torch.compile re-creates a user kernel's source in a compile worker
    # from the JIT functions it references directly, so a module alias is undefined there
    _dot, _bf16 = _gt._dot, _gt._bf16

    @triton.jit
    def _dequantize(qb, s):
        """e4m3 bytes qb (as uint8) times their block scales s in fp32 (broadcast against qb) -- exact:
        e4m3 times a power of two is a bf16 value -- as bf16 (the dequantisation of every fp8 weight
        kernel: this one, grouped_gemm_fp8's, output_a_triton's)."""
        return (qb.to(tl.float8e4nv, bitcast=True).to(tl.float32) * s).to(tl.bfloat16)

    @triton.jit
    def _dequantize_tile(qb, s):
        """_dequantize of a tile qb [BLOCK_K, BLOCK_N] of w^T within one scale column: s [BLOCK_N],
        each weight row's scale."""
        return _dequantize(qb, s[None, :])

    @triton.jit
    def _grouped_tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """Program (i, j, g) of a grouped linear's grid: its rows rm, columns rn, group g, the K step's
        offsets rk, the row and column masks, and the weight's rows g N + rn."""
        rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        g = tl.program_id(2)
        return rm, rn, g, tl.arange(0, BLOCK_K), rm < M, rn < N, g * N + rn

    @triton.jit
    def _fp8_linear_kernel(x_ptr, q_ptr, s_ptr, srow_ptr, out_ptr, M, N, K,
                           stride_xm, stride_xg, stride_xk, stride_qn, stride_qk, stride_sr, stride_sc,
                           stride_om, stride_og, stride_on,
                           INTERPRETED: tl.constexpr, SCALE_COLS: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """out[m, g, n] = sum_k x[m, g, k] * q[g N + n, k] * scale[scale_row[g N + n], k // SCALE_COLS]."""
        rm, rn, g, rk, m_ok, n_ok, row = _grouped_tile(M, N, BLOCK_M, BLOCK_N, BLOCK_K)
        srow = tl.load(srow_ptr + row, mask=n_ok, other=0)
        x_tile = x_ptr + rm[:, None].to(tl.int64) * stride_xm + g * stride_xg + rk[None, :] * stride_xk
        q_tile = q_ptr + row[None, :].to(tl.int64) * stride_qn + rk[:, None] * stride_qk  # [BLOCK_K, BLOCK_N] of w^T
        s_rows = s_ptr + srow.to(tl.int64) * stride_sr
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = k0 + rk < K
            a = tl.load(x_tile + k0 * stride_xk, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            qb = tl.load(q_tile + k0 * stride_qk, mask=n_ok[None, :] & k_ok[:, None], other=0)
            s = tl.load(s_rows + (k0 // SCALE_COLS) * stride_sc, mask=n_ok, other=0.0)
            acc = _dot(a, _dequantize_tile(qb, s), acc, INTERPRETED)
        tl.store(out_ptr + rm[:, None].to(tl.int64) * stride_om + g * stride_og + rn[None, :] * stride_on,
                 _bf16(acc, INTERPRETED), mask=m_ok[:, None] & n_ok[None, :])

    @torch.library.triton_op("lockstep::fp8_linear", mutates_args=())
    def _fp8_linear_op(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, scale_row: torch.Tensor,
                       n_groups: int, block_n: int = 0, block_k: int = 0, block_m: int = 0, num_warps: int = 0,
                       num_stages: int = 0) -> torch.Tensor:
        """x [M, G, K] bf16, q [G N, K] uint8 (e4m3 bytes), scale [R, ceil(K/128)] fp32, scale_row
        [G N] int32 -> [M, G, N] bf16. Nonzero launch settings override `launch_config`'s."""
        M, G, K = x.shape
        N = q.shape[0] // n_groups
        cfg = launch_config(N, K)
        for key, value in (("BLOCK_N", block_n), ("BLOCK_K", block_k), ("BLOCK_M", block_m),
                           ("num_warps", num_warps), ("num_stages", num_stages)):
            cfg[key] = value or cfg[key]
        assert BLOCK_COLS % cfg["BLOCK_K"] == 0, "a K step must lie within one scale column"
        out = x.new_empty(M, G, N)
        if M == 0:
            return out
        grid = (triton.cdiv(M, cfg["BLOCK_M"]), triton.cdiv(N, cfg["BLOCK_N"]), G)
        interpreted = os.environ.get("TRITON_INTERPRET", "0") not in ("0", "")
        torch.library.wrap_triton(_fp8_linear_kernel)[grid](
            x, q, scale, scale_row, out, M, N, K, *x.stride(), *q.stride(), *scale.stride(), *out.stride(),
            INTERPRETED=interpreted, SCALE_COLS=BLOCK_COLS, **cfg)
        return out

    @_fp8_linear_op.register_fake
    def _(x, q, scale, scale_row, n_groups, *config):
        return x.new_empty(x.shape[0], x.shape[1], q.shape[0] // n_groups)


# ---- modules -------------------------------------------------------------------------------


class Fp8Linear(nn.Module):
    """A bias-free linear over packed fp8 storage (module docstring). `n_groups` > 0: the grouped
    form of attention.GroupedLinear (x [..., G, in])."""

    def __init__(self, out_features: int, in_features: int, device=None, n_groups: int = 0):
        super().__init__()
        self.out_features, self.in_features, self.n_groups = out_features, in_features, n_groups
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=FP8, device=device))
        self.register_buffer("weight_scale", torch.ones(fp8_scale_shape((out_features, in_features)),
                                                        device=device), persistent=False)
        self.register_buffer("scale_row", block_scale_rows(out_features).to(device), persistent=False)

    @classmethod
    def packing(cls, module: nn.Module) -> "Fp8Linear":
        """A packed copy of an nn.Linear (bias-free) or GroupedLinear, quantised from its weight."""
        w = module.weight.detach()
        packed = cls(*w.shape, device=w.device, n_groups=getattr(module, "n_groups", 0))
        packed.load_(w)
        return packed

    @torch.no_grad()
    def load_(self, w: torch.Tensor) -> None:
        """Quantise w [out, in] (any float dtype) into this module's storage, in place."""
        quantise_packed("fp8", [w.to(self.weight.device)], [self.packed_target()[1]])

    def packed_target(self) -> tuple[str, tuple[torch.Tensor, torch.Tensor]]:
        """("fp8", the storage load_ quantises into: (bytes, scales)), with FP8_SCALE_FMT and 128x128
        blocks; a caller loading many weights quantises them at once (engine/weight_update.write_served:
        quant.fp8.quantize_fp8_blocks_into)."""
        return "fp8", (self.weight, self.weight_scale)

    @property
    def logical(self) -> torch.Tensor:
        """The unpacked weight's shape, as a meta tensor (packed_weights)."""
        return torch.empty(self.weight.shape, dtype=torch.float32, device="meta")

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_rows(self.weight, self.weight_scale, self.scale_row, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.weight_scale, self.scale_row, self.n_groups)

    def extra_repr(self) -> str:
        groups = f", n_groups={self.n_groups}" if self.n_groups else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 e4m3 128x128{groups}"


def packable(module: nn.Module) -> bool:
    """nn.Linear without bias, or GroupedLinear: the modules Fp8Linear replaces."""
    from .attention import GroupedLinear  # attention imports fused_linear, which imports this module

    if isinstance(module, nn.Linear):
        return module.bias is None
    return isinstance(module, GroupedLinear)


@torch.no_grad()
def pack_fp8_linears(model: nn.Module, is_fp8: Callable[[str], bool]) -> list[str]:
    """Replace every packable module whose `{name}.weight` is_fp8 by an Fp8Linear quantised from its
    weight (the bf16 weight is freed). Returns the packed weights' names. Modules sharing one weight
    (tied) are left alone."""
    counts: dict[int, int] = {}
    for module in model.modules():
        w = getattr(module, "weight", None)
        if isinstance(w, torch.Tensor):
            counts[w.data_ptr()] = counts.get(w.data_ptr(), 0) + 1
    packed = []
    for name, module in list(model.named_modules()):
        if not packable(module) or not is_fp8(f"{name}.weight") or counts[module.weight.data_ptr()] > 1:
            continue
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name), attr, Fp8Linear.packing(module))
        packed.append(f"{name}.weight")
    return packed


def packed_weights(model: nn.Module) -> dict:
    """State-dict name of each packed tensor -> what writes it: `load_(w)` quantises w into the
    storage in place, `logical` is a meta tensor of the unpacked shape and dtype (Fp8Linear: its
    own module; other packed modules, packed_experts.py, say theirs with `packed_tensors()`)."""
    out = {}
    for name, m in model.named_modules():
        prefix = f"{name}." if name else ""
        if isinstance(m, Fp8Linear):
            out[f"{prefix}weight"] = m
        elif hasattr(m, "packed_tensors"):
            out.update({prefix + attr: p for attr, p in m.packed_tensors().items()})
    return out
