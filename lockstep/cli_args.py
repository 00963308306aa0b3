"""Command-line flags generated from frozen config dataclasses: one flag per field.

`--field-name` for every field of the dataclass (underscores become dashes); booleans
become `--flag / --no-flag`; tuple fields take several values. Building the config from the
parsed namespace runs the dataclass's own validation, so a bad flag fails with the field's name.

A flag's help is the field's own documentation, the string literal on the line below the field
(an attribute docstring, the one place a field is described), followed by its default:

    lr: float = 1e-6
    \"\"\"AdamW learning rate, constant over the run.\"\"\"

Allowed values come from the class's `CHOICES` mapping (field -> tuple), the same tuples its
`__post_init__` validates with (`lockstep.config.check_choices`); the flag lists them.
tests/test_cli_help.py fails on any flag without a description.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import textwrap
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


@functools.cache
def field_docs(cls) -> dict[str, str]:
    """{field name: its attribute docstring as one line} for `cls` and its dataclass bases."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):  # no source shipped: flags still work, only their help is bare
            continue
        body = ast.parse(textwrap.dedent(source)).body[0].body
        for node, after in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                    and isinstance(after.value.value, str)):
                docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _help(doc: str, default_text: str) -> str:
    # argparse %-formats help strings: a literal % in a docstring must not be read as a format
    return f"{doc} (default: {default_text})".replace("%", "%%")


def add_dataclass_arguments(parser: argparse.ArgumentParser, cls, *, skip: tuple[str, ...] = (),
                            group: str | None = None, default_text: dict[str, str] | None = None,
                            only: tuple[str, ...] | None = None) -> None:
    """One flag per field of `cls` (see the module docstring); `only` limits them to those fields.
    `default_text` replaces the shown default of some fields, for commands whose defaults depend on
    other flags (e.g. presets)."""
    target = parser.add_argument_group(group) if group else parser
    hints, docs = typing.get_type_hints(cls), field_docs(cls)
    choices = getattr(cls, "CHOICES", {})
    for f in dataclasses.fields(cls):
        if f.name in skip or not f.init or (only is not None and f.name not in only):
            continue
        flag = "--" + f.name.replace("_", "-")
        tp = _base_type(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else None
        shown = (default_text or {}).get(f.name, '""' if default == "" else str(default))
        kwargs = dict(dest=f.name, default=argparse.SUPPRESS, help=_help(docs.get(f.name, ""), shown))
        if tp is bool:
            target.add_argument(flag, action=argparse.BooleanOptionalAction, **kwargs)
        elif isinstance(tp, tuple):
            target.add_argument(flag, nargs="*", type=tp[1], **kwargs)
        elif tp in (int, float, str):
            target.add_argument(flag, type=tp, choices=choices.get(f.name), **kwargs)
        else:  # dict and other structured fields are not flags
            continue


def given_fields(args: argparse.Namespace, names: tuple[str, ...]) -> dict:
    """The fields among `names` given on the command line (flags default to absent, so the
    dataclass's own default applies to the rest)."""
    return {k: getattr(args, k) for k in names if hasattr(args, k)}


def dataclass_from_args(cls, args: argparse.Namespace, **overrides):
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    values = {k: v for k, v in vars(args).items() if k in names}
    values.update(overrides)
    for k, v in list(values.items()):
        if isinstance(v, list):
            values[k] = tuple(v)
    return cls(**values)
