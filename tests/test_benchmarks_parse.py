"""Every benchmark compiles (benchmarks/ has no other test that imports most of them: a syntax
error would reach a GPU call first), and the trainer's kernel switches reach the benchmarks that
measure them."""

import os
import py_compile
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from lockstep.models.layers.kernel_switch import TRAINER_ONLY, trainer_kernels
from lockstep.train.config import TrainConfig

BENCH_DIR = Path(__file__).parent.parent / "benchmarks"
BENCHMARKS = sorted(BENCH_DIR.glob("*.py"))


@pytest.mark.parametrize("path", BENCHMARKS, ids=lambda p: p.name)
def test_compiles(path, tmp_path):
    py_compile.compile(str(path), cfile=str(tmp_path / "out.pyc"), doraise=True)


def test_the_kernel_rows_name_train_config_switches():
    sys.path.insert(0, str(BENCH_DIR))
    try:
        import train_throughput
    finally:
        sys.path.pop(0)
    fields = TrainConfig.__dataclass_fields__
    for row in train_throughput.KERNEL_ROWS[1:]:
        assert all(name in fields and fields[name].default is None for name in row.split("+")), row  # on CUDA
    args = train_throughput.parse_args(["--config", "cpu-tiny", "--kernel-rows", "none", "triton_norm"])
    assert args.kernel_rows == ["none", "triton_norm"]
    assert trainer_kernels(["triton_norm"]) == {name: name == "triton_norm" for name in TRAINER_ONLY}
    with pytest.raises(ValueError, match="unknown trainer kernel switches"):
        trainer_kernels(["flash"])


