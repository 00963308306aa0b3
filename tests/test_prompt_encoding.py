"""One prompt -> token ids rule for the server, the rollout and SFT (lockstep/prompt_encoding.py).

Before it had one home, a message list sent to a tokenizer without a chat template was joined with
newlines by the rollout but raised inside the engine, so the same prompt could be tokenised two ways.
"""

import pytest

from lockstep.prompt_encoding import encode_prompt
from lockstep.rl.char_tokenizer import build_char_tokenizer
from lockstep.rl.data import Prompt
from lockstep.rl.rollout import RolloutSpec, make_requests
from lockstep.train.sft import make_examples

MESSAGES = [{"role": "system", "content": "Add."}, {"role": "user", "content": "What is 2 + 3?"}]


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


@pytest.fixture
def plain_tok():
    t = build_char_tokenizer()
    t.chat_template = None
    return t


def rollout_ids(tokenizer, prompt, chat: bool) -> list[int]:
    spec = RolloutSpec(n_samples=1, temperature=1.0, top_p=1.0, max_response_len=4, apply_chat_template=chat, seed=0)
    return make_requests([Prompt(prompt=prompt, label="5", index=0)], tokenizer, spec, ("t",), 0)[0].prompt_ids


@pytest.mark.parametrize("prompt", ["What is 2 + 3?", MESSAGES])
def test_rollout_sft_and_rule_agree(tok, prompt):
    ids = encode_prompt(tok, prompt)
    assert tok.decode(ids).endswith("<|assistant|>")
    assert rollout_ids(tok, prompt, chat=True) == ids
    assert make_examples(tok, [(prompt, "5")])[0].prompt_ids == ids


def test_plain_string_without_template_flag(tok):
    assert rollout_ids(tok, "What is 2 + 3?", chat=False) == tok.encode("What is 2 + 3?")


def test_messages_always_use_the_template(tok):
    # apply_chat_template only decides whether a plain string becomes a user turn
    assert rollout_ids(tok, MESSAGES, chat=False) == encode_prompt(tok, MESSAGES)


def test_messages_without_a_template_are_an_error_everywhere(plain_tok):
    with pytest.raises(ValueError, match="chat template"):
        rollout_ids(plain_tok, MESSAGES, chat=True)
    with pytest.raises(ValueError, match="chat template"):
        encode_prompt(plain_tok, MESSAGES)


def test_string_without_a_template_is_encoded_as_text(plain_tok):
    assert encode_prompt(plain_tok, "What is 2 + 3?") == plain_tok.encode("What is 2 + 3?")
