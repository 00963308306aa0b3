import pytest

from lockstep.eval.pass_at_k import ks_up_to, pass_at_k, pass_at_k_metrics


def test_pass_at_k_hand_values():
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # 1 - C(3,2)/C(4,2)
    assert pass_at_k(10, 3, 4) == pytest.approx(1 - 35 / 210)  # 1 - C(7,4)/C(10,4)
    assert pass_at_k(5, 0, 3) == 0.0
    assert pass_at_k(5, 3, 3) == 1.0  # n - c = 2 < k: every draw of 3 holds a correct one
    # Large n: the product form stays finite where the binomials would be astronomically large.
    assert pass_at_k(1000, 1, 1) == pytest.approx(1e-3)
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)


def test_ks_up_to():
    assert ks_up_to(1) == [1]
    assert ks_up_to(8) == [1, 2, 3, 4, 5, 6, 7, 8]  # every k, not only powers of two


def test_metrics_for_a_set():
    rewards = [[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0]]
    finish = [["stop", "length", "stop", "stop"], ["stop"] * 4]
    m = pass_at_k_metrics("gsm8k", rewards, finish)
    # pass@1: (1/4 + 2/4) / 2 ; pass@2: (1 - 3/6 + 1 - 1/6) / 2 ; pass@3: (1 - 1/4 + 1) / 2 ; pass@4: 1
    assert m == pytest.approx({
        "eval/gsm8k/pass@1": 0.375,
        "eval/gsm8k/pass@2": (0.5 + 5 / 6) / 2,
        "eval/gsm8k/pass@3": 0.875,
        "eval/gsm8k/pass@4": 1.0,
        "eval/gsm8k/truncated_ratio": 1 / 8,
    })
    # A partial reward below the threshold is not a success.
    assert pass_at_k_metrics("s", [[0.9, 1.0]])["eval/s/pass@1"] == pytest.approx(0.5)


def test_every_k_up_to_n_as_a_reference_run_reports_pass_at_1_and_8():
    m = pass_at_k_metrics("aime", [[1.0] + [0.0] * 7, [0.0] * 8])
    assert [k for k in m if "pass@" in k] == [f"eval/aime/pass@{k}" for k in range(1, 9)]
    assert m["eval/aime/pass@1"] == pytest.approx(1 / 16) and m["eval/aime/pass@8"] == pytest.approx(0.5)
    assert m["eval/aime/pass@3"] == pytest.approx(3 / 16)  # 1 - C(7,3)/C(8,3) = 3/8 for the first prompt
