"""`lockstep sft`: supervised warm start. With no arguments it builds the embedded default:
a character-level tokenizer, a tiny DeepSeek-V4 (every layer kind), trained on synthetic
arithmetic until its greedy accuracy on the model-selection split reaches --target-accuracy (so RL
starts neither at 0% nor near 100%), saved to lockstep/assets/tiny-dsv4/. Training, selection and
the RL eval prompts are disjoint splits of the problem space (lockstep/rl/arithmetic.py). Only this
no-argument rebuild writes the asset: with --model or --data, --output is required.

    lockstep sft --model DIR --data pairs.jsonl --input-key prompt --label-key answer --output OUT
    lockstep sft --preset gpu-dsv4-0.85b --output DIR   # a new ~0.85B DSV4 on worked-step arithmetic, one GPU

A preset (lockstep/commands/presets.py SFT_PRESETS) fixes the model, data, device and step budget;
--steps / --batch-size / --lr / --seed given on the command line still win.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="", choices=["", *_preset_names()],
                        help="a new model + task + budget from presets.SFT_PRESETS (needs --output)")
    parser.add_argument("--model", default="", help="HF-style directory to start from (default: a new tiny DeepSeek-V4)")
    parser.add_argument("--data", default="", help="jsonl/parquet of prompt/answer rows (default: synthetic arithmetic)")
    parser.add_argument("--input-key", default="prompt", help="column of the prompt in --data rows (default: prompt)")
    parser.add_argument("--label-key", default="label", help="column of the target answer (default: label)")
    parser.add_argument("--output", default="",
                        help="output directory; required with --model or --data (default: the embedded asset "
                             "directory, which only the embedded rebuild may write)")
    # None = not given: a preset's own value then, else BUDGET's
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps at most (default: 3000)")
    parser.add_argument("--batch-size", type=int, default=None, help="examples per step (default: 64)")
    parser.add_argument("--lr", type=float, default=None, help="AdamW learning rate (default: 3e-3)")
    parser.add_argument("--target-accuracy", type=float, default=0.35,
                        help="stop once greedy accuracy on the selection prompts (the \"select\" split, or "
                             "--data's first 5%%) reaches this (default: 0.35; 1.0 = train all steps)")
    parser.add_argument("--eval-every", type=int, default=50,
                        help="measure selection greedy accuracy every this many steps (default: 50)")
    parser.add_argument("--seed", type=int, default=None, help="seed of the initialisation and data order (default: 0)")


def _preset_names() -> list[str]:
    from .presets import SFT_PRESETS
    return list(SFT_PRESETS)


def _new_embedded_model(seed: int):
    from ..models.deepseek_v4 import DeepseekV4ForCausalLM
    from ..models.deepseek_v4_init import init_deepseek_v4_
    from ..rl.char_tokenizer import build_char_tokenizer
    from ..rl.embedded import tiny_model_config

    tok = build_char_tokenizer()
    model = DeepseekV4ForCausalLM(tiny_model_config(len(tok), tok.eos_token_id, tok.bos_token_id, tok.pad_token_id))
    init_deepseek_v4_(model, seed)
    return model, tok


def _pairs(args):
    from ..rl.embedded import embedded_prompts
    from ..rl.setup import load_prompts

    if args.data:
        prompts, _ = load_prompts(args.data, args.input_key, args.label_key, "", False)
        held_out = max(len(prompts) // 20, 1)
        return prompts[held_out:], prompts[:held_out]
    # select on the "select" split: the RL eval set stays unseen by model selection too
    return embedded_prompts("train"), embedded_prompts("select")


def output_dir(args) -> Path:
    """Where the model is saved. The bundled asset is the embedded rebuild's alone: an SFT of another
    model or data set must name its own --output rather than overwrite what `lockstep train` runs."""
    from ..rl.embedded import ASSET_DIR

    out = Path(args.output) if args.output else ASSET_DIR
    custom = [flag for flag, value in (("--model", args.model), ("--data", args.data),
                                       ("--preset", getattr(args, "preset", ""))) if value]
    if custom and out.resolve() == ASSET_DIR.resolve():
        raise ValueError(f"{' and '.join(custom)} given: pass --output DIR (the default, {ASSET_DIR}, is the "
                         "bundled embedded model, written only by `lockstep sft` without --model / --data)")
    return out


def run(args) -> int:
    import torch
    from rich.console import Console
    from ..models import load_pretrained, save_pretrained
    from ..models.tokenizer import load_tokenizer
    from ..train.sft import greedy_accuracy, make_examples, run_sft

    out = output_dir(args)  # before any work: a refused output wastes no training
    if getattr(args, "preset", ""):
        if args.model or args.data:
            raise ValueError("--preset builds its own model and data: drop --model / --data")
        run_preset(args.preset, out, **_given_budget(args))
        return 0
    budget = {**BUDGET, **_given_budget(args)}
    torch.manual_seed(budget["seed"])
    console = Console()
    if args.model:
        model, tok = load_pretrained(args.model, dtype=torch.float32), load_tokenizer(args.model)
    else:
        model, tok = _new_embedded_model(budget["seed"])
    train, held = _pairs(args)
    train_ex = make_examples(tok, [(p.prompt, p.label) for p in train])
    held_ex = make_examples(tok, [(p.prompt, p.label) for p in held])

    def on_step(step: int, loss: float) -> bool:
        if (step + 1) % args.eval_every:
            return False
        acc = greedy_accuracy(model, held_ex, tok.pad_token_id)
        console.print(f"step {step + 1:5d}  loss {loss:.4f}  selection greedy accuracy {acc:.3f}")
        model.train()
        return acc >= args.target_accuracy

    run_sft(model, train_ex, pad_id=tok.pad_token_id, on_step=on_step, **budget)
    out.mkdir(parents=True, exist_ok=True)
    save_pretrained(model, out)
    tok.save_pretrained(out)
    console.print(f"saved {out}  (final selection greedy accuracy {greedy_accuracy(model, held_ex, tok.pad_token_id):.3f})")
    return 0


# the run's budget where no flag and no preset sets it (--help shows these)
BUDGET = dict(steps=3000, batch_size=64, lr=3e-3, seed=0)


def _given_budget(args) -> dict:
    """The budget flags given on the command line (argparse leaves the others None); a step count or batch
    size below 1, or a negative learning rate, is an error (0 steps saved the untrained model)."""
    given = {k: getattr(args, k) for k in BUDGET if getattr(args, k, None) is not None}
    for name, least in (("steps", 1), ("batch_size", 1), ("lr", 0)):
        if name in given and not given[name] >= least:
            raise ValueError(f"--{name.replace('_', '-')} {given[name]}: must be >= {least}")
    return given


def run_preset(name: str, out: Path, *, model_overrides: dict | None = None, device: str | None = None,
               split_sizes: dict | None = None, **budget) -> list[float]:
    """Train preset `name` from random init, save it to `out`; the per-step losses. `model_overrides`,
    `device` and `split_sizes` are test-only: the same path at a CPU size."""
    import torch
    from rich.console import Console
    from ..models import save_pretrained
    from ..rl.arithmetic import worked_pairs
    from ..train.sft import greedy_accuracy, make_examples, run_sft
    from .presets import SFT_PRESETS

    preset, console = SFT_PRESETS[name], Console()
    run = {**dict(steps=preset.steps, batch_size=preset.batch_size, lr=preset.lr, seed=0), **budget}
    model, tok = _new_preset_model(preset, run["seed"], device or preset.device, model_overrides or {})
    sizes = split_sizes or preset.split_sizes
    train_ex, held_ex = (make_examples(tok, worked_pairs(sizes[s], digits=preset.digits, split=s))
                         for s in ("train", "select"))
    amp = getattr(torch, preset.autocast_dtype) if preset.autocast_dtype else None
    losses = []

    def on_step(step: int, loss: float) -> bool:
        losses.append(loss)
        if (step + 1) % preset.eval_every == 0 or step + 1 == run["steps"]:
            acc = greedy_accuracy(model, held_ex, tok.pad_token_id, autocast_dtype=amp)
            console.print(f"step {step + 1:5d}  loss {loss:.4f}  selection greedy accuracy {acc:.3f}")
            model.train()
        return False

    run_sft(model, train_ex, pad_id=tok.pad_token_id, on_step=on_step, autocast_dtype=amp, **run)
    out.mkdir(parents=True, exist_ok=True)
    save_pretrained(model.cpu(), out)
    tok.save_pretrained(out)
    console.print(f"saved {out}  ({name}, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, "
                  f"loss {losses[0]:.4f} -> {losses[-1]:.4f})")
    return losses


def _new_preset_model(preset, seed: int, device: str, overrides: dict):
    from ..models.deepseek_v4 import DeepseekV4ForCausalLM
    from ..models.deepseek_v4_init import init_deepseek_v4_
    from ..rl.char_tokenizer import build_char_tokenizer
    from .presets import sft_model_config

    tok = build_char_tokenizer()
    model = DeepseekV4ForCausalLM(sft_model_config(preset, tok, **overrides))
    init_deepseek_v4_(model, seed)  # draws on the CPU generator: initialise, then move
    return model.to(device), tok
