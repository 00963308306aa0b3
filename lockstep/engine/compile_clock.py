"""Where a compiling engine start's seconds go, from torch.compile's own timers.

An engine start on CUDA compiles the decoder layers and captures the decode graphs (decode_path.py).
With the compile cache hit (compile_cache.py) inductor generates no code, yet the 1b config's start
with compiled prefill still took 67 s on an H200; which part is left decides what to cut next:
  tracing   dynamo's symbolic run of the Python code (fake tensors), on every start, hit or miss
  backend   AOT autograd and inductor: lowering, code generation and Triton compilation on a miss,
            looking up and loading their cached output on a hit
  guards    building the guards that decide when a compiled graph applies
and the rest of the start (warm-up runs, CUDA graph capture, loading weights onto the device).
torch._dynamo.utils.compile_times sums each timer over the process; a `CompileClock` takes the
difference over one start.
"""

from __future__ import annotations

# (what the startup line calls it, torch._dynamo's timer); "total" spans the others
PHASES = (("tracing", "bytecode_tracing"), ("backend", "OutputGraph.call_user_compiler"),
          ("guards", "build_guards"))
TOTAL = "_compile.compile_inner"


def compile_seconds() -> dict[str, float]:
    """Seconds this process has spent in each of torch.compile's timers so far, by timer name."""
    from torch._dynamo.utils import compile_times

    names, values = compile_times(repr="csv", aggregate=True)
    return {name: float(value) for name, value in zip(names, values)}


class CompileClock:
    """Started at the beginning of an engine start; `phases()` is the seconds since, per phase."""

    def __init__(self):
        self._before = compile_seconds()

    def phases(self) -> dict[str, float]:
        """{"compiling": total, "tracing": ..., "backend": ..., "guards": ...} since the clock started."""
        now = compile_seconds()

        def since(timer: str) -> float:
            return now.get(timer, 0.0) - self._before.get(timer, 0.0)

        return {"compiling": since(TOTAL), **{name: since(timer) for name, timer in PHASES}}

    def timers(self, top: int | None = None) -> list[tuple[str, float]]:
        """Every torch.compile timer's seconds since the clock started, largest first (the `top` of
        them): inductor's own steps beyond the three phases (code generation, waiting on the Triton
        compile workers, ...), for a start whose backend time needs taking apart."""
        now = compile_seconds()
        spent = ((name, value - self._before.get(name, 0.0)) for name, value in now.items())
        return sorted((item for item in spent if item[1] > 0), key=lambda item: -item[1])[:top]

    def describe(self) -> str:
        """e.g. "compiling 48.2 s (tracing 20.1, backend 26.0, guards 1.0)"; "" when nothing compiled."""
        p = self.phases()
        if p["compiling"] <= 0:
            return ""
        parts = ", ".join(f"{name} {p[name]:.1f}" for name, _ in PHASES)
        return f"compiling {p['compiling']:.1f} s ({parts})"
