"""Markdown reports of a profile and of its evaluation on held-out data.

Each report opens with whether the judge beats the label prior (``calibration.certificates.signal``), in
words, before any metric: a well-calibrated prior predictor must not pass for a judge.
"""

from __future__ import annotations

from calibration.certificates.per_class import ClassReport
from calibration.certificates.signal import SignalReport
from calibration.fitting import PolicyEvaluation
from calibration.limits import FEW_LABELS
from calibration.maps.map_types import Probe
from calibration.metrics import Interval, MetricReport
from calibration.profile import CalibrationProfile

__all__ = [
    "comparison_markdown",
    "evaluation_markdown",
    "metrics_table",
    "profile_markdown",
    "signal_markdown",
]

_ROWS = [
    ("accuracy", "accuracy"),
    ("NLL", "nll"),
    ("Brier", "brier"),
    ("ECE (15 bins)", "ece"),
    ("adaptive ECE", "adaptive_ece"),
    ("MCE", "mce"),
    ("classwise ECE", "classwise_ece"),
]


def _cell(x: Interval) -> str:
    return f"{x.value:.4f} [{x.low:.4f}, {x.high:.4f}]"


def metrics_table(before: MetricReport, after: MetricReport) -> str:
    lines = ["| metric | before | after |", "|---|---|---|"]
    for label, field in _ROWS:
        lines.append(
            f"| {label} | {_cell(getattr(before, field))} | {_cell(getattr(after, field))} |"
        )
    lines.append(
        f"| ECE noise floor (mean, p95) | {before.ece_noise_floor:.4f}, {before.ece_noise_floor_p95:.4f} "
        f"| {after.ece_noise_floor:.4f}, {after.ece_noise_floor_p95:.4f} |"
    )
    return "\n".join(lines)


def signal_markdown(signal: SignalReport | None, *, label_free: bool = False) -> str:
    """The verdict on the judge against the label prior, as one markdown line."""
    if signal is None:
        if label_free:
            return (
                "- **signal: untested**: a label-free profile has no labels, so whether the "
                "judge beats the label prior is unknown; run `judge evaluate` on labeled data"
            )
        return "- **signal: not recorded** (a profile written before signal reports; refit it)"
    head = "beats the label prior" if signal.beats_prior else "NO SIGNAL"
    auroc = "n/a" if signal.auroc is None else f"{signal.auroc:.3f}"
    return (
        f"- **signal: {head}** (accuracy gain {signal.accuracy_gain.value:+.3f} "
        f"[{signal.accuracy_gain.low:+.3f}, {signal.accuracy_gain.high:+.3f}], NLL gain "
        f"{signal.nll_gain.value:+.4f} [{signal.nll_gain.low:+.4f}, {signal.nll_gain.high:+.4f}]"
        f" nats/item, AUROC {auroc}, temperature at bound: "
        f"{'yes' if signal.temperature_at_bound else 'no'}): {signal.verdict}"
    )


def _threshold_line(profile: CalibrationProfile) -> str:
    t = profile.threshold
    if t.feasible and t.threshold is not None:
        return (
            f"accept when calibrated confidence >= **{t.threshold:.3f}** (and the choice mass "
            f">= {profile.min_choice_mass:g} and the conformal set holds one choice): certified "
            f"precision >= {t.target_precision} with probability >= {1 - t.delta:.2f} "
            f"({t.method}) on {t.n} examples the map was not fitted on; coverage there "
            f"{t.coverage:.3f}, precision {t.precision:.4f}, lower bound "
            f"{t.precision_lower_bound:.4f}"
        )
    return f"**no certified threshold**: {t.reason}; every item escalates unless a caller sets one"


LABEL_MORE = (
    "label more with judge label --queue --items FILE --task DIR (its audit labels certify, "
    "its taught ones fit the map), then calibrate again"
)


