"""Monitoring a served profile: Clopper-Pearson audits, drift tests, prediction-powered shares.

The synthetic world here (``draw``) is also the one benchmarks/bench_monitoring.py deploys.
"""

from __future__ import annotations

import itertools
import math

import msgspec
import numpy as np
import numpy.typing as npt
import pytest
from scipy import stats

from calibration.errors import RuleError
from calibration.monitoring.health import (
    MAX_REFERENCE,
    MIN_DRIFT_ITEMS,
    Reference,
    audited_precision,
    drift_test,
    prediction_powered_shares,
    reference_of,
)

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


def draw(
    rng: np.random.Generator,
    n: int,
    prior: npt.ArrayLike,
    margin: float,
    *,
    model_prior: npt.ArrayLike | None = None,
    model_margin: float | None = None,
) -> tuple[FloatArray, IntArray]:
    """n items of a k-choice task: labels and the judge's calibrated probabilities, (n, k).

    y ~ prior; the judge's scores are s = margin * onehot(y) + N(0, I_k), so the exact
    posterior is softmax(log prior + margin * s). The judge computes it with the prior and
    margin it was calibrated on (by default the true ones: then it is perfectly calibrated);
    live traffic whose prior or margin differs makes it miscalibrated.
    """
    pi = np.asarray(prior, dtype=np.float64)
    k = pi.shape[0]
    y = rng.choice(k, size=n, p=pi)
    s = margin * np.eye(k)[y] + rng.standard_normal((n, k))  # (n, k)
    m_pi = pi if model_prior is None else np.asarray(model_prior, dtype=np.float64)
    m = margin if model_margin is None else model_margin
    z = np.log(m_pi) + m * s
    p = np.exp(z - z.max(axis=1, keepdims=True))
    return p / p.sum(axis=1, keepdims=True), y


# --- audited_precision: a bet against the target, valid however often checked -------------


def test_the_confidence_sequence_covers_at_every_label() -> None:
    """300 streams of 300 labels at precision 0.8: the bounds after the last label are the
    running intersection of every earlier look's, so they hold the truth iff every look did:
    in >= 1 - alpha of the streams."""
    rng = np.random.default_rng(29)
    alpha, sims = 0.1, 300
    held = 0
    for _ in range(sims):
        check = audited_precision(rng.random(300) < 0.8, target=0.5, alpha=alpha)
        assert check.lower is not None and check.upper is not None
        assert 0.0 <= check.lower <= check.upper <= 1.0
        held += check.lower <= 0.8 <= check.upper
    assert held / sims >= 1 - alpha - 3 * np.sqrt(alpha * (1 - alpha) / sims)
    # The price of holding at every label: wider than one fixed-n Clopper-Pearson interval.
    shuffled = np.random.default_rng(1).permutation(300) < 240
    last = audited_precision(shuffled, target=0.5, alpha=alpha)
    assert last.upper is not None and last.upper > float(stats.beta.ppf(0.95, 241, 60))
    # Far from exchangeable (every label right, then every one wrong): still an interval.
    runs = audited_precision(np.arange(300) < 240, target=0.5, alpha=alpha)
    assert runs.lower is not None and runs.upper is not None and runs.lower <= runs.upper


def test_edge_cases() -> None:
    none = audited_precision([False] * 20, target=0.9, alpha=0.1)
    assert none.contradicts and none.upper is not None and none.upper < 0.5
    every = audited_precision(np.ones(200, dtype=bool), target=0.99, alpha=0.1)
    assert not every.contradicts  # all correct never contradicts, whatever the target
    assert every.max_capital == 1.0 and every.upper == 1.0
    assert not audited_precision([1], target=1.0).contradicts
    assert audited_precision([1, 1, 0], target=1.0).contradicts  # one miss refutes 1.0


def test_false_alarm_rate_checked_after_every_label_is_at_most_alpha() -> None:
    """1,000 streams of 400 labels at exactly the target precision, checked after every label:
    the bet raises a false alarm in at most alpha of them (Ville); the Clopper-Pearson test
    this replaced, run the same way, in far more."""
    from calibration.monitoring.sequential import betting_capital

    rng = np.random.default_rng(30)
    alpha, target, streams, n = 0.05, 0.9, 1000, 400
    x = rng.random((streams, n)) < target
    bet = sum(bool(betting_capital(row.astype(float), target).max() >= 1 / alpha) for row in x)
    hits = np.cumsum(x, axis=1)
    trials = np.arange(1, n + 1)
    # Per-check Clopper-Pearson from 20 labels on: upper bound < target at any label.
    upper = stats.beta.ppf(1 - alpha, hits + 1, np.maximum(trials - hits, 1e-12))
    upper = np.where(hits == trials, 1.0, upper)
    per_check = int((upper[:, 19:] < target).any(axis=1).sum())
    slack = 3 * np.sqrt(alpha * (1 - alpha) / streams)
    assert bet / streams <= alpha + slack
    assert per_check / streams > 2 * alpha  # why the per-check test had to go


