"""Command-line flags generated from frozen config dataclasses: one flag per field.

`--field-name` for every field of the dataclass (underscores become dashes); booleans
become `--flag / --no-flag`; tuple fields take several values. Building the config from the
parsed namespace runs the dataclass's own validation, so a bad flag fails with the field's name.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing


def _base_type(tp):
    """int | None -> int; tuple[int, ...] -> (tuple, int)."""
    origin = typing.get_origin(tp)
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)) and args:
        return _base_type(args[0])
    if origin is tuple:
        return (tuple, args[0] if args else str)
    return tp


def add_dataclass_arguments(parser: argparse.ArgumentParser, cls, *, skip: tuple[str, ...] = (),
                            group: str | None = None) -> None:
    target = parser.add_argument_group(group) if group else parser
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip or not f.init:
            continue
        flag = "--" + f.name.replace("_", "-")
        tp = _base_type(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else None
        kwargs = dict(dest=f.name, default=argparse.SUPPRESS, help=f"(default: {default})")
        if tp is bool:
            target.add_argument(flag, action=argparse.BooleanOptionalAction, **kwargs)
        elif isinstance(tp, tuple):
            target.add_argument(flag, nargs="*", type=tp[1], **kwargs)
        elif tp in (int, float, str):
            target.add_argument(flag, type=tp, **kwargs)
        else:  # dict and other structured fields are not flags
            continue


def dataclass_from_args(cls, args: argparse.Namespace, **overrides):
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    values = {k: v for k, v in vars(args).items() if k in names}
    values.update(overrides)
    for k, v in list(values.items()):
        if isinstance(v, list):
            values[k] = tuple(v)
    return cls(**values)
