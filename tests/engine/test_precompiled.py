"""models/precompiled.py: the engine's compiled layers precompiled, saved, and loaded by another
process that traces nothing. For real on the CPU with the aot_eager backend (inductor's C++ build
would take minutes): a first process compiles the tiny model's decode regions and saves them; a
second, with empty compiler caches, loads them, compiles no graph, and decodes the same tokens
with the same log-probabilities. With LOCKSTEP_TEST_DEVICE=cuda the same runs inductor and CUDA
graphs, and the second process also decodes with layers compiled the ordinary way (no precompile):
the same tokens and log-probabilities again."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lockstep.models.layers import fixed_shapes
from lockstep.models.precompiled import PrecompiledRegions, precompilable

from conftest import DEVICE, make_engine, tiny_dsv4
from processes import cli_env

ROOT = Path(__file__).resolve().parents[2]
# a serializable backend: torch 2.11's aot_eager (the GPU image's) is not, 2.13's is
BACKEND = "inductor" if DEVICE == "cuda" else "aot_eager"

# one process: load DIR's regions, start the decode graphs' stand-in precompiling into them, decode, save
CHILD = r"""
import json, sys, torch
from conftest import DEVICE, FEW_SINKHORN, greedy, make_engine, prompts, requests, tiny_dsv4
from lockstep.engine.decode_path import start_graphs
from lockstep.engine.engine import compiled_graph_count
from lockstep.models.precompiled import PrecompiledRegions

torch.set_num_threads(1)
cuda = DEVICE == "cuda"
backend = "inductor" if cuda else "aot_eager"  # serializable backends (BACKEND above)


def decode(regions):
    # cuda_graph off: the engine's own start would compile its layers first, without precompile;
    # the graphs are captured below all the same. compile_hc off: on CUDA the eager prefill would
    # compile mHC's coefficients outside the regions, a graph of its own that the count below
    # would take for a region traced again
    engine = make_engine(model=tiny_dsv4(**FEW_SINKHORN), max_num_seqs=2, compile_prefill=False, dtype="bfloat16",
                         cuda_graph=False, compile_hc=False)
    start_graphs(engine.adapter, engine.config, capture=cuda, compile_backend=backend, regions=regions)
    outs = engine.generate(requests(prompts(2), greedy(4)))
    return [o.response_ids.tolist() for o in outs], [o.rollout_logprobs.tolist() for o in outs]


regions = PrecompiledRegions(sys.argv[1])
regions.load()
tokens, logprobs = decode(regions)
result = dict(loaded=regions.loaded, compiled=regions.compiled, graphs=compiled_graph_count(),
              saved=regions.save(), failures=regions.failures, tokens=tokens, logprobs=logprobs)
if cuda and regions.loaded:  # the same engine, its layers compiled without precompile
    result["ordinary"] = decode(None)
