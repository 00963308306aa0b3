"""`lockstep plan` end to end: the issue's example with --json, tables, and bad input."""

import json

from lockstep.cli import main

EXAMPLE = ["plan", "--model", "deepseek-v4-flash", "--nodes", "4", "--gpus-per-node", "8", "--gpu-memory-gb", "288",
           "--actor-nodes", "2", "--rollout-nodes", "2", "--seq-len", "4096", "--max-tokens-per-gpu", "8192",
           "--decoder-last-pipeline-num-layers", "10"]


def _json(capsys, argv):
    assert main(argv + ["--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _find(rows, tp, pp, ep, cp):
    return next(r for r in rows if (r["tp"], r["pp"], r["ep"], r["cp"]) == (tp, pp, ep, cp))


def test_example_json(capsys):
    rows = _json(capsys, EXAMPLE + ["--recompute", "--optimizer-offload"])
    keys = {"tp", "pp", "ep", "cp", "feasible", "actor_gb_per_gpu", "rollout_gb_per_gpu", "reason"}
    assert all(keys <= set(r) for r in rows) and len(rows) > 50
    settled = _find(rows, 1, 4, 4, 1)
    assert settled["feasible"] is True and settled["reason"] == ""
    assert settled["stage_layers"] == [11, 11, 11, 10]
    assert 100 < settled["actor_gb_per_gpu"] < 259.2 and settled["rollout_gb_per_gpu"] < 50
    assert any(not r["feasible"] and "GB usable" in r["reason"] for r in rows)


def test_example_without_offload_or_recompute(capsys):
    for extra, term in ((["--recompute"], "optimizer states"), (["--optimizer-offload"], "activations")):
        row = _find(_json(capsys, EXAMPLE + extra + ["--pp", "4", "--tp", "1"]), 1, 4, 4, 1)
        assert row["feasible"] is False and term in row["reason"]


def test_table_and_config_json(capsys, tmp_path):
    assert main(EXAMPLE + ["--recompute", "--optimizer-offload", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "TP2 PP4 EP2 CP1 DP2" in out and "Choose" in out and "host: optimizer states" in out
    cfg = {"hidden_size": 576, "num_hidden_layers": 30, "vocab_size": 49152, "num_attention_heads": 9,
           "num_key_value_heads": 3, "intermediate_size": 1536, "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    rows = _json(capsys, ["plan", "--model", str(tmp_path), "--nodes", "2", "--gpu-memory-gb", "80",
                          "--seq-len", "2048", "--max-tokens-per-gpu", "4096", "--rollout-gpus-per-engine", "1"])
    assert rows[0]["feasible"] and {r["ep"] for r in rows} == {1} and {r["tp"] for r in rows} == {1}


def test_bad_input_is_a_clear_error(capsys):
    assert main(EXAMPLE + ["--tp", "1", "--pp", "4", "--ep", "512", "--cp", "1"]) == 2
    assert "EP 512 is larger than the 256 routed experts" in capsys.readouterr().err
    no_last = [a for a in EXAMPLE if a not in ("--decoder-last-pipeline-num-layers", "10")]
    assert main(no_last + ["--tp", "1", "--pp", "4", "--ep", "4", "--cp", "1"]) == 2
    assert "43 layers are not divisible by PP 4" in capsys.readouterr().err
    assert main(EXAMPLE + ["--actor-nodes", "3"]) == 2
    assert "exceeds nodes" in capsys.readouterr().err
    assert main(["plan", "--model", "nope"]) == 2
    assert "neither a preset" in capsys.readouterr().err


def test_use_kl_loss_counts_the_reference_weights(capsys):
    fixed = EXAMPLE + ["--recompute", "--optimizer-offload", "--tp", "1", "--pp", "4", "--ep", "4", "--cp", "1"]
    plain, kl = _find(_json(capsys, fixed), 1, 4, 4, 1), _find(_json(capsys, fixed + ["--use-kl-loss"]), 1, 4, 4, 1)
    assert kl["actor_gb_per_gpu"] > plain["actor_gb_per_gpu"]
