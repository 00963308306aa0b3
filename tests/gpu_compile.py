"""Compile the trainer's Triton kernels to sm_90 PTX on a machine without a GPU (Triton's own
ptxas), one line per kernel variant: `ok NAME`, or the error. The interpreter (the CPU tests)
runs Python where the GPU compiler would refuse the kernel (a tuple indexed by a non-constexpr
cost a GPU call once), and cannot see what that compiler does to roundings: `ptx(...)` hands the
PTX to a test that looks (test_stream_mix_triton.py).

Run as a script (tests/models/test_kernels_compile_for_gpu.py): it tells lockstep that torch is a
CUDA build, so that the kernels get defined, which no test process should believe."""

from __future__ import annotations

import os
import re
import sys

os.environ["TRITON_INTERPRET"] = "0"
import torch  # noqa: E402

torch.version.cuda = "13.0"  # lockstep.triton_support: a CUDA build defines the kernels
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)  # an H200
BF, FP, I32, I64 = "*bf16", "*fp32", "*i32", "*i64"


def ptx(kernel, pointers: dict[str, str], ints=(), floats=(), num_warps: int = 4, **constexprs) -> str:
    """PTX of `kernel` with these pointer types, int32 / fp32 scalars and constexpr values, launched
    with num_warps; FP fusion on, as Triton 3.6 (the GPU image's) compiles by default."""
    signature, values = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in pointers:
            signature[name] = pointers[name]
        elif name in ints:
            signature[name] = "i32"
        elif name in floats:
            signature[name] = "fp32"
        else:
            signature[name], values[(i,)] = "constexpr", constexprs[name]
    source = ASTSource(fn=kernel, signature=signature, constexprs=values)
    return triton.compile(source, target=TARGET, options=dict(num_warps=num_warps, enable_fp_fusion=True)).asm["ptx"]


