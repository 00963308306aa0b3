"""A real, character-level Hugging Face tokenizer for the embedded default model.

One token per printable ASCII character plus a few special tokens, built with the
`tokenizers` library and wrapped in `PreTrainedTokenizerFast` with a chat template, so the
tiny bundled model goes through exactly the same tokenizer / chat-template code paths as a
real checkpoint (AutoTokenizer.from_pretrained, apply_chat_template, decode).

    <|user|>What is 23 + 58?<|assistant|>81<|end|>
"""

from __future__ import annotations

import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIAL = ["<|pad|>", "<|end|>", "<|bos|>", "<|unk|>", "<|system|>", "<|user|>", "<|assistant|>"]
CHARS = [c for c in string.printable if c not in "\t\r\x0b\x0c"]  # 96 printable characters incl. '\n'
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}"
    "{% if message['role'] == 'assistant' %}<|end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {tok: i for i, tok in enumerate(SPECIAL + CHARS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|unk|>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<|pad|>", eos_token="<|end|>", bos_token="<|bos|>", unk_token="<|unk|>",
        additional_special_tokens=["<|system|>", "<|user|>", "<|assistant|>"],
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok
