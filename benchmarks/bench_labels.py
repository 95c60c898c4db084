"""What N labels buy: a profile fitted on N labeled items, its served policy measured on test,
against what a user with the same labels would train instead (TF-IDF + logistic regression).

For each task, N labeled items are drawn from the calibration split (several draws per N,
stratified by label; N from 16 to all of it: the label curve), and two arms are fitted on them:

* **probe**: a profile with ``methods="auto"`` (the probe on the pass's hidden state competing
  with the scalar maps, as ``judge calibrate`` does by default);
* **tfidf**: word (1-2) and character (2-5) TF-IDF n-grams with a logistic regression
  (scikit-learn; C by cross-validation), trained on the fit items of the probe's split (5:1:4,
  ``split_examples``) only, its log-probabilities then fitted and certified by the same
  ``fit_profile`` on that split (``probe_split=True``): the map on the fit items' out-of-fold
  log-probabilities, the conformal and certify items never seen by the classifier. So both arms
  learn from the same items and are certified on the same items. Its test accuracy trained on
  all N labels, uncertified, as a user would train it, is reported beside
  (``accuracy_all_labels``).

Each served policy, every gate included, is measured on the whole test split at each target
precision: how often a threshold was certified, how often the test precision then met the
target, and the mean test accuracy and coverage. The judgments are bench_calibration.py's
cache (judged once if missing).

    python benchmarks/bench_labels.py [--tasks sst2 sms_spam ag_news] [--draws 3]
        [--sizes 16 32 64 128 256] [--arms probe tfidf]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from benchlib import cpu_model

from calibration import FitSettings
from calibration.limits import MIN_EXAMPLES
from judge.atomicio import write_text

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT.parent / "shared" / "data"
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_calibration import cached_scores, fit_and_evaluate  # noqa: E402


def draw(labels: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """Indices of n items, each label's share as in ``labels`` (at least one of each)."""
    classes, counts = np.unique(labels, return_counts=True)
    want = np.maximum(1, np.round(counts / counts.sum() * n).astype(int))
    picked = [
        rng.choice(np.flatnonzero(labels == c), size=min(w, k), replace=False)
        for c, w, k in zip(classes, want, counts, strict=True)
    ]
    return np.sort(np.concatenate(picked))


def tfidf_classifier(texts: list[str], labels: np.ndarray) -> tuple[Any, Any, Any]:
    """TF-IDF word (1-2) and character (2-5) n-grams with a logistic regression, C by
    cross-validated log loss (folds: the rarest class's items, at most 5), fitted on
    ``texts``: the fitted model, the unfitted one with the chosen C and the folds (both None
    where a class has one item: no folds, C = 10)."""
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import GridSearchCV, StratifiedKFold
    from sklearn.pipeline import make_pipeline, make_union

    def pipeline() -> Any:
        return make_pipeline(
            make_union(
                TfidfVectorizer(ngram_range=(1, 2), sublinear_tf=True, min_df=1),
                TfidfVectorizer(analyzer="char_wb", ngram_range=(2, 5), sublinear_tf=True),
            ),
            LogisticRegression(max_iter=2000),
        )

    counts = np.bincount(labels)
    folds = int(min(5, counts[counts > 0].min()))
    if folds < 2:
        return pipeline().set_params(logisticregression__C=10.0).fit(texts, labels), None, None
    cv = StratifiedKFold(folds, shuffle=True, random_state=0)
    grid = {"logisticregression__C": [1.0, 10.0, 100.0]}
    model = GridSearchCV(pipeline(), grid, cv=cv, scoring="neg_log_loss").fit(texts, labels)
    return model.best_estimator_, pipeline().set_params(**model.best_params_), cv


def _log_probabilities(model: Any, proba: np.ndarray, k: int) -> np.ndarray:
    """(n, k) log-probabilities from ``model``'s ``proba``, whose columns are the classes its
    fit items held (the others get 1e-9 before normalising)."""
    out = np.full((proba.shape[0], k), 1e-9)
    out[:, model.classes_] = proba
    return np.log(out / out.sum(axis=1, keepdims=True))