def variants():
    """(name, thunk) of every kernel variant the trainer launches on a GPU, and the engine's decode
    attention, mHC pre stage, router and routed experts."""
    from lockstep.models.layers import bf16x3 as b3
    from lockstep.models.layers import compressor_step_triton as cs
    from lockstep.models.layers import flash_sink_attention_triton as fa
    from lockstep.models.layers import fixed_order_rmsnorm as fo
    from lockstep.models.layers import grouped_gemm_fp8 as g8
    from lockstep.models.layers import grouped_gemm_triton as gg
    from lockstep.models.layers import hc_pre_triton as hp
    from lockstep.models.layers import hc_projection_triton as hc
    from lockstep.models.layers import logprob_entropy_triton as le
    from lockstep.models.layers import moe_combine_triton as mc
    from lockstep.models.layers import rms_norm_grad_triton as rn
    from lockstep.models.layers import rope_triton as rt
    from lockstep.models.layers import router_triton as ro
    from lockstep.models.layers import scaled_projection_triton as sp
    from lockstep.models.layers import step_attention_triton as sa
    from lockstep.models.layers import stream_mix_triton as sm
    from lockstep.models.layers import swiglu_triton as sw

    flash = dict(CLOSED=True, H=16, D=128, BLOCK_D=128, BLOCK_M=64, BLOCK_N=64, BF16=True, INTERPRETED=False)
    yield "flash delta", lambda: ptx(fa._row_dot_kernel, dict(a_ptr=BF, b_ptr=BF, out_ptr=FP), {"R", "D"},
                                     BLOCK_R=fa.DELTA_ROWS, BLOCK_D=128)
    yield "flash forward", lambda: ptx(fa._fwd_kernel, dict(q_ptr=BF, kv_ptr=BF, ent_ptr=BF, ebias_ptr=FP, sinks_ptr=FP,
                                                            out_ptr=BF, lse_ptr=FP), "SEWM", {"scale"},
                                       HAS_ENTRIES=True, **flash)
    yield "flash dq", lambda: ptx(fa._dq_kernel, dict(q_ptr=BF, kv_ptr=BF, ent_ptr=BF, ebias_ptr=FP, do_ptr=BF, lse_ptr=FP,
                                                      delta_ptr=FP, dq_ptr=BF), "SEWM", {"scale"},
                                  HAS_ENTRIES=True, **flash)
    for entries in (False, True):
        yield f"flash dkv entries={entries}", lambda e=entries: ptx(
            fa._dkv_kernel, dict(q_ptr=BF, k_ptr=BF, ebias_ptr=FP, do_ptr=BF, lse_ptr=FP, delta_ptr=FP,
                                 dk_ptr=FP if e else BF), "SLEWM", {"scale"}, ENTRIES=e, **flash)
    for weight in (True, False):
        yield f"rmsnorm dx weight={weight}", lambda w=weight: ptx(
            rn._rms_norm_dx_kernel, dict(x_ptr=BF, w_ptr=FP, g_ptr=BF, dx_ptr=BF, r_ptr=FP), {"D"},
            {"d_float", "eps"}, HAS_WEIGHT=w, BF16=True, INTERPRETED=False, BLOCK=1024)
    yield "bf16x3 split", lambda: ptx(b3._split_kernel, dict(t_ptr=FP, out_ptr=BF),
                                      {"numel", "cols", "stride_r", "stride_c", "row_step", "part_step"},
                                      INTERPRETED=False, BLOCK=b3.SPLIT_BLOCK)
    yield "rmsnorm backward", lambda: ptx(
        rn._rms_norm_backward_kernel, dict(x_ptr=BF, w_ptr=FP, g_ptr=BF, dx_ptr=BF, partial_ptr=FP), {"R", "D", "ROWS"},
        {"d_float", "eps"}, BF16=True, INTERPRETED=False, BLOCK=1024)
    yield "rmsnorm dw", lambda: ptx(rn._rms_norm_dw_kernel, dict(x_ptr=BF, g_ptr=BF, r_ptr=FP, partial_ptr=FP),
                                    {"R", "D", "ROWS_PER_SHARE"}, BLOCK_R=rn.DW_BLOCK_R, BLOCK_D=rn.DW_BLOCK_D)
    yield "rmsnorm", lambda: ptx(fo._fixed_order_rms_norm_kernel, dict(x_ptr=BF, w_ptr=FP, out_ptr=BF),
                                 {"D", "stride_xm", "stride_xd", "stride_om", "stride_od"}, {"d_float", "eps"},
                                 HAS_WEIGHT=True, BF16=True, INTERPRETED=False, BLOCK=1024)
    yield "rope", lambda: ptx(rt._rope_kernel, dict(x_ptr=BF, cos_ptr=FP, sin_ptr=FP, out_ptr=BF), {"rows", "G"},
                              D=128, HALF=32, BLOCK_D=128, BLOCK_R=16, BF16=True, INTERPRETED=False)
    combine = dict(K=6, K_PAD=8, BLOCK=1024, BF16=True, INTERPRETED=False)
    no_hc = dict(x_ptr=None, post_ptr=None, comb_ptr=None, N_HC=0)
    yield "moe combine", lambda: ptx(mc._combine_kernel, dict(ys_ptr=BF, rows_ptr=I64, w_ptr=FP, out_ptr=BF), {"H"},
                                     SHARED=False, **no_hc, **combine)
    yield "decode combine with the shared rows", lambda: ptx(
        mc._combine_kernel, dict(ys_ptr=BF, rows_ptr=I64, w_ptr=FP, out_ptr=BF), {"H"}, SHARED=True, **no_hc,
        **combine)
    yield "decode combine with the shared rows and the mHC combine", lambda: ptx(
        mc._combine_kernel, dict(ys_ptr=BF, rows_ptr=I64, w_ptr=FP, out_ptr=BF, x_ptr=BF, post_ptr=FP, comb_ptr=FP),
        {"H"}, SHARED=True, N_HC=4, **combine)
    yield "moe combine backward", lambda: ptx(mc._combine_backward_kernel, dict(ys_ptr=BF, rows_ptr=I64, w_ptr=FP, g_ptr=BF,
                                                                                d_ys_ptr=BF, d_w_ptr=FP), {"H"}, **combine)
    yield "moe dispatch backward", lambda: ptx(mc._dispatch_backward_kernel, dict(g_ptr=BF, rows_ptr=I64, dx_ptr=BF),
                                               {"H"}, K=6, BLOCK=1024, BF16=True, INTERPRETED=False)
    yield "adamw", lambda: adamw_ptx(16)
    for scale_bytes in (False, True):  # the push's fp8 re-quantisation: fp32 or e8m0-byte scales
        yield f"fp8 quantise many{' e8m0' if scale_bytes else ''}", lambda scale_bytes=scale_bytes: quantise_ptx(
            "fp8", 16, scale_bytes)
    yield "fp4 quantise many", lambda: quantise_ptx("fp4", 16)
    yield "copy many", lambda: copy_ptx(16)
    yield "nonfinite flags", lambda: nonfinite_ptx(16)
    yield "logprobs forward", lambda: ptx(le._forward_kernel, dict(z_ptr=FP, y_ptr=I64, logp_ptr=FP, entropy_ptr=FP,
                                                                   lse_ptr=FP), {"V", "stride_zm"}, {"temperature"},
                                          BLOCK=4096)
    for entropy in (False, True):
        yield f"logprobs backward entropy={entropy}", lambda e=entropy: ptx(
            le._backward_kernel, dict(z_ptr=FP, y_ptr=I64, lse_ptr=FP, entropy_ptr=FP, g_logp_ptr=FP, g_entropy_ptr=FP,
                                      dz_ptr=FP), {"V", "stride_zm", "stride_dm"}, {"temperature"}, BLOCK=4096, ENTROPY=e)
    for post in (False, True):
        yield f"stream mix post={post}", lambda p=post: stream_mix_ptx(p)
    yield "stream combine backward", lambda: ptx(
        sm._stream_combine_backward_kernel, dict(comb_ptr=BF, x_ptr=BF, post_ptr=BF, y_ptr=BF, g_ptr=BF, dx_ptr=BF,
                                                 dy_ptr=BF, dpost_ptr=FP, dcomb_ptr=FP), {"D"},
        N=4, K=4, R=16, ROUND=True, INTERPRETED=False, BLOCK=sm.COMBINE_BACKWARD_BLOCK,
        num_warps=sm.COMBINE_BACKWARD_WARPS)
    for add in (False, True):  # with the streams' gradient from their other consumers added, or not
        yield f"projection streams grad add={add}", lambda add=add: ptx(
            sp._streams_grad_kernel, dict(gr_ptr=FP, fn_ptr=FP, s_ptr=FP, x_ptr=BF, add_ptr=BF, out_ptr=BF), {"T", "D"},
            J=24, J_PAD=32, ADD=add, ROUND=True, INTERPRETED=False, BLOCK_M=32, BLOCK_D=128)
        yield f"collapse backward add={add}", lambda add=add: ptx(
            sm._collapse_backward_kernel, dict(pre_ptr=FP, x_ptr=BF, g_ptr=BF, add_ptr=BF, dx_ptr=BF, dpre_ptr=FP),
            {"D"}, N=4, ADD=add, ROUND=True, INTERPRETED=False, BLOCK=sm.MIX_BLOCK)
    yield "swiglu forward", lambda: ptx(sw._forward_kernel, dict(h_ptr=BF, out_ptr=BF), {"F"}, {"limit"},
                                        ROUND=True, INTERPRETED=False, BLOCK=1024)
    yield "swiglu backward", lambda: ptx(sw._backward_kernel, dict(h_ptr=BF, g_ptr=BF, dh_ptr=BF), {"F"}, {"limit"},
                                         ROUND=True, INTERPRETED=False, BLOCK=1024)
    # the engine's decode attention (forward only): not the trainer's, but the interpreter hides the same
    for entries, name in ((sa.NO_ENTRIES, "window"), (sa.CLOSED_BLOCKS, "closed blocks"), (sa.PICKED, "picked")):
        yield f"decode step attention, {name}", lambda entries=entries: ptx(
            sa._step_kernel, dict(q_ptr=BF, ring_ptr=BF, slots_ptr=I64, pos_ptr=I64, ent_ptr=BF, picks_ptr=I64,
                                  sinks_ptr=FP, out_ptr=BF),
            {"W", "capacity", "num_picks", "rate", "stride_pos", "stride_rs", "stride_rw", "stride_es", "stride_ee",
             "stride_pn"}, {"scale"}, H=16, D=128, BLOCK_H=16, BLOCK_D=128, BLOCK_K=sa.BLOCK_K, ENTRIES=entries,
            BF16=True, INTERPRETED=False)
    for norm in (False, True):  # the collapse alone, or a whole row then the block's norm
        yield f"decode mHC pre norm={norm}", lambda norm=norm: ptx(
            hp._hc_pre_kernel, dict(p_ptr=FP, x_ptr=BF, base_ptr=FP, scale_ptr=FP, out_ptr=BF, post_ptr=FP,
                                    comb_ptr=FP, w_ptr=BF),
            {"S", "K", "D", "iters", "stride_ps", "stride_pt", "stride_xt", "stride_xn", "stride_xd"},
            {"hc_eps", "norm_eps", "block_eps"}, N=4, BLOCK_N=4, BLOCK_S=32, BLOCK_D=1024 if norm else hp.BLOCK_D,
            NORM=norm, BF16=True, INTERPRETED=False, num_warps=1)
    # the mHC projection's partials as the engine launches them (tf32x3 tl.dot)
    for n_hc in (0, 4):  # alone, or after the previous block's mHC combine (hc_combine_partials)
        yield f"decode mHC partials, combine of {n_hc} streams", lambda n_hc=n_hc: ptx(
            hc._partials_kernel, dict(x_ptr=BF, fn_ptr=FP, out_ptr=FP, y_ptr=BF, post_ptr=FP, comb_ptr=FP, new_ptr=BF),
            {"T", "J", "K", "k_per_split", "stride_xt", "stride_xk", "stride_fj", "stride_fk", "stride_os", "stride_ot",
             "D"}, BLOCK_T=16, BLOCK_J=32, BLOCK_K=64, EVEN_K=True, PRECISION=hc.PRECISION, INTERPRETED=False,
            N_HC=n_hc)
    # the C4 and C128 layers' entries, alone or with the state's writes (compressor_step; fp32 bias)
    for m, overlap, write in ((4, True, False), (128, False, False), (4, True, True), (128, False, True)):
        yield f"decode compressor entry, m {m}, state writes {write}", lambda m=m, overlap=overlap, write=write: ptx(
            cs._closing_entry_kernel, dict(kv_new_ptr=BF, gate_new_ptr=BF, pos_ptr=I64, num_new_ptr=I64, slots_ptr=I64,
                                           buf_kv_ptr=BF, buf_gate_ptr=BF, prev_kv_ptr=BF, prev_gate_ptr=FP,
                                           bias_ptr=FP if write else BF, weight_ptr=BF, cos_ptr=FP, sin_ptr=FP,
                                           out_ptr=BF),
            {"D", "ROPE_HALF", "stride_kn", "stride_gn", "stride_bs", "stride_bt", "stride_ps", "stride_pt",
             "stride_bias", "stride_cn", "stride_on", "W", "scratch_slot", "stride_ee"}, {"eps"}, M=m,
            OVERLAP=overlap, HALF=64, SB=cs.SLOT_BLOCK, BF16=True, INTERPRETED=False, WRITE=write,
            MP=m, WP=256 if overlap else 128, BIAS_BF16=False)
    for block_t in (1, ro.BLOCK_T):  # broadcast products; tl.dot in tf32x3 (the default, 16)
        yield f"decode router, {block_t} tokens a program", lambda block_t=block_t: ptx(
            ro._route_kernel, dict(x_ptr=BF, w_ptr=FP, bias_ptr=FP, experts_ptr=I64, weights_ptr=FP), {"T", "H", "E"},
            {"scaling"}, K=6, SCORING=0, BLOCK_T=block_t, BLOCK_E=64, BLOCK_H=ro.BLOCK_H, INTERPRETED=False)
    yield "decode router from split-K partial logits", lambda: ptx(
        ro._route_partials_kernel, dict(p_ptr=FP, bias_ptr=FP, experts_ptr=I64, weights_ptr=FP),
        {"T", "E", "S", "stride_ps", "stride_pt"}, {"scaling"}, K=6, SCORING=0, BLOCK_T=ro.BLOCK_T, BLOCK_E=64)
    from lockstep.models.layers import dispatch_order_triton as do
    yield "decode dispatch order", lambda: ptx(
        do._dispatch_order_kernel, dict(flat_ptr=I64, order_ptr=I64, counts_ptr=I64), {"M", "E"}, (),
        BLOCK=do.BLOCK, BLOCK_E=64)
    yield "decode dispatch rows, offsets and slot rows", lambda: ptx(
        do._decode_dispatch_kernel, dict(flat_ptr=I64, rows_ptr=I64, offs_ptr=I32, slot_rows_ptr=I64),
        {"M", "E", "T"}, (), K=6, SHARED_GROUPS=4, BLOCK=do.BLOCK, BLOCK_E=64)
    from lockstep.models.layers import output_a_triton as oa
    # the rotation back and wo_a over bf16 or packed fp8 weights; fp8 also with a K step across scale columns
    # and split K into fp32 partials
    for fp8, setting in ((False, {}), (True, {}), (True, {"BLOCK_K": 512}), (False, {"SPLIT_K": 4})):
        yield f"decode output projection a fp8={fp8} {setting}", lambda fp8=fp8, setting=setting: ptx(
            oa._derope_output_a_kernel, dict(o_ptr=BF, cos_ptr=FP, sin_ptr=FP, w_ptr="*u8" if fp8 else BF, s_ptr=FP,
                                             srow_ptr=I32, out_ptr=FP if setting.get("SPLIT_K") else BF),
            {"M", "N", "K", "K_SPLIT", "stride_om", "stride_og", "stride_cm", "stride_wn", "stride_wk", "stride_sr",
             "stride_sc", "stride_split", "stride_outm", "stride_outg", "stride_outn"}, (), D=128, ROPE=64, FP8=fp8,
            SCALE_COLS=128, INTERPRETED=False, BLOCK_M=oa.BLOCK_M, **{**oa.launch_config(256, 512), **setting})
    from lockstep.engine import draw_triton as dr
    strides = {"V", "stride_xm", "stride_xv", "PLANE", "CHUNKS"}
    yield "draw chunks", lambda: ptx(dr._chunk_kernel, dict(x_ptr=FP, part_ptr=FP, part_index_ptr=I32), strides,
                                     {"inv_t"}, INTERPRETED=False, BLOCK=2048)
    yield "draw chunk masses", lambda: ptx(dr._chunk_mass_kernel, dict(x_ptr=FP, part_ptr=FP, mass_ptr="*fp64"),
                                           strides, {"inv_t"}, INTERPRETED=False, BLOCK=2048, BLOCK_C=16)
    for sampled in (False, True):
        yield f"draw rows sampled={sampled}", lambda sampled=sampled: ptx(
            dr._row_kernel, dict(x_ptr=FP, part_ptr=FP, part_index_ptr=I32, mass_ptr="*fp64", u_ptr="*fp64",
                                 tokens_ptr=I64, logp_ptr=FP), strides | {"stride_u"}, {"inv_t"}, INTERPRETED=False,
            BLOCK=2048, SAMPLED=sampled, BLOCK_C=16)
    from lockstep.models.layers import qk_norm_rope_triton as qk
    yield "decode query / key norms, rotation and ring write", lambda: ptx(
        qk._qk_norm_rope_kernel, dict(q_ptr=BF, kv_ptr=BF, w_ptr=BF, inv_freq_ptr=FP, q_out_ptr=BF, cos_ptr=FP,
                                      sin_ptr=FP, ring_ptr=BF, slots_ptr=I64, pos_ptr=I64, valid_ptr="*i1",
                                      num_new_ptr=I64),
        {"stride_qt", "stride_kvt", "S", "W", "scratch_slot"}, {"eps"}, H=16, D=128, ROPE=64,
        BLOCK_H=qk.BLOCK_H, INTERPRETED=False)
    yield "decode hash router", lambda: ptx(
        ro._hash_route_kernel, dict(x_ptr=BF, w_ptr=FP, table_ptr=I64, ids_ptr=I64, experts_ptr=I64, weights_ptr=FP),
        {"H"}, {"scaling"}, K=6, SCORING=0, BLOCK_K=8, BLOCK_H=ro.HASH_BLOCK_H)
    # the routed experts' decode GEMMs (the shared expert's groups read a second weight pointer)
    grouped = {"G_ROUTED", "N", "K", "stride_xm", "stride_xk", "stride_wg", "stride_wn", "stride_wk", "stride_om",
               "stride_on"}
    for swiglu in (True, False):  # the first reads the dispatch's rows where they are (GATHER)
        yield f"decode grouped GEMM swiglu={swiglu}", lambda swiglu=swiglu: ptx(
            gg._grouped_kernel, dict(x_ptr=BF, w_ptr=BF, ws_ptr=BF, out_ptr=BF, offs_ptr="*i32", rows_ptr=I64), grouped,
            {"limit"}, SWIGLU=swiglu, GATHER=swiglu, INTERPRETED=False, BLOCK_M=gg.BLOCK_M, EVEN_K=True, BLOCK_N=32,
            BLOCK_K=128)
    for swiglu in (False, True):
        yield f"decode grouped GEMM fp8 swiglu={swiglu}", lambda swiglu=swiglu: ptx(
            g8._grouped_fp8_kernel, dict(x_ptr=BF, w_ptr="*u8", s_ptr=FP, ws_ptr="*u8", ss_ptr=FP, out_ptr=BF,
                                         offs_ptr="*i32", rows_ptr=I64), grouped | {"stride_sg", "stride_sn", "stride_sk"},
            {"limit"}, num_warps=2, SWIGLU=swiglu, GATHER=not swiglu, INTERPRETED=False, SCALE_BLOCK=128,
            BLOCK_M=gg.BLOCK_M, BLOCK_N=64, BLOCK_K=128)  # the engine's gate_up: the plain kernel, gathering


