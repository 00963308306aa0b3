"""The embedded task's train, SFT-selection and eval prompts are disjoint by construction."""

import argparse

import pytest

from lockstep.commands.sft import _pairs
from lockstep.rl.arithmetic import SPLITS, arithmetic_prompts, problem_split
from lockstep.rl.config import RunConfig
from lockstep.rl.embedded import SPLIT_SIZES, embedded_prompts
from lockstep.rl.setup import eval_sets, train_prompts


def questions(prompts):
    return {p.prompt for p in prompts}


def test_train_select_and_eval_sets_share_no_question():
    sets = {split: questions(embedded_prompts(split)) for split in SPLITS}
    assert {k: len(v) for k, v in sets.items()} == SPLIT_SIZES  # distinct within each set
    assert not sets["train"] & sets["eval"]
    assert not sets["train"] & sets["select"]
    assert not sets["select"] & sets["eval"]


def test_sft_selects_on_neither_train_nor_eval_prompts():
    train, select = _pairs(argparse.Namespace(data=""))
    eval_ = questions(embedded_prompts("eval"))
    assert not questions(select) & eval_  # the warm start was not chosen on the RL eval set
    assert not questions(select) & questions(train)
    assert not questions(train) & eval_


def test_build_run_train_source_and_eval_sets_do_not_overlap():
    run = RunConfig()
    prompts, _ = train_prompts(run)
    held_out, _ = eval_sets(run, prompts)
    assert list(held_out) == ["arithmetic"] and len(held_out["arithmetic"].prompts) == SPLIT_SIZES["eval"]
    assert not questions(prompts) & questions(held_out["arithmetic"].prompts)


def test_split_is_a_function_of_the_problem_not_the_seed():
    for seed in (0, 1, 7):
        for p in arithmetic_prompts(50, seed=seed, operators=("+", "-", "*"), split="eval"):
            a, op, b = p.prompt[len("What is "):-1].split(" ")
            assert problem_split(int(a), op, int(b)) == "eval"
    # a op b and b op a share a split where op commutes, so a held-out sum is not trained on reversed
    assert all(problem_split(a, op, b) == problem_split(b, op, a) for a in range(10, 60) for b in range(10, 60)
               for op in "+*")
    shares = [problem_split(a, "+", b) for a in range(10, 100) for b in range(10, 100)]
    for split, share in SPLITS.items():
        assert abs(shares.count(split) / len(shares) - share) < 0.03


def test_too_small_a_split_names_it():
    with pytest.raises(ValueError, match="split 'eval'"):
        arithmetic_prompts(100, digits=1, operators=("+",), split="eval")  # one-digit sums: ~10 in "eval"
    with pytest.raises(ValueError, match="split must be one of"):
        arithmetic_prompts(1, split="test")
