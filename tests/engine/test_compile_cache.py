"""engine/compile_cache.py: compiled graphs carried between machines as one file."""

import shutil

import pytest
import torch

from lockstep.engine import compile_cache


def test_a_missing_file_is_an_empty_cache(tmp_path):
    assert compile_cache.load(tmp_path / "none.bin") is False


def test_a_damaged_file_is_reported_by_name_and_ignored(tmp_path):
    path = tmp_path / "cache.bin"
    path.write_bytes(b"not a cache")
    with pytest.warns(RuntimeWarning, match=f"compile cache {path}: unreadable"):
        assert compile_cache.load(path) is False
    assert path.read_bytes() == b"not a cache"  # left as it was


@pytest.mark.skipif(shutil.which("g++") is None, reason="inductor on the CPU needs a C++ compiler")
def test_graphs_compiled_here_round_trip(tmp_path):
    path = tmp_path / "sub" / "cache.bin"

    @torch.compile(backend="inductor")
    def f(x):
        return torch.sin(x) * 2 + 1

    x = torch.randn(8)
    torch.testing.assert_close(f(x), torch.sin(x) * 2 + 1)
    written = compile_cache.save(path)
    assert written == path.stat().st_size > 0 and not path.with_name("cache.bin.tmp").exists()
    assert compile_cache.load(path) is True
