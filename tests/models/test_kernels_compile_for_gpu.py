"""Every Triton kernel the trainer launches on a GPU compiles to sm_90 PTX (tests/gpu_compile.py,
in a process of its own: Triton's ptxas, no GPU needed). The interpreter, which the other kernel
tests run, accepts Python the GPU compiler refuses."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lockstep.models.layers import stream_mix_triton as sm

SCRIPT = Path(__file__).parent.parent / "gpu_compile.py"


def compile_for_gpu(*args: str) -> str:
    out = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "TRITON_INTERPRET": "0"})
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


@pytest.mark.skipif(sm.triton is None, reason="triton is not installed")
def test_every_trainer_kernel_compiles_for_sm90():
    lines = compile_for_gpu().splitlines()
    failed = [line for line in lines if not line.startswith("ok ")]
    assert not failed, "\n".join(failed)
    # flash 5 (delta, forward, dq, dkv twice), RMSNorm 5 (d x and d w in one kernel, or apart), RoPE 1, MoE combine
    # and dispatch 3, logprobs 3, mHC 8 (the projection's and the collapse's streams gradient each with and without an
    # addend; the bf16x3 split), SwiGLU 2, AdamW 1; decode:
    # attention 3 (window, closed blocks, picked), mHC pre 1, partials 1, compressor entry 2, router 4 (two forms, from partials,
    # hash), dispatch order 2 (the order; rows, offsets and slot rows), combine with the shared rows 2 (and the
    # mHC combine), experts 4 (bf16 with and without SwiGLU, fp8 with and without), output projection a 4 (fp8
    # with a K step across scale columns, bf16 in split K), the sampler's draw 4 (chunks, their masses, rows
    # greedy or sampled); the weight update's byte copy 1 and finiteness check 1
    assert len(lines) == 65


@pytest.mark.skipif(sm.triton is None, reason="triton is not installed")
def test_aligned_table_kernels_load_and_store_16_bytes_at_a_time():
    """The push's fp8 / fp4 kernels, AdamW and the update's byte copy and finiteness check read their
    tensors' addresses from a table; told they are 16-byte aligned (ALIGN 16, tensor_tables.alignment),
    they load and store vectors; without the hint, one element at a time (the fp8 launch took 6.3 ms
    for gpu-848m's 1.4 GB on an H200). The fp8 kernel converts to e4m3 by the GPU's instruction
    (fp8_triton._e4m3_code: 1.33x its arithmetic's speed in one H100 run)."""
    kernels = ("fp8", "fp4", "adamw", "copy", "nonfinite")
    for line in compile_for_gpu("vectors", "1", *kernels).splitlines():
        assert line.split()[1:5] == ["loads", "0", "stores", "0"], line
    for fmt, line in zip(kernels, compile_for_gpu("vectors", "16", *kernels).splitlines()):
        assert line.split()[0] == fmt
        loads, stores, conversions = (int(n) for n in line.split()[2::2])
        assert loads > 0 and (stores > 0) == (fmt != "nonfinite"), fmt  # the check stores flags only
        assert (conversions > 0) == (fmt == "fp8"), (fmt, conversions)
