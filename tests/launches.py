"""Counting a Triton kernel's launches in a test, the kernel still running each time."""


def count_launches(monkeypatch, module, kernel: str) -> list:
    """The launches of `module.kernel` from now on (their grids), each still run."""
    launches, real = [], getattr(module, kernel)
    monkeypatch.setattr(module, kernel, type("Counted", (), {
        "__getitem__": lambda self, grid: launches.append(grid) or real[grid]})())
    return launches


def launch_arguments(monkeypatch, module, kernel: str) -> list:
    """The launches of `module.kernel` from now on, as (positional arguments, keyword arguments),
    each still run."""
    launches, real = [], getattr(module, kernel)

    def launcher(grid):
        def launch(*args, **kwargs):
            launches.append((args, kwargs))
            return real[grid](*args, **kwargs)
        return launch

    monkeypatch.setattr(module, kernel, type("Recorded", (), {"__getitem__": lambda self, grid: launcher(grid)})())
    return launches
