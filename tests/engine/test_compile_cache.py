"""engine/compile_cache.py: compiled graphs reused across processes through one keyed file, and
`lockstep compile MODEL`. The mechanism runs for real on the CPU (inductor compiles a small function
in one process; a second process with an empty inductor cache loads the artifact and hits); the
engine's own compilation is CUDA-only, so its start here compiles nothing (the test says so)."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lockstep.cli import main
from lockstep.config import EngineConfig
from lockstep.engine import GenerateRequest, compile_cache
from lockstep.engine.compile_cache import StartCache, default_dir
from lockstep.models.deepseek_v4_init import tiny_config

from conftest import DEVICE, make_engine
from processes import cli_env

TINY_MODEL = Path(__file__).resolve().parents[2] / "lockstep" / "assets" / "tiny-dsv4"

# one process: load the directory's artifact (if any), compile and run f, save; report as JSON
CHILD = r"""
import json, sys, torch
from torch._dynamo.utils import counters
from lockstep.config import EngineConfig
from lockstep.engine.compile_cache import StartCache
from lockstep.models.deepseek_v4_init import tiny_config

# inductor probes the CPU's vector ISAs by compiling a test program per ISA in each fresh cache dir
# (~9 s on 2 cores): skipped, scalar C++ serves this test alike
import torch._inductor.cpu_vec_isa as isa
isa.valid_vec_isa_list = lambda: []

cache = StartCache(sys.argv[1], tiny_config(), EngineConfig(max_num_seqs=int(sys.argv[2])))
cache.load()

@torch.compile(backend="inductor")
def f(x):
    return torch.sin(x) * 2 + x.cos()

y = f(torch.linspace(-3, 3, 16))
cache.save()
print(json.dumps(dict(out=y.tolist(), status=cache.status, loaded=cache.loaded, saved=cache.saved_bytes,
                      hit=counters["inductor"]["fxgraph_cache_hit"], miss=counters["inductor"]["fxgraph_cache_miss"],
                      describe=cache.describe())))
