"""A CPU process without Triton (a CPU-only torch, TRITON_INTERPRET unset: lockstep/triton_support.py
loads none) serving packed fp8 weights and fp4 experts takes weight updates. The suite's own process
runs Triton's interpreter (tests/conftest.py), where every kernel is defined; without Triton none is,
and a weight update of packed storage asked fp8_triton / fp4_triton for a kept launch of a kernel that
did not exist (NameError at the first update, until 2026-12-06). Here a child process without Triton
and this process (interpreter loaded) push the same two versions: the same served bytes, the same samples."""

import subprocess
import sys

import pytest
import torch

from processes import cli_env

PUSH_AND_SAMPLE = """
import hashlib
import torch
from lockstep.config import EngineConfig, SamplingParams
from lockstep.engine import Engine, GenerateRequest
from lockstep.rl.embedded import ASSET_DIR

def push_and_sample():
    trainer = Engine.from_pretrained(ASSET_DIR, EngineConfig()).model  # the trainer's names and values
    engine = Engine.from_pretrained(ASSET_DIR, EngineConfig(serving_format="fp8-fp4", packed_fp8=True,
                                                            packed_experts=True))
    for version, scale in ((1, 1.01), (2, 0.98)):  # a second push of the same layout: the kept plan's path
        weights = {k: (v.float() * scale).to(torch.bfloat16) if v.is_floating_point() and v.dim() >= 2 else v
                   for k, v in trainer.state_dict().items()}
        engine.update_weights(weights.items(), version=version)
    digest = hashlib.sha256()  # every served byte: the packed storage, its scales, the copied tensors
    for name, t in sorted(engine.model.state_dict().items()):
        digest.update(name.encode() + t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    params = [SamplingParams(temperature=1.0, seed=seed, max_new_tokens=8, ignore_eos=True) for seed in range(4)]
    out = engine.generate([GenerateRequest([1, 2, 3, 4], p) for p in params])
    return digest.hexdigest(), [o.response_ids.tolist() for o in out]
"""


@pytest.mark.skipif(torch.version.cuda is not None or torch.version.hip is not None,
                    reason="a GPU build of torch loads Triton in every process (triton_support.load_triton)")
def test_a_process_without_triton_pushes_into_packed_weights_as_one_with_it():
    child = PUSH_AND_SAMPLE + """
from lockstep.quant import fp4_triton, fp8_triton
assert fp8_triton.triton is None and fp4_triton.triton is None, "the child was to run without Triton"
print(push_and_sample())
"""
    done = subprocess.run([sys.executable, "-c", child], env=cli_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    here: dict = {}
    exec(PUSH_AND_SAMPLE, here)
    assert done.stdout.strip() == str(here["push_and_sample"]()), done.stdout
