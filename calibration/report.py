"""Markdown reports of a profile and of its evaluation on held-out data."""

from __future__ import annotations

from calibration.fitting import ProfileEvaluation
from calibration.metrics import Interval, MetricReport
from calibration.profile import CalibrationProfile

__all__ = ["evaluation_markdown", "metrics_table", "profile_markdown"]

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


def _threshold_line(profile: CalibrationProfile) -> str:
    t = profile.threshold
    if t.feasible and t.threshold is not None:
        return (
            f"accept when calibrated confidence >= **{t.threshold:.3f}**: certified precision "
            f">= {t.target_precision} with probability >= {1 - t.delta:.2f} ({t.method}); "
            f"coverage on the calibration data {t.coverage:.3f}, precision {t.precision:.4f}, "
            f"lower bound {t.precision_lower_bound:.4f}"
        )
    return f"**infeasible**: {t.reason}"


def profile_markdown(
    profile: CalibrationProfile, evaluation: ProfileEvaluation | None = None
) -> str:
    parts = [
        f"# Calibration profile `{profile.name}`",
        "",
        f"- model: `{profile.model}` (sha256 {profile.model_sha256 or 'n/a'}), dtype {profile.dtype}",
        f"- choices: {', '.join(f'`{c}`' for c in profile.choices)}",
        f"- data: `{profile.dataset}`, {profile.n_examples} examples (sha256 {profile.dataset_sha256[:16]}...)",
        f"- method: **{profile.method}**, temperature {profile.temperature:.4f}"
        + (f", bias {[round(b, 4) for b in profile.bias]}" if profile.bias else ""),
        f"- cross-validated NLL: {', '.join(f'{k} {v:.4f}' for k, v in profile.cv_nll.items())}",
        f"- {profile.note}",
        f"- routing: {_threshold_line(profile)}",
        f"- conformal (LAC, alpha {profile.conformal_alpha}): quantile {profile.conformal_quantile:.4f}",
        f"- created {profile.created_at}",
        "",
        "## On the calibration data (after = out-of-fold)",
        "",
        metrics_table(profile.metrics_before, profile.metrics_after),
    ]
    if evaluation is not None:
        parts += ["", evaluation_markdown(evaluation)]
    return "\n".join(parts) + "\n"


def evaluation_markdown(evaluation: ProfileEvaluation) -> str:
    e = evaluation
    if e.threshold is None:
        routing = "threshold infeasible: every item escalates"
    else:
        precision = "n/a (nothing accepted)" if e.precision is None else f"{e.precision:.4f}"
        routing = (
            f"threshold {e.threshold:.3f}: coverage {e.coverage:.3f} ({e.n_accepted} of {e.n} "
            f"accepted), precision {precision} (target {e.target_precision})"
        )
    return "\n".join(
        [
            f"## Held-out evaluation ({e.n} items)",
            "",
            metrics_table(e.before, e.after),
            "",
            f"- routing: {routing}",
            f"- conformal sets (alpha {e.conformal_alpha}): coverage {e.conformal_coverage:.3f}, "
            f"mean size {e.mean_set_size:.2f}, single-choice {e.singleton_rate:.3f}",
        ]
    )
