"""Routed experts at decode: the Triton grouped GEMMs (grouped_gemm_triton.py) vs torch._grouped_mm.

    python benchmarks/moe_grouped_gemm.py                        # 1b decode shapes, batch 64
    python benchmarks/moe_grouped_gemm.py --batch 64 256 1024    # where the two cross (moe.Experts.mlp: decode only)
    python benchmarks/moe_grouped_gemm.py --sweep                # pick launch_config's defaults
    python benchmarks/moe_grouped_gemm.py --fp8 [--sweep]        # packed fp8 experts vs bf16 (grouped_gemm_fp8.py)
    python benchmarks/moe_grouped_gemm.py --shared [--fp8]       # the shared expert folded into the kernels

Shapes of the 1b config: --batch tokens, each routed to --top-k distinct experts drawn uniformly
of --experts, hidden H, expert intermediate F: gate_up [E, 2F, H] and down [E, H, F] in bf16, a
decode step's --layers sets of them cycled (so no layer's weights are still in L2 when it runs
again). Compared per layer: the first GEMM with the clamped SwiGLU (Triton: one fused kernel;
torch: torch._grouped_mm then eager swiglu_clamped, several element-wise kernels where the
engine's inductor makes one), the second GEMM, and both.

Timed as the engine runs them: --calls calls captured in one CUDA graph (no launch cost from
Python, which for a custom op can exceed the kernel's time), replayed --reps times between CUDA
events after a warm-up. Printed per kernel: us per call, GB/s of the weight bytes it must read
(the experts the batch touches), that as a fraction of the device copy bandwidth (a large copy_,
bytes read + written, as rollout_throughput.py measures), and the Triton / torch throughput
ratio; then the max |Triton - torch| of each output (bf16: the sums run in another order, so a
few ulps). --sweep times a grid of (BLOCK_N, BLOCK_K, num_warps, num_stages) for each Triton
kernel at each --batch and prints the fastest, with the default's time.

--fp8: the packed fp8 experts' kernel (grouped_gemm_fp8.grouped_mm_fp8: e4m3 bytes + 128x128
block scales, dequantised in registers) against the bf16 Triton grouped_mm on the same GEMMs
(gate_up without the SwiGLU, down), each with GB/s of the bytes it must read (1 byte a parameter
for fp8) and that as a fraction of the copy bandwidth; fp8 reads half the bytes, so at the same
fraction it takes half the time. With --sweep its launch settings are swept too (SWEEP_FP8).
Then gate_up with the SwiGLU: fp8's kernel followed by the SwiGLU compiled (the engine's step) against
grouped_gemm_fp8.grouped_swiglu_fp8 (fused; swept too with --sweep).

--shared: each decode kernel over the routed rows alone and with a shared expert's rows (every
token once more) as groups of their own (moe.Experts.folds_shared, grouped_gemm_triton.with_shared_groups),
in bf16 (and with --fp8 in packed fp8), against the shared expert run on its own as the engine ran it
unfolded (one GEMM for gate and up, the SwiGLU, the down GEMM): the extra time of the folded kernels
against the separate expert's time is what folding saves per layer.
"""

from __future__ import annotations

import argparse

import torch

from lockstep.models.layers import grouped_gemm_fp8 as g8
from lockstep.models.layers import grouped_gemm_triton as gt
from lockstep.models.layers.moe import dispatch_order, swiglu_clamped
from lockstep.quant.fp8 import quantize_fp8_block
from cuda_graph_timing import capture, fastest, graph_us
from rollout_throughput import copy_bandwidth

DEVICE = "cuda"  # a dry run of the code on a CPU (interpreter) sets "cpu"
SWEEP = dict(block_n=(32, 64, 128), block_k=(128, 256), num_warps=(4, 8), num_stages=(3, 4))
SWEEP_FP8 = dict(block_n=(16, 32, 64, 128), block_k=(64, 128), num_warps=(2, 4), num_stages=(3, 5))


def make_layers(args) -> list[tuple[torch.Tensor, torch.Tensor]]:
    E, H, F = args.experts, args.hidden, args.inter
    return [(torch.randn(E, 2 * F, H, device=DEVICE, dtype=torch.bfloat16) * H**-0.5,
             torch.randn(E, H, F, device=DEVICE, dtype=torch.bfloat16) * F**-0.5) for _ in range(args.layers)]


