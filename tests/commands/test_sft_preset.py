"""`lockstep sft --preset`: worked-step arithmetic data whose splits stay disjoint, and the preset's
whole path (random init, bf16 autocast, SFT, save) at a CPU size, loaded back by Engine and Trainer."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lockstep.align.compare import compare
from lockstep.cli import main
from lockstep.commands.presets import SFT_PRESETS
from lockstep.commands.sft import run_preset
from lockstep.config import EngineConfig, SamplingParams
from lockstep.engine.engine import Engine
from lockstep.models import load_pretrained
from lockstep.models.deepseek_v4_config import CSA, HCA, SLIDING
from lockstep.models.tokenizer import load_tokenizer
from lockstep.prompt_encoding import encode_prompt
from lockstep.rl.arithmetic import SPLITS, arithmetic_prompts, problem_split, worked_pairs, worked_solution
from lockstep.rl.rewards.arithmetic import reward
from lockstep.train.config import TrainConfig
from lockstep.train.sft import collate, make_examples, sft_loss
from lockstep.train.trainer import Trainer
from processes import cli_env

ROOT = Path(__file__).resolve().parents[2]
PRESET = "gpu-dsv4-0.85b"
# the embedded tiny model's shape (lockstep/rl/embedded.py): every layer kind, CPU-sized
TINY = dict(hidden_size=64, moe_intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, head_dim=32,
            q_lora_rank=32, num_experts_per_tok=2, n_routed_experts=8, o_groups=2, o_lora_rank=32,
            index_n_heads=16, index_head_dim=16, index_topk=2, sliding_window=16, compress_rates={CSA: 4, HCA: 8},
            layer_types=(SLIDING, CSA, HCA, CSA), mlp_layer_types=("hash_moe", "moe", "moe", "moe"))
_PROBLEM = re.compile(r"What is (\d+) ([+-]) (\d+)\?")


def _problem(question: str) -> tuple[int, str, int]:
    a, op, b = _PROBLEM.fullmatch(question).groups()
    return int(a), op, int(b)


def test_worked_splits_are_disjoint_and_follow_the_problem_hash():
    digits = SFT_PRESETS[PRESET].digits
    sets = {s: [q for q, _ in worked_pairs(2000 if s == "train" else 300, digits=digits, split=s)] for s in SPLITS}
    for split, questions in sets.items():
        assert len(set(questions)) == len(questions)
        assert all(problem_split(*_problem(q)) == split for q in questions)
    train = {_problem(q) for q in sets["train"]}
    for held in ("select", "eval"):
        for a, op, b in map(_problem, sets[held]):
            # nor its commuted twin: 58 + 23 held out means 23 + 58 was not trained on
            assert (a, op, b) not in train and (op != "+" or (b, op, a) not in train)
    assert not set(sets["select"]) & set(sets["eval"])


def test_worked_pairs_are_the_prompts_the_reward_scores():
    prompts = arithmetic_prompts(200, digits=4, split="eval")
    pairs = worked_pairs(200, digits=4, split="eval")
    assert [p.prompt for p in prompts] == [q for q, _ in pairs]
    assert all(reward(w, p.label) == 1.0 for p, (_, w) in zip(prompts, pairs))
    assert {"c1", "b1"} <= {line[-2:] for _, w in pairs for line in w.splitlines()}  # carries and borrows occur


@pytest.mark.parametrize("a,op,b", [(9999, "+", 1), (1000, "-", 1), (58, "+", 67), (52, "-", 17), (7, "-", 7)])
def test_every_worked_line_is_true_arithmetic(a, op, b):
    *columns, answer = worked_solution(a, op, b).splitlines()
    digits = []
    for line in columns:
        lhs, rhs = line.split("=")
        value, flag = rhs.split(" ")
        assert sum(map(int, re.findall(r"[+-]?\d+", lhs))) == int(value)
        digits.append(int(value) % 10)
        assert int(flag[1]) == (int(value) >= 10 if op == "+" else "+10" in lhs)
    expected = a + b if op == "+" else a - b
    assert answer == f"Answer: {expected}"
    carried = int(columns[-1][-1]) if op == "+" else 0
    assert int("".join(map(str, reversed(digits)))) + carried * 10 ** len(digits) == expected


def test_preset_needs_its_own_output_and_no_other_model(capsys, tmp_path):
    assert main(["sft", "--preset", PRESET]) == 2
    assert "--output" in capsys.readouterr().err
    assert main(["sft", "--preset", PRESET, "--model", "some/model", "--output", str(tmp_path / "o")]) == 2
    assert "--preset builds its own model" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The preset trained at CPU size once: (its directory, its per-step losses)."""
    out = tmp_path_factory.mktemp("preset")
    torch.manual_seed(0)
    # batches of 8: a step costs half of 16's (bf16 autocast on the CPU), and the loss falls as far
    # (last 3 steps / first 3: 0.81 with either)
    return out, run_preset(PRESET, out, model_overrides=TINY, device="cpu",
                           split_sizes={"train": 256, "select": 16}, steps=20, batch_size=8, lr=3e-3)


def test_preset_path_at_cpu_size_trains_saves_and_loads(trained):
    tmp_path, losses = trained
    assert len(losses) == 20 and sum(losses[-3:]) / 3 < 0.9 * sum(losses[:3]) / 3
    tok = load_tokenizer(tmp_path)
    saved = load_pretrained(tmp_path)  # the trained weights, not the init: its loss is the trained one
    batch = make_examples(tok, worked_pairs(16, digits=4, split="train"))
    assert sft_loss(saved, *collate(batch, tok.pad_token_id)).item() < 0.9 * losses[0]
    engine = Engine(load_pretrained(tmp_path), EngineConfig(dtype="float32", device="cpu", max_model_len=64,
                                                            compile_decode=False))
    trainer = Trainer(load_pretrained(tmp_path), TrainConfig(dtype="float32"))
    prompts = [encode_prompt(tok, p.prompt) for p in arithmetic_prompts(4, digits=4, split="eval")]
    report = compare(engine, trainer, prompts, SamplingParams(temperature=1.0, max_new_tokens=8, seed=5,
                                                              ignore_eos=True))
    assert report.as_dict()["mean_abs_diff"] < 1e-4  # both sides run the saved weights, in float32


@pytest.mark.parametrize("reinit", [False, True])
def test_logprob_gap_measures_the_saved_model(trained, reinit):
    """benchmarks/logprob_gap.py --model DIR (and --reinit, the random-init baseline) prints its agreement row."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "logprob_gap.py"), "--model", str(trained[0]), "--device", "cpu",
           "--dtype", "float32", "--batch", "2", "--new-tokens", "4", "--formats", "bf16", "--batch-invariant", "0",
           "--routing-replay", "0", "--no-compile-decode", *(["--reinit"] if reinit else [])]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=cli_env())
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(line[5:]) for line in done.stdout.splitlines() if line.startswith("JSON ")]
    assert len(rows) == 1 and rows[0]["mean_abs_diff"] < 1e-4  # float32 on both sides
    assert ("(reinit)" in done.stdout) == reinit
