"""Latency of the engine's draw (each row's token and its logprob) as draw_triton's kernels against
the torch form the sampler runs otherwise (sampler.Sampler.draw: log_softmax over the fp32 logits,
then argmax, or exp, an fp64 cumsum and a search; a gather).

    python benchmarks/draw.py                      # GPU: batch 8, 64, 256 at the 1b config's and
                                                   # DeepSeek-V4's vocabularies, greedy and sampled

Per (vocabulary, form, batch): both captured back to back in one CUDA graph (cuda_graph_timing.py),
graph and device microseconds per call, the ratio torch / kernels (graph), whether the tokens agree
and max |logprob difference|, and the kernels' time against one read of the fp32 logits at this
GPU's copy bandwidth measured in the same run (the physical limit; sampled rows read them twice).
Sampled rows draw at temperature 1 with random uniforms, as an RL rollout's do. GPU only; --help
works anywhere.
"""

from __future__ import annotations

import argparse

import torch

from cuda_graph_timing import add_timing_arguments, require_kernels, table_header, table_row, time_calls
from rollout_throughput import copy_bandwidth


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 64, 256], help="rows drawn in the step")
    ap.add_argument("--vocab", type=int, nargs="+", default=[32768, 129280],
                    help="vocabulary sizes (the 1b config's; DeepSeek-V4's)")
    add_timing_arguments(ap, 8, "calls per CUDA graph")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    from lockstep.engine import draw_triton
    from lockstep.engine.sampler import DrawPlan, Sampler

    require_kernels("draw.py", draw_triton)
    torch.manual_seed(args.seed)

    torch_sampler = Sampler(draw_kernels=False)
    greedy, sampled = DrawPlan(1.0, False, False, True), DrawPlan(1.0, True, False, False)

    def torch_form(xut):  # the sampler's own torch form
        x, u, table = xut
        return torch_sampler.draw(x, table, greedy if u is None else sampled, identity_rows=True)

    calls = {"kernels": lambda xut: draw_triton.draw(xut[0], 1.0, xut[1]), "torch": torch_form}
    gbps = copy_bandwidth("cuda", 1024) / 1e9
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {gbps:.0f} GB/s; {args.graph_calls} calls per graph, "
          f"{args.reps} reps; microseconds per call")
    for V in args.vocab:
        for form in ("greedy", "sampled"):
            print(f"vocabulary {V}, {form}")
            print(table_header("batch", calls, "torch/kernels", ["tokens", "max|dlogp|", "of bound"]))
            for batch in args.batch:
                xs = [_inputs(batch, V, form == "sampled") for _ in range(args.graph_calls)]
                row = time_calls(calls, xs, args.reps, args.warmup, args.profile_reps)
                (t1, lp1), (t2, lp2) = calls["kernels"](xs[0]), torch_form(xs[0])
                same = "same" if torch.equal(t1, t2) else f"{(t1 != t2).sum().item()} differ"
                bound_us = 4 * batch * V / (gbps / 2) / 1e3  # one read of the fp32 logits at half the copy rate
                print(table_row(batch, row, calls, ("torch", "kernels"),
                                [f"{same:>10}", f"{(lp1 - lp2).abs().max().item():10.2e}",
                                 f"{bound_us / row['kernels'][0]:10.2f}"]))


def _inputs(batch: int, V: int, sampled: bool) -> tuple:
    """Logits, the uniforms (None: greedy) and the sampler's table holding them (column 2)."""
    table = torch.zeros(batch, 5, dtype=torch.float64, device="cuda")
    table[:, 2] = torch.rand(batch, device="cuda", dtype=torch.float64) if sampled else -1.0
    return torch.randn(batch, V, device="cuda") * 4, table[:, 2] if sampled else None, table


if __name__ == "__main__":
    main()