def next_steps(
    profile: CalibrationProfile,
    *,
    labels: str = "uniform labels",
    then: str = LABEL_MORE,
    shortfall: bool = True,
) -> list[str]:
    """What to do when ``profile`` certifies nothing, a line each: how close its certificate
    came, about how many more uniform labels (``labels``: what to call them) would likely
    certify at the precision its map shows (``CalibrationProfile.labels_needed``) and
    ``then`` what to do, or why more would not help and what to try instead. Empty when it
    certifies a threshold (pooled, or for a class). ``shortfall`` False leaves out the first
    line, how close the certificate came, for a fit whose certificate must stay unread."""
    t = profile.threshold
    if t.threshold is not None or any(
        c.threshold is not None for c in profile.class_thresholds or []
    ):
        return []
    if profile.metrics_after is None:  # label-free: nothing to certify on
        return ["label a uniform sample of the items to certify a threshold"]
    at = "" if t.best_threshold is None else f" (at threshold {t.best_threshold:g})"
    lines = [
        f"certified nothing: on its {t.n} certify labels the best lower bound on the "
        f"precision is {t.best_certified_precision:.3f}{at}, short of the "
        f"{t.target_precision:g} to certify at delta {t.delta:.3g}"
    ][: 1 if shortfall else 0]
    signal, needed = profile.signal, profile.labels_needed
    if needed is not None and needed.more is not None:
        assert needed.threshold is not None and needed.acceptance is not None
        lines.append(
            f"about {needed.more} more {labels} ({needed.labels} in all) would likely certify "
            f"{t.target_precision:g}, at threshold {needed.threshold:g} accepting about "
            f"{needed.acceptance:.0%} of items, if the map stays as good as it is: {then}"
        )
        return lines
    given = 0 if needed is None else needed.given
    if given < FEW_LABELS:
        lines.append(
            f"on {given} uniform labels the fitted map shows no threshold that a certificate "
            f"could confirm at {t.target_precision:g}: too few labels to tell whether more "
            f"would (from about {FEW_LABELS} it says)"
        )
        return lines
    try_else = (
        "try a clearer instruction, another model (judge qualify ranks the ones you have), or "
        + ("a guarantee per class (--per-class)" if len(profile.choices) > 2 else "a lower target")
    )
    if signal is not None and not signal.beats_prior:
        lines.append(
            "the calibrated judge does not beat the label prior on the labels it was not "
            f"fitted on ({signal.verdict}): the model shows no signal here, and more labels "
            f"will not change that; {try_else}"
        )
    else:
        lines.append(
            "at no threshold does the fitted map, judging the uniform labels as new items, "
            f"show a precision above {t.target_precision:g} that a certificate could confirm: "
            f"more labels will not open the gate for this map; {try_else}"
        )
    return lines


def class_certificate_lines(profile: CalibrationProfile) -> list[str]:
    """The per-class certificate, a line per class (``calibration.certificates.class_certify``); none for a
    pooled profile."""
    if profile.class_thresholds is None:
        return []
    delta = profile.threshold.delta
    lines = [
        f"- **served per class** (each class's accepted decisions >= "
        f"{profile.threshold.target_precision} precise, every class at once with probability "
        f">= {1 - delta:.2f}: delta {delta:g} / {len(profile.choices)} each); the pooled "
        "threshold above is kept for comparison only"
    ]
    for choice, t in zip(profile.choices, profile.class_thresholds, strict=True):
        if t.threshold is None:
            lines.append(f"  - {choice}: **none certified**, its decisions escalate: {t.reason}")
        else:
            lines.append(
                f"  - {choice}: accept at >= **{t.threshold:.3f}**; on its {t.n} certify "
                f"decisions, coverage {t.coverage:.3f}, precision {t.precision:.4f}, lower bound "
                f"{t.precision_lower_bound:.4f}"
            )
    return lines


def _map_line(profile: CalibrationProfile) -> str:
    m = profile.calibration_map
    if isinstance(m, Probe):
        return (
            f"- map: **probe**, a multinomial logistic head on the hidden state of layer "
            f"{', '.join(map(str, m.layers))} of {m.num_layers} (width {m.feature_dim}) and the "
            f"choices' log-probabilities: {len(m.intercept)} x {m.width} weights, C {m.l2:g}"
        )
    bias = getattr(m, "bias", None)
    return f"- map: **{m.method}**, temperature {m.temperature:.4f}" + (
        f", bias {[round(b, 4) for b in bias]}" if bias else ""
    )


