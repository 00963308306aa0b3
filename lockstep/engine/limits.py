"""What one client may ask of the HTTP server (`lockstep serve`), and how long it waits on a stuck engine.

Each field is one `lockstep serve` flag (`--max-n` ...); its documentation below is the flag's help
and the README's "Limits and security" table. A request beyond a per-request limit is refused
before it reaches the engine with 400 (413 for the body size), naming the field and the limit; a
request that finds the server full gets 429 and may retry. The engine itself is not limited: the
RL loop drives it in-process with whatever it needs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class ServerLimits:
    """Limits of `lockstep serve`; each field's documentation is the string below it (also its --help)."""

    max_n: int = 128
    """Samples per prompt (n) one request may ask for; more is a 400."""
    max_request_tokens: int = 262144
    """Prompt tokens times n of one request, summed over its prompts (the prefill work it asks for); more is
    a 400."""
    max_queued_requests: int = 1024
    """Generation requests the server holds at once, running or waiting; the next one gets 429 until one
    finishes, and /health answers 503 while the server is full."""
    max_request_bytes: int = 8 * 2**20
    """Largest request body in bytes; a larger one gets 413 before it is read (tokenising is the costly part)."""
    stall_seconds: float = 60.0
    """/health answers 503 when the engine has had work but finished no step for this many seconds."""
    shutdown_grace: float = 5.0
    """On SIGTERM, seconds that requests in flight get to finish; then they are aborted and the server exits."""

    def __post_init__(self):
        for name in ("max_n", "max_request_tokens", "max_queued_requests", "max_request_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"ServerLimits.{name}: must be >= 1, got {getattr(self, name)}")
        for name in ("stall_seconds", "shutdown_grace"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"ServerLimits.{name}: must be a positive number of seconds, got {value}")