def quantise_ptx(fmt: str, align: int, scale_bytes: bool = True) -> str:
    """The push's many-tensor fp8 / fp4 quantisation kernel (bf16 weights) with ALIGN `align`."""
    from lockstep.quant import fp4_triton as q4
    from lockstep.quant import fp8_triton as q8

    tables = dict(addr_ptr=I64, meta_ptr=I64, tensor_ptr="*i32", local_ptr="*i32", gate_ptr="*i32")
    if fmt == "fp8":
        return ptx(q8._fp8_many_kernel, tables, {"T"}, num_warps=4, W_DTYPE=0, BLOCK_R=128, BLOCK_C=128,
                   CHUNK_R=q8.CHUNK_ROWS, UE8M0=True, SCALE_BYTES=scale_bytes, ALIGN=align, HW=True)
    return ptx(q4._fp4_many_kernel, tables, {"T"}, W_DTYPE=0, BLOCK_R=16, BLOCK_K=256, BLOCK=32, SCALE_BYTES=True,
               ALIGN=align)


def adamw_ptx(align: int) -> str:
    """MasterAdamW's multi-tensor kernel (bf16 gradients and parameters, clipped) with ALIGN `align`."""
    from lockstep.train import adamw_triton as aw

    return ptx(aw._adamw_kernel, dict(addr_ptr=I64, numel_ptr=I64, tensor_ptr="*i32", first_ptr=I64,
                                      found_inf_ptr=FP, inv_scale_ptr=FP), {"T"},
               {"lr", "beta1", "beta2", "eps", "weight_decay", "step_size", "bias_correction2_sqrt"},
               num_warps=8, HAS_P=True, SCALED=True, G_BF16=True, P_BF16=True, INTERPRETED=False,
               BLOCK=aw.BLOCK, CHUNK=aw.CHUNK, ALIGN=align)


