"""Where a rollout's GPU time goes: the kernels of one `Engine.generate`, ranked by device time.

    from kernel_profile import profile_generate      # used by grpo_step.py --profile
    print(profile_generate(engine, requests))

profile_call / host_profile: the kernels and the host functions of any one call (weight_push.py
--profile).

CUPTI reports the kernels a replayed CUDA graph runs one by one, so the table covers decode
steps (graph replays) and prefill (eager launches) alike. Printed: total device time, kernel
count, wall time, and the top kernels with their share of device time.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import time

import torch
from torch.profiler import ProfilerActivity, profile


def profile_generate(engine, requests, top: int = 40) -> str:
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        samples = engine.generate(requests)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name, []).append(e.device_time)
    device_us = sum(sum(v) for v in by_name.values())
    steps = max(s.response_len for s in samples)
    lines = [f"generate: wall {wall * 1e3:.1f} ms, {steps} steps; device time {device_us / 1e3:.1f} ms in "
             f"{len(kernels)} kernels ({len(kernels) / steps:.0f} per step, mean {device_us / max(len(kernels), 1):.1f} us)"]
    for name, times in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]:
        lines.append(f"  {sum(times) / device_us:6.1%} {sum(times) / 1e3:8.2f} ms  {len(times):6d}x  {name[:110]}")
    return "\n".join(lines)


def host_profile(fn, top: int = 25) -> str:
    """Where the host's time goes while fn() runs (cProfile): the `top` functions by their own
    time, then by cumulative time. The GPU work fn queues is not in it; a step whose wall time
    exceeds its device time is waiting on these."""
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.runcall(fn)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    body = "\n".join(line for line in out.getvalue().splitlines() if line.strip())
    return f"host profile: wall {wall * 1e3:.1f} ms (cProfile's own overhead included)\n{body}"


def profile_call(fn, label: str, top: int = 12) -> str:
    """The kernels one fn() runs on this process's GPU: wall time, device time and count, by family
    and the `top` kernels by device time; a call whose wall time far exceeds its device time waits
    on the host (host_profile says where) or on another process."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    kernels = [(e.name, e.device_time) for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    device_us = sum(us for _, us in kernels)
    by_name: dict[str, list[float]] = {}
    for name, us in kernels:
        by_name.setdefault(name, []).append(us)
    lines = [f"{label}: wall {wall * 1e3:.2f} ms, device {device_us / 1e3:.2f} ms in {len(kernels)} kernels"]
    lines += family_table(kernels)
    lines += [f"  {sum(t):8.1f} {len(t):5d}  {name[:110]}" for name, t in
              sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]]
    return "\n".join(lines)


def decode_step_trace(engine, requests) -> str:
    """The kernels of a generate's last decode step in launch order (device us, idle us before it,
    name), one per line: which op each of the step's several hundred kernels comes from, and where
    the device waited between them. Run it with max_new_tokens=2 (prefill, then one decode step);
    the step is the kernels after the last gap of > 50 us."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.generate(requests)
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    start = 0
    for i in range(1, len(kernels)):
        if kernels[i].time_range.start - kernels[i - 1].time_range.end > 50:
            start = i
    step = kernels[start:]
    total = step[-1].time_range.end - step[0].time_range.start
    idle = [0.0] + [max(b.time_range.start - a.time_range.end, 0.0) for a, b in zip(step, step[1:])]
    lines = [f"last step: {len(step)} kernels, {sum(e.device_time for e in step):.0f} us device, {total:.0f} us span, "
             f"{sum(idle):.0f} us idle between kernels"]
    lines += family_table([(e.name, e.device_time) for e in step])
    lines += [f"{e.device_time:7.1f} {gap:6.1f}  {e.name[:150]}" for e, gap in zip(step, idle)]
    return "\n".join(lines)


def kernel_family(name: str) -> str:
    """Which family a kernel belongs to in a step's table: inductor's generated kernels, cuBLAS's
    GEMMs, torch's native kernels, or (lockstep's Triton kernels and anything else) its own name."""
    if name.startswith("triton_"):
        return "inductor (triton_*)"
    if any(tag in name for tag in ("nvjet", "cutlass", "cublas", "gemm")):
        return "cuBLAS / CUTLASS"
    if name.startswith(("void at::native", "void (anonymous namespace)", "Memcpy", "Memset")):
        return "torch native / copies"
    return name[:60]


def family_table(kernels: list[tuple[str, float]]) -> list[str]:
    """Lines "  total_us  count  family", largest first, for (name, device us) pairs."""
    totals: dict[str, list[float]] = {}
    for name, us in kernels:
        totals.setdefault(kernel_family(name), []).append(us)
    ranked = sorted(totals.items(), key=lambda kv: -sum(kv[1]))
    return ["by family (us, kernels):"] + [f"  {sum(t):8.1f} {len(t):5d}  {family}" for family, t in ranked]
