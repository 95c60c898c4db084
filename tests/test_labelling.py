"""What to label next (calibration.monitoring.labelling): the teach stream's uncertain, spread-out picks
and the audit stream's uniform order."""

from __future__ import annotations

import numpy as np
import pytest

from calibration.monitoring.labelling import audit_order, margins, teach_order, teach_rounds


def test_a_margin_is_the_top_probability_minus_the_second() -> None:
    p = [[0.5, 0.5, 0.0], [0.9, 0.05, 0.05], [0.2, 0.3, 0.5]]
    assert np.allclose(margins(p), [0.0, 0.85, 0.2])
    with pytest.raises(ValueError, match=r"\(n, k\) with k >= 2"):
        margins([[1.0], [1.0]])


def test_without_features_the_smallest_margins_come_first() -> None:
    p = np.array([[0.9, 0.1], [0.55, 0.45], [0.7, 0.3], [0.5, 0.5], [0.99, 0.01]])
    assert teach_order(p, 3).tolist() == [3, 1, 2]
    assert teach_order(p, 0).tolist() == []
    assert sorted(teach_order(p, 99).tolist()) == [0, 1, 2, 3, 4]  # no more than the pool


def test_the_picks_spread_over_the_features() -> None:
    rng = np.random.default_rng(0)
    # Ten near-duplicates, all a coin toss; three distinct items almost as uncertain; many
    # sure ones. By margin alone the duplicates take every pick.
    duplicates = rng.normal(0.0, 0.01, (10, 4)) + np.array([5.0, 0, 0, 0])
    distinct = np.array([[0.0, 5.0, 0, 0], [0, 0, 5.0, 0], [0, 0, 0, 5.0]])
    sure = rng.normal(0.0, 1.0, (40, 4))
    x = np.concatenate([duplicates, distinct, sure])
    top = np.concatenate([np.full(10, 0.50), np.full(3, 0.52), np.full(40, 0.95)])
    p = np.stack([top, 1 - top], axis=1)
    assert set(teach_order(p, 4).tolist()) <= set(range(10))
    picks = teach_order(p, 4, features=x)
    assert picks[0] == 0  # the most uncertain first
    assert set(picks[1:].tolist()) == {10, 11, 12}  # then the farthest, among the uncertain
    assert len(set(picks.tolist())) == 4
    # Only among the widen * count most uncertain: the sure items are never taken.
    assert set(teach_order(p, 4, features=x, widen=3).tolist()) <= set(range(13))
    with pytest.raises(ValueError, match="features must be"):
        teach_order(p, 4, features=x[:5])
    with pytest.raises(ValueError, match="count"):
        teach_order(p, -1)


def test_the_audit_order_is_a_seeded_uniform_permutation() -> None:
    a = audit_order(50, seed=3)
    assert sorted(a.tolist()) == list(range(50))
    assert np.array_equal(a, audit_order(50, seed=3))
    assert not np.array_equal(a, audit_order(50, seed=4))
    # Every item is equally likely to come first (a uniform sample's first draw).
    firsts = np.bincount([audit_order(5, seed=s)[0] for s in range(5000)], minlength=5)
    assert firsts.min() > 850 and firsts.max() < 1150


def test_the_first_teach_rounds_are_the_whole_order_s_first() -> None:
    """``count`` orders only what a caller shows (GET /profiles/{name}/queue: its next 20),
    and gives exactly the first items of the whole order: each round reads only what the
    rounds before it left (issue 69: ordering thousands on every call took 3 s)."""
    rng = np.random.default_rng(0)
    p = rng.dirichlet([1.0, 1.0], size=137)
    x = rng.normal(size=(137, 5))
    for features in (None, x):
        whole = teach_rounds(p, features=features)
        assert sorted(whole.tolist()) == list(range(137))
        for count in (0, 1, 7, 10, 20, 136, 137, 500):
            first = teach_rounds(p, features=features, count=count)
            assert first.tolist() == whole[:count].tolist(), count
    with pytest.raises(ValueError, match="count"):
        teach_rounds(p, count=-1)