def make_rows(args, batch: int):
    """(xs [batch * k, H] sorted by expert, offs [E] int32, counts [E]) for random routing."""
    g = torch.Generator().manual_seed(args.seed + batch)
    experts = torch.rand(batch, args.experts, generator=g).topk(args.top_k, dim=-1).indices.sort(-1).values
    order, counts = dispatch_order(experts.flatten(), args.experts)
    x = torch.randn(batch, args.hidden, generator=g).to(DEVICE, torch.bfloat16)
    xs = x[(order // args.top_k).to(DEVICE)]
    return xs, torch.cumsum(counts, 0).to(DEVICE, torch.int32), counts


def torch_gate_up(xs, w, offs, limit):
    gate, up = torch._grouped_mm(xs, w.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
    return swiglu_clamped(gate, up, limit)


def torch_down(act, w, offs):
    return torch._grouped_mm(act, w.transpose(-2, -1), offs=offs)


def time_us(fn, n_layers: int, calls: int, reps: int) -> float:
    """Device time per call of fn(layer index), calls cycling over the layers in one CUDA graph
    (warmed up first: Triton compiles, CUTLASS picks its kernel)."""
    graph, _ = capture(fn, [i % n_layers for i in range(calls)])
    return graph_us(graph, calls, reps, warmup=1)


def report(name, us_torch, us_triton, nbytes, bw):
    def cols(us):
        gbs = nbytes / us / 1e3
        return f"{us:9.1f} us {gbs:8.1f} GB/s {gbs * 1e9 / bw:6.1%}"
    print(f"  {name:16s} torch {cols(us_torch)} | triton {cols(us_triton)} | triton/torch {us_torch / us_triton:5.2f}x")


def compare(args, layers, batch, bw):
    xs, offs, counts = make_rows(args, batch)
    E, H, F, L = args.experts, args.hidden, args.inter, len(layers)
    touched = int((counts > 0).sum())
    up_bytes, down_bytes = touched * 2 * F * H * 2, touched * H * F * 2
    print(f"batch {batch}: {xs.shape[0]} rows, {touched} of {E} experts touched, "
          f"{xs.shape[0] / E:.1f} rows per expert (max {int(counts.max())})")
    act = gt.grouped_swiglu(xs, layers[0][0], offs, args.limit)
    lim = args.limit
    t_up = time_us(lambda i: torch_gate_up(xs, layers[i][0], offs, lim), L, args.calls, args.reps)
    g_up = time_us(lambda i: gt.grouped_swiglu(xs, layers[i][0], offs, lim), L, args.calls, args.reps)
    t_down = time_us(lambda i: torch_down(act, layers[i][1], offs), L, args.calls, args.reps)
    g_down = time_us(lambda i: gt.grouped_mm(act, layers[i][1], offs), L, args.calls, args.reps)
    t_both = time_us(lambda i: torch_down(torch_gate_up(xs, layers[i][0], offs, lim), layers[i][1], offs),
                     L, args.calls, args.reps)
    g_both = time_us(lambda i: gt.grouped_mm(gt.grouped_swiglu(xs, layers[i][0], offs, lim), layers[i][1], offs),
                     L, args.calls, args.reps)
    report("gate_up+swiglu", t_up, g_up, up_bytes, bw)
    report("down", t_down, g_down, down_bytes, bw)
    report("both", t_both, g_both, up_bytes + down_bytes, bw)

    w_up, w_down = layers[0]
    ref_act = torch_gate_up(xs, w_up, offs, lim)
    diff_act = (act.float() - ref_act.float()).abs()
    out, ref_out = gt.grouped_mm(act, w_down, offs), torch_down(act, w_down, offs)
    diff_out = (out.float() - ref_out.float()).abs()
    print(f"  max |triton - torch|: act {diff_act.max().item():.3g} ({(diff_act > 0).float().mean().item():.2%} "
          f"differ, |act| <= {ref_act.abs().max().item():.3g}); down {diff_out.max().item():.3g} "
          f"({(diff_out > 0).float().mean().item():.2%} differ, |out| <= {ref_out.abs().max().item():.3g})")


def fp8_layers(layers) -> list[tuple[tuple[torch.Tensor, torch.Tensor], ...]]:
    """Each layer's (gate_up, down) as (e4m3 bytes, block scales), quantised as PackedExperts does."""
    return [tuple(quantize_fp8_block(w, scale_fmt="ue8m0") for w in pair) for pair in layers]


def compare_fp8(args, layers, packed, batch, bw):
    """fp8 grouped_mm vs the bf16 Triton grouped_mm per GEMM (module docstring); --sweep: fp8's settings."""
    xs, offs, counts = make_rows(args, batch)
    H, F, L = args.hidden, args.inter, len(layers)
    touched = int((counts > 0).sum())
    act = gt.grouped_swiglu(xs, layers[0][0], offs, args.limit)
    gemms = {  # name: (x, bf16 weight index, rows x cols of a weight)
        "gate_up": (xs, 0, 2 * F * H), "down": (act, 1, H * F)}
    print(f"fp8 experts, batch {batch}: {touched} experts touched")
    for name, (x, j, params) in gemms.items():
        bf16 = time_us(lambda i: gt.grouped_mm(x, layers[i][j], offs), L, args.calls, args.reps)
        fp8 = time_us(lambda i: g8.grouped_mm_fp8(x, *packed[i][j], offs), L, args.calls, args.reps)
        for label, us, nbytes in (("bf16", bf16, 2), ("fp8", fp8, 1)):
            gbs = touched * params * nbytes / us / 1e3
            print(f"  {name:8s} {label:5s} {us:8.1f} us {gbs:8.1f} GB/s {gbs * 1e9 / bw:6.1%}")
        print(f"  {name:8s} fp8 / bf16 time {fp8 / bf16:.2f} (0.5 at the same bandwidth)")
        if args.sweep:
            ref = g8.grouped_mm_fp8(x, *packed[0][j], offs)
            ranked = fastest(SWEEP_FP8, lambda cfg: g8.grouped_mm_fp8(x, *packed[0][j], offs, **cfg),
                             lambda cfg: time_us(lambda i: g8.grouped_mm_fp8(x, *packed[i][j], offs, **cfg), L,
                                                 args.calls, args.reps), ref)
            print(f"  sweep fp8 {name}: default {g8.launch_config(*layers[0][j].shape[1:])} {fp8:.1f} us; fastest:")
            for us, cfg, err in ranked[:6]:
                print(f"    {us:8.1f} us  {cfg}  max |diff to the default| {err:.3g}")
    compare_fp8_swiglu(args, packed, xs, offs)


def compare_fp8_swiglu(args, packed, xs, offs):
    """fp8 gate_up then the SwiGLU compiled (the engine's decode step without FUSED_SWIGLU) against
    grouped_swiglu_fp8 (the SwiGLU in the kernel), each --calls calls a CUDA graph; --sweep: the fused
    kernel's settings."""
    L, lim = len(packed), args.limit
    swiglu = torch.compile(lambda h: swiglu_clamped(*h.chunk(2, dim=-1), lim), dynamic=True)
    two_step = time_us(lambda i: swiglu(g8.grouped_mm_fp8(xs, *packed[i][0], offs)), L, args.calls, args.reps)
    fused = time_us(lambda i: g8.grouped_swiglu_fp8(xs, *packed[i][0], offs, lim), L, args.calls, args.reps)
    same = torch.equal(swiglu(g8.grouped_mm_fp8(xs, *packed[0][0], offs)),
                       g8.grouped_swiglu_fp8(xs, *packed[0][0], offs, lim))
    print(f"  gate_up+swiglu fp8: kernel then compiled SwiGLU {two_step:.1f} us, fused {fused:.1f} us "
          f"({two_step / fused:.2f}x; same bits: {same})")
    if args.sweep:
        ref = g8.grouped_swiglu_fp8(xs, *packed[0][0], offs, lim)
        ranked = fastest(SWEEP_FP8, lambda cfg: g8.grouped_swiglu_fp8(xs, *packed[0][0], offs, lim, **cfg),
                         lambda cfg: time_us(lambda i: g8.grouped_swiglu_fp8(xs, *packed[i][0], offs, lim, **cfg), L,
                                             args.calls, args.reps), ref)
        print("  sweep fp8 fused gate_up+swiglu; fastest:")
        for us, cfg, err in ranked[:6]:
            print(f"    {us:8.1f} us  {cfg}  max |diff to the default| {err:.3g}")


def compare_shared(args, layers, packed, batch):
    """--shared (module docstring)."""
    xs, offs, _ = make_rows(args, batch)
    H, F, L, lim = args.hidden, args.inter, len(layers), args.limit
    g = torch.Generator().manual_seed(args.seed + 1)
    x = torch.randn(batch, H, generator=g).to(DEVICE, torch.bfloat16)
    shared = [(torch.randn(2 * F, H, generator=g) * H**-0.5, torch.randn(H, F, generator=g) * F**-0.5)
              for _ in range(L)]
    shared = [tuple(w.to(DEVICE, torch.bfloat16) for w in pair) for pair in shared]
    ext, xe = gt.with_shared_groups(offs, batch), torch.cat([xs, x])
    act, act_e = gt.grouped_swiglu(xs, layers[0][0], offs, lim), gt.grouped_swiglu(xe, layers[0][0], ext, lim,
                                                                                   shared=shared[0][0])

    def alone(i):
        gate, up = torch.nn.functional.linear(x, shared[i][0]).chunk(2, dim=-1)
        return torch.nn.functional.linear(swiglu_clamped(gate, up, lim), shared[i][1])

    kernels = {  # name: (routed rows only, with the shared groups)
        "bf16 gate_up+swiglu": (lambda i: gt.grouped_swiglu(xs, layers[i][0], offs, lim),
                                lambda i: gt.grouped_swiglu(xe, layers[i][0], ext, lim, shared=shared[i][0])),
        "bf16 down": (lambda i: gt.grouped_mm(act, layers[i][1], offs),
                      lambda i: gt.grouped_mm(act_e, layers[i][1], ext, shared=shared[i][1]))}
    if packed is not None:
        shared_fp8 = fp8_layers(shared)
        kernels.update({
            "fp8 gate_up": (lambda i: g8.grouped_mm_fp8(xs, *packed[i][0], offs),
                            lambda i: g8.grouped_mm_fp8(xe, *packed[i][0], ext, shared=shared_fp8[i][0])),
            "fp8 down": (lambda i: g8.grouped_mm_fp8(act, *packed[i][1], offs),
                         lambda i: g8.grouped_mm_fp8(act_e, *packed[i][1], ext, shared=shared_fp8[i][1]))})
    print(f"shared expert, batch {batch}: {gt.SHARED_GROUPS} groups of ~{batch / gt.SHARED_GROUPS:.0f} rows")
    extra = {}
    for name, (routed, folded) in kernels.items():
        us = [time_us(fn, L, args.calls, args.reps) for fn in (routed, folded)]
        extra[name.split()[0]] = extra.get(name.split()[0], 0.0) + us[1] - us[0]
        print(f"  {name:20s} routed {us[0]:7.1f} us, with the shared groups {us[1]:7.1f} us (+{us[1] - us[0]:.1f})")
    own = time_us(alone, L, args.calls, args.reps)
    for fmt, more in extra.items():
        print(f"  {fmt}: folding adds {more:.1f} us a layer where the shared expert on its own (bf16 GEMMs + "
              f"SwiGLU) took {own:.1f} us")


def sweep(args, layers, batch):
    xs, offs, _ = make_rows(args, batch)
    act = gt.grouped_swiglu(xs, layers[0][0], offs, args.limit)
    H, F = args.hidden, args.inter
    kernels = {  # name: (call, torch's output, default config)
        "grouped_swiglu": (lambda i, cfg: gt.grouped_swiglu(xs, layers[i][0], offs, args.limit, **cfg),
                           torch_gate_up(xs, layers[0][0], offs, args.limit), gt.launch_config(F, H, True)),
        "grouped_mm": (lambda i, cfg: gt.grouped_mm(act, layers[i][1], offs, **cfg),
                       torch_down(act, layers[0][1], offs), gt.launch_config(H, F, False)),
    }
    for name, (fn, ref, default_cfg) in kernels.items():
        default = time_us(lambda i: fn(i, {}), len(layers), args.calls, args.reps)
        results = fastest(SWEEP, lambda cfg: fn(0, cfg),
                          lambda cfg: time_us(lambda i: fn(i, cfg), len(layers), args.calls, args.reps), ref)
        print(f"sweep {name}, batch {batch}: default {default_cfg} {default:.1f} us; fastest:")
        for us, cfg, err in results[:8]:
            print(f"  {us:8.1f} us  {cfg}  max |diff to torch| {err:.3g}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[64], help="decode tokens (top-k rows each)")
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--inter", type=int, default=512, help="expert intermediate size F")
    ap.add_argument("--limit", type=float, default=10.0, help="swiglu_limit")
    ap.add_argument("--layers", type=int, default=8, help="weight sets cycled, as a decode step's layers")
    ap.add_argument("--calls", type=int, default=32, help="calls captured per CUDA graph")
    ap.add_argument("--reps", type=int, default=20, help="timed graph replays")
    ap.add_argument("--sweep", action="store_true", help="also sweep the Triton kernels' launch configs")
    ap.add_argument("--fp8", action="store_true", help="the packed fp8 experts' kernel against bf16 instead")
    ap.add_argument("--shared", action="store_true",
                    help="the kernels without and with a shared expert's rows folded in (with --fp8: fp8 too)")
    ap.add_argument("--copy-mib", type=int, default=1024, help="size of the bandwidth probe")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() or gt.triton is None:
        raise SystemExit("needs a CUDA GPU and Triton")

    bw = copy_bandwidth("cuda", args.copy_mib)
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bw / 1e9:.1f} GB/s (read + write); "
          f"E {args.experts}, top-{args.top_k}, H {args.hidden}, F {args.inter}, {args.layers} layers")
    layers = make_layers(args)
    if args.shared:
        packed = fp8_layers(layers) if args.fp8 else None
        for batch in args.batch:
            compare_shared(args, layers, packed, batch)
        return
    if args.fp8:
        packed = fp8_layers(layers)
        for batch in args.batch:
            compare_fp8(args, layers, packed, batch, bw)
        return
    for batch in args.batch:
        compare(args, layers, batch, bw)
    if args.sweep:
        for batch in args.batch:
            sweep(args, layers, batch)


if __name__ == "__main__":
    main()
