"""What a `lockstep` process loads at start (lockstep/triton_support.py, row_blocks.CallMode): on a
CPU-only torch without Triton's interpreter, neither Triton nor torch's compiler stack (~2.5 s of
each start on a 2-core machine, and the multi-process runs start dozens of processes). Nor when it
builds the default model and samples from it uncompiled: the shape marks for torch.compile wait
until something compiles (models/layers/fixed_shapes.py; dynamo, inductor and Triton loaded by the
marks cost 5 s of a 17 s `lockstep train` run on 2 cores)."""

import subprocess
import sys

import torch

from lockstep.models.layers import grouped_gemm_triton
from lockstep.models.layers.row_blocks import CallMode
from processes import cli_env

CHILD = """
import sys
import lockstep.cli, lockstep.commands.train, lockstep.rl.loop, lockstep.train.trainer, lockstep.engine.engine
from lockstep.models.layers import grouped_gemm_triton, sinkhorn_triton
from lockstep.quant import fp8_triton
loaded = [m.triton is not None for m in (grouped_gemm_triton, sinkhorn_triton, fp8_triton)]
print(loaded, "torch._dynamo" in sys.modules, "torch._inductor" in sys.modules)
"""

SAMPLES_THEN_COMPILES = """
import sys
from lockstep.engine import Engine, GenerateRequest
from lockstep.config import EngineConfig, SamplingParams
from lockstep.rl.embedded import ASSET_DIR
engine = Engine.from_pretrained(ASSET_DIR, EngineConfig())
out = engine.generate([GenerateRequest([1, 2, 3], SamplingParams(temperature=0.0, max_new_tokens=3, ignore_eos=True))])
print(len(out[0].response_ids), "torch._dynamo" in sys.modules)
attention = engine.model.model.layers[0].self_attn
from lockstep.models.compiled_layers import CompiledLayers
CompiledLayers(backend="eager")  # marks what was built before dynamo was loaded
print(sorted(attention.inv_freq._dynamo_static_indices))
"""


def test_a_cpu_process_loads_no_triton_and_no_compiler_unless_kernels_can_run():
    gpu_build = torch.version.cuda is not None or torch.version.hip is not None
    done = subprocess.run([sys.executable, "-c", CHILD], env=cli_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    if gpu_build:
        assert done.stdout.split("]")[0].count("True") == 3, done.stdout
    else:
        assert done.stdout.strip() == "[False, False, False] False False", done.stdout
    # this process runs the interpreted kernels (tests/conftest.py sets TRITON_INTERPRET): loaded
    assert grouped_gemm_triton.triton is not None


def test_an_uncompiled_engine_loads_no_compiler_and_a_compilation_marks_its_tensors():
    done = subprocess.run([sys.executable, "-c", SAMPLES_THEN_COMPILES], env=cli_env(), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    tokens, dynamo_loaded, marked = done.stdout.split()
    assert tokens == "3" and marked == "[0]", done.stdout
    gpu_build = torch.version.cuda is not None or torch.version.hip is not None
    assert dynamo_loaded == "False" or gpu_build, done.stdout  # a GPU build loads it with the kernels' ops


def test_a_mode_never_entered_traces_off_without_its_hook():
    """A CallMode builds its compile-time hook (which imports dynamo) at its first entry; a region
    traced before that reads the mode as off, as the hook would, and one traced inside it as on."""
    mode = CallMode("never_entered_yet")

    def signed(x):
        return x + 1 if mode.on() else x - 1

    x = torch.zeros(3)
    assert torch.equal(torch.compile(signed, backend="eager", fullgraph=True)(x), x - 1)
    torch._dynamo.reset()
    with mode():
        assert torch.equal(torch.compile(signed, backend="eager", fullgraph=True)(x), x + 1)