def tfidf_log_probabilities(
    texts: list[str], labels: np.ndarray, fit_idx: np.ndarray, test_texts: list[str], k: int
) -> tuple[np.ndarray, np.ndarray]:
    """``tfidf_classifier`` trained on ``texts[fit_idx]`` only: (n, k) log-probabilities of
    every text (out-of-fold for the fit items, so that a map fitted on them sees what the
    classifier does on new text) and (m, k) of the test texts."""
    from sklearn.model_selection import cross_val_predict

    x_fit, y_fit = [texts[i] for i in fit_idx], labels[fit_idx]
    fitted, best, cv = tfidf_classifier(x_fit, y_fit)
    if cv is None:  # no folds: its own predictions stand in
        oof = fitted.predict_proba(x_fit)
    else:
        oof = cross_val_predict(best, x_fit, y_fit, cv=cv, method="predict_proba")
    lp = _log_probabilities(fitted, fitted.predict_proba(texts), k)
    lp[fit_idx] = _log_probabilities(fitted, oof, k)
    return lp, _log_probabilities(fitted, fitted.predict_proba(test_texts), k)


def tfidf_accuracy(
    texts: list[str], labels: np.ndarray, test_texts: list[str], test_labels: np.ndarray
) -> float:
    """Test accuracy of ``tfidf_classifier`` trained on every text, uncertified: as a user
    with these labels would train it."""
    fitted, _, _ = tfidf_classifier(texts, labels)
    return float((fitted.predict(test_texts) == test_labels).mean())


@dataclass
class Draws:
    """What every draw of one task at one label count is fitted and evaluated against."""

    judge: Any
    task: Any
    test: Any  # the test split's LabeledScores
    digest: str  # the calibration split's sha256
    n: int = 0  # labels drawn


def fit_arm(
    arm: str,
    target: float,
    scores: Any,
    tfidf: tuple[np.ndarray, np.ndarray] | None,
    draws: Draws,
) -> tuple[str, Any]:
    """One arm's profile on one draw at one target, evaluated on the whole test split: the
    calibration method it chose and the evaluation. ``scores``: the draw's LabeledScores;
    ``tfidf``: for the TF-IDF arm, its (n, k) and (m, k) log-probabilities."""
    from calibration import LabeledScores, Provenance, evaluate_policy, fit_profile

    if arm == "probe":  # as bench_calibration fits and measures an auto profile
        settings = argparse.Namespace(target_precision=target, delta=FitSettings().delta)
        profile, e = fit_and_evaluate(
            draws.judge,
            draws.task,
            settings,
            scores,
            draws.digest,
            draws.test,
            "auto",
            n_bootstrap=10,
        )
    else:
        assert tfidf is not None
        lp, test_lp = tfidf
        provenance = Provenance(
            fingerprint=draws.judge.fingerprint(),
            dataset=f"{draws.task.name}/calibration[{draws.n}] (TF-IDF + LR)",
            dataset_sha256=draws.digest,
        )
        profile = fit_profile(
            f"{draws.task.name}-tfidf",
            # The classifier's scores alone: no choice mass, no hidden states.
            LabeledScores(lp, np.ones(len(lp)), scores.labels),
            draws.task.choices,
            provenance,
            FitSettings(target_precision=target),
            probe_split=True,
        ).profile
        e = evaluate_policy(profile, test_lp, draws.test.labels, n_bootstrap=10)
    return profile.calibration_map.method, e


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--tasks", nargs="*", default=["sst2", "sms_spam", "ag_news", "trec"])
    parser.add_argument(
        "--sizes",
        nargs="*",
        type=int,
        default=[16, 32, 64, 128, 256],
        help="label counts below the split's size; the whole split is always one more",
    )
    parser.add_argument("--arms", nargs="*", default=["probe", "tfidf"], choices=["probe", "tfidf"])
    parser.add_argument("--targets", nargs="*", type=float, default=[0.9, 0.8])
    parser.add_argument("--draws", type=int, default=3)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "judge" / "logits")
    parser.add_argument("--out", type=Path, default=RESULTS / "bench_labels.json")
    args = parser.parse_args()

    from calibration import candidate_layers
    from calibration.fitting import split_examples
    from calibration.tasks import LabeledScores, load_split, load_task
    from judge import Judge

    judge = Judge.load(dtype=args.dtype)
    layers = candidate_layers(judge.num_layers or 0)
    start = time.perf_counter()
    rows = []
    for name in args.tasks:
        task = load_task(args.data / name)
        cal, digest = cached_scores(judge, task, "calibration", None, args.cache, layers)
        test, _ = cached_scores(judge, task, "test", None, args.cache, layers)
        assert cal.features is not None and test.features is not None
        texts = [item.text for item in load_split(task, "calibration")[0]]
        test_texts = [item.text for item in load_split(task, "test")[0]]
        draws = Draws(judge, task, test, digest)
        for n in [*(s for s in args.sizes if s < len(cal)), len(cal)]:
            draws.n = n
            # (arm, target) -> per draw: the method chosen and the evaluation on test
            outcomes: dict[tuple[str, float], list[tuple[str, Any]]] = {}
            on_all: list[float] = []  # TF-IDF trained on all n labels: its test accuracy
            for d in range(args.draws if n < len(cal) else 1):
                idx = draw(cal.labels, n, np.random.default_rng(d))
                y = cal.labels[idx]
                drawn = [texts[i] for i in idx]
                if "tfidf" in args.arms:
                    on_all.append(tfidf_accuracy(drawn, y, test_texts, test.labels))
                if n < MIN_EXAMPLES:  # no profile: accuracy only
                    engine = float((test.log_probabilities.argmax(axis=1) == test.labels).mean())
                    for arm in args.arms:  # the probe arm: the engine's own choice
                        hits = engine if arm == "probe" else on_all[-1]
                        for target in args.targets:
                            outcomes.setdefault((arm, target), []).append(("none", hits))
                    continue
                subset = LabeledScores(
                    log_probabilities=cal.log_probabilities[idx],
                    choice_mass=cal.choice_mass[idx],
                    labels=y,
                    features=cal.features[idx],
                    feature_layers=cal.feature_layers,
                )
                tfidf = None
                if "tfidf" in args.arms:
                    fit_idx = split_examples(y, FitSettings().seed, probe=True)[0]
                    tfidf = tfidf_log_probabilities(
                        drawn, y, fit_idx, test_texts, len(task.choices)
                    )
                for arm in args.arms:
                    for target in args.targets:
                        outcomes.setdefault((arm, target), []).append(
                            fit_arm(arm, target, subset, tfidf, draws)
                        )
            for (arm, target), got in outcomes.items():
                rows.append(summarize(name, n, arm, target, got))
                if arm == "tfidf" and n >= MIN_EXAMPLES:
                    rows[-1]["accuracy_all_labels"] = float(np.mean(on_all))
                print(json.dumps(rows[-1]), file=sys.stderr)
    summary = {
        "model": judge.model_id,
        "dtype": judge.dtype,
        "cpu": cpu_model(),
        "rows": rows,
        "seconds": round(time.perf_counter() - start, 1),
    }
    write_text(args.out, json.dumps(summary, indent=2) + "\n")
    print(markdown(summary))


