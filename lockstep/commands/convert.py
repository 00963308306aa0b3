"""`lockstep convert`: checkpoint conversions.

    lockstep convert gguf SRC.gguf DST_DIR [--dtype float32|bfloat16]
        a llama.cpp GGUF (dense Llama / Qwen3) -> Hugging Face style directory with tokenizer
    lockstep convert quant SRC_DIR DST_DIR --to bf16|fp8|fp8-fp4 [--scale-fmt ue8m0|fp32]
        re-store a DeepSeek-V4 checkpoint in a serving format (lockstep.quant.convert)
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from lockstep.config import SERVING_FORMATS

    kinds = parser.add_subparsers(dest="kind", metavar="KIND", required=True)
    g = kinds.add_parser("gguf", help="GGUF file -> Hugging Face style directory (config, safetensors, tokenizer)")
    g.add_argument("src", help="the .gguf file")
    g.add_argument("dst", help="output directory")
    g.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="dtype of the dequantised weights (default float32: GGUF values are exact in it)")
    g.add_argument("--no-tokenizer", action="store_true", help="skip writing tokenizer files")
    q = kinds.add_parser("quant", help="checkpoint directory -> serving format bf16 | fp8 | fp8-fp4")
    q.add_argument("src", help="source checkpoint directory")
    q.add_argument("dst", help="output directory")
    q.add_argument("--to", required=True, choices=SERVING_FORMATS, help="serving format")
    q.add_argument("--scale-fmt", choices=("ue8m0", "fp32"), default="ue8m0",
                   help="fp8 scale format: power-of-two ue8m0 (V4) or float32 (V3)")


def run(args: argparse.Namespace) -> int:
    if args.kind == "gguf":
        import torch

        from lockstep.models.gguf import convert_gguf

        out = convert_gguf(args.src, args.dst, dtype=getattr(torch, args.dtype), tokenizer=not args.no_tokenizer)
        print(f"wrote {out}")
        return 0
    from lockstep.quant.convert import convert_checkpoint

    result = convert_checkpoint(args.src, args.dst, to=args.to, scale_fmt=args.scale_fmt)
    print(f"wrote {len(result.files)} file(s) to {args.dst}")
    return 0
