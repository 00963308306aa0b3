"""Timing kernels the way the engine runs them: captured back to back in one CUDA graph.

    from cuda_graph_timing import add_timing_arguments, capture, graph_us, kernel_us, require_kernels, time_calls

Shared by the kernel benchmarks (sinkhorn_kernel.py, hc_projection.py, moe_grouped_gemm.py,
step_attention.py): inside a graph there is no launch cost from Python (which for a custom op can exceed the
kernel's own time), so the figures are what a decode step pays per call.
"""

from __future__ import annotations

import itertools
import sys

import torch


def capture(call, xs) -> tuple[torch.cuda.CUDAGraph, list[torch.Tensor]]:
    """One CUDA graph of len(xs) back-to-back calls, and its outputs (warmed up on a side stream
    first, as torch.cuda.graph requires; the Triton kernel compiles at its first call)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for x in xs:
            call(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = [call(x) for x in xs]
    return graph, outputs


def graph_us(graph: torch.cuda.CUDAGraph, calls: int, reps: int, warmup: int) -> float:
    for _ in range(warmup):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * calls)


def kernel_us(graph: torch.cuda.CUDAGraph, calls: int, reps: int) -> float:
    """Device time per call: all kernels of reps replays (CUPTI lists a graph's kernels one by one)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            graph.replay()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sum(e.device_time for e in kernels) / (reps * calls)


def fastest(grid: dict, output, timed, ref: torch.Tensor) -> list[tuple[float, dict, float]]:
    """A launch-settings sweep: for each combination cfg of `grid` (name -> values) that the GPU can
    run, (timed(cfg) us, cfg, max |output(cfg) - ref|), fastest first; a combination that fails (out
    of resources, say) is printed and skipped."""
    results = []
    for values in itertools.product(*grid.values()):
        cfg = dict(zip(grid, values))
        try:
            err = (output(cfg).float() - ref.float()).abs().max().item()  # compiles it
            results.append((timed(cfg), cfg, err))
        except Exception as e:  # noqa: BLE001 - a setting the GPU cannot run
            print(f"    {cfg}: skipped ({type(e).__name__})")
    return sorted(results, key=lambda r: r[0])


def time_calls(calls: dict, xs, reps: int, warmup: int, profile_reps: int) -> dict[str, tuple[float, float]]:
    """Each of `calls` (name -> call(x)) captured over xs -> name: (graph_us, kernel_us) per call."""
    row = {}
    for name, call in calls.items():
        graph, _outputs = capture(call, xs)
        row[name] = (graph_us(graph, len(xs), reps, warmup), kernel_us(graph, len(xs), profile_reps))
        del graph, _outputs
    return row


def add_timing_arguments(ap, graph_calls: int, graph_calls_help: str, reps_help: str = "graph replays timed",
                         profile_help: str = "graph replays under the profiler (device columns)") -> None:
    """The timing flags the kernel benchmarks share: --graph-calls, --reps, --warmup, --profile-reps."""
    ap.add_argument("--graph-calls", type=int, default=graph_calls, help=graph_calls_help)
    ap.add_argument("--reps", type=int, default=200, help=reps_help)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--profile-reps", type=int, default=10, help=profile_help)


def table_header(key: str, names, ratio: str, extras) -> str:
    """The kernel benchmarks' table header: the row's `key`, per timed call its graph and device
    columns (time_calls' pair), the ratio column, then `extras` (comparisons of the outputs)."""
    cells = [f"{key:>7}"] + [f"{name + ': graph':>16} {'device':>7}" for name in names]
    return " | ".join(cells + [f"{ratio:>16}", " ".join(f"{e:>10}" for e in extras)])


def table_row(key, row: dict[str, tuple[float, float]], names, ratio: tuple[str, str], extras) -> str:
    """One line under table_header: `row` from time_calls, the ratio of ratio[0]'s graph time to
    ratio[1]'s, and `extras` already formatted."""
    cells = [f"{key:>7}"] + [f"{row[n][0]:>16.2f} {row[n][1]:>7.2f}" for n in names]
    return " | ".join(cells + [f"{row[ratio[0]][0] / row[ratio[1]][0]:>15.2f}x", " ".join(f"{e:>10}" for e in extras)])


def require_kernels(script: str, kernels=None) -> None:
    """Exit with the reason unless this machine can time `script`'s kernels: a GPU, and Triton where
    `kernels` (a lockstep kernel module) needs it."""
    if not torch.cuda.is_available():
        sys.exit(f"{script} times CUDA kernels: no GPU here")
    if kernels is not None and kernels.triton is None:
        sys.exit(f"{script}: the kernels do not run here: triton is not installed")
