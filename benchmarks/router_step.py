"""Latency of a decode step's top-k router as one Triton kernel against the torch ops it replaces.

    python benchmarks/router_step.py                # GPU: batch 8, 64, 256; 64 experts of 1024, k = 6 (1b config)
    python benchmarks/router_step.py --experts 256 --hidden 4096 --top-k 8

Each top-k MoE layer of a decode step routes its tokens: fp32 logits W x, scores sqrt(softplus),
the top k of score + bias in ascending expert order, and the normalised weights. Three forms are
timed in microseconds per call:
- kernel: router_triton.route_step (`lockstep::route_step`);
- compiled: moe.Router's torch ops (Router.route of Router.logits) under torch.compile (inductor,
  dynamic shapes, as the engine compiles its decoder layers): cuBLAS's fp32 GEMM, inductor's kernels;
- partials: the logits from mHC's split-K projection kernel (hc_projection_triton.hc_mix_partials,
  tf32x3 tensor-core products, its sums-of-squares column unused), summed over the splits and
  routed by Router.route, compiled as above: a candidate form that keeps inductor's scoring and
  top-k and replaces cuBLAS's SIMT sgemm + split-K reduce (~8 us a call on an H200);
- eager: the same uncompiled;
each two ways (cuda_graph_timing.py): graph (--graph-calls back-to-back calls on distinct inputs in
one CUDA graph, replayed --reps times) and device (the calls' kernels' device time, CUPTI).
Printed per batch: those timings (the kernel with each --block-t B in a column "kernel tB" (and
each --warps W: "kernel tB wW"), with
each --split S, the logits first as S split-K partials, in "kernel sS"), the
ratio compiled / kernel (graph), for the kernel and the partials form the rows whose chosen experts
differ from the eager ops' and the largest weight difference among the rows that agree, then the
ratio compiled / partials. --hash: a hash layer's router the same way (router_triton.hash_route_step
against the torch ops). GPU only; --help works anywhere.
"""

from __future__ import annotations

import argparse

import torch

