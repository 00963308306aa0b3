"""Builds an RL run's components from its three configs: model copies, engine, trainer, data.

The trainer and the engine each hold their own copy of the model (the engine's is re-quantised
to its serving format); weights only move between them through `Engine.update_weights`.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from ..config import EngineConfig
from ..dist.config import DistConfig
from ..models import load_pretrained
from ..models.tokenizer import load_tokenizer
from .config import RunConfig
from .data import DataError, PromptDataset, PromptSource
from .embedded import ASSET_DIR, embedded_prompts
from .evaluate import EvalSet
from .held_out import prompt_texts, without_training_prompts
from .long_prompts import check_room, without_long_prompts
from .rewards import get_reward_fn

# (input_key, label_key) of the data sets lockstep knows, tried when the run's keys don't fit
KNOWN_KEYS = [("prompt", "reward_model.ground_truth"), ("question", "answer"), ("problem", "answer"), ("prompt", "label")]


def model_path(run: RunConfig) -> Path:
    path = Path(run.model) if run.model else ASSET_DIR
    if not (path / "config.json").is_file():
        hint = " (run `lockstep sft` to build the embedded default)" if not run.model else ""
        raise FileNotFoundError(f"--model {path}: no config.json there{hint}")
    return path


def load_prompts(path: str, input_key: str, label_key: str, metadata_key: str, skip_bad_rows: bool,
                 other_layouts: bool = True):
    """(prompts, rows skipped) of a prompt file with the given keys, or, if its rows use another
    known layout (GSM8K, MATH-500, DAPO) and `other_layouts`, that one. Errors name the file and the row."""
    others = [k for k in KNOWN_KEYS if k != (input_key, label_key)] if other_layouts else []
    candidates = [(input_key, label_key)] + others
    first_error = None
    for ik, lk in candidates:
        try:
            ds = PromptDataset(path, ik, lk, metadata_key or None, skip_bad_rows=skip_bad_rows)
        except DataError as e:  # keep the error for the keys that were asked for
            first_error = first_error or e
            continue
        if ds.prompts:
            return ds.prompts, ds.num_skipped
        first_error = first_error or DataError(f"{path}: no usable rows for input key {ik!r} / label key {lk!r}")
    raise first_error


def train_prompts(run: RunConfig):
    """(prompts, malformed rows skipped)."""
    if run.prompt_data:
        # keys the user chose are the training file's: a file without them is an error, not another layout
        # (eval sets, often of another layout than the training set's, still fall back to theirs)
        chosen = (run.input_key, run.label_key) != (RunConfig.input_key, RunConfig.label_key)
        return load_prompts(run.prompt_data, run.input_key, run.label_key, run.metadata_key, run.skip_bad_rows,
                            other_layouts=not chosen)
    return embedded_prompts("train"), 0


def eval_sets(run: RunConfig, train: list | None = None,
              tokenizer=None) -> tuple[dict[str, EvalSet], dict[str, int]]:
    """(name -> EvalSet, what was left out: {"eval_overlap/<set>" | "long_prompts/<set>": count}):
    --eval-data's sets, or with neither --eval-data nor --prompt-data the embedded task's "eval" split;
    each with its own reward (RunConfig.eval_reward). `train`: the run's training prompts, left out of
    every set (held_out.py); with --max-prompt-len, prompts longer than it too (long_prompts.py;
    `tokenizer`: the engine's)."""
    files = {name: (path, reward) for name, path, reward in run.eval_sets}
    if not files and not run.prompt_data:
        files["arithmetic"] = (None, run.eval_reward("arithmetic"))
    sets, left_out, train_texts = {}, {}, prompt_texts(train or [])
    for name, (path, reward) in files.items():
        prompts = (embedded_prompts("eval") if path is None else
                   load_prompts(path, run.input_key, run.label_key, run.metadata_key, run.skip_bad_rows)[0])
        prompts, left_out[f"eval_overlap/{name}"] = without_training_prompts(prompts, train_texts)
        if not prompts:
            raise DataError(f"--eval-data {name} {path or ''}: every prompt is also a training prompt")
        prompts, left_out[f"long_prompts/{name}"] = without_long_prompts(
            prompts, tokenizer, run.apply_chat_template, run.max_prompt_len, name)
        if not prompts:
            raise DataError(f"--eval-data {name} {path or ''}: {_all_long(run)}")
        sets[name] = EvalSet(prompts[: run.eval_prompts_limit or None], get_reward_fn(reward), reward)
    return sets, left_out


def long_training_prompts_out(run: RunConfig, prompts: list, tokenizer) -> tuple[list, int]:
    """(the training prompts within --max-prompt-len, how many were longer)."""
    kept, dropped = without_long_prompts(prompts, tokenizer, run.apply_chat_template, run.max_prompt_len, "train")
    if not kept:
        raise DataError(f"--prompt-data {run.prompt_data or '(embedded task)'}: {_all_long(run)}")
    return kept, dropped


def _all_long(run: RunConfig) -> str:
    return f"every prompt is longer than --max-prompt-len {run.max_prompt_len} tokens"


def left_out_lines(left_out: dict[str, int]) -> list[str]:
    """What a run prints about the prompts it left out (the counts that are not 0)."""
    why = {"eval_overlap": "held-out prompts are training prompts too; left out of the set (rl/held_out.py)",
           "long_prompts": "prompts are longer than --max-prompt-len; left out (rl/long_prompts.py)"}
    return [f"{key.partition('/')[2]}: {n} {why[key.partition('/')[0]]}" for key, n in left_out.items() if n]


def make_run_dir(run: RunConfig) -> Path:
    d = Path(run.run_dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}")
    d.mkdir(parents=True, exist_ok=True)
    return d


def check_ref_load(run: RunConfig, kl_loss_coef: float) -> None:
    if run.ref_load and kl_loss_coef == 0:
        raise ValueError(f"--ref-load {run.ref_load}: a reference model is only used with --kl-loss-coef > 0")
    if run.ref_load and not (Path(run.ref_load) / "config.json").is_file():
        raise FileNotFoundError(f"--ref-load {run.ref_load}: no config.json there (a model directory as --model takes)")


def reference_model(run: RunConfig, kl_loss_coef: float, policy):
    """The KL loss's frozen reference (None when kl_loss_coef is 0): --ref-load's model, else a copy
    of the policy as loaded, before the trainer wraps it or --load restores later weights."""
    import copy

    if kl_loss_coef == 0:
        return None
    if not run.ref_load:
        return copy.deepcopy(policy)
    param = next(policy.parameters())
    ref = load_pretrained(run.ref_load, dtype=param.dtype, device=param.device)
    if ref.config.vocab_size != policy.config.vocab_size:  # the KL compares logprobs of the same token ids
        raise ValueError(f"--ref-load {run.ref_load}: vocab_size {ref.config.vocab_size} differs from the "
                         f"policy's {policy.config.vocab_size}")
    return ref


def components(run: RunConfig, train_cfg, engine_cfg: EngineConfig, path, dist_ctx, weight_buffer_size: int,
               rollout_ep_size: int = 1):
    """(engine, trainer): one process's own, or this rank's part of the world's."""
    import torch

    from ..engine.engine import Engine
    from ..train.trainer import Trainer

    def ref_model(policy):
        return reference_model(run, train_cfg.kl_loss_coef, policy)

    if dist_ctx is not None:
        from .data_parallel import data_parallel_components

        return data_parallel_components(dist_ctx, path, train_cfg, engine_cfg, ref_model, weight_buffer_size,
                                        run_cfg=run, rollout_ep_size=rollout_ep_size)
    engine = Engine.from_pretrained(path, engine_cfg)
    policy = load_pretrained(path, dtype=getattr(torch, train_cfg.dtype), device=engine_cfg.device)
    return engine, Trainer(policy, train_cfg, ref_model=ref_model(policy))


def shared_run_dir(run: RunConfig, dist_ctx) -> Path:
    """The run directory, made by the primary process; on N processes rank 0's, known to every rank."""
    if dist_ctx is None:
        return make_run_dir(run)
    from .data_parallel import agreed_run_dir

    return Path(agreed_run_dir(dist_ctx, make_run_dir(run) if dist_ctx.rank == 0 else None))


def build_run(run: RunConfig, train_cfg, engine_cfg: EngineConfig, progress=None, dist_ctx=None,
              weight_buffer_size: int = DistConfig.update_weight_buffer_size, rollout_ep_size: int = 1):
    """The run's components; `dist_ctx` (a lockstep.dist DistContext): this rank's part of an N-process
    run (lockstep/rl/data_parallel.py; `weight_buffer_size`: push bucket bytes; `rollout_ep_size`: the
    engines' expert parallelism, DistConfig.rollout_expert_parallel_size), rank 0 writing the
    run directory's files."""
    from .loop import RLRun

    # inputs first: a bad data file or reward name fails before any model is loaded
    path = model_path(run)
    check_ref_load(run, train_cfg.kl_loss_coef)
    prompts, skipped = train_prompts(run)
    tokenizer = None
    if run.max_prompt_len:
        check_room(run.max_prompt_len, engine_cfg.max_model_len)
        tokenizer = load_tokenizer(path)
    prompts, long_train = long_training_prompts_out(run, prompts, tokenizer)
    source = PromptSource(prompts, seed=run.seed)
    held_out, left_out = eval_sets(run, prompts, tokenizer)
    left_out = {"long_prompts/train": long_train, **left_out}  # the training set's line first
    reward_fn = get_reward_fn(run.custom_reward_path or run.rm_type)
    engine, trainer = components(run, train_cfg, engine_cfg, path, dist_ctx, weight_buffer_size, rollout_ep_size)
    primary = dist_ctx is None or dist_ctx.rank == 0
    run_dir = shared_run_dir(run, dist_ctx)
    if primary:
        for line in left_out_lines(left_out):
            print(line)
        (run_dir / "config.json").write_text(json.dumps(
            {"run": run.__dict__, "train": train_cfg.__dict__, "engine": engine_cfg.__dict__,
             "eval_rewards": {name: s.reward for name, s in held_out.items()},
             "world_size": dist_ctx.world_size if dist_ctx is not None else 1}, indent=1, default=str))
    gather = None
    if dist_ctx is not None:
        from .data_parallel import gather_to_every_rank

        gather = gather_to_every_rank(dist_ctx)
    rl = RLRun(run, engine, trainer, source, reward_fn, held_out, run_dir,
               advantage_estimator=train_cfg.advantage_fn, progress=progress if primary else None,
               start_metrics={"data/skipped_rows": float(skipped),
                              **{f"data/{key}": float(n) for key, n in left_out.items() if n}},
               primary=primary,
               device=str(dist_ctx.device) if dist_ctx is not None else engine_cfg.device, gather=gather)
    if run.load:
        rl.load(run.load)
    return rl
