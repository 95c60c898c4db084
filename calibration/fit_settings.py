"""What a fit is asked to certify, and how: one record, from the command line to the fitter.

``judge calibrate``, ``POST /profiles/{name}/fit``, ``judge calibrate --from-log`` and the
Python API each build one ``FitSettings`` and hand it down unchanged through ``fit_labeled``,
``fit_profile`` and ``fit_rule`` (and ``fit_label_free_profile``, which records it), so a new
setting is one field here and one reading at the place that uses it, not a keyword argument
threaded through five signatures.

A leaf: it imports neither scipy nor scikit-learn, so the command line and the service build
settings without loading the fitter.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

import msgspec

__all__ = ["AUTO_METHODS", "DEFAULT_METHODS", "DEFAULT_SETTINGS", "FitSettings"]

DEFAULT_METHODS = ("temperature", "bias_temperature")
AUTO_METHODS = ("temperature", "bias_temperature", "probe")


class FitSettings(msgspec.Struct, frozen=True, kw_only=True):
    """The guarantees a profile is fitted to certify, the rule they are certified for, and the
    fit's own knobs. Checked where they are used (``fit_rule``), each error naming its field.

    target_precision, delta
        The certified threshold's claim: the accepted items' precision is at least
        ``target_precision`` with probability at least 1 - ``delta``.
    alpha
        The conformal set covers the label with probability at least 1 - ``alpha``.
    min_choice_mass
        The served rule escalates a judgment whose choices hold less of the model's
        probability than this; the certificate covers the rule with that gate. "auto" (the
        default): chosen from the labels where a gate raises the coverage certified on the
        items the certificate does not rest on (``calibration.certificates.mass_check``), else 0.
    values, max_std
        A score task's number per choice and the bound on a score's std (the ``high_std``
        gate); None for a plain choice task.
    methods
        ``fit_calibrator``'s labeled candidates, or "auto" (the default): every labeled method,
        the probe where hidden-state features are given and there are enough examples (else
        the scalar maps, and the profile's note says why the probe was not tried).
    per_class
        Also certify a threshold for each predicted class (``calibration.certificates.class_certify``):
        the accepted decisions of each class are at least ``target_precision`` precise, all
        classes at once with probability at least 1 - ``delta``. The profile then serves that
        rule instead of the pooled one.
    procedure
        ``select_threshold``'s multiple-testing procedure.
    allotment
        Where uniform labels go beside taught ones (``calibration.limits.allot``): "by_role"
        (the default), the taught labels fill the fit split first and the uniform ones set
        the conformal quantile and certify; "pattern", every uniform label's part from the
        split's pattern of ten, the taught ones added to the fit split (how fits split before
        2026-12-07; kept to compare and to reproduce older profiles).
    """

    target_precision: float = 0.9
    delta: float = 0.1
    alpha: float = 0.1
    min_choice_mass: float | Literal["auto"] = "auto"
    values: Mapping[str, float] | None = None
    max_std: float | None = None
    methods: Sequence[str] | str = "auto"
    per_class: bool = False
    procedure: str = "fixed_sequence"
    allotment: Literal["by_role", "pattern"] = "by_role"
    seed: int = 0
    n_bootstrap: int = 1000


DEFAULT_SETTINGS = FitSettings()
