"""A checkpoint directory's tokenizer, loaded by transformers, with errors that name the file.

transformers reports a malformed tokenizer.json as the bare JSON error ("Expecting property name:
line 1 column 44") or a Rust panic; the JSON files are parsed here first so the message names the
file, line and column (lockstep/files.py), and anything transformers still refuses names the directory.
"""

from __future__ import annotations

from pathlib import Path

from lockstep.files import naming, read_json

# any of these makes a directory carry a tokenizer; the JSON ones are checked before transformers reads them
TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
_JSON_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json")


def has_tokenizer(path: str | Path) -> bool:
    return any((Path(path) / f).exists() for f in TOKENIZER_MARKERS)


def load_tokenizer(path: str | Path):
    """transformers.AutoTokenizer for directory `path`; FileError if a tokenizer file is malformed."""
    path = Path(path)
    for name in _JSON_FILES:
        if (path / name).exists():
            read_json(path / name)
    from transformers import AutoTokenizer

    with naming(path):
        return AutoTokenizer.from_pretrained(str(path))
