"""engine/compile_clock.py: a start's compile seconds by phase, from torch.compile's own timers."""

import torch

from lockstep.engine.compile_clock import PHASES, CompileClock


def test_the_clock_counts_a_compilation_since_it_started_and_nothing_else():
    @torch.compile(backend="aot_eager", dynamic=False)
    def before(x):
        return x.cos() * 3

    before(torch.ones(4))  # compiled before the clock: not its seconds
    clock = CompileClock()
    assert clock.phases()["compiling"] == 0 and clock.describe() == ""

    @torch.compile(backend="aot_eager", dynamic=False)
    def f(x):
        return torch.sin(x) * 2 + x.exp().sum()

    f(torch.ones(8))
    p = clock.phases()
    assert set(p) == {"compiling"} | {name for name, _ in PHASES}
    # the tracing, the backend (AOT autograd here) and the guards all took time, within the total
    assert p["tracing"] > 0 and p["backend"] > 0 and p["guards"] > 0
    assert p["tracing"] + p["backend"] + p["guards"] <= p["compiling"] * 1.001
    timers = clock.timers()
    assert timers == sorted(timers, key=lambda t: -t[1]) and all(s > 0 for _, s in timers)
    named = dict(timers)
    assert named["_compile.compile_inner"] == p["compiling"] and named["bytecode_tracing"] == p["tracing"]
    assert clock.timers(2) == timers[:2]
    text = clock.describe()
    assert text.startswith("compiling ") and " s (tracing " in text and ", backend " in text and ", guards " in text

    again = CompileClock()
    f(torch.ones(8))  # the compiled graph applies: nothing compiles
    before(torch.ones(4))
    assert again.phases()["compiling"] == 0 and again.timers() == []