def summarize(task: str, n: int, arm: str, target: float, got: list[tuple[str, Any]]) -> dict:
    """One row of the table: an arm's draws at one label count and target, summed up. A draw
    below MIN_EXAMPLES labels holds its test accuracy only (no profile can be fitted)."""
    evaluated = [e for _, e in got if not isinstance(e, float)]
    accuracy = [e if isinstance(e, float) else e.after.accuracy.value for _, e in got]
    return {
        "task": task,
        "labels": n,
        "arm": arm,
        "target": target,
        "draws": len(got),
        "probe_chosen": sum(m == "probe" for m, _ in got),
        "accuracy": float(np.mean(accuracy)),
        "certified": sum(e.threshold is not None for e in evaluated),
        "precision_met": sum(e.precision is not None and e.precision >= target for e in evaluated),
        "coverage": float(np.mean([e.coverage for e in evaluated])) if evaluated else 0.0,
        "profile": bool(evaluated),
    }


def markdown(summary: dict[str, object]) -> str:
    lines = [
        f"{summary['model']} ({summary['dtype']}); auto profiles fitted on N labels drawn from "
        "each calibration split, served policy measured on the whole test split",
        "",
        "| task | labels | arm | target | draws | probe chosen | test accuracy "
        "(TF-IDF on all labels) | certified | test precision >= target | mean test coverage |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in summary["rows"]:  # type: ignore[attr-defined]
        fitted = r.get("profile", True)
        lines.append(
            f"| {r['task']} | {r['labels']} | {r['arm']} | {r['target']} | {r['draws']} "
            f"| {r['probe_chosen']} | {r['accuracy']:.3f}"
            + (f" ({r['accuracy_all_labels']:.3f}) " if "accuracy_all_labels" in r else " ")
            + (
                f"| {r['certified']} | {r['precision_met']} | {r['coverage']:.3f} |"
                if fitted
                else f"| no profile under {MIN_EXAMPLES} labels | | |"
            )
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
