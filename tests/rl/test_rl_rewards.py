import threading

import pytest

from lockstep.rl.rewards import BUILTIN_REWARDS, get_reward_fn, load_custom_reward, safe_reward, score_all
from lockstep.rl.rewards import arithmetic, dapo, gsm8k
from lockstep.rl.rewards import math as math_reward


@pytest.mark.parametrize(
    "response,label,expected",
    [
        ("step one\nAnswer: $34$", "34", 1.0),
        ("answer: 34.", "34", 1.0),
        ("Answer: \\boxed{1,000}", "1000", 1.0),
        ("Answer: x = 34", "34", 1.0),
        ("Answer: 12 dollars", "12", 1.0),
        ("Answer: 3\nthen Answer: 4", "4", 1.0),  # the last one counts
        ("Answer: 3\nthen Answer: 4", "3", 0.0),
        ("the result is 34", "34", 0.0),  # no "Answer:" line
        ("Answer: 34" + " pad" * 100, "34", 0.0),  # the answer line itself keeps the padding
        ("Answer: 34\n" + "x" * 400, "34", 0.0),  # only the last 300 characters are read
    ],
)
def test_dapo(response, label, expected):
    assert dapo.reward(response, label) == expected


def test_dapo_normalize():
    assert dapo.normalize_answer("$\\text{90}^\\circ$.") == "90"
    assert dapo.normalize_answer("\\frac{1}{2}") == "\\frac{1}{2}"


def test_math_verify_reward():
    assert math_reward.reward("so \\boxed{\\frac{1}{2}}", "0.5") == 1.0
    label = "\\left( 3, \\frac{\\pi}{2} \\right)"  # MATH-500 row 0
    assert math_reward.reward("polar: $\\boxed{(3, \\frac{\\pi}{2})}$", label) == 1.0
    assert math_reward.reward("\\boxed{2} then \\boxed{3}", "3") == 1.0  # last box
    assert math_reward.reward("\\boxed{2} then \\boxed{3}", "2") == 0.0
    assert math_reward.reward("the answer is 3", "3") == 0.0  # no box
    assert math_reward.reward("\\boxed{3", "3") == 0.0  # truncated box
    assert math_reward.last_boxed("x \\boxed{\\frac{a}{b}} y") == "\\frac{a}{b}"


def test_math_reward_works_off_the_main_thread():
    out = []
    t = threading.Thread(target=lambda: out.append(math_reward.reward("\\boxed{\\frac{2}{4}}", "\\frac12")))
    t.start()
    t.join(timeout=30)
    assert out == [1.0]


def test_gsm8k_reward():
    label = "He makes 9 * 2 = $<<9*2=18>>18.\n#### 18"
    assert gsm8k.reward("So she makes $18.00 every day.", label) == 1.0
    assert gsm8k.reward("18 eggs... no wait, 17", label) == 0.0
    assert gsm8k.reward("The total is 1,080 dollars.", "#### 1080") == 1.0
    assert gsm8k.reward("no number here", label) == 0.0
    assert gsm8k.reward("-3", "#### -3") == 1.0


def test_arithmetic_reward():
    assert arithmetic.reward("23 + 58 = 81. Answer: 81", "81") == 1.0
    assert arithmetic.reward("Answer: 80, I mean 81", "81") == 0.0  # "Answer:" wins over the last integer
    assert arithmetic.reward("it is 81", "81") == 1.0
    assert arithmetic.reward("Answer: -4", "-4") == 1.0
    assert arithmetic.reward("nothing", "81") == 0.0


def test_registry_and_custom_loading(tmp_path):
    for name in BUILTIN_REWARDS:
        assert callable(get_reward_fn(name))
    assert get_reward_fn("arithmetic")("Answer: 5", "5") == 1.0
    with pytest.raises(ValueError, match="unknown reward"):
        get_reward_fn("nope")
    f = tmp_path / "my_reward.py"
    f.write_text("def score(response, label):\n    return float(len(response) == int(label))\n")
    fn = get_reward_fn(f"{f}:score")
    assert fn("abc", "3") == 1.0 and fn("ab", "3") == 0.0
    assert load_custom_reward("lockstep.rl.rewards.gsm8k:reward") is gsm8k.reward
    with pytest.raises(ValueError, match="module:function"):
        load_custom_reward("lockstep.rl.rewards.gsm8k")
    with pytest.raises(ValueError, match="no callable"):
        load_custom_reward("lockstep.rl.rewards.gsm8k:missing")
    with pytest.raises(ValueError, match="cannot import no_such_module"):  # was a traceback from the CLI
        load_custom_reward("no_such_module:score")


def test_safe_reward_counts_errors():
    def boom(response, label):
        raise RuntimeError("bug in a custom reward")

    assert safe_reward(boom, "x", "y") == (0.0, True)
    assert safe_reward(lambda r, l: float("nan"), "x", "y") == (0.0, True)
    assert safe_reward(lambda r, l: True, "x", "y") == (1.0, False)
    assert safe_reward(arithmetic.reward, "Answer: 1", "not-an-int") == (0.0, True)
    rewards, errors = score_all(arithmetic.reward, ["Answer: 1", "Answer: 2", "3"], ["1", "bad", "4"])
    assert rewards == [1.0, 0.0, 0.0] and errors == 1
