"""A fitted profile's files, as ``judge calibrate`` writes them: the profile, its report and
its reliability diagram. ``judge calibrate --task`` and the labelling queue (which writes the
profile ``judge calibrate`` would write, once it certifies) both write through here."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from judge.atomicio import write_text

if TYPE_CHECKING:
    import numpy as np

    from calibration import CalibrationProfile
    from calibration.tasks import LabeledScores

__all__ = ["kept_instead", "save_fitted"]


def kept_instead(profile: CalibrationProfile, path: Path) -> str | None:
    """Why ``profile``, a look of a lineage, must not replace the profile at ``path``: that
    one is an earlier look of the same lineage (a labelling queue's certificate, say) and
    certifies more coverage, the rule a background refit is served by. None: write it."""
    from calibration.errors import ProfileError
    from calibration.profile import certified_coverage, load_profile

    look = profile.recertification
    if look is None or not path.is_file():
        return None
    try:
        there = load_profile(path)
    except ProfileError:
        return None  # not a profile this can read: replaced, as before
    before, after = certified_coverage(there), certified_coverage(profile)
    if there.recertification is None or there.recertification.log != look.log or after >= before:
        return None
    return (
        f"kept {path}: look {there.recertification.look} of this lineage certified coverage "
        f"{before:.3f} there, and this look (look {look.look}, at its smaller share of the "
        f"delta) {after:.3f}: this fit is not written (its look is counted all the same); "
        "--name NAME writes a later look under another name"
    )


def save_fitted(
    profile: CalibrationProfile, scores: LabeledScores, taught: np.ndarray | None, out: Path
) -> None:
    """Write a profile fitted on a task's ``scores`` (``taught``: the labels that only fit it)
    as ``judge calibrate`` does: ``<out>/<name>.json``, its report ``.report.md`` and the
    reliability diagram ``.reliability.png`` of the examples its map was not fitted on."""
    from calibration.fitting import held_out_examples
    from calibration.maps.probe import map_features
    from calibration.maps.scaling import softmax
    from calibration.profile import save_profile
    from calibration.reliability import reliability_diagram
    from calibration.report import profile_markdown

    name = profile.name
    save_profile(profile, out / f"{name}.json")
    write_text(out / f"{name}.report.md", profile_markdown(profile))
    # The diagram shows what the map was not fitted on: a probe fits its own items far
    # better than new ones (ECE 0.16 on all 374 items of a 4-class set, 0.07 held out).
    held = held_out_examples(scores.labels, profile.split, taught)
    z, labels = scores.log_probabilities[held], scores.labels[held]
    features = None if scores.features is None else scores.features[held]
    means = None if scores.span_features is None else scores.span_features[held]
    x = map_features(profile.calibration_map, features, scores.feature_layers, means)
    reliability_diagram(
        (softmax(z), labels),
        (profile.calibration_map.apply(z, x), labels),
        out / f"{name}.reliability.png",
        title=f"{name}: the {held.shape[0]} examples the map was not fitted on",
    )
