"""Every flag of every subcommand is described in --help (the config fields by their own
documentation, the string below each field), with its default, its allowed values, and, for
`lockstep train`, which preset a default belongs to (issue 14 item 18, issue 15 item 10)."""

import argparse
import re

import pytest

from lockstep.cli import SUBCOMMANDS, build_parser
from lockstep.commands.presets import PROMPT_ROOM
from lockstep.commands.train import configs_from_args

HOW_TO = ('document it with a string on the line below the field, e.g.\n    lr: float = 1e-6\n'
          '    """AdamW learning rate, constant over the run."""\n(lockstep/cli_args.py), or give add_argument a help=')


def subparsers(parser, prefix=()):
    """(command path, parser) of every subcommand, nested ones included (`convert gguf`)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield prefix + (name,), sub
                yield from subparsers(sub, prefix + (name,))


def all_options():
    return [(" ".join(path), action) for path, sub in subparsers(build_parser())
            for action in sub._actions if not isinstance(action, (argparse._HelpAction, argparse._SubParsersAction))]


def test_every_subcommand_is_checked():
    assert {path.split()[0] for path, _ in all_options()} == set(SUBCOMMANDS)
    assert len([1 for path, _ in all_options() if path == "train"]) > 60


@pytest.mark.parametrize("path,action", all_options(), ids=lambda x: x if isinstance(x, str) else x.dest)
def test_every_flag_has_a_description(path, action):
    text = re.sub(r"\(default:.*$", "", action.help or "").strip(" .")
    assert text, f"lockstep {path} {'/'.join(action.option_strings) or action.dest} has no description: {HOW_TO}"


def train_help(capsys):
    with pytest.raises(SystemExit):
        build_parser(["train"]).parse_args(["train", "--help"])
    return " ".join(capsys.readouterr().out.split())


def test_train_help_shows_both_presets_units_and_choices(capsys):
    out = train_help(capsys)
    assert "--num-rollout NUM_ROLLOUT Rollouts" in out
    assert "(default: 40 with --model; 120 without (the embedded preset))" in out
    assert "(default: 1e-06 with --model; 0.001 without (the embedded preset))" in out
    assert "(default: False with --model; True without (the embedded preset))" in out  # --use-tis
    assert "in tokens (Miles' DeepSeek-V4 DAPO run uses 4096). (default: 4096 with --model; 8 without" in out
    for flag, values in [("--advantage-estimator", "{grpo,dr_grpo,gspo,rloo,reinforce_plus_plus,"),
                         ("--loss-agg", "{token,sequence,dr_grpo}"), ("--rm-type", "{dapo,math,gsm8k,arithmetic}"),
                         ("--mis", "{token,sequence,geometric}"), ("--serving-format", "{bf16,fp8,fp8-fp4}")]:
        assert f"{flag} {values}" in out


def test_choices_come_from_the_validating_tuples():
    from lockstep.config import SERVING_FORMATS, EngineConfig
    from lockstep.rl.config import RunConfig
    from lockstep.rl.rewards import BUILTIN_REWARDS
    from lockstep.train.config import ADVANTAGE_ESTIMATORS, LOSS_AGGS, MIS_LEVELS, TrainConfig

    parser = build_parser(["train"])
    train = next(sub for path, sub in subparsers(parser) if path == ("train",))
    choices = {a.dest: a.choices for a in train._actions}
    assert choices["advantage_estimator"] is ADVANTAGE_ESTIMATORS and tuple(choices["loss_agg"]) == tuple(LOSS_AGGS)
    assert choices["mis"] is MIS_LEVELS and choices["rm_type"] is BUILTIN_REWARDS
    assert choices["serving_format"] is SERVING_FORMATS
    for cls, field, bad in [(TrainConfig, "loss_agg", "mean"), (RunConfig, "rm_type", "exact"),
                            (EngineConfig, "serving_format", "fp4")]:
        with pytest.raises(ValueError, match=f"{cls.__name__}.{field}: must be one of"):
            cls(**{field: bad})


def parse_train(*argv):
    return configs_from_args(build_parser(["train"]).parse_args(["train", *argv]))


def test_a_real_model_gets_real_run_defaults(tmp_path):
    run, train, engine = parse_train("--model", str(tmp_path))
    assert (run.rollout_max_response_len, run.eval_max_response_len) == (4096, 4096)
    assert (run.num_rollout, train.lr, train.use_tis) == (40, 1e-6, False)
    assert engine.max_model_len == PROMPT_ROOM + 4096
    run, _, engine = parse_train("--model", str(tmp_path), "--eval-max-response-len", "8192")
    assert engine.max_model_len == PROMPT_ROOM + 8192
    _, _, engine = parse_train("--model", str(tmp_path), "--max-model-len", "1000")
    assert engine.max_model_len == 1000


def test_the_embedded_run_keeps_its_preset():
    run, train, engine = parse_train()
    assert (run.rollout_max_response_len, run.eval_max_response_len, run.num_rollout) == (8, 8, 120)
    assert (train.lr, train.use_tis, engine.max_model_len) == (1e-3, True, 64)
    run, train, _ = parse_train("--lr", "0.5", "--eval-max-response-len", "5")
    assert (train.lr, run.eval_max_response_len) == (0.5, 5)


def test_true_on_policy_is_decided_for_engine_and_trainer_together():
    """Left to the default (None), each side decides at construction (on CUDA for DeepSeek-V4);
    where either side rules it out, both get it off, so neither runs it alone."""
    _, train, engine = parse_train()
    assert train.true_on_policy is None and engine.true_on_policy is None
    for flag, value in (("--true-on-policy", True), ("--no-true-on-policy", False)):
        _, train, engine = parse_train(flag)
        assert train.true_on_policy is value and engine.true_on_policy is value
    for argv in (["--expert-model-parallel-size", "2"], ["--serving-format", "fp8", "--packed-fp8"],
                 ["--rollout-expert-parallel-size", "2"]):
        _, train, engine = parse_train(*argv)
        assert train.true_on_policy is False and engine.true_on_policy is False, argv
