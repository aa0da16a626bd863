"""Metric functions checked against hand-computed examples."""

import pytest

from draftsmith.eval.metrics import Sample, aggregate, by_category, compare, per_position_acceptance, speedup, \
    sum_positions, tau


def test_tau_includes_bonus_token():
    # 3 verifications: accepted 2, 0, 3 drafts -> emitted 3 + 1 + 4 = 8 tokens
    assert tau(8, 3) == pytest.approx(8 / 3)
    assert tau(5, 5) == 1.0  # target-only: one token per verification
    assert tau(0, 0) == 0.0


def test_per_position_acceptance_and_sums():
    assert sum_positions([[3, 2], [1, 1, 1], []]) == [4, 3, 1]
    assert per_position_acceptance([4, 3, 1], [8, 8, 0]) == [0.5, 0.375, 0.0]


def test_speedup():
    assert speedup(30.0, 20.0) == 1.5
    assert speedup(10.0, 0.0) == 0.0


def test_aggregate_and_by_category_by_hand():
    # a: prefill token + 4 verifications emitting 10 (tau 2.5); b: 4 verifications emitting 6 (tau 1.5)
    spec = [Sample("a", new_tokens=11, verifications=4, seconds=1.0, accepted=[3, 2], proposed=[4, 4],
                   emitted_per_verification=[3, 1, 4, 2]),
            Sample("b", new_tokens=7, verifications=4, seconds=1.0, accepted=[1, 0], proposed=[4, 4],
                   emitted_per_verification=[2, 1, 2, 1])]
    base = [Sample("a", new_tokens=11, verifications=10, seconds=2.0),
            Sample("b", new_tokens=7, verifications=6, seconds=1.5)]
    agg = aggregate(spec)
    assert agg["tau"] == 16 / 8 and agg["tokens_per_s"] == 9.0
    assert agg["per_position_acceptance"] == [0.5, 0.25]
    assert aggregate(base)["tau"] == 1.0  # target-only: emitted defaults to new_tokens - 1
    # tokens emitted by one verification -> how many verifications emitted that many (JSON keys, ascending)
    assert agg["accepted_length_histogram"] == {"1": 3, "2": 3, "3": 1, "4": 1}
    assert aggregate(base)["accepted_length_histogram"] == {"1": 16}
    hist = agg["accepted_length_histogram"]
    assert sum(int(n) * c for n, c in hist.items()) / sum(hist.values()) == agg["tau"]
    c = compare(spec, base)
    assert c["target_only_tokens_per_s"] == pytest.approx(18 / 3.5)
    assert c["speedup"] == pytest.approx(9.0 / (18 / 3.5))
    cats = by_category(spec, base)
    assert list(cats) == ["a", "b"]
    assert cats["a"]["tau"] == 2.5 and cats["a"]["speedup"] == pytest.approx(11.0 / 5.5)
    assert cats["b"]["tau"] == 1.5 and cats["b"]["speedup"] == pytest.approx(7.0 / (7 / 1.5))
    with pytest.raises(ValueError):
        by_category(spec, base[:1])