"""


def _child(tmp_path: Path, name: str, cache_dir: Path, max_num_seqs: int = 8) -> dict:
    inductor_dir = tmp_path / f"inductor-{name}"  # empty: nothing of another process's compilation
    env = cli_env(TORCHINDUCTOR_CACHE_DIR=str(inductor_dir), TORCHINDUCTOR_COMPILE_THREADS="1",
                  PYTHONPATH=str(TINY_MODEL.parents[2]))
    done = subprocess.run([sys.executable, "-c", CHILD, str(cache_dir), str(max_num_seqs)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="inductor on the CPU needs a C++ compiler")
def test_a_second_process_with_an_empty_inductor_cache_hits_the_saved_artifact(tmp_path):
    cache_dir = tmp_path / "compile-cache"
    first = _child(tmp_path, "a", cache_dir)
    assert first["status"] == "miss" and first["miss"] >= 1 and first["hit"] == 0 and first["saved"] > 0
    files = sorted(p.name for p in cache_dir.iterdir())
    assert len(files) == 2 and files[0].endswith(".bin") and files[1].endswith(".json"), files  # no .tmp left
    assert f"saved {cache_dir}" in first["describe"]

    second = _child(tmp_path, "b", cache_dir)
    assert second["hit"] >= 1 and second["miss"] == 0
    assert second["status"] == "hit" and second["loaded"] >= 1 and second["saved"] == 0  # nothing new: kept
    assert second["describe"] == f"compile cache: loaded {second['loaded']} entries from {cache_dir}"
    assert second["out"] == first["out"]


def _cache(directory, **config) -> StartCache:
    return StartCache(directory, tiny_config(), EngineConfig(**config))


def test_the_key_covers_what_changes_the_graphs_and_nothing_else(tmp_path):
    base = _cache(tmp_path).path
    for changed in (dict(max_num_seqs=32), dict(dtype="bfloat16"), dict(compile_prefill=False),
                    dict(compile_options={"combo_kernels": False}), dict(serving_format="fp8")):
        assert _cache(tmp_path, **changed).path != base, changed
    assert StartCache(tmp_path, tiny_config(hidden_size=64), EngineConfig()).path != base  # the model's config
    for unchanged in (dict(eos_token_ids=(3,)), dict(decode_steps=4), dict(async_scheduling=False), dict(cache_memory_bytes=123456)):
        assert _cache(tmp_path, **unchanged).path == base, unchanged
    fields = compile_cache.key_fields(tiny_config(), EngineConfig())
    assert fields["torch"] == torch.__version__ and fields["device"].startswith("cpu")
    # the settings the decode step compiles with, lockstep's defaults included, not only those configured
    assert fields["engine"]["compile_options"] == {"combo_kernels": True}


def test_an_artifact_of_other_settings_is_not_loaded(tmp_path, monkeypatch):
    other = _cache(tmp_path, max_num_seqs=32)
    other.path.parent.mkdir(parents=True, exist_ok=True)
    other.path.write_bytes(b"artifacts of a max_num_seqs=32 start")
    loads = []
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", lambda data: loads.append(data))
    cache = _cache(tmp_path, max_num_seqs=16)
    cache.load()
    assert loads == [] and cache.loaded == 0 and cache.status == "nothing"
    assert "none of the 1 artifacts there is for these settings" in cache.describe()
    assert not cache.regions.save_on_compile
    cache.save()  # the start's save: from here on a region is written as it compiles
    assert cache.regions.save_on_compile


def test_a_corrupt_file_warns_naming_it_and_is_left_alone(tmp_path):
    path = tmp_path / "cache.bin"
    path.write_bytes(b"not a cache")
    with pytest.warns(RuntimeWarning, match=f"compile cache {path}: unreadable"):
        assert compile_cache.load(path) is None
    assert path.read_bytes() == b"not a cache"
    assert compile_cache.load(tmp_path / "absent.bin") is None


def test_with_a_corrupt_artifact_the_engine_still_starts_and_serves(tmp_path):
    engine = make_engine(seed=5, dtype="bfloat16", compile_cache_dir=str(tmp_path))
    path = engine.compile_cache.path
    path.write_bytes(b"\x00garbage")
    with pytest.warns(RuntimeWarning, match=f"compile cache {path}: unreadable"):
        engine._capture_graphs()  # the start-up compile step (CUDA only in __init__; stand-in graphs here)
    if DEVICE == "cpu":  # the engine serves eagerly: nothing compiles
        assert engine.compile_cache.describe() == \
            "compile cache: nothing to cache (this start compiled nothing with inductor)"
    else:  # the first start (in __init__) precompiled its regions; the second found them all
        assert "precompiled regions" in engine.compile_cache.describe()
        assert engine.compile_cache.regions.compiled == len(list(engine.compile_cache.regions.directory.glob("*.bin")))
    from lockstep.config import SamplingParams

    [sample] = engine.generate([GenerateRequest([1, 2, 3], SamplingParams(temperature=0.0, max_new_tokens=3))])
    assert sample.response_len == 3


def test_default_dir_is_the_models_compile_cache_when_it_exists(tmp_path):
    assert default_dir(tmp_path) is None
    (tmp_path / "compile-cache").mkdir()
    assert default_dir(tmp_path) == str(tmp_path / "compile-cache")
    assert default_dir(tmp_path, "/elsewhere") == "/elsewhere"
    assert default_dir(tmp_path, "") is None  # "" turns it off
    assert default_dir("") is None  # the embedded model of lockstep train


def test_engine_commands_take_the_models_compile_cache_by_default(tmp_path, monkeypatch):
    from lockstep.commands.train import configs_from_args
    from lockstep.cli import build_parser
    from lockstep.engine import Engine

    model = tmp_path / "model"
    shutil.copytree(TINY_MODEL, model)
    (model / "compile-cache").mkdir()
    seen = []

    def stop(path, config):
        seen.append(config.compile_cache_dir)
        raise SystemExit("stop before loading")

    monkeypatch.setattr(Engine, "from_pretrained", staticmethod(stop))
    for argv in (["generate", "--model", str(model)], ["serve", "--model", str(model)],
                 ["generate", "--model", str(model), "--compile-cache-dir", ""]):
        with pytest.raises(SystemExit):
            main(argv)
    assert seen == [str(model / "compile-cache")] * 2 + [None]
    args = build_parser(["train"]).parse_args(["train", "--model", str(model)])
    assert configs_from_args(args)[2].compile_cache_dir == str(model / "compile-cache")


def test_lockstep_compile_on_the_cpu_starts_the_engine_and_has_nothing_to_cache(tmp_path, capsys):
    cache_dir = tmp_path / "cc"
    assert main(["compile", str(TINY_MODEL), "--device", "cpu", "--compile-cache-dir", str(cache_dir),
                 "--max-num-seqs", "4", "--max-model-len", "64"]) == 0
    out = capsys.readouterr().out
    assert "lockstep compile: engine start " in out and " s (" in out
    assert "nothing to cache" in out and not cache_dir.exists()


def test_lockstep_compile_writes_the_artifact_and_says_where(tmp_path, capsys, monkeypatch):
    """The command's report when the start compiled (as on a GPU): the start saved the file."""
    from lockstep.engine import Engine

    real_init = Engine.__init__

    def compiling_init(self, model, config, tokenizer=None):
        real_init(self, model, config, tokenizer)
        self.compile_cache.status, self.compile_cache.saved_bytes = "miss", 2_500_000

    monkeypatch.setattr(Engine, "__init__", compiling_init)
    model = tmp_path / "model"
    shutil.copytree(TINY_MODEL, model)
    assert main(["compile", str(model), "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    path = model / "compile-cache"
    assert f"compile cache: saved {path}/" in out and f"lockstep compile: artifact {path}/" in out
    assert ".bin (2.5 MB); its settings: " in out and out.count(".json") == 1
