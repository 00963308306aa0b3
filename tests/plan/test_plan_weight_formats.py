"""Rollout weights per format (issue 17): one copy of the model in bf16, fp8 and native fp8-fp4,
against bytes worked out here from parameter counts; the --rollout-weight-format flag."""

import importlib.util
import json
from pathlib import Path

import pytest

from lockstep.cli import main
from lockstep.plan.cluster import RolloutSpec
from lockstep.plan.hf_config import load_model, spec_from_config
from lockstep.plan.model import DEEPSEEK_V4_FLASH
from lockstep.plan.params import all_groups
from lockstep.plan.rollout import weight_bytes_per_gpu, weight_formats

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "lockstep" / "assets" / "tiny-dsv4"
FP8, FP4 = 1 + 4 / 128**2, 0.5 + 1 / 32  # e4m3 + fp32 scale per 128x128; e2m1 + e8m0 per 32
PLAN = ["plan", "--model", str(TINY), "--nodes", "2", "--gpus-per-node", "1", "--gpu-memory-gb", "80",
        "--seq-len", "256", "--max-tokens-per-gpu", "512"]


def _ratios(model) -> dict[str, float]:
    return {f.format: f.ratio for f in weight_formats(model)}


def _expected(n8: int, n4: int, n16: int, n32: int) -> dict[str, float]:
    """Bytes by hand from the counts released in fp8 / fp4 / bf16 / fp32, as ratios to bf16."""
    rest = 2 * n16 + 4 * n32  # bf16 and fp32 groups are served as they are in every format
    bf16 = 2 * (n8 + n4) + rest
    return {"bf16": 1.0, "fp8": (FP8 * (n8 + n4) + rest) / bf16, "native": (FP8 * n8 + FP4 * n4 + rest) / bf16}


def test_tiny_dsv4_asset_ratios_by_hand():
    m = load_model(str(TINY))
    # H 64, r 32, 4 heads x d 32, o 2 groups x 32, experts 8 x 3 x 64 x 64, one shared, C4 layers 1 and 3
    attention = 64 * 32 + 32 * 4 * 32 + 64 * 32 + 4 * 32 * 32 + 2 * 32 * 64  # q_a, q_b, kv, o_a, o_b
    n8 = 4 * (attention + 3 * 64 * 64) + 2 * 32 * 16 * 16  # + shared expert; indexer wq_b (16 x 16)
    n4 = 4 * 8 * 3 * 64 * 64
    n16 = sum(g.count for g in all_groups(m) if g.serve == "bf16")
    n32 = sum(g.count for g in all_groups(m) if g.serve == "fp32")
    assert (n8, n4) == (131_072, 393_216)
    assert n8 + n4 + n16 + n32 == sum(g.count for g in all_groups(m))
    got, want = _ratios(m), _expected(n8, n4, n16, n32)
    assert got == pytest.approx(want, rel=1e-12)
    assert got["native"] < got["fp8"] < got["bf16"] == 1.0
    assert [f.label for f in weight_formats(m)] == ["bf16", "fp8", "fp8-fp4 (native)"]


def test_deepseek_v4_flash_meets_the_issue_targets():
    r = _ratios(DEEPSEEK_V4_FLASH)
    print(f"DeepSeek-V4-Flash: fp8 {r['fp8']:.3f}, fp8-fp4 {r['native']:.3f} of bf16")
    assert r["fp8"] <= 0.55 and r["native"] <= 0.35  # 0.503, 0.274
    assert weight_formats(DEEPSEEK_V4_FLASH)[0].bytes == pytest.approx(568_735_118_684)


def test_1b_benchmark_config_meets_the_issue_targets():
    """The 1b config of benchmarks/rollout_throughput.py (its engine measured fp8 0.542, fp8-fp4 0.337
    of bf16 with the buffers and scale tables it really stores)."""
    spec = importlib.util.spec_from_file_location("rollout_throughput", ROOT / "benchmarks" / "rollout_throughput.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    r = _ratios(spec_from_config(bench.bench_config("1b").to_hf_dict(), name="1b"))
    print(f"1b config: fp8 {r['fp8']:.3f}, fp8-fp4 {r['native']:.3f} of bf16")
    assert r["fp8"] <= 0.55 and r["native"] <= 0.35  # 0.540, 0.335


def test_llama_is_served_as_released(tiny_llama):
    assert set(_ratios(tiny_llama).values()) == {1.0}


def test_fp8_format_per_gpu_sits_between_native_and_bf16(tiny_v4):
    per_gpu = {f: sum(weight_bytes_per_gpu(tiny_v4, RolloutSpec(gpus_per_engine=4, weight_format=f)).values())
               for f in ("native", "fp8", "bf16")}
    assert per_gpu["native"] < per_gpu["fp8"] < per_gpu["bf16"]
    with pytest.raises(ValueError, match="weight_format must be one of"):
        RolloutSpec(weight_format="fp4")


def test_cli_table_json_and_flag(capsys):
    assert main(PLAN + ["--rollout-weight-format", "fp8", "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert "Rollout weights per format" in out and "fp8-fp4 (native)" in out and "1,348,404" in out
    assert main(PLAN + ["--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    formats = rows[0]["rollout_weight_formats"]
    assert all(r["rollout_weight_formats"] == formats for r in rows)
    assert list(formats) == ["bf16", "fp8", "native"] and formats["bf16"] == {
        "label": "bf16", "bytes": 1_348_404, "ratio": 1.0}
    assert formats["native"]["ratio"] < formats["fp8"]["ratio"] < 1.0


def test_bad_weight_format_names_the_flag(capsys):
    with pytest.raises(SystemExit) as e:
        main(PLAN + ["--rollout-weight-format", "fp4"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--rollout-weight-format" in err and "invalid choice: 'fp4'" in err and "native" in err


def test_heavy_ratio_other_than_128_is_planned_and_c4_must_stay_4():
    """The tiny asset compresses its heavy layers 8:1: planned as C128-kind layers (it was refused)."""
    assert load_model(str(TINY)).compress_ratios == (0, 4, 8, 4)
    cfg = json.loads((TINY / "config.json").read_text())
    cfg["compress_rates"] = {**cfg["compress_rates"], "compressed_sparse_attention": 8}
    with pytest.raises(ValueError, match="compress_rates: compressed_sparse_attention must be 4"):
        spec_from_config(cfg)
