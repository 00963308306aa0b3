"""`lockstep sft`: supervised warm start. With no arguments it builds the embedded default:
a character-level tokenizer, a tiny DeepSeek-V4 (every layer kind), trained on synthetic
arithmetic until its greedy accuracy on the model-selection split reaches --target-accuracy (so RL
starts neither at 0% nor near 100%), saved to lockstep/assets/tiny-dsv4/. Training, selection and
the RL eval prompts are disjoint splits of the problem space (lockstep/rl/arithmetic.py). Only this
no-argument rebuild writes the asset: with --model or --data, --output is required.

    lockstep sft --model DIR --data pairs.jsonl --input-key prompt --label-key answer --output OUT
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="", help="HF-style directory to start from (default: a new tiny DeepSeek-V4)")
    parser.add_argument("--data", default="", help="jsonl/parquet of prompt/answer rows (default: synthetic arithmetic)")
    parser.add_argument("--input-key", default="prompt", help="column of the prompt in --data rows (default: prompt)")
    parser.add_argument("--label-key", default="label", help="column of the target answer (default: label)")
    parser.add_argument("--output", default="",
                        help="output directory; required with --model or --data (default: the embedded asset "
                             "directory, which only the embedded rebuild may write)")
    parser.add_argument("--steps", type=int, default=3000, help="optimizer steps at most (default: 3000)")
    parser.add_argument("--batch-size", type=int, default=64, help="examples per step (default: 64)")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default: 3e-3)")
    parser.add_argument("--target-accuracy", type=float, default=0.35,
                        help="stop once greedy accuracy on the selection prompts (the \"select\" split, or "
                             "--data's first 5%%) reaches this (default: 0.35; 1.0 = train all steps)")
    parser.add_argument("--eval-every", type=int, default=50,
                        help="measure selection greedy accuracy every this many steps (default: 50)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the initialisation and data order (default: 0)")


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
    custom = [flag for flag, value in (("--model", args.model), ("--data", args.data)) if value]
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
    torch.manual_seed(args.seed)
    console = Console()
    if args.model:
        model, tok = load_pretrained(args.model, dtype=torch.float32), load_tokenizer(args.model)
    else:
        model, tok = _new_embedded_model(args.seed)
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

    run_sft(model, train_ex, steps=args.steps, batch_size=args.batch_size, lr=args.lr, pad_id=tok.pad_token_id,
            seed=args.seed, on_step=on_step)
    out.mkdir(parents=True, exist_ok=True)
    save_pretrained(model, out)
    tok.save_pretrained(out)
    console.print(f"saved {out}  (final selection greedy accuracy {greedy_accuracy(model, held_ex, tok.pad_token_id):.3f})")
    return 0