print(json.dumps(result))
"""


def _child(tmp_path: Path, name: str, regions: Path) -> dict:
    # cli_env: no Triton interpreter (the child's CPU engine runs no kernel; loading them cost seconds)
    env = cli_env(TORCHINDUCTOR_CACHE_DIR=str(tmp_path / f"inductor-{name}"),
                  PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests" / "engine")]))
    done = subprocess.run([sys.executable, "-c", CHILD, str(regions)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_second_process_loads_the_regions_and_traces_nothing(tmp_path):
    regions = tmp_path / "regions"
    first = _child(tmp_path, "first", regions)
    assert first["failures"] == {} and first["loaded"] == 0
    # the tiny model's three layer kinds and the final norm, at one decode shape
    assert first["compiled"] == first["saved"] == len(list(regions.glob("*.bin"))) == 4
    second = _child(tmp_path, "second", regions)
    assert second["loaded"] == 4 and second["compiled"] == 0 and second["saved"] == 0
    assert second["graphs"] == 0, "the second process traced a graph"
    assert second["tokens"] == first["tokens"] and second["logprobs"] == first["logprobs"]
    if "ordinary" in second:  # CUDA: inductor's code, precompiled or not, computes alike
        assert second["ordinary"] == [second["tokens"], second["logprobs"]]


def _attend_of(cache):
    return lambda h: h + cache


def test_the_key_tells_apart_what_dropped_identity_guards_would_and_nothing_else():
    model = tiny_dsv4()
    regions = PrecompiledRegions()
    layers = model.model.layers
    kinds = [layer.self_attn.layer_type for layer in layers]
    x, cache = torch.zeros(2, 3), torch.zeros(3)

    def key(layer, attend=_attend_of(cache), forced=None, name="layer"):
        return regions.key(name, (layer, x, forced, attend))

    same_kind = [i for i, k in enumerate(kinds) if k == kinds[1]]
    assert len(same_kind) >= 2
    assert key(layers[same_kind[0]]) == key(layers[same_kind[1]])  # layer_idx is not part of it
    assert len({key(layers[i]) for i in range(len(layers))}) == len(set(kinds))
    assert key(layers[1]) != key(layers[1], attend=lambda h: h - cache)  # other code
    assert key(layers[1]) != key(layers[1], forced=torch.zeros(2, dtype=torch.long))  # None or a tensor
    assert key(layers[1]) != key(layers[1], name="final")
    with_grad = key(layers[1])
    with torch.no_grad():
        assert key(layers[1]) != with_grad


def test_a_damaged_file_warns_naming_it_and_is_left_out(tmp_path):
    (tmp_path / "abc-1.bin").write_bytes(b"not a compiled function")
    regions = PrecompiledRegions(tmp_path)
    with pytest.warns(RuntimeWarning, match="abc-1.bin"):
        assert regions.load() == 0


def test_a_backend_that_cannot_precompile_warns_and_still_computes():
    compiled = precompilable(lambda x: torch.sin(x) * 2, backend=lambda gm, inputs: gm.forward)  # not serializable
    regions = PrecompiledRegions()
    x = torch.linspace(-1, 1, 8)
    with pytest.warns(RuntimeWarning, match="precompiling the toy region failed"):
        out = regions.call(compiled, "toy", (x,))
    assert torch.equal(out, torch.sin(x) * 2) and list(regions.failures.values())[0].startswith("toy: ")
    assert torch.equal(regions.call(compiled, "toy", (x * 2,)), torch.sin(x * 2) * 2)  # no second warning


def test_a_function_whose_guards_fail_is_not_run_another_is_compiled():
    compiled = precompilable(lambda x: x * 3, dynamic=True, backend=BACKEND)
    regions = PrecompiledRegions()
    a = torch.arange(4.0, device=DEVICE)
    assert torch.equal(regions.call(compiled, "toy", (a,)), a * 3)
    b = torch.arange(4, dtype=torch.float64, device=DEVICE)  # same key (a tensor of rank 1), a dtype guard apart
    assert torch.equal(regions.call(compiled, "toy", (b,)), b * 3) and regions.compiled == 2


def test_after_the_start_a_region_is_saved_as_it_compiles(tmp_path):
    compiled = precompilable(lambda x: x * 3, dynamic=True, backend=BACKEND)
    regions = PrecompiledRegions(tmp_path)
    regions.call(compiled, "toy", (torch.arange(4.0, device=DEVICE),))
    assert not list(tmp_path.glob("*.bin"))  # during the start: saved with the start's other artifacts
    assert regions.save() == 1 and len(list(tmp_path.glob("*.bin"))) == 1
    regions.save_on_compile = True  # as StartCache.save leaves it
    b = torch.arange(4, dtype=torch.float64, device=DEVICE)  # a dtype guard apart: one more function
    assert torch.equal(regions.call(compiled, "toy", (b,)), b * 3)
    assert len(list(tmp_path.glob("*.bin"))) == 2  # written at once, not at the next start's save
    assert PrecompiledRegions(tmp_path).load() == 2


def test_marks_are_off_outside_a_compilation_and_on_inside():
    t = fixed_shapes.fixed_shape(torch.zeros(2, 3))
    assert getattr(t, "_dynamo_static_indices", None) == {0, 1}
    fixed_shapes.unmark([t])
    assert not hasattr(t, "_dynamo_static_indices") and not hasattr(t, "_has_dynamo_dim_marking")
    u = fixed_shapes.fixed_shape(torch.zeros(4, 5), range(1, 2), mark=False)
    assert not hasattr(u, "_dynamo_static_indices")
    with fixed_shapes.marked([t, u, torch.zeros(1)]):
        assert t._dynamo_static_indices == {0, 1} and u._dynamo_static_indices == {1}
    assert not hasattr(t, "_dynamo_static_indices") and not hasattr(u, "_dynamo_static_indices")


def test_the_tensors_a_region_sees_are_found_through_closures_objects_and_modules():
    from lockstep.models.precompiled import REACH, _tensors

    engine = make_engine(max_num_seqs=2)
    layer = engine.model.model.layers[1]
    assert layer.self_attn.compressor is not None
    layer_cache = engine.adapter.cache.cache.layers[1]

    def attend_for(layer, layer_cache):
        return lambda h: (layer, layer_cache, h)

    attend = attend_for(layer, layer_cache)
    found = {id(t) for t in _tensors((layer, torch.zeros(1), attend), REACH)}
    assert {id(t) for t in layer_cache.tensors()} <= found  # the compressors' state, two objects down
    assert id(layer.self_attn._inv_freq) in found
    assert id(layer.self_attn.q_a_proj.weight) not in found  # parameters are never marked