from cuda_graph_timing import add_timing_arguments, require_kernels, table_header, table_row, time_calls


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 64, 256], help="tokens in the step")
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--top-k", type=int, default=6)
    ap.add_argument("--block-t", type=int, nargs="*", default=[],
                    help="also time the kernel with these tokens per program (router_triton.BLOCK_T is the default)")
    ap.add_argument("--block-h", type=int, nargs="*", default=[0],
                    help="with --block-t: hidden columns per step of the logits' loop, each timed with each "
                         "--block-t (0: router_triton.BLOCK_H)")
    ap.add_argument("--warps", type=int, nargs="*", default=[0],
                    help="with --block-t: the routing kernel's warps after the partials, each timed with each "
                         "--block-t (0: router_triton.PARTIALS_WARPS)")
    ap.add_argument("--split", type=int, nargs="*", default=[],
                    help="also time the two-kernel form: the logits as S split-K partial sums, then the routing "
                         "(router_triton.SPLIT is the default form; 0 the one kernel)")
    ap.add_argument("--hash", action="store_true",
                    help="also time a hash layer's router: router_triton.hash_route_step against the torch ops")
    add_timing_arguments(ap, 8, "calls per CUDA graph (decode step: one per top-k layer)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    from lockstep.models.layers import hc_projection_triton, moe, router_triton

    require_kernels("router_step.py", router_triton)
    g = torch.Generator().manual_seed(args.seed)
    router = moe.Router(args.hidden, args.experts, args.top_k, vocab_size=8, is_hash=False,
                        scoring_func="sqrtsoftplus", routed_scaling_factor=1.5)
    with torch.no_grad():
        router.weight.copy_(torch.randn(args.experts, args.hidden, generator=g) * args.hidden ** -0.5)
        router.e_score_correction_bias.copy_(torch.randn(args.experts, generator=g) * 0.1)
    router = router.cuda().requires_grad_(False)
    torch_ops = lambda x: router.route(router.logits(x), None)  # noqa: E731
    compiled = torch.compile(torch_ops, dynamic=True)

    def partial_logits(x):
        return hc_projection_triton.hc_mix_partials(x, router.weight, hc_projection_triton.default_split(args.hidden)
                                                    ).sum(0)[:, :args.experts]

    calls = {
        "kernel": lambda x: router_triton.route_step(x, router.weight, router.e_score_correction_bias,
                                                     args.top_k, "sqrtsoftplus", 1.5),
        "compiled": compiled,
        "partials": torch.compile(lambda x: router.route(partial_logits(x), None), dynamic=True),
        "eager": torch_ops,
    }
    for b in args.block_t:
        for h in args.block_h:
            for w in args.warps:
                calls[f"kernel t{b}" + (f" h{h}" if h else "") + (f" w{w}" if w else "")] = (
                    lambda x, b=b, h=h, w=w: router_triton.route_step(
                        x, router.weight, router.e_score_correction_bias, args.top_k, "sqrtsoftplus", 1.5,
                        block_t=b, block_h=h, warps=w))
    for s in args.split:
        calls[f"kernel s{s}"] = lambda x, s=s: router_triton.route_step(
            x, router.weight, router.e_score_correction_bias, args.top_k, "sqrtsoftplus", 1.5, split=s)
    print(f"{torch.cuda.get_device_name()}: {args.experts} experts of {args.hidden}, top {args.top_k}, bf16 x, "
          f"fp32 weight; {args.graph_calls} calls per graph, {args.reps} reps; microseconds per call")
    print(table_header("batch", calls, "compiled/kernel", ["kernel: rows differ", "max|dw|",
                                                          "partials: rows differ", "max|dw|"]))
    with torch.no_grad():
        for batch in args.batch:
            xs = [torch.randn(batch, args.hidden, generator=g).bfloat16().cuda() for _ in range(args.graph_calls)]
            row = time_calls(calls, xs, args.reps, args.warmup, args.profile_reps)
            ref_experts, ref_weights = torch_ops(xs[0])
            extras = []
            for form in ("kernel", "partials"):
                experts, weights = calls[form](xs[0])
                same = (experts == ref_experts).all(dim=-1)
                dw = (weights[same] - ref_weights[same]).abs().max().item() if same.any() else float("nan")
                extras += [str(int((~same).sum())), f"{dw:.1e}"]
            print(table_row(batch, row, calls, ("compiled", "kernel"), extras))
            print(f"{'':>7}   compiled / partials {row['compiled'][0] / row['partials'][0]:.2f}x")
    if args.hash:
        time_hash_router(args, g)


def time_hash_router(args, g: torch.Generator) -> None:
    """A hash layer's routing (experts from a table row per token id): the kernel against the
    torch ops compiled and eager, with the largest weight difference (the experts must be equal)."""
    from lockstep.models.layers import moe, router_triton

    vocab = 32768
    router = moe.Router(args.hidden, args.experts, args.top_k, vocab_size=vocab, is_hash=True,
                        scoring_func="sqrtsoftplus", routed_scaling_factor=1.5)
    with torch.no_grad():
        router.weight.copy_(torch.randn(args.experts, args.hidden, generator=g) * args.hidden ** -0.5)
        router.tid2eid.copy_(torch.randint(0, args.experts, (vocab, args.top_k), generator=g))
    router = router.cuda().requires_grad_(False)
    torch_ops = lambda xi: router.route(router.logits(xi[0]), xi[1])  # noqa: E731
    calls = {"hash kernel": lambda xi: router_triton.hash_route_step(xi[0], router.weight, router.tid2eid, xi[1],
                                                                      "sqrtsoftplus", 1.5),
             "compiled": torch.compile(torch_ops, dynamic=True), "eager": torch_ops}
    print(f"hash router: {args.experts} experts of {args.hidden}, {args.top_k} a token from a {vocab}-row table")
    print(table_header("batch", calls, "compiled/kernel", ["experts equal", "max|dw|"]))
    with torch.no_grad():
        for batch in args.batch:
            xs = [(torch.randn(batch, args.hidden, generator=g).bfloat16().cuda(),
                   torch.randint(0, vocab, (batch,), generator=g).cuda()) for _ in range(args.graph_calls)]
            row = time_calls(calls, xs, args.reps, args.warmup, args.profile_reps)
            (experts, weights), (ref_experts, ref_weights) = calls["hash kernel"](xs[0]), torch_ops(xs[0])
            extras = [str(bool(torch.equal(experts, ref_experts))), f"{(weights - ref_weights).abs().max().item():.1e}"]
            print(table_row(batch, row, calls, ("compiled", "hash kernel"), extras))


if __name__ == "__main__":
    main()
