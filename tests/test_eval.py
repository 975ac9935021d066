"""Eval metrics: unbiased pass@k against brute-force enumeration, mean@n, and the k that are reported."""

from __future__ import annotations

from itertools import combinations

import pytest
import torch

from molt.eval import pass_at_k, set_metrics


def brute_pass_at_k(outcomes: list[bool], k: int) -> float:
    """The fraction of all k-subsets of the samples that hold a correct one (the quantity estimated)."""
    subsets = list(combinations(outcomes, k))
    return sum(any(s) for s in subsets) / len(subsets)


def test_pass_at_k_is_the_exact_subset_average() -> None:
    for n in (1, 2, 5, 8):
        for c in range(n + 1):
            outcomes = [True] * c + [False] * (n - c)
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(brute_pass_at_k(outcomes, k), abs=1e-12)
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)                   # pass@1 = c / n
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)                    # 1 - C(3,2)/C(4,2) = 1 - 3/6
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(4, 1, 5)


def test_set_metrics_names_and_values() -> None:
    # 3 prompts x 4 samples; reward >= 1 is correct, partial credit counts for mean@4 only
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0]])
    m = set_metrics("gsm", rewards, 1.0)
    assert sorted(m) == ["eval/gsm/mean@4", "eval/gsm/pass@1", "eval/gsm/pass@2", "eval/gsm/pass@4"]
    assert m["eval/gsm/mean@4"] == pytest.approx(3.5 / 12)
    assert m["eval/gsm/pass@1"] == pytest.approx((1 / 4 + 2 / 4 + 0) / 3)
    assert m["eval/gsm/pass@2"] == pytest.approx((1 / 2 + 5 / 6 + 0) / 3)
    assert m["eval/gsm/pass@4"] == pytest.approx(2 / 3)
    assert set_metrics("gsm", rewards, 0.5)["eval/gsm/pass@4"] == pytest.approx(2 / 3)   # threshold moves
    assert set_metrics("gsm", rewards, 0.5)["eval/gsm/pass@1"] == pytest.approx((1 / 4 + 3 / 4 + 0) / 3)
    assert sorted(set_metrics("x", torch.zeros(2, 10), 1.0)) == [
        f"eval/x/{m}" for m in ("mean@10", "pass@1", "pass@10", "pass@2", "pass@4", "pass@8")]
