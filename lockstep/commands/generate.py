"""`lockstep generate`: sample completions from a model with the rollout engine.

    lockstep generate                                   # the embedded tiny DeepSeek-V4, default prompts
    lockstep generate --model PATH --prompt "What is 2 + 3?" --prompt "Name a prime." \
        --max-new-tokens 64 --temperature 0.7 --serving-format fp8 --n 2

Prompts go through the tokenizer's chat template when it has one (--no-chat-template: raw text).
Without a tokenizer, --prompt-ids "1 2 3" gives token ids directly.
"""

from __future__ import annotations

import argparse
from pathlib import Path

DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "assets" / "tiny-dsv4"
DEFAULT_PROMPTS = ("What is 2 + 3?", "Write the word hello.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from lockstep.cli_args import add_dataclass_arguments
    from lockstep.config import SERVING_FORMATS, EngineConfig

    parser.add_argument("--model", default=None, help=f"checkpoint directory (default: {DEFAULT_MODEL})")
    parser.add_argument("--prompt", action="append", default=None, help="a prompt; repeat for several")
    parser.add_argument("--prompt-ids", action="append", default=None,
                        help='a prompt as space-separated token ids, e.g. "1 2 3"; repeat for several')
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens sampled at most per completion (default: 64)")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0: greedy (default: 0)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1.0, off)")
    parser.add_argument("--top-k", type=int, default=-1, help="sample among the k likeliest tokens (default: -1, off)")
    parser.add_argument("--n", type=int, default=1, help="samples per prompt (default: 1)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    parser.add_argument("--serving-format", choices=SERVING_FORMATS, default="bf16",
                        help="the engine's weight format (default: bf16)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="compute dtype (default: float32)")
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cuda (default: cpu)")
    parser.add_argument("--max-model-len", type=int, default=2048,
                        help="longest sequence, prompt + completion, in tokens (default: 2048)")
    parser.add_argument("--no-chat-template", action="store_true", help="tokenize prompts as raw text")
    parser.add_argument("--show-logprobs", action="store_true", help="print each token's rollout logprob")
    add_dataclass_arguments(parser, EngineConfig, only=(*EngineConfig.PATH_FIELDS, "compile_cache_dir"),
                            group="served path")


def _model_dir(arg: str | None) -> Path:
    if arg is not None:
        path = Path(arg)
        if not (path / "config.json").exists():
            raise SystemExit(f"lockstep generate: {path} is not a checkpoint directory (no config.json)")
        return path
    if not (DEFAULT_MODEL / "config.json").exists():
        raise SystemExit(f"lockstep generate: no --model given and the embedded default model is missing "
                         f"({DEFAULT_MODEL}); pass --model PATH to a checkpoint directory")
    return DEFAULT_MODEL


def _prompt_ids(engine, args) -> list[tuple[str, list[int]]]:
    if args.prompt_ids:
        return [(p, [int(t) for t in p.split()]) for p in args.prompt_ids]
    if engine.tokenizer is None:
        raise SystemExit("lockstep generate: this model has no tokenizer; give prompts with --prompt-ids")
    texts = args.prompt or list(DEFAULT_PROMPTS)
    return [(t, engine.tokenize_prompt(t, chat_template=not args.no_chat_template)) for t in texts]


def run(args) -> int:
    from lockstep.cli_args import given_fields
    from lockstep.config import EngineConfig, SamplingParams
    from lockstep.engine import Engine, GenerateRequest
    from lockstep.engine.compile_cache import default_dir

    path = _model_dir(args.model)
    config = EngineConfig(max_model_len=args.max_model_len, serving_format=args.serving_format, dtype=args.dtype,
                          device=args.device, max_num_seqs=max(8, args.n * 2),
                          **given_fields(args, EngineConfig.PATH_FIELDS),
                          compile_cache_dir=default_dir(path, getattr(args, "compile_cache_dir", None)))
    engine = Engine.from_pretrained(path, config)
    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, n=args.n,
                              seed=args.seed, max_new_tokens=args.max_new_tokens)
    prompts = _prompt_ids(engine, args)
    samples = engine.generate([GenerateRequest(ids, sampling, group_id=i) for i, (_, ids) in enumerate(prompts)])
    for i, s in enumerate(samples):
        text, _ = prompts[s.group_id]
        print(f"=== prompt {s.group_id} sample {i % args.n}: {text!r}")
        completion = s.metadata.get("text", " ".join(map(str, s.response_ids.tolist())))
        print(completion)
        if args.show_logprobs:
            print("logprobs:", [round(x, 4) for x in s.rollout_logprobs.tolist()])
        print(f"--- {s.response_len} tokens, finish_reason={s.finish_reason}, "
              f"mean logprob {s.rollout_logprobs.mean().item() if s.response_len else 0.0:.4f}")
    return 0