def _baseline_markdown(profile: CalibrationProfile) -> str:
    """The probe against the scalar maps fitted and certified on the same split."""
    b, after = profile.baseline, profile.metrics_after
    assert b is not None and after is not None
    rows = [
        ("probe", after, profile.threshold, profile.calibration_map.method),
        ("scalar map", b.metrics_after, b.threshold, b.calibration_map.method),
    ]
    lines = [
        "## What the labels bought: the probe against temperature scaling on the same split",
        "",
        "Temperature scaling means the scalar maps: temperature, or bias + temperature, "
        "whichever wins on cross-validated NLL, as a profile without a probe would be.",
        "",
        "| map | accuracy | NLL | ECE | certified threshold | coverage (certify split) |",
        "|---|---|---|---|---|---|",
    ]
    for name, m, t, method in rows:
        threshold = "none" if t.threshold is None else f"{t.threshold:.3f}"
        lines.append(
            f"| {name} ({method}) | {m.accuracy.value:.3f} | {m.nll.value:.3f} | "
            f"{m.ece.value:.3f} | {threshold} | {t.coverage:.3f} |"
        )
    return "\n".join(lines)


def comparison_markdown(evaluation: PolicyEvaluation) -> str:
    """The served policy against its scalar-map baseline on the same held-out items."""
    e, b = evaluation, evaluation.baseline
    if b is None:
        return ""
    lines = [
        "| served policy | accuracy | NLL | ECE | threshold | coverage | precision |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, x in ((f"{e.method} (the profile)", e), (f"{b.method} (baseline)", b)):
        threshold = (
            "per class"
            if x.class_thresholds is not None
            else "none"
            if x.threshold is None
            else f"{x.threshold:.3f}"
        )
        precision = "-" if x.precision is None else f"{x.precision:.4f}"
        lines.append(
            f"| {name} | {x.after.accuracy.value:.3f} | {x.after.nll.value:.3f} | "
            f"{x.after.ece.value:.3f} | {threshold} | {x.coverage:.3f} | {precision} |"
        )
    return "\n".join(lines)


def profile_markdown(
    profile: CalibrationProfile, evaluation: PolicyEvaluation | None = None
) -> str:
    s = profile.split
    lf = profile.label_free
    fingerprint = profile.fingerprint
    parts = [
        f"# Calibration profile `{profile.name}`",
        "",
        signal_markdown(profile.signal, label_free=profile.metrics_after is None),
        f"- model: `{fingerprint.model}` (sha256 {fingerprint.model_sha256 or 'n/a'}), "
        f"dtype {fingerprint.dtype}",
        f"- choices: {', '.join(f'`{c}`' for c in profile.choices)}",
        f"- data: `{profile.dataset}`, {profile.n_examples} examples (sha256 {profile.dataset_sha256[:16]}...), "
        f"split {s.fit} to fit the map / {s.conformal} for the conformal quantile / {s.certify} to certify the threshold (seed {s.seed})",
        _map_line(profile),
        f"- cross-validated NLL (fit split): {', '.join(f'{k} {v:.4f}' for k, v in profile.cv_nll.items()) or 'none (no labels)'}",
        f"- {profile.note}",
    ]
    if lf is not None:
        prior = ", ".join(f"{c} {p:.4f}" for c, p in zip(profile.choices, lf.prior, strict=True))
        parts.append(
            f"- label-free prior correction: **{lf.method}** calibration on {lf.n_inputs} "
            f"inputs ({lf.source}); estimated prior {prior}"
        )
    if profile.values is not None or profile.max_std is not None:
        shown = (
            ", ".join(f"`{c}`={v:g}" for c, v in profile.values.items())
            if profile.values is not None
            else "the numerals themselves"
        )
        bound = "none" if profile.max_std is None else f"{profile.max_std:g}"
        parts.append(f"- score: values {shown}; escalate when the std exceeds {bound}")
    quantile = (
        "none (no labels: no conformal set)"
        if profile.conformal_quantile is None
        else f"quantile {profile.conformal_quantile:.4f}"
    )
    parts += [
        f"- routing: {_threshold_line(profile)}",
        *class_certificate_lines(profile),
        *(f"- next: {line}" for line in next_steps(profile)),
        f"- conformal (LAC, alpha {profile.conformal_alpha}): {quantile}",
        f"- created {profile.created_at}",
    ]
    r = profile.recertification
    if r is not None:
        parts.append(
            f"- certified from the labels of `{r.log}`: look {r.look} of its lineage, "
            f"certified at delta {r.spent:.4g}, its share of {r.delta:g}, so that every look's "
            f"certificate holds at once with probability >= {1 - r.delta:g} "
            "(calibration.certificates.recertify)"
        )
    if profile.metrics_before is not None and profile.metrics_after is not None:
        parts += [
            "",
            "## On the calibration data (before: every example; after: the examples the map "
            "was not fitted on)",
            "",
            metrics_table(profile.metrics_before, profile.metrics_after),
        ]
        if profile.class_evidence is not None:
            parts += [
                "",
                "The examples the map was not fitted on, under the rule as served (the "
                "threshold was certified on part of them, so this is evidence, not a test):",
                "",
                class_markdown(profile.class_evidence),
            ]
        if profile.baseline is not None:
            parts += ["", _baseline_markdown(profile)]
    else:
        parts += ["", "No metrics: the profile was fitted without labels."]
    if evaluation is not None:
        parts += ["", evaluation_markdown(evaluation)]
    return "\n".join(parts) + "\n"


def evaluation_markdown(evaluation: PolicyEvaluation) -> str:
    e = evaluation
    if e.class_thresholds is not None:
        threshold = (
            "per class ("
            + ", ".join(
                f"{c.choice} {'none' if t is None else f'{t:.3f}'}"
                for c, t in zip(
                    e.classes.classes if e.classes else [], e.class_thresholds, strict=False
                )
            )
            + ")"
        )
    elif e.threshold is None:
        threshold = "none (no certified threshold)"
    else:
        threshold = f"{e.threshold:.3f}"
    if e.precision is None:
        precision = "n/a (nothing accepted)"
    else:
        low, high = e.precision_interval or (0.0, 1.0)
        precision = f"{e.precision:.4f} [{low:.4f}, {high:.4f}] (target {e.target_precision})"
    escalated = e.n - e.n_accepted
    kinds = ", ".join(f"{code} {count}" for code, count in e.escalations.items()) or "none"
    if e.conformal_coverage is None or e.mean_set_size is None or e.singleton_rate is None:
        sets = "- conformal sets: none (the profile has no conformal quantile)"
    else:
        sets = (
            f"- conformal sets (alpha {e.conformal_alpha}): coverage {e.conformal_coverage:.3f}, "
            f"mean size {e.mean_set_size:.2f}, single-choice {e.singleton_rate:.3f}"
        )
    return "\n".join(
        [
            f"## Held-out evaluation ({e.n} items)",
            "",
            signal_markdown(e.signal) + f" (prior predictor: {e.signal_prior})",
            "",
            metrics_table(e.before, e.after),
            "",
            f"- served policy: threshold {threshold}, min choice mass {e.min_choice_mass:g}, "
            f"single-choice conformal set; {'certified' if e.certified else 'NOT certified (overridden or none)'}",
            f"- accepted {e.n_accepted} of {e.n} (coverage {e.coverage:.3f}), precision {precision}",
            f"- escalated {escalated}; by reason (an item may have several): {kinds}",
            sets,
        ]
        + (["", class_markdown(e.classes)] if e.classes is not None else [])
        + (["", comparison_markdown(e)] if e.baseline is not None else [])
    )


def _share(value: float | None, interval: list[float] | None) -> str:
    if value is None or interval is None:
        return "n/a"
    return f"{value:.3f} [{interval[0]:.3f}, {interval[1]:.3f}]"


def class_markdown(report: ClassReport) -> str:
    """Each choice's precision, recall and coverage of the accepted items (95% Clopper-Pearson
    intervals), then the confusion matrices of every item and of the accepted ones."""
    names = [c.choice for c in report.classes]
    lines = [
        "### Per class (the accepted items; 95% Clopper-Pearson intervals)",
        "",
        "| class | labelled | accepted as | precision | recall | coverage |",
        "|---|---|---|---|---|---|",
    ]
    for c in report.classes:
        lines.append(
            f"| {c.choice} | {c.support} | {c.accepted} | "
            f"{_share(c.precision, c.precision_interval)} | "
            f"{_share(c.recall, c.recall_interval)} | {_share(c.coverage, c.coverage_interval)} |"
        )
    lines += [
        "",
        "precision: of the accepted items decided as the class, the share labelled it; recall: "
        "of the items labelled it, the share accepted as it; coverage: of the items labelled "
        "it, the share accepted.",
    ]
    for title, matrix in (
        ("every item", report.confusion),
        ("the accepted items", report.confusion_accepted),
    ):
        lines += [
            "",
            f"Confusion matrix, {title} (rows: label; columns: the top choice):",
            "",
            "| label \\ choice | " + " | ".join(names) + " |",
            "|---" * (len(names) + 1) + "|",
        ]
        lines += [
            f"| {name} | " + " | ".join(str(n) for n in row) + " |"
            for name, row in zip(names, matrix, strict=True)
        ]
    return "\n".join(lines)
