"""`lockstep align`: how far apart are the trainer's and the engine's log-probabilities?

Samples completions with the engine (in its serving format), re-scores them with the trainer
(optionally with the quantisation-aware forward and routing replay) and prints the mean / max
token abs diff. With no --model: the embedded tiny model on arithmetic prompts.

    lockstep align --model DIR --dtype bfloat16 --device cuda --serving-format fp8 --quant-aware-forward fp8
"""

from __future__ import annotations

import argparse
import json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..config import SERVING_FORMATS
    from ..train.config import DTYPES, QUANT_AWARE_FORMATS

    parser.add_argument("--model", default="", help="checkpoint directory (default: the embedded tiny DeepSeek-V4)")
    parser.add_argument("--dtype", default="float32", choices=DTYPES,
                        help="compute dtype of both engine and trainer (default: float32)")
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cuda (default: cpu)")
    parser.add_argument("--serving-format", default="bf16", choices=SERVING_FORMATS,
                        help="the engine's weight format (default: bf16)")
    parser.add_argument("--quant-aware-forward", default=None, choices=QUANT_AWARE_FORMATS,
                        help="the trainer re-scores with dequant(quant(w)) in this format (default: plain weights)")
    parser.add_argument("--routing-replay", action="store_true",
                        help="the trainer uses the experts the engine chose for each token (default: off)")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="the engine's logprobs do not depend on the batch (default: off)")
    parser.add_argument("--true-on-policy", action="store_true",
                        help="engine and trainer both run the true-on-policy forward: the gap must be 0 (default: off)")
    parser.add_argument("--num-prompts", type=int, default=32, help="arithmetic prompts sampled (default: 32)")
    parser.add_argument("--max-new-tokens", type=int, default=16, help="tokens sampled per prompt (default: 16)")
    parser.add_argument("--temperature", type=float, default=1.0,
                        help="sampling temperature, also the trainer's logprob temperature (default: 1.0)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--layers", action="store_true",
                        help="also report per-layer drift between the full and the incremental path")
    parser.add_argument("--chunk", type=int, default=1, help="incremental chunk size for --layers, in tokens (default: 1)")


def run(args) -> int:
    import torch

    from ..align.compare import compare
    from ..config import EngineConfig, SamplingParams
    from ..engine.engine import Engine
    from ..models import load_pretrained
    from ..rl.arithmetic import arithmetic_prompts
    from ..rl.config import RunConfig
    from ..prompt_encoding import encode_prompt
    from ..rl.setup import model_path
    from ..train.config import TrainConfig
    from ..train.trainer import Trainer

    path = model_path(RunConfig(model=args.model))
    engine = Engine.from_pretrained(path, EngineConfig(
        dtype=args.dtype, device=args.device, serving_format=args.serving_format, batch_invariant=args.batch_invariant,
        true_on_policy=args.true_on_policy, max_num_seqs=max(args.num_prompts, 1), max_model_len=512))
    trainer = Trainer(load_pretrained(path, dtype=getattr(torch, args.dtype), device=args.device), TrainConfig(
        dtype=args.dtype, temperature=args.temperature, quant_aware_forward=args.quant_aware_forward,
        use_rollout_routing_replay=args.routing_replay, true_on_policy=args.true_on_policy))
    prompts = [encode_prompt(engine.tokenizer, p.prompt, True) for p in arithmetic_prompts(args.num_prompts, seed=7)]
    sampling = SamplingParams(temperature=args.temperature, max_new_tokens=args.max_new_tokens, seed=args.seed,
                              return_routed_experts=args.routing_replay)
    report = compare(engine, trainer, prompts, sampling)
    drift = _layer_drift(engine.model, prompts[0], args.chunk) if args.layers else []
    if args.json:
        print(json.dumps({**report.as_dict(), "layers": [d.__dict__ for d in drift]}))
    else:
        for k, v in report.as_dict().items():
            print(f"{k:16s} {v}")
        for d in drift:
            print(f"layer {d.layer:3d}  max |d| {d.max_abs:.3e}  mean |d| {d.mean_abs:.3e}")
    return 0


def _layer_drift(model, prompt: list[int], chunk: int):
    from ..align.layers import layer_drift

    return layer_drift(model, prompt, chunk)