def test_a_five_point_drop_is_caught() -> None:
    """Precision 0.85 under a 0.9 certificate: caught in 95% of 200 streams within 2,000
    audited accepted labels (benchmarks/bench_monitoring.py states the delay)."""
    from calibration.monitoring.sequential import betting_capital

    rng = np.random.default_rng(31)
    caught = [
        bool(betting_capital((rng.random(2000) < 0.85).astype(float), 0.9).max() >= 20)
        for _ in range(200)
    ]
    assert np.mean(caught) >= 0.95


def test_nothing_to_check_without_audits() -> None:
    check = audited_precision([], target=0.9)
    assert (check.n, check.precision, check.lower, check.upper) == (0, None, None, None)
    assert not check.contradicts and "nothing to check" in check.reason


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"correct": [1, 0], "target": 0.0}, "target"),
        ({"correct": [1, 0], "target": 1.2}, "target"),
        ({"correct": [1, 0], "target": True}, "target"),
        ({"correct": [1, 0], "target": 0.9, "alpha": 1.0}, "alpha"),
        ({"correct": [[1, 0]], "target": 0.9}, "correct"),
        ({"correct": [1, 2], "target": 0.9}, "correct"),
    ],
)
def test_audited_precision_refuses_bad_input(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        audited_precision(**kwargs)  # type: ignore[arg-type]


# --- reference_of and Reference ------------------------------------------------------------


def test_reference_keeps_every_item_when_there_are_few() -> None:
    p, y = draw(np.random.default_rng(0), 600, [0.5, 0.3, 0.2], 2.0)
    ref = reference_of(p, y, source="600 held-out items")
    assert ref.n == 600 and ref.confidence == pytest.approx(p.max(axis=1))
    assert ref.choice_counts == np.bincount(p.argmax(axis=1), minlength=3).tolist()
    assert ref.label_counts == np.bincount(y, minlength=3).tolist()
    assert reference_of(p, source="no labels").label_counts is None


def test_reference_subsamples_confidences_uniformly_and_reproducibly() -> None:
    p, _ = draw(np.random.default_rng(1), 5000, [0.7, 0.3], 2.0)
    ref = reference_of(p, source="s", seed=3)
    assert ref.n == 5000 and len(ref.confidence) == MAX_REFERENCE
    assert sum(ref.choice_counts) == 5000  # the counts are over every item
    conf = p.max(axis=1)
    assert set(ref.confidence) <= set(conf.tolist())
    assert len(set(ref.confidence)) == MAX_REFERENCE  # without replacement
    assert reference_of(p, source="s", seed=3) == ref
    assert reference_of(p, source="s", seed=4).confidence != ref.confidence
    # uniform: the subsample looks like the whole
    assert stats.ks_2samp(ref.confidence, conf).pvalue > 0.01
    assert len(reference_of(p, source="s", max_items=10).confidence) == 10
    with pytest.raises(ValueError, match="max_items"):
        reference_of(p, source="s", max_items=MAX_REFERENCE + 1)


def test_reference_round_trips_and_refuses_unknown_fields() -> None:
    p, y = draw(np.random.default_rng(2), 100, [0.5, 0.5], 1.0)
    ref = reference_of(p, y, source="s")
    assert msgspec.json.decode(msgspec.json.encode(ref), type=Reference) == ref
    raw = msgspec.json.decode(msgspec.json.encode(ref))
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(msgspec.json.encode({**raw, "extra": 1}), type=Reference)


GOOD = {
    "source": "s",
    "n": 4,
    "confidence": [0.9, 0.6, 0.7],
    "choice_counts": [3, 1],
    "label_counts": [2, 2],
}


@pytest.mark.parametrize(
    "change",
    [
        {"n": 0},
        {"confidence": []},
        {"confidence": [0.9, 0.6, 0.7, 0.8, 0.5]},  # more than n
        {"confidence": [0.9, float("nan"), 0.7]},
        {"confidence": [0.9, 1.5, 0.7]},
        {"choice_counts": [3, 2]},  # sums to 5, not n
        {"choice_counts": [5, -1]},
        {"choice_counts": [4]},
        {"label_counts": [1, 1, 2]},  # not one per choice
        {"label_counts": [1, 2]},
    ],
)
def test_reference_refuses_bad_data(change: dict[str, object]) -> None:
    assert Reference(**GOOD)  # type: ignore[arg-type]
    with pytest.raises(RuleError):
        Reference(**{**GOOD, **change})  # type: ignore[arg-type]
    # decoding runs the same checks (or the schema's own, for n and NaN)
    with pytest.raises((RuleError, msgspec.ValidationError)):
        msgspec.json.decode(msgspec.json.encode({**GOOD, **change}), type=Reference)


# --- drift_test -----------------------------------------------------------------------------


def _live(p: FloatArray) -> tuple[FloatArray, IntArray]:
    return p.max(axis=1), p.argmax(axis=1)


def test_no_drift_false_alarm_rate_is_at_most_alpha() -> None:
    """400 seeded reference/live pairs from one distribution, alpha 0.05: the alarm rate
    stays below alpha plus three binomial standard errors."""
    rng = np.random.default_rng(10)
    alpha, sims = 0.05, 400
    alarms, p_values = 0, []
    for i in range(sims):
        prior = [0.7, 0.3] if i % 2 else [0.5, 0.3, 0.2]
        ref = reference_of(draw(rng, 600, prior, 2.0)[0], source="ref")
        result = drift_test(ref, *_live(draw(rng, 300, prior, 2.0)[0]), alpha=alpha)
        assert result.confidence_p is not None and result.choice_p is not None
        assert result.drifted == (min(result.confidence_p, result.choice_p) < alpha / 2)
        alarms += result.drifted
        p_values.append((result.confidence_p, result.choice_p))
    assert alarms / sims <= alpha + 3 * np.sqrt(alpha * (1 - alpha) / sims)
    # neither test is anti-conservative: P(p < level) <= level (+ Monte Carlo slack)
    for ps in np.array(p_values).T:
        for level in (0.05, 0.1, 0.2, 0.5):
            assert np.mean(ps < level) <= level + 3 * np.sqrt(level * (1 - level) / sims)


@pytest.mark.parametrize("prior", [[0.7, 0.3], [0.5, 0.3, 0.2]])
def test_label_prior_shift_is_caught_by_the_choice_test(prior: list[float]) -> None:
    rng = np.random.default_rng(11)
    shifted = prior[::-1]  # the minority class becomes the majority
    caught = 0
    for _ in range(40):
        ref = reference_of(draw(rng, 600, prior, 2.0)[0], source="ref")
        p, _ = draw(rng, 500, shifted, 2.0, model_prior=prior)
        result = drift_test(ref, *_live(p))
        caught += result.drifted and result.choice_p is not None and result.choice_p < 0.005
    assert caught >= 36
    assert "top-choice shares moved" in result.reason


def test_confidence_shift_is_caught_by_the_ks_test() -> None:
    """Harder inputs (the margin halves) under the same label prior: confidence falls."""
    rng = np.random.default_rng(12)
    caught = 0
    for _ in range(40):
        ref = reference_of(draw(rng, 600, [0.7, 0.3], 2.0)[0], source="ref")
        p, _ = draw(rng, 500, [0.7, 0.3], 1.0, model_margin=2.0)
        result = drift_test(ref, *_live(p))
        caught += result.drifted and result.confidence_p is not None and result.confidence_p < 0.005
    assert caught >= 36
    assert "confidence distribution moved" in result.reason


def test_too_few_live_items_are_not_tested() -> None:
    rng = np.random.default_rng(13)
    ref = reference_of(draw(rng, 600, [0.5, 0.5], 2.0)[0], source="ref")
    conf, top = _live(draw(rng, MIN_DRIFT_ITEMS, [0.5, 0.5], 2.0)[0])
    few = drift_test(ref, conf[:-1], np.zeros(MIN_DRIFT_ITEMS - 1, dtype=int))  # all one choice
    assert not few.drifted and few.confidence_p is None and few.choice_p is None
    assert few.n_live == MIN_DRIFT_ITEMS - 1 and "not tested" in few.reason
    assert drift_test(ref, [], []).n_live == 0
    assert drift_test(ref, conf, top).choice_p is not None


def _exact_homogeneity_p(live: list[int], reference: list[int]) -> float:
    """P(chi-square >= observed) over every table with the observed margins (brute force):
    the live row is multivariate hypergeometric given the column totals."""
    cols = np.add(live, reference)
    rows = np.array([sum(live), sum(reference)])
    expected = np.outer(rows, cols) / rows.sum()

    def chi(a: tuple[int, ...]) -> float:
        table = np.array([a, cols - np.array(a)], dtype=float)
        return float(((table - expected) ** 2 / expected).sum())

    observed, p = chi(tuple(live)), 0.0
    for a in itertools.product(*(range(c + 1) for c in cols)):
        if sum(a) == rows[0] and chi(a) >= observed - 1e-9:
            ways = math.prod(math.comb(int(c), x) for c, x in zip(cols, a, strict=True))
            p += ways / math.comb(int(rows.sum()), int(rows[0]))
    return p


def test_small_counts_use_monte_carlo_tables_that_match_the_exact_test() -> None:
    # 3 choices, one rare: expected counts below 5, so the chi-square approximation is off.
    ref = Reference(
        source="s", n=40, confidence=[0.8] * 40, choice_counts=[30, 8, 2], label_counts=None
    )
    live_counts = [40, 6, 4]
    choice = np.repeat(np.arange(3), live_counts)
    result = drift_test(ref, np.full(50, 0.8), choice)
    assert result.choice_p is not None and "Monte Carlo" in result.reason
    exact = _exact_homogeneity_p(live_counts, [30, 8, 2])
    assert result.choice_p == pytest.approx(exact, abs=0.01)
    # the same counts always give the same p-value
    assert drift_test(ref, np.full(50, 0.8), choice[::-1]).choice_p == result.choice_p


def test_a_choice_neither_side_chose_is_dropped() -> None:
    ref = Reference(
        source="s", n=100, confidence=[0.9] * 100, choice_counts=[60, 40, 0], label_counts=None
    )
    rng = np.random.default_rng(14)
    choice = rng.choice(2, size=200, p=[0.6, 0.4])
    result = drift_test(ref, rng.uniform(0.5, 1.0, 200), choice)
    table = [[int((choice == 0).sum()), int((choice == 1).sum())], [60, 40]]
    want = stats.chi2_contingency(table, correction=False)
    assert result.choice_statistic == pytest.approx(want.statistic)
    assert result.choice_p == pytest.approx(want.pvalue)
    # every item on both sides has one top choice: nothing moved
    one = Reference(source="s", n=60, confidence=[0.9], choice_counts=[0, 60], label_counts=None)
    same = drift_test(one, np.full(80, 0.9), np.ones(80, dtype=int))
    assert same.choice_p == 1.0 and same.confidence_p == pytest.approx(1.0)
    assert not same.drifted


@pytest.mark.parametrize(
    ("confidence", "choice", "alpha", "match"),
    [
        ([0.5, 1.2], [0, 1], 0.01, "confidence"),
        ([[0.5, 0.7]], [0, 1], 0.01, "confidence"),
        ([0.5, 0.7], [0, 2], 0.01, "choice"),
        ([0.5, 0.7], [0], 0.01, "choice"),
        ([0.5, 0.7], [0, 1], 0.0, "alpha"),
    ],
)
def test_drift_test_refuses_bad_input(
    confidence: list[object], choice: list[int], alpha: float, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        drift_test(Reference(**GOOD), confidence, choice, alpha=alpha)  # type: ignore[arg-type]


# --- prediction_powered_shares --------------------------------------------------------------


def _audit(
    rng: np.random.Generator, n: int, prior: list[float], **kw: float | list[float]
) -> tuple[FloatArray, IntArray, FloatArray, IntArray]:
    p, y = draw(rng, n, prior, 1.5, **kw)  # type: ignore[arg-type]
    audited = rng.random(n) < 0.05
    return p[~audited], y[~audited], p[audited], y[audited]


@pytest.mark.parametrize("model_prior", [None, [0.2, 0.3, 0.5]])  # calibrated, then not
def test_prediction_powered_intervals_cover_the_true_shares(
    model_prior: list[float] | None,
) -> None:
    """Simultaneous coverage over 400 audited streams, even when the judge's prior is wrong
    (its mean prediction is then far off, and the rectifier repairs it)."""
    rng = np.random.default_rng(20)
    prior, alpha, sims = [0.5, 0.3, 0.2], 0.1, 400
    kw = {} if model_prior is None else {"model_prior": model_prior}
    covered = 0
    for _ in range(sims):
        pu, _, pl, yl = _audit(rng, 3000, prior, **kw)
        est = prediction_powered_shares(["a", "b", "c"], pu, pl, yl, alpha=alpha)
        covered += all(lo <= t <= hi for lo, t, hi in zip(est.lower, prior, est.upper, strict=True))
    assert covered / sims >= 1 - alpha - 3 * np.sqrt(alpha * (1 - alpha) / sims)
    if model_prior is not None:  # the judge alone is biased: its mean misses the truth
        assert abs(pu.mean(axis=0)[2] - prior[2]) > 0.1


def test_prediction_powered_intervals_beat_the_audits_alone() -> None:
    from calibration.monitoring.sequential import asymptotic_half_width

    rng = np.random.default_rng(21)
    p, y = draw(rng, 4000, [0.6, 0.4], 3.0)
    pu, pl, yl = p[200:], p[:200], y[:200]
    est = prediction_powered_shares(["yes", "no"], pu, pl, yl, alpha=0.05)
    onehot = np.eye(2)[yl]
    # The audits alone, with the same kind of interval: a confidence sequence at alpha.
    alone = [2 * asymptotic_half_width(200, float(onehot[:, j].var()), 0.05) for j in range(2)]
    width = np.subtract(est.upper, est.lower)
    assert np.all(width < 0.6 * np.array(alone))
    assert est.estimate == pytest.approx([0.6, 0.4], abs=0.04)
    assert est.n_unlabeled == 3800 and est.n_labeled == 200
    assert "Bonferroni" not in est.method  # two choices: one event


def test_prediction_powered_estimate_is_ppi_plus_plus() -> None:
    from calibration.monitoring.estimates import ppi_mean
    from calibration.monitoring.sequential import asymptotic_half_width

    rng = np.random.default_rng(22)
    pu, _, pl, yl = _audit(rng, 2000, [0.5, 0.3, 0.2])
    est = prediction_powered_shares(["a", "b", "c"], pu, pl, yl, alpha=0.05)
    onehot = np.eye(3)[yl]
    for j in range(3):
        tuned = ppi_mean(onehot[:, j], pl[:, j], pu[:, j])
        assert est.estimate[j] == pytest.approx(tuned.estimate)
        lam = tuned.lam
        half = asymptotic_half_width(
            len(pu), float((lam * pu[:, j]).var()), 0.05 / 6
        ) + asymptotic_half_width(len(pl), float((onehot[:, j] - lam * pl[:, j]).var()), 0.05 / 6)
        assert est.upper[j] == pytest.approx(min(1.0, tuned.estimate + half))
    assert "Bonferroni over 3" in est.method


def test_shares_hold_at_every_recomputation() -> None:
    """300 streams, the shares recomputed after every 25th label up to 500 (20 looks): the
    intervals hold at all looks at once in >= 1 - alpha of the streams."""
    rng = np.random.default_rng(24)
    prior, alpha, sims = [0.5, 0.3, 0.2], 0.1, 300
    held = 0
    for _ in range(sims):
        p, y = draw(rng, 10_500, prior, 1.5)
        pu, pl, yl = p[500:], p[:500], y[:500]
        looks = (
            prediction_powered_shares(["a", "b", "c"], pu[: 20 * t], pl[:t], yl[:t], alpha=alpha)
            for t in range(25, 501, 25)
        )
        held += all(
            all(lo <= t <= hi for lo, t, hi in zip(e.lower, prior, e.upper, strict=True))
            for e in looks
        )
    assert held / sims >= 1 - alpha - 3 * np.sqrt(alpha * (1 - alpha) / sims)


def test_prediction_powered_shares_refuses_bad_input() -> None:
    rng = np.random.default_rng(23)
    p, y = draw(rng, 50, [0.5, 0.5], 1.0)
    with pytest.raises(ValueError, match=r"labeled_probabilities.*at least 2"):
        prediction_powered_shares(["a", "b"], p, p[:1], y[:1])
    with pytest.raises(ValueError, match=r"unlabeled_probabilities.*at least 2"):
        prediction_powered_shares(["a", "b"], p[:1], p, y)
    with pytest.raises(ValueError, match="columns"):
        prediction_powered_shares(["a", "b", "c"], p, p, y)
    with pytest.raises(ValueError, match="distinct"):
        prediction_powered_shares(["a", "a"], p, p, y)
    with pytest.raises(ValueError, match="labels"):
        prediction_powered_shares(["a", "b"], p, p, y[:-1])
    with pytest.raises(ValueError, match="alpha"):
        prediction_powered_shares(["a", "b"], p, p, y, alpha=2.0)
