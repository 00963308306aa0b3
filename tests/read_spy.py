"""A spy on lockstep's safetensors reads (`safetensors_io.safe_open` handles): every tensor read,
whole (`get_tensor`) or in rows (`get_slice`), recorded as (name, shape). The expert-window tests
use it to prove a rank never reads another rank's experts."""

from __future__ import annotations

import re

import lockstep.quant.safetensors_io as safetensors_io

# the routed experts' tensors in the per-expert layouts (transformers', DeepSeek's) and the stacked one
PER_EXPERT = re.compile(r".*experts\.(\d+)\.w[123]\.(weight|scale)")
STACKED = re.compile(r".*mlp\.experts\.(gate_up_proj|down_proj)")


class _Slice:
    def __init__(self, sl, name: str, reads: list):
        self.sl, self.name, self.reads = sl, name, reads

    def __getitem__(self, index):
        out = self.sl[index]
        self.reads.append((self.name, tuple(out.shape)))
        return out

    def __getattr__(self, attr):  # get_shape / get_dtype: the header, no data
        return getattr(self.sl, attr)


class _Handle:
    def __init__(self, handle, reads: list):
        self.handle, self.reads = handle, reads

    def __enter__(self):
        self.handle.__enter__()
        return self

    def __exit__(self, *exc):
        return self.handle.__exit__(*exc)

    def get_tensor(self, name: str):
        out = self.handle.get_tensor(name)
        self.reads.append((name, tuple(out.shape)))
        return out

    def get_slice(self, name: str):
        return _Slice(self.handle.get_slice(name), name, self.reads)

    def __getattr__(self, attr):
        return getattr(self.handle, attr)


def spy_on_reads(log: list, setattr_=setattr) -> None:
    """From now on append (name, shape) of every tensor read to `log`. `setattr_`: pytest's
    monkeypatch.setattr where the spy must be undone after the test; plain setattr in a process
    that ends with it (a rank of a multi-process test)."""
    opener = safetensors_io.safe_open
    setattr_(safetensors_io, "safe_open", lambda *a, **k: _Handle(opener(*a, **k), log))


def experts_read(log: list) -> set[int]:
    """The routed experts whose per-expert tensors `log` holds reads of."""
    return {int(m[1]) for name, _ in log if (m := PER_EXPERT.fullmatch(name))}
