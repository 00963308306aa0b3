"""The one error type of `lockstep.quant`: a tensor whose layout does not fit its format.

Messages start with the tensor's name when the caller gave one, so a failure deep inside a
checkpoint conversion says which tensor (and, from `convert`, which file) is at fault.
"""

from __future__ import annotations


class QuantFormatError(ValueError):
    """A quantised tensor or its scale has the wrong shape, dtype or values for its format."""


def where(name: str | None, what: str) -> str:
    """`what` itself, or "name: what" when the tensor has a name."""
    return f"{name}: {what}" if name else what