def test_grpo_step_takes_the_same_switches():
    out = subprocess.run([sys.executable, str(BENCH_DIR / "grpo_step.py"), "--help"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for name in TRAINER_ONLY:
        assert name in out.stdout and name in TrainConfig.__dataclass_fields__


def test_the_cuda_graphs_rows_reach_the_train_config():
    """train_throughput --cuda-graphs and grpo_step --train-cuda-graphs set TrainConfig.train_cuda_graphs
    (on the CPU the trainer refuses it by name)."""
    sys.path.insert(0, str(BENCH_DIR))
    try:
        import grpo_step
        import train_throughput
    finally:
        sys.path.pop(0)
    args = train_throughput.parse_args(["--config", "cpu-tiny", "--cuda-graphs"])
    config = train_throughput.model_config("cpu-tiny")
    with pytest.raises(ValueError, match="train_cuda_graphs: CUDA graphs need the model on a CUDA device"):
        train_throughput.lockstep_trainer(config, train_throughput.initial_weights(config, 0), args, None,
                                          cuda_graphs=True)
    assert grpo_step._train_config(grpo_step._configs()["cpu-tiny"], cuda_graphs=True).train_cuda_graphs


def test_the_fused_adamw_row_reaches_the_optimizer():
    """train_throughput --fused-adamw builds its trainer with TrainConfig.triton_adamw=False, which the
    optimiser takes; the other rows take the default (None: the Triton update on CUDA)."""
    sys.path.insert(0, str(BENCH_DIR))
    try:
        import train_throughput
    finally:
        sys.path.pop(0)
    args = train_throughput.parse_args(["--config", "cpu-tiny", "--fused-adamw"])
    assert args.fused_adamw
    config = train_throughput.model_config("cpu-tiny")
    state = train_throughput.initial_weights(config, 0)
    trainer = train_throughput.lockstep_trainer(config, state, args, None, triton_adamw=False)
    assert trainer.config.triton_adamw is False and trainer.optimizer.triton is False
    default = train_throughput.lockstep_trainer(config, state, args, None)
    assert default.config.triton_adamw is None and default.optimizer.triton is None


def test_scaling_plans_each_count_as_told(tmp_path):
    """scaling.py --plan: one ARGS for every count or "N=ARGS;M=ARGS" per count; the plan's JSON and the
    layout `lockstep train --layout` will run (the 4-GPU PP 2 x EP 2 layout of the embedded model)."""
    sys.path.insert(0, str(BENCH_DIR))
    try:
        import scaling
    finally:
        sys.path.pop(0)
    assert scaling.plan_args_for("--pp 4 --ep 2", 8) == ["--pp", "4", "--ep", "2"]
    spec = "2=--pp 2;8=--pp 4 --ep 2 --recompute"
    assert scaling.plan_args_for(spec, 2) == ["--pp", "2"]
    assert scaling.plan_args_for(spec, 8) == ["--pp", "4", "--ep", "2", "--recompute"]
    assert scaling.plan_args_for(spec, 4) is None
    args = SimpleNamespace(plan="--pp 2 --ep 2", device="cpu", max_response_len=8, prompts_per_gpu=2, n=4)
    from lockstep.rl.embedded import ASSET_DIR

    path, entry = scaling.plan_layout(args, 4, ASSET_DIR, tmp_path)
    assert path.is_file() and (entry["pp"], entry["ep"], entry["colocate"]) == (2, 2, True)
    assert "--max-tokens-per-gpu" in entry["train_flags"] and str(scaling.tokens_per_gpu(args)) in entry["train_flags"]
    assert scaling.plan_layout(args, 1, ASSET_DIR, tmp_path) is None  # one process: no layout to plan


def test_rollout_throughput_reports_each_formats_memory_and_both_schedulings(capsys):
    """rollout_throughput.py on the tiny config (CPU): the weight and cache bytes each engine really
    holds per serving format (packed fp8 below bf16, the same cache), and `--scheduling async sync`
    timing both, and `--compile-timers` printing a line per engine start."""
    sys.path.insert(0, str(BENCH_DIR))
    try:
        import rollout_throughput
    finally:
        sys.path.pop(0)
    rollout_throughput.main(["--config", "tiny", "--skip-transformers", "--batch", "2", "--new-tokens", "4",
                             "--prompt-len", "4", "--serving-format", "bf16", "fp8", "--packed-experts",
                             "--scheduling", "async", "sync", "--threads", "1", "--compile-timers", "5"])
    out = capsys.readouterr().out
    assert out.count("compile timers (s, largest first): ") == 2
    rows = {line.split()[0]: line.split() for line in out.split("engine memory per format")[1].splitlines()[1:]}
    weights = {fmt: int(rows[fmt][1].replace(",", "")) for fmt in ("bf16", "fp8")}
    caches = {fmt: int(rows[fmt][3].replace(",", "")) for fmt in ("bf16", "fp8")}
    assert weights["fp8"] < 0.7 * weights["bf16"] and caches["fp8"] == caches["bf16"] > 0
    assert f"weight bytes fp8 {weights['fp8']} " in out and f"cache bytes bf16 {caches['bf16']} " in out
    assert "sync scheduling:" in out and "async scheduling)" in out


def rows_of_train_throughput(monkeypatch, row, flags: list[str]) -> None:
    """train_throughput.main on cpu-tiny with `flags`, each lockstep row's run replaced by
    row(backend, cuda_graphs) (and a stand-in result), the GEMM peak not measured."""
    sys.path.insert(0, str(BENCH_DIR))
    try:
        import train_throughput
    finally:
        sys.path.pop(0)

    def run(config, state, samples, args, backend, kernels=None, cuda_graphs=False, triton_adamw=None):
        row(backend, cuda_graphs)
        return {"seconds": 1.0, "peak_bytes": 0, "grad_norm": 0.5}

    monkeypatch.setattr(train_throughput, "run_lockstep", run)
    monkeypatch.setattr(train_throughput, "gemm_tflops", lambda *a: 1.0)
    train_throughput.main(["--config", "cpu-tiny", "--skip-transformers", *flags])


def test_the_graphed_rows_follow_each_compile_backend(monkeypatch, capsys):
    """train_throughput --cuda-graphs times one graphed row per --compile-backend (with the compiled
    layers recorded in the graphs), after the launched rows."""
    calls = []
    rows_of_train_throughput(monkeypatch, lambda backend, cuda_graphs: calls.append((backend, cuda_graphs)),
                             ["--compile-backend", "none", "eager", "--cuda-graphs"])
    assert calls == [(None, False), ("eager", False), (None, True), ("eager", True)]
    out = capsys.readouterr().out
    assert "lockstep train_step (cuda graphs):" in out and "lockstep train_step (cuda graphs + compile eager):" in out
    assert '"cuda_graphs+eager"' in out


def test_fp8_linear_times_the_shapes_the_engine_packs():
    """benchmarks/fp8_linear.py's shapes are the linears engine/packed_weights.py packs for the fp8
    format (the same storage rule), with their counts."""
    from collections import Counter

    from lockstep.engine.packed_weights import install_packed_weights
    from lockstep.models.deepseek_v4 import DeepseekV4ForCausalLM
    from lockstep.models.deepseek_v4_init import tiny_config
    from lockstep.models.layers.fp8_linear import Fp8Linear

    sys.path.insert(0, str(BENCH_DIR))
    try:
        import fp8_linear
    finally:
        sys.path.pop(0)
    model = DeepseekV4ForCausalLM(tiny_config())
    install_packed_weights(model, "fp8", packed_fp8=True)
    packed = Counter((*m.weight.shape, m.n_groups) for m in model.modules() if isinstance(m, Fp8Linear))
    assert packed and fp8_linear.fp8_shapes(tiny_config()) == packed


def test_the_index_kernel_row_sets_the_switch_for_that_row_only(monkeypatch, capsys):
    """train_throughput --index-kernel: one more row with KernelSwitches.triton_index on (its
    environment variable, for that row), the rows around it without."""
    from lockstep.models.layers.kernel_switch import KernelSwitches

    seen = []
    monkeypatch.delenv("LOCKSTEP_TRITON_INDEX", raising=False)
    rows_of_train_throughput(monkeypatch, lambda *_: seen.append(bool(KernelSwitches().on("triton_index"))),
                             ["--index-kernel", "--fused-adamw"])
    assert seen == [False, True, False] and "LOCKSTEP_TRITON_INDEX" not in os.environ
    assert "lockstep train_step (index kernel):" in capsys.readouterr().out


def test_the_step_trace_groups_kernels_by_family():
    sys.path.insert(0, str(BENCH_DIR))
    try:
        from kernel_profile import family_table
    finally:
        sys.path.pop(0)
    lines = family_table([("triton_poi_fused_2", 1.5), ("_grouped_kernel", 40.0), ("triton_per_fused_1", 2.0),
                          ("nvjet_sm90_tst_64x8_64x16_2x4_h_bz_TNT", 4.5), ("_grouped_kernel", 19.0),
                          ("void at::native::reduce_kernel<512, 1>", 10.0)])
    assert lines == ["by family (us, kernels):", "      59.0     2  _grouped_kernel",
                     "      10.0     1  torch native / copies", "       4.5     1  cuBLAS / CUTLASS",
                     "       3.5     2  inductor (triton_*)"]


def test_the_train_profile_names_where_the_device_waited():
    sys.path.insert(0, str(BENCH_DIR))
    try:
        import torch
        from train_throughput import idle_gaps
    finally:
        sys.path.pop(0)

    def kernel(name, start, end):  # us, as torch.profiler's events carry them
        return SimpleNamespace(name=name, device_type=torch.autograd.DeviceType.CUDA,
                               time_range=SimpleNamespace(start=start, end=end))

    host = SimpleNamespace(name="aten::item", device_type=torch.autograd.DeviceType.CPU,
                           time_range=SimpleNamespace(start=0, end=5000))
    prof = SimpleNamespace(events=lambda: [kernel("b", 1100, 1500), host, kernel("a", 1000, 1100),
                                           kernel("c", 4500, 5000)])
    lines = idle_gaps(prof, top=2).splitlines()
    assert lines[0].startswith("device timeline: span 4.0 ms, idle between kernels 3.0 ms")
    assert lines[1].split() == ["0.50", "3000.0", "b", "->", "c"] and lines[2].split()[:2] == ["0.10", "0.0"]


def test_requantize_prints_its_ratio_and_the_reference_check():
    """benchmarks/requantize.py on the CPU (the PyTorch rule; on a GPU the push's Triton kernels):
    a ratio to the copy bound per format, and the bitwise check against the CPU reference."""
    out = subprocess.run([sys.executable, str(BENCH_DIR / "requantize.py"), "--config", "cpu-tiny", "--device", "cpu",
                          "--calls", "2", "--check", "3"], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=BENCH_DIR)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    for fmt in ("fp8", "fp4"):
        ratio = next(line for line in lines if line.startswith(f"ratio {fmt} copy bound / call: "))
        assert 0 < float(ratio.rsplit(" ", 1)[1]) < 1  # the PyTorch rule on 2 cores is far from a copy
        assert f"{fmt} bitwise the CPU reference on 3 of " in out.stdout and out.stdout.count(": True") == 2


def test_weight_update_parts_runs_on_the_cpu():
    """The in-process update's parts, each against the copy bound (a GPU call's first use would
    otherwise find its errors)."""
    out = subprocess.run([sys.executable, str(BENCH_DIR / "weight_update_parts.py"), "--config", "cpu-tiny",
                          "--repeats", "2"], capture_output=True, text=True, timeout=300, cwd=BENCH_DIR,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if "of the bound" in line]
    assert len(rows) >= 8 and any(row.startswith("Engine.update_weights with the walk") for row in rows), out.stdout