def copy_ptx(align: int) -> str:
    """The weight update's many-tensor byte copy (tensor_copy_triton.py) with ALIGN `align`."""
    from lockstep import tensor_copy_triton as tc

    return ptx(tc._copy_kernel, dict(addr_ptr=I64, tensor_ptr="*i32", local_ptr="*i32", gate_ptr="*i32"), {"T"},
               CHUNK=tc.CHUNK if align > 1 else tc.BYTE_CHUNK,
               TILE=tc.TILE if align > 1 else tc.BYTE_TILE, ALIGN=align)


def nonfinite_ptx(align: int) -> str:
    """The weight update's many-tensor finiteness check (tensor_finite_triton.py) on bf16, ALIGN `align`."""
    from lockstep import tensor_finite_triton as tf

    return ptx(tf._nonfinite_kernel, dict(addr_ptr=I64, tensor_ptr="*i32", local_ptr="*i32", flags_ptr="*i32",
                                          gate_ptr="*i32"), {"T"}, KIND=0, CHUNK=tf.CHUNK, TILE=tf.TILE, ALIGN=align)


def vector_accesses(kernel: str, align: int) -> str:
    """"loads L stores S conversions C": the vector (.v2 / .v4) global loads and stores of a kernel
    reading its tensors' addresses from a table (the push's fp8 / fp4 quantisation, AdamW, the copy), and its
    e4m3 conversion instructions."""
    code = {"adamw": adamw_ptx, "copy": copy_ptx, "nonfinite": nonfinite_ptx}.get(
        kernel, lambda a: quantise_ptx(kernel, a))(align)
    loads, stores = (len(re.findall(rf"{op}[.]global[.]v[24]", code)) for op in ("ld", "st"))
    conversions = len(re.findall(r"cvt[.]rn[.]satfinite[.]e4m3x2[.]f32", code))
    return f"loads {loads} stores {stores} conversions {conversions}"


def stream_mix_ptx(post: bool = True) -> str:
    """mHC's stream mix (with StreamCombine's post_k y where `post`) in bf16."""
    from lockstep.models.layers import stream_mix_triton as sm

    return ptx(sm._stream_mix_kernel, dict(comb_ptr=BF, x_ptr=BF, post_ptr=BF, y_ptr=BF, out_ptr=BF), {"D"},
               N=4, K=4, ROUND=True, POST=post, INTERPRETED=False, BLOCK=1024)


if __name__ == "__main__":
    if sys.argv[1:] == ["stream-mix"]:
        print(stream_mix_ptx())
        sys.exit(0)
    if sys.argv[1:2] == ["vectors"]:  # vectors ALIGN KERNEL...: a line "KERNEL loads L stores S conversions C" each
        for kernel in sys.argv[3:]:
            print(kernel, vector_accesses(kernel, int(sys.argv[2])))
        sys.exit(0)
    for name, compile_it in variants():
        try:
            compile_it()
            print(f"ok {name}", flush=True)
        except Exception as e:  # every variant reported, not only the first failure
            print(f"FAILED {name}: {type(e).__name__}: {str(e)[:400]}", flush=True)
