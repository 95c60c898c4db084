"""PPI++ estimates for a whole dataset, in simulation (issue 58): coverage of each choice's
share and of the judge's accuracy, and the intervals' width against the labels alone.

Each draw is a dataset of 10,250 items: labels from a skewed prior over k choices, and a
judge's probabilities (``judged``: its confidence in its answer Beta-distributed about its
accuracy, and right that often, so calibrated unless a setting says otherwise). 250 items
are labelled, drawn uniformly; the other 10,000 are not. ``calibration.monitoring.estimates`` estimates
the first choice's share and the judge's accuracy over the whole dataset at alpha 0.1; the
truth is the dataset's own. Settings: the issue's judge (accuracy 0.85, two choices), a
sharper one with four, a weak one, an overconfident one, and one that knows nothing.

    python benchmarks/bench_estimates.py [--draws 1000]

It times nothing: a busy machine changes no number. tests/test_estimates.py runs fewer draws.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from calibration.monitoring.estimates import dataset_estimate

RESULTS = Path(__file__).resolve().parent / "results" / "bench_estimates.json"
LABELS, UNLABELLED, ALPHA = 250, 10_000, 0.1


def judged(
    rng: np.random.Generator, m: int, k: int, accuracy: float, *, sharpen: float = 1.0
) -> tuple[np.ndarray, np.ndarray]:
    """``m`` items with labels from a skewed prior over ``k`` choices and a judge's
    probabilities: its confidence in its answer Beta-distributed about ``accuracy`` (a spread
    of 4: most items near 1, a tail down to a coin toss, as a classifier's) and right that
    often (calibrated; ``sharpen`` < 1 makes it overconfident, 0 a judge that knows nothing)."""
    prior = np.linspace(1.0, 2.0, k)
    y = rng.choice(k, size=m, p=prior / prior.sum())
    spread = 4.0
    confidence = rng.beta(accuracy * spread, (1 - accuracy) * spread, m)
    confidence = np.clip(confidence, 1 / k + 1e-3, 1 - 1e-6)
    right = rng.random(m) < confidence
    other = (y + rng.integers(1, k, m)) % k
    answer = np.where(right, y, other)
    shown = np.clip(confidence**sharpen if sharpen else np.full(m, 1 / k), 1 / k, 1 - 1e-9)
    p = np.tile(((1 - shown) / (k - 1))[:, None], (1, k))
    p[np.arange(m), answer] = shown
    if sharpen == 0:
        p = rng.dirichlet(np.ones(k), m)
    return p, y


# Each setting: (choices, accuracy, sharpen); the first is the judge of accuracy 0.85.
SETTINGS = {
    "calibrated 0.85": (2, 0.85, 1.0),
    "calibrated 0.95, 4 choices": (4, 0.95, 1.0),
    "weak 0.6, 3 choices": (3, 0.6, 1.0),
    "overconfident 0.75": (2, 0.75, 0.3),
    "knows nothing": (3, 0.5, 0.0),
}


def simulate(setting: str, draws: int, seed: int = 0) -> dict[str, float]:
    """Coverage and mean width of the first choice's share and of the accuracy, PPI++ against
    the labels alone: ``LABELS`` drawn uniformly from a dataset of ``LABELS + UNLABELLED``."""
    k, accuracy, sharpen = SETTINGS[setting]
    rng = np.random.default_rng(seed)
    hits = {"share": 0, "accuracy": 0}
    width = {"share": 0.0, "share labels": 0.0, "accuracy": 0.0, "accuracy labels": 0.0}
    for _ in range(draws):
        p, y = judged(rng, LABELS + UNLABELLED, k, accuracy, sharpen=sharpen)
        order = rng.permutation(LABELS + UNLABELLED)
        labelled, rest = order[:LABELS], order[LABELS:]
        est = dataset_estimate(
            [str(j) for j in range(k)], p[rest], p[labelled], y[labelled], alpha=0.1
        )
        share, truth = est.shares[0], float((y == 0).mean())
        hits["share"] += share.ppi.lower <= truth <= share.ppi.upper
        right = float((p.argmax(axis=1) == y).mean())
        hits["accuracy"] += est.accuracy.lower <= right <= est.accuracy.upper
        width["share"] += share.ppi.upper - share.ppi.lower
        width["share labels"] += share.labels_only.upper - share.labels_only.lower
        width["accuracy"] += est.accuracy.upper - est.accuracy.lower
        width["accuracy labels"] += est.accuracy_labels_only.upper - est.accuracy_labels_only.lower
    return {
        "share coverage": hits["share"] / draws,
        "accuracy coverage": hits["accuracy"] / draws,
        **{f"{name} width": total / draws for name, total in width.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draws", type=int, default=1000)
    args = parser.parse_args()
    rows = {setting: simulate(setting, args.draws) for setting in SETTINGS}
    print(f"{args.draws} draws each; {LABELS} labels, {UNLABELLED} unlabelled; alpha {ALPHA}")
    print(
        "| setting | share cover | share width PPI++ / labels | accuracy cover | accuracy width PPI++ / labels |"
    )
    print("|---|---|---|---|---|")
    for setting, r in rows.items():
        print(
            f"| {setting} | {r['share coverage']:.3f} | {r['share width']:.4f} / "
            f"{r['share labels width']:.4f} ({r['share width'] / r['share labels width']:.2f}) | "
            f"{r['accuracy coverage']:.3f} | {r['accuracy width']:.4f} / "
            f"{r['accuracy labels width']:.4f} "
            f"({r['accuracy width'] / r['accuracy labels width']:.2f}) |"
        )
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(
        json.dumps(
            {"draws": args.draws, "python": platform.python_version(), "rows": rows}, indent=2
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
