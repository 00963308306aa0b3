"""`lockstep serve`: serve a model over HTTP (OpenAI-compatible + SGLang-style native endpoints).

    lockstep serve                                   # the embedded tiny DeepSeek-V4 on 127.0.0.1:30000
    lockstep serve --model DIR --serving-format fp8 --weights-dir /ckpts --port 30000
    LOCKSTEP_ADMIN_TOKEN=... lockstep serve --model DIR --host 0.0.0.0 --weights-dir /ckpts

Endpoints and their shapes: lockstep/engine/server.py. The server binds 127.0.0.1 unless --host
says otherwise. Beyond loopback, the state-changing endpoints (weight updates, pause / continue,
flush, abort) need `Authorization: Bearer <token>` and the server refuses to start without a token
(--admin-token or the LOCKSTEP_ADMIN_TOKEN environment variable, which keeps it out of `ps`).
`/update_weights_from_disk` only reads checkpoints under --weights-dir and is refused without it.

Limits (lockstep/engine/limits.py, the README's "Limits and security"): samples per request, prompt
tokens x n, requests held at once, body bytes, when /health calls the engine stalled, and the grace
period on SIGTERM. The rollout cache takes --cache-memory-bytes, else --cache-memory-fraction of the
memory available at start (never more than --max-num-seqs sequences of --max-model-len need); the
start line says what it got.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "assets" / "tiny-dsv4"
TOKEN_ENV = "LOCKSTEP_ADMIN_TOKEN"
# a laptop keeps room for everything else; a dedicated GPU server passes --cache-memory-fraction 0.8
DEFAULT_CACHE_FRACTION = 0.25


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from lockstep.cli_args import add_dataclass_arguments
    from lockstep.config import SERVING_FORMATS, EngineConfig
    from lockstep.engine.limits import ServerLimits

    parser.add_argument("--model", default=None, help=f"checkpoint directory (default: {DEFAULT_MODEL})")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    parser.add_argument("--port", type=int, default=30000, help="TCP port (default: 30000)")
    parser.add_argument("--serving-format", choices=SERVING_FORMATS, default="bf16",
                        help="the engine's weight format (default: bf16)")
    parser.add_argument("--admin-token", default=None,
                        help=f"bearer token for the state-changing endpoints (default: ${TOKEN_ENV})")
    parser.add_argument("--weights-dir", default=None,
                        help="the only directory /update_weights_from_disk may read from (default: none, refused)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="compute dtype (default: float32)")
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cuda (default: cpu)")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="sequences decoded together at most (default: 64)")
    parser.add_argument("--max-model-len", type=int, default=2048,
                        help="longest sequence, prompt + completion, in tokens (default: 2048)")
    parser.add_argument("--cache-memory-bytes", type=int, default=None,
                        help="rollout cache memory in bytes (default: --cache-memory-fraction of the memory available "
                             "at start)")
    parser.add_argument("--cache-memory-fraction", type=float, default=DEFAULT_CACHE_FRACTION,
                        help="without --cache-memory-bytes, this fraction of the device's available memory at start "
                             f"goes to the rollout cache, at most what --max-num-seqs sequences of --max-model-len "
                             f"need (default: {DEFAULT_CACHE_FRACTION})")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="a request's logprobs do not depend on what else is in the batch")
    parser.add_argument("--served-model-name", default=None, help="the `model` field of OpenAI answers")
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                        help="uvicorn log level (default: info)")
    add_dataclass_arguments(parser, ServerLimits, group="limits")
    add_dataclass_arguments(parser, EngineConfig, only=(*EngineConfig.PATH_FIELDS, "compile_cache_dir"),
                            group="served path")


def check_port(host: str, port: int) -> None:
    """Fail before the model loads (minutes for a large one) if the server could not listen there."""
    import socket

    if not 0 <= port <= 65535:
        raise ValueError(f"--port {port}: must be in [0, 65535]")
    try:
        with socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET):
            pass
    except OSError as e:
        why = os.strerror(e.errno) if e.errno else str(e)
        raise ValueError(f"--host {host} --port {port}: cannot listen there ({why})") from None


def run(args) -> int:
    import uvicorn

    from lockstep.cli_args import dataclass_from_args, given_fields
    from lockstep.config import EngineConfig
    from lockstep.engine import Engine
    from lockstep.engine.compile_cache import default_dir
    from lockstep.engine.kv_cache import describe
    from lockstep.engine.limits import ServerLimits
    from lockstep.engine.server import create_app, is_loopback

    token = args.admin_token or os.environ.get(TOKEN_ENV) or None
    beyond_loopback = not is_loopback(args.host)
    if beyond_loopback and not token:  # checked before the model loads: fail fast
        raise ValueError(f"--host {args.host} listens beyond loopback; refusing to start without an admin token "
                         f"(pass --admin-token or set {TOKEN_ENV}), or bind 127.0.0.1")
    check_port(args.host, args.port)
    if args.weights_dir is not None and not Path(args.weights_dir).is_dir():
        raise ValueError(f"--weights-dir {args.weights_dir}: not a directory")
    path = Path(args.model) if args.model else DEFAULT_MODEL
    if not (path / "config.json").is_file():
        raise ValueError(f"--model {path}: no config.json there (not a checkpoint directory)")
    limits = dataclass_from_args(ServerLimits, args)
    config = EngineConfig(max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len, dtype=args.dtype,
                          device=args.device, serving_format=args.serving_format, batch_invariant=args.batch_invariant,
                          cache_memory_bytes=cache_budget(args), **given_fields(args, EngineConfig.PATH_FIELDS),
                          compile_cache_dir=default_dir(path, getattr(args, "compile_cache_dir", None)))
    engine = Engine.from_pretrained(path, config)
    print(f"lockstep serve: rollout cache {describe(engine.cache, engine.max_model_len)}", file=sys.stderr)
    app = create_app(engine, admin_token=token, weights_dir=args.weights_dir, require_admin=beyond_loopback,
                     model_name=args.served_model_name, limits=limits)
    # past the grace period uvicorn cancels the requests still running; the engine aborts them
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=limits.shutdown_grace)
    return 0


def cache_budget(args) -> int:
    """--cache-memory-bytes, else the fraction of what is available (the engine caps it at what
    max_num_seqs sequences of max_model_len need: 64 x 2048 tokens was 7.3 GB for a 135M model)."""
    from lockstep.engine.kv_cache import available_memory_bytes

    if args.cache_memory_bytes is not None:
        if args.cache_memory_bytes < 1:
            raise ValueError(f"--cache-memory-bytes: must be >= 1, got {args.cache_memory_bytes}")
        return args.cache_memory_bytes
    if not 0 < args.cache_memory_fraction <= 1:
        raise ValueError(f"--cache-memory-fraction: must be in (0, 1], got {args.cache_memory_fraction}")
    return int(args.cache_memory_fraction * available_memory_bytes(args.device))
