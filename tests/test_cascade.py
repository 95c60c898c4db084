"""A cascade: its profiles fitted with one certificate for the whole rule, and stages tried in
order."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from calibration import Cascade, FitError, FitSettings, Gate, Overrides
from calibration.cascade import StageAnswer, StageItem
from calibration.tasks import (
    CascadeStageData,
    FittedCascade,
    LabeledScores,
    cascade_decisions,
    checks_on_scores,
    fit_cascade,
)
from judge import Fingerprint, Judge
from service.cascade.stages import LocalStage

CHOICES = ["A", "B", "C"]
SETTINGS = FitSettings(target_precision=0.9, delta=0.1, methods=["temperature"], n_bootstrap=20)


def _fingerprint(model: str) -> Fingerprint:
    return Fingerprint(
        model=model,
        model_sha256=None,
        dtype="float32",
        response_prefix='{"answer": "',
        response_suffix='"',
        system_sha256=None,
    )


def _stage(labels: np.ndarray, skill: float, seed: int) -> LabeledScores:
    """A model's scores on the items: the label's logit raised by ``skill`` over noise."""
    rng = np.random.default_rng(seed)
    z = rng.normal(size=(len(labels), len(CHOICES)))
    z[np.arange(len(labels)), labels] += skill
    z -= np.log(np.exp(z).sum(axis=1, keepdims=True))  # log-probabilities
    return LabeledScores(log_probabilities=z, choice_mass=np.full(len(labels), 0.9), labels=labels)


def _pool(n: int, seed: int) -> tuple[LabeledScores, LabeledScores]:
    labels = np.random.default_rng(seed).integers(0, len(CHOICES), n)
    return _stage(labels, 1.8, seed + 1), _stage(labels, 2.4, seed + 2)


def _fit(
    small: LabeledScores, large: LabeledScores, settings: FitSettings = SETTINGS
) -> FittedCascade:
    return fit_cascade(
        "syn",
        [
            CascadeStageData("small", small, _fingerprint("small")),
            CascadeStageData("large", large, _fingerprint("large")),
        ],
        CHOICES,
        dataset="synthetic",
        dataset_sha256="0" * 64,
        settings=settings,
    )


def test_both_stages_fit_on_every_item_and_one_rule_is_certified_at_the_full_delta() -> None:
    small, large = _pool(2400, seed=0)
    fitted = _fit(small, large)
    profiles = fitted.profiles
    assert [p.name for p in profiles] == ["syn", "syn-large"]
    assert [p.fingerprint.model for p in profiles] == ["small", "large"]
    # Each stage learnt from every labeled item, not from a fold of them.
    assert [p.n_examples for p in profiles] == [2400, 2400]
    rule = fitted.certificate.rule
    assert rule is not None and fitted.certificate.certified >= 1
    assert [p.threshold.threshold for p in profiles] == rule.thresholds
    assert [p.threshold.delta for p in profiles] == [0.1, 0.1]
    assert all("tuples" in p.threshold.method for p in profiles)
    assert (fitted.certificate.precision_lower_bound or 0) >= SETTINGS.target_precision
    decided_by, choice = cascade_decisions(profiles, [small, large])
    share = [float(np.mean(decided_by == s)) for s in (0, 1, -1)]
    assert share[0] > 0.1 and share[1] > 0.1, share  # both stages decide a real share
    assert np.all((choice >= 0) == (decided_by >= 0))


def test_the_cascade_s_precision_meets_the_target_but_in_at_most_delta_of_resamples() -> None:
    """The guarantee end to end, simulated: fit on one half, measure on the other, 30 times."""
    runs, failures, covered, by_stage = 30, 0, [], []
    for r in range(runs):
        small, large = _pool(2000, seed=100 + 7 * r)
        rows = np.random.default_rng(r).permutation(2000)
        fit_rows, test_rows = rows[:1000], rows[1000:]
        profiles = _fit(small.rows(fit_rows), large.rows(fit_rows)).profiles
        test = [small.rows(test_rows), large.rows(test_rows)]
        decided_by, choice = cascade_decisions(profiles, test)
        accepted = decided_by >= 0
        covered.append(float(accepted.mean()))
        by_stage.append([float(np.mean(decided_by == s)) for s in (0, 1)])
        if accepted.any():
            precision = float(np.mean(choice[accepted] == test[0].labels[accepted]))
            failures += precision < SETTINGS.target_precision
    # delta = 0.1: expect at most ~3 of 30; 7 or more would happen with probability < 0.01
    # if the true failure rate were 0.1.
    assert failures <= 6, failures
    # It accepts a real share, both stages take part: the bound is not met by refusing.
    assert np.mean(covered) > 0.5
    assert min(np.mean(by_stage, axis=0)) > 0.2


def test_stages_must_score_the_same_items_and_enough_are_held_out() -> None:
    small, large = _pool(400, seed=3)
    other = _stage(np.roll(small.labels, 1), 3.5, seed=9)
    with pytest.raises(FitError, match="scored other items"):
        _fit(small, other)
    tiny_small, tiny_large = small.rows(np.arange(30)), large.rows(np.arange(30))
    with pytest.raises(FitError, match=r"hold out \d+ labeled items in common"):
        _fit(tiny_small, tiny_large)


class _Broken:
    name = "broken"

    def answer(self, item: StageItem, *, timeout_s: float | None) -> StageAnswer:
        raise ConnectionError("the server at 127.0.0.1:9 is down")


def test_a_failing_stage_escalates_to_the_next(judge: Judge) -> None:
    prompt, choices = "Is this SMS spam? WINNER!! Claim your prize now.", ["spam", "ham"]
    never = LocalStage("never", judge, Gate(overrides=Overrides(uncertified_threshold=1.0)))
    always = LocalStage("always", judge, Gate(overrides=Overrides(uncertified_threshold=0.0)))
    verdict = Cascade([_Broken(), never, always]).judge(prompt, choices)
    assert verdict.accepted and verdict.decided_by == "always"
    broken, first, last = verdict.stages
    assert broken.failure == "stage_failed" and "is down" in (broken.error or "")
    assert broken.answer is None
    assert first.answer is not None and first.answer.decision == "escalate"
    assert first.answer.reason_codes == ["below_threshold"]
    assert last.answer is not None and last.answer.choice == verdict.choice
    assert first.answer.prompt_tokens == last.answer.prompt_tokens
    assert last.answer.prompt_tokens is not None and last.answer.prompt_tokens > 0
    # The same item alone at the deciding stage: the same probabilities.
    alone = Gate(overrides=Overrides(uncertified_threshold=0.0)).judge(judge, prompt, choices)
    assert alone.probabilities == last.answer.probabilities
    # Nobody accepts: a person decides, and every stage says why.
    nobody = Cascade([never]).judge(prompt, choices)
    assert not nobody.accepted and nobody.decided_by is None and nobody.choice is None


def test_no_stage_starts_after_the_deadline(judge: Judge) -> None:
    always = LocalStage("always", judge, Gate(overrides=Overrides(uncertified_threshold=0.0)))
    verdict = Cascade([always]).judge("Spam? Free prize!", ["spam", "ham"], deadline_s=0.0)
    assert not verdict.accepted
    assert [s.failure for s in verdict.stages] == ["stage_timeout"]
    with pytest.raises(ValueError, match="stage names must differ"):
        Cascade([always, always])


def test_the_readme_cascade_example_runs(judge: Judge) -> None:
    """The README's example as written, both stages the session model under their profiles
    (fitted on synthetic scores: the example is about the shape of the API)."""
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parent.parent / "docs" / "cascade.md").read_text()
    section = page[page.index("# Cascade: escalate to a stronger judge") :]
    code = re.findall(r"```python\n(.*?)```", section, re.S)[0]
    labels = np.random.default_rng(5).integers(0, 2, 600)

    def scores(skill: float, seed: int) -> LabeledScores:
        rng = np.random.default_rng(seed)
        z = rng.normal(size=(600, 2))
        z[np.arange(600), labels] += skill
        z -= np.log(np.exp(z).sum(axis=1, keepdims=True))
        return LabeledScores(log_probabilities=z, choice_mass=np.full(600, 0.9), labels=labels)

    names: dict[str, Any] = {
        "small": judge,
        "large": judge,
        "small_scores": scores(2.0, 1),
        "large_scores": scores(3.0, 2),
        "digest": "0" * 64,
        "prompt": "Is this SMS spam? WINNER!! Claim your free prize now.",
    }
    exec(code, names)
    verdict = names["verdict"]
    assert verdict.decided_by in {"smollm2", "gemma3", None}
    assert verdict.stages[0].stage == "smollm2"
    assert [p.name for p in names["profiles"]] == ["sms", "sms-gemma3"]


def test_the_rules_are_ordered_on_each_probe_s_out_of_fold_probabilities(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A probe is sharper on the items it was fitted on than on new ones: ordered there, the
    sequence starts at rules too aggressive for the certification items. The cascade orders
    its rules on each stage's probabilities as its map judges new items (a probe's fit items
    from the folds that did not see them) and certifies on the items as served."""
    import msgspec

    import calibration.tasks.cascade as fitting_cascade
    from calibration.certificates.cascade_certify import StageView
    from calibration.fitting import profile_split

    n = 600
    labels = np.random.default_rng(0).integers(0, len(CHOICES), n)

    def probed(seed: int, skill: float) -> LabeledScores:
        """Uninformative log-probabilities, hidden states that carry the label."""
        rng = np.random.default_rng(seed)
        z = rng.normal(size=(n, len(CHOICES)))
        z -= np.log(np.exp(z).sum(axis=1, keepdims=True))
        f = rng.normal(size=(n, 1, 16))
        f[np.arange(n), 0, labels] += skill
        return LabeledScores(
            log_probabilities=z,
            choice_mass=np.full(n, 0.9),
            labels=labels,
            features=f.astype(np.float32),
            feature_layers=(3,),
        )

    seen: list[list[StageView]] = []
    certify_rules = fitting_cascade.certify_rules

    def recorded(ordering: list[StageView], *args: Any, **kwargs: Any) -> Any:
        seen.append(ordering)
        return certify_rules(ordering, *args, **kwargs)

    monkeypatch.setattr(fitting_cascade, "certify_rules", recorded)
    fingerprint = msgspec.structs.replace(_fingerprint("probed"), num_layers=6)
    stages = [probed(1, 1.5), probed(2, 2.0)]
    fitted = fit_cascade(
        "syn",
        [CascadeStageData(f"s{i}", s, fingerprint) for i, s in enumerate(stages)],
        CHOICES,
        dataset="synthetic",
        dataset_sha256="0" * 64,
        settings=msgspec.structs.replace(SETTINGS, methods=["probe"]),
    )
    assert [p.calibration_map.method for p in fitted.profiles] == ["probe", "probe"]
    for profile, scores, ordering in zip(fitted.profiles, stages, seen[0], strict=True):
        fit_idx, _, certify_idx = profile_split(labels, profile.split)
        order = np.setdiff1d(np.arange(n), certify_idx)
        in_sample = StageView.of(checks_on_scores(profile, scores.rows(order)))
        fit_rows = np.isin(order, fit_idx)
        # The conformal items were never the map's: there the two agree.
        assert np.allclose(ordering.confidence[~fit_rows], in_sample.confidence[~fit_rows])
        # The fit items are judged as new ones: less sure than in sample.
        assert ordering.confidence[fit_rows].mean() < in_sample.confidence[fit_rows].mean() - 0.01


def test_a_remote_stage_sends_its_profile_and_the_overrides_that_bear_on_its_gate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import service.cascade.stages as remote_stage

    sent: list[dict[str, Any]] = []

    class Client:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass

        def __enter__(self) -> Client:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def judge(self, prompt: str, choices: list[str], **options: Any) -> Any:
            sent.append({"prompt": prompt, "choices": choices, **options})
            raise TimeoutError("not asked further")

    monkeypatch.setattr(remote_stage, "JudgeClient", Client)
    asked = Overrides(threshold=0.7, min_choice_mass=0.1, max_std=2.0, max_order_spread=0.3)
    stage = remote_stage.RemoteStage("big", "http://10.0.0.2:8000", "p", asked)
    settings = {"profile": "p", "threshold": 0.7, "uncertified_threshold": None}
    assert stage.settings == settings | {"min_choice_mass": 0.1}  # max_std etc. stay here
    with pytest.raises(TimeoutError):
        stage.answer(StageItem(prompt="Spam? hi", choices=["spam", "ham"]), timeout_s=None)
    assert sent == [
        {"prompt": "Spam? hi", "choices": ["spam", "ham"], "item_span": None}
        | settings
        | {"min_choice_mass": 0.1}
    ]
