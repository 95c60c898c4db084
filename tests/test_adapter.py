"""Adapters that learn (issue 56), on the real default model.

A profile fitted with ``--method adapter`` carries LoRA weights trained under its probe's head
on the fit split alone; every judgment under it runs the model with them merged, in the same
one pass, batch- and cache-invariant bit for bit; the certificate rests on items the adapter
never saw; a tampered adapter, one for other weights, or an engine that cannot merge one is
refused naming the field. An adapter profile retrained from its decision log (issue 57)
trains a new adapter on the logged items, the audited labels alone certifying.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from collections.abc import Callable
from contextlib import closing
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
from test_label_queue import decision
from test_span_service import every_route

from calibration import CalibrationProfile, Gate, ProfileMismatchError, load_profile, save_profile
from calibration.fitting import split_examples
from calibration.maps.map_types import Probe
from calibration.tasks import (
    AdapterProfile,
    LabeledItems,
    fit_adapter_profile,
    labeled_queries,
    load_split,
    load_task,
    task_item_span,
    task_prompt,
)
from calibration.tasks.adapter.training import AdapterSettings, fit_adapter, require_peft
from judge import InvalidQueryError, Judge, Query
from judge.adapters import Adapter, weights_sha256
from service.cli.main import main
from service.config import ServiceConfig
from service.install import missing_adapter_extra
from service.log.adapter_refit import logged_items, retrain_from_log
from service.log.backends import open_log
from service.log.record import LoggedDecision
from service.log.refit import LogRefit, refit_settings
from service.profiles import ProfileStore
from service.web.background_refit import BackgroundRefit

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
# Small and quick: the routing, the honesty and the bits are what is tested here; what an
# adapter buys is measured in benchmarks/bench_adapter.py.
QUICK = AdapterSettings(blocks=2, epochs=1, batch_size=8)
# The tests that train an adapter on the real model (minutes on 2 cores) run with the
# benchmarks' quick runs (`make bench-smoke`, which CI runs after `make test`), so that
# `make test` keeps within its time; the rest (merging, invariance, refusals) run in both.
# Training needs the `adapter` extra (peft; `make install` brings it): without it those tests
# skip and the rest still run, as an install without the extra judges under an adapter.
NEEDS_PEFT = pytest.mark.skipif(
    importlib.util.find_spec("peft") is None, reason="training needs peft, the 'adapter' extra"
)


def TRAINS(test: Callable[..., None]) -> Callable[..., None]:
    return pytest.mark.bench(NEEDS_PEFT(test))


def fit_sst2(judge: Judge, *, keep_adapter: bool) -> AdapterProfile:
    """A quick adapter fit on sst2's first 100 calibration items."""
    task = load_task(DATA / "sst2")
    items, digest = load_split(task, "calibration", 100)
    return fit_adapter_profile(
        judge,
        task,
        LabeledItems(items, "sst2/calibration", digest),
        "sst2",
        adapter_settings=QUICK,
        keep_adapter=keep_adapter,
    )


@pytest.fixture(scope="module")
def fitted(judge: Judge) -> AdapterProfile:
    # What is tested is the adapter's profile, won or not.
    return fit_sst2(judge, keep_adapter=True)


def random_adapter(judge: Judge, blocks: list[int], seed: int = 0) -> Adapter:
    """An adapter of the model's shapes with small random A and B (B nonzero, so that it
    changes the numbers)."""
    from safetensors.torch import save

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    layers: Any = judge.model.get_decoder().layers
    for i in blocks:
        for name in ("q_proj", "v_proj", "down_proj"):
            part = "self_attn" if name != "down_proj" else "mlp"
            w = layers[i].get_submodule(f"{part}.{name}").weight
            tensors[f"{i}.{name}.A"] = torch.randn(4, w.shape[1], generator=g) * 0.05
            tensors[f"{i}.{name}.B"] = torch.randn(w.shape[0], 4, generator=g) * 0.05
    weights = save(tensors)
    return Adapter(
        blocks=blocks,
        rank=4,
        alpha=8.0,
        targets=["q_proj", "v_proj", "down_proj"],
        weights=weights,
        sha256=weights_sha256(weights),
        model_sha256=judge.model_sha256,
    )


@TRAINS
def test_the_adapter_trains_on_the_fit_split_alone_and_is_certified_on_the_rest(
    fitted: AdapterProfile,
) -> None:
    profile, probe = fitted.profile, fitted.probe
    adapter = profile.adapter
    assert adapter is not None and probe.adapter is None
    # Trained and validated on the fit split's items; the rest certify.
    assert fitted.fit.n_train + fitted.fit.n_validation == profile.split.fit
    assert profile.split == probe.split  # the same items fit, set the quantile and certify
    fit_idx, conformal_idx, certify_idx = split_examples(fitted.scores.labels, 0, True)
    assert fit_idx.shape[0] == profile.split.fit and certify_idx.shape[0] == profile.split.certify
    # The head reads what the adapted blocks feed, and the blocks sit just below it.
    head = profile.calibration_map
    assert isinstance(head, Probe) and adapter.blocks == [head.layers[0] - 2, head.layers[0] - 1]
    assert profile.metrics_after is not None and profile.metrics_after.n == (
        conformal_idx.shape[0] + certify_idx.shape[0]
    )
    assert "LoRA rank 8" in profile.note and "validation" in profile.note


@TRAINS
def test_what_wins_on_the_validation_fold_is_kept(fitted: AdapterProfile, judge: Judge) -> None:
    nll = fitted.validation_nll
    assert set(nll) == {"adapter", "rival"} and all(v > 0 for v in nll.values())
    assert fitted.fit.validation_probabilities.shape == (fitted.fit.n_validation, 2)
    # The same fit without keep_adapter serves whichever had the lower validation NLL.
    chosen = fit_sst2(judge, keep_adapter=False)
    assert chosen.fit.adapter.sha256 == fitted.fit.adapter.sha256  # reproducible
    learned = fitted.fit.best_epoch > 0  # an adapter no epoch improved is not kept
    rival = fitted.rival.calibration_map.method  # auto's choice on the same split
    assert fitted.rival.split == fitted.probe.split
    winner = "adapter" if learned and nll["adapter"] < nll["rival"] else rival
    assert chosen.winner == fitted.winner == winner
    assert (chosen.profile.adapter is not None) == (winner == "adapter")
    if winner != "adapter":
        assert "not kept" in chosen.profile.note and chosen.profile.calibration_map.method == rival


@TRAINS
def test_a_profile_carries_its_adapter_and_refuses_one_tampered(
    fitted: AdapterProfile, tmp_path: Path
) -> None:
    path = save_profile(fitted.profile, tmp_path / "sst2.json")
    loaded = load_profile(path)
    assert loaded == fitted.profile and loaded.adapter is not None
    assert loaded.adapter.sha256 == weights_sha256(loaded.adapter.weights)
    data = msgspec.json.decode(path.read_bytes())
    weights = bytearray(loaded.adapter.weights)
    weights[-1] ^= 1  # one bit of one weight
    import base64

    data["adapter"]["weights"] = base64.b64encode(bytes(weights)).decode()
    path.write_bytes(msgspec.json.encode(data))
    with pytest.raises(Exception, match=r"adapter\.sha256"):
        load_profile(path)


def test_judgments_under_an_adapter_are_batch_and_cache_invariant(judge: Judge) -> None:
    adapter = random_adapter(judge, [12, 13, 14])
    prompts = ["Is the sky blue?", "Is water dry? Think about it.", "Is 91 a prime number?"]
    plain = [Query(prompt=p, choices=["yes", "no"], feature_layers=(15,)) for p in prompts]
    adapted = [msgspec.structs.replace(q, adapter=adapter) for q in plain]
    base = judge.judge_batch(plain)
    lone = [judge.judge_batch([q])[0] for q in adapted]  # the base model's cache is warm
    batch = judge.judge_batch(adapted)
    warm = [judge.judge_batch([q])[0] for q in adapted]  # the adapter's own cache is warm
    mixed = judge.judge_batch([adapted[0], plain[1], adapted[2], plain[0]])
    for i in range(3):
        assert lone[i].probs == batch[i].probs == warm[i].probs
        assert lone[i].features == batch[i].features == warm[i].features
        assert lone[i].adapter_sha256 == adapter.sha256 and base[i].adapter_sha256 == ""
        assert lone[i].probs != base[i].probs  # the adapter changes the numbers
    assert warm[0].cached_tokens > 0  # read from a cache: the adapter's, never the base's
    assert judge.adapted(adapter).prefix_cache is not judge.prefix_cache
    assert [m.probs for m in mixed] == [lone[0].probs, base[1].probs, lone[2].probs, base[0].probs]
    # The base model is untouched by the merged copies.
    assert [j.probs for j in judge.judge_batch(plain)] == [j.probs for j in base]


def training_stack_matches_the_model(
    judge: Judge, prompts: list[str], layer: int, blocks: int
) -> None:
    """What training reads (the states entering the adapted blocks, run through their copies
    with LoRA at its start, zero) is the model's own state at ``layer``, item by item in one
    padded batch: the blocks' masks, rotary embeddings and (at the last layer) final norm
    are the model's."""
    from calibration.tasks.adapter.training import _entering_states, _features, _trainable_stack

    if importlib.util.find_spec("peft") is None:
        pytest.skip("training needs peft, the 'adapter' extra")

    queries = [Query(prompt=p, choices=["yes", "no"]) for p in prompts]
    first = max(0, layer - blocks)
    items = _entering_states(judge, queries, first, "point", None)
    stack, norm, attention = _trainable_stack(
        judge,
        list(range(first, layer)),
        AdapterSettings(blocks=blocks),
        last=layer == judge.num_layers,
    )
    with torch.no_grad():
        got = _features(items, stack, norm, attention, "point")
    for b, query in enumerate(queries):
        ids = torch.tensor([judge.prepare(query).trie.context])
        with torch.inference_mode():
            out = judge.model(input_ids=ids, output_hidden_states=True, use_cache=False)
        want = out.hidden_states[layer][0, -1].float()
        assert torch.allclose(got[b], want, rtol=1e-3, atol=1e-3), (b, (got[b] - want).abs().max())


@pytest.mark.parametrize("layer", [20, 30], ids=["middle", "last, normed"])
def test_training_reads_the_model_s_own_states(judge: Judge, layer: int) -> None:
    prompts = ["Is this SMS spam? WINNER!! Claim your free prize now.", "Spam? hi"]
    training_stack_matches_the_model(judge, prompts, layer, blocks=10)


def test_an_adapter_trained_on_other_weights_is_refused(judge: Judge) -> None:
    other = msgspec.structs.replace(random_adapter(judge, [3]), model_sha256="0" * 64)
    with pytest.raises(InvalidQueryError, match="trained on weights") as caught:
        judge.judge("Is the sky blue?", ["yes", "no"], adapter=other)
    assert caught.value.field == "adapter"


def test_an_adapter_is_merged_once_into_the_base_model_only(judge: Judge) -> None:
    first, second = random_adapter(judge, [4], seed=1), random_adapter(judge, [4], seed=2)
    merged = judge.adapted(first)
    assert judge.adapted(first) is merged and merged.adapted(first) is merged
    with pytest.raises(InvalidQueryError, match="not into another adapter's"):
        merged.adapted(second)
    # A judge switched to the grammar-exact read shares the table, not the merged judge.
    grammar = judge.with_choice_paths("grammar").adapted(first)
    assert grammar is not merged and grammar.choice_paths == "grammar"
    assert merged.choice_paths == "canonical"


@TRAINS
def test_training_is_reproducible(judge: Judge) -> None:
    task = load_task(DATA / "sst2")
    items, _ = load_split(task, "calibration", 24)
    queries = labeled_queries(
        [task_prompt(task, it.text) for it in items],
        task.choices,
        item_spans=[task_item_span(task, it.text) for it in items],
    )
    labels = [task.choices.index(it.label) for it in items]
    k, h = len(task.choices), judge.hidden_size or 0
    runs = [
        fit_adapter(
            judge,
            queries,
            labels,
            layer=8,
            reads="mean",
            warm_start=lambda train: (np.zeros((k, h)), np.zeros(k)),
            settings=AdapterSettings(blocks=1, epochs=2, batch_size=8, seed=3),
        )
        for _ in range(2)
    ]
    assert runs[0].adapter.sha256 == runs[1].adapter.sha256
    assert np.array_equal(runs[0].weights, runs[1].weights)
    assert runs[0].adapter.blocks == [7]


@TRAINS
def test_a_decision_names_its_adapter(fitted: AdapterProfile, judge: Judge) -> None:
    adapter = fitted.profile.adapter
    assert adapter is not None
    verdict = Gate(fitted.profile).judge(judge, item="a gorgeous, witty, seductive movie.")
    assert verdict.adapter_sha256 == adapter.sha256
    assert Gate(fitted.probe).judge(judge, item="a dull movie.").adapter_sha256 is None


@TRAINS
def test_an_engine_that_cannot_merge_an_adapter_is_refused(fitted: AdapterProfile) -> None:
    class Served:
        model_id = "openai+http://127.0.0.1:9/v1"

        def fingerprint(self, **template: Any) -> Any:
            raise AssertionError("refused before the fingerprint is read")

    gate = Gate(fitted.profile)
    with pytest.raises(ProfileMismatchError, match="cannot merge one") as caught:
        gate.check_engine(Served())  # type: ignore[arg-type]
    assert caught.value.field == "adapter"


def test_every_route_judges_under_the_adapter(
    judge: Judge, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from test_span_service import LAYER
    from test_span_service import profile as probe_profile

    base: CalibrationProfile = probe_profile.__wrapped__(judge)  # type: ignore[attr-defined]
    adapted = msgspec.structs.replace(base, adapter=random_adapter(judge, [LAYER - 2, LAYER - 1]))
    views = every_route(judge, adapted, tmp_path / "adapted", capsys)
    expected = views["python"]
    assert adapted.adapter is not None
    # The answer, and the log's row, name the adapter.
    assert expected["adapter_sha256"] == views["decision log"]["adapter_sha256"]
    assert expected["adapter_sha256"] == adapted.adapter.sha256
    for route, view in views.items():
        for key, value in view.items():
            assert value == expected[key], (route, key, value, expected[key])
    # Not the numbers of the same probe without the adapter.
    plain = every_route(judge, base, tmp_path / "plain", capsys)["python"]
    assert plain["raw_probabilities"] != expected["raw_probabilities"]


@TRAINS
def test_judge_calibrate_method_adapter_writes_a_profile_judge_ask_serves(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], loaded_once: list[dict[str, object]]
) -> None:
    profiles = tmp_path / "profiles"
    argv = ["calibrate", "--task", str(DATA / "sst2"), "--method", "adapter", "--limit", "100"]
    argv += ["--epochs", "1", "--adapter-blocks", "1", "--profiles-dir", str(profiles)]
    assert main([*argv, "--keep-adapter"]) == 0
    out = capsys.readouterr().out
    assert "adapter kept" in out and "on the same split" in out
    profile = load_profile(profiles / "sst2.json")
    assert profile.adapter is not None and len(profile.adapter.blocks) == 1
    text = "a gorgeous, witty, seductive movie."
    assert main(["ask", text, "--profile", str(profiles / "sst2.json")]) == 0
    asked = msgspec.json.decode(capsys.readouterr().out)
    assert asked["profile"] == "sst2" and set(asked["probabilities"]) == {"negative", "positive"}
    assert asked["adapter_sha256"] == profile.adapter.sha256  # the answer names its adapter


# --- retrained from the decision log (issue 57) --------------------------------------------


def logged(profile: CalibrationProfile, path: Path) -> tuple[str, dict[str, str]]:
    """A log of sst2 decisions under ``profile``, each keeping its request: 110 audited and
    20 others labelled, 3 without a request. Returns the log and each id's label."""
    task = load_task(DATA / "sst2")
    items, _ = load_split(task, "test", 130)
    assert profile.template is not None
    now = time.time() - 600
    records: list[LoggedDecision] = []
    labels = {}
    for i, item in enumerate(items):
        prompt, span = profile.template.render(item.text)
        base = decision("e" * 8, 0.7, audit=i < 110, item="x", at=now + i)
        record = msgspec.structs.replace(
            base,
            profile=profile.name,
            choices=list(profile.choices),
            log_probs=[float(np.log(0.5))] * 2,
            probabilities=dict.fromkeys(profile.choices, 0.5),
            choice=profile.choices[0],
            model_sha256=profile.fingerprint.model_sha256 or "a" * 64,
            request={"query": {"prompt": prompt, "choices": profile.choices, "item_span": span}},
        )
        records.append(record)
        labels[record.judgment_id] = item.label
    for i in range(3):  # labelled, but with no request kept: left out
        bare = decision("e" * 8, 0.7, audit=True, item=None, at=now + 200 + i)
        records.append(
            msgspec.structs.replace(
                bare,
                profile=profile.name,
                choices=list(profile.choices),
                probabilities=dict.fromkeys(profile.choices, 0.5),
                choice=profile.choices[0],
                model_sha256=profile.fingerprint.model_sha256 or "a" * 64,
            )
        )
        labels[records[-1].judgment_id] = profile.choices[0]
    target = str(path / "decisions.db")
    with closing(open_log(target)) as log:
        log.append(records)
        for judgment_id, label in labels.items():
            log.label(judgment_id, label)
    return target, labels


@TRAINS
def test_the_adapter_is_retrained_from_the_logged_items(
    judge: Judge, fitted: AdapterProfile, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    profile = fitted.profile
    assert profile.adapter is not None
    target, labels = logged(profile, tmp_path)
    with closing(open_log(target)) as log:
        items, left_out = logged_items(log.decisions(profile=profile.name, labeled=True), profile)
        assert left_out == 3 and len(items) == 130
        assert sum(item.taught for item in items) == 20
        assert all(item.label == labels[item.id] for item in items)
        refit = retrain_from_log(
            log,
            profile,
            judge.sibling(),
            refit_settings(profile),
            name=profile.name,
            log_name="test log",
            adapter_settings=QUICK,
        )
    new = refit.profile
    assert refit.audited == 110 and refit.taught == 20
    assert new.recertification is not None and new.recertification.look == 1
    assert new.threshold.delta == pytest.approx(new.recertification.spent)
    assert new.split.taught == 20  # the taught items trained, never certified
    assert "decision log test log" in new.dataset
    assert "3 labelled decisions left out" in refit.notes[1]
    if new.adapter is not None:  # the adapter won again: a new one, trained on the log
        assert new.adapter.sha256 != profile.adapter.sha256
    else:  # the probe or a scalar map won the validation fold, and says so
        assert "Adapter tried and not kept" in new.note
    # The server's background refit takes this path for an adapter profile when it has a
    # judge to train with (--refit-adapters), and the head-only refit otherwise.
    calls: list[str] = []

    def fake(*args: Any, **kwargs: Any) -> LogRefit:
        calls.append(kwargs["name"])
        return refit

    monkeypatch.setattr("service.web.background_refit.retrain_from_log", fake)
    store = ProfileStore(tmp_path / "profiles")
    store.put(profile)
    with closing(open_log(target)) as log:
        BackgroundRefit(store, log, target, 1, trainer=judge.sibling)._refit(profile.name, 133)
        assert calls == [profile.name]
        head_only = BackgroundRefit(store, log, target, 1)
        head_only._refit(profile.name, 133)
        assert calls == [profile.name]  # not called again: the head-only refit ran
        assert head_only.refits[profile.name]


def test_refit_adapters_needs_refits_and_requests(tmp_path: Path) -> None:
    log = str(tmp_path / "d.db")
    with pytest.raises(ValueError, match="refit_adapters"):
        ServiceConfig(decision_log=log, refit_adapters=True, log_requests=True)
    with pytest.raises(ValueError, match="refit_adapters"):
        ServiceConfig(decision_log=log, refit_adapters=True, refit_every=10)
    ServiceConfig(decision_log=log, refit_adapters=True, refit_every=10, log_requests=True)


def test_without_peft_training_is_refused_before_any_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """An install without the `adapter` extra: every way into training says what to install
    before it loads a model or judges an item (the model named here does not exist)."""
    monkeypatch.setitem(sys.modules, "peft", None)  # import peft raises ImportError
    with pytest.raises(ModuleNotFoundError, match="the 'adapter' extra"):
        require_peft()
    missing = missing_adapter_extra()  # what every front (and a log refit) says
    assert missing is not None and "calibrated-judge[adapter]" in missing
    reviews = Path(__file__).resolve().parents[1] / "examples" / "reviews"
    argv = ["calibrate", "--task", str(reviews), "--method", "adapter"]
    no_model = ["--model", str(tmp_path / "no-model"), "--profiles-dir", str(tmp_path)]
    assert main([*argv, *no_model]) == 2
    said = capsys.readouterr().err
    assert "--method adapter: training an adapter needs peft" in said
    assert "calibrated-judge[adapter]" in said
    # The server refuses --refit-adapters at its start, before the engine loads.
    log = str(tmp_path / "d.db")
    serve = ["serve", "--model", str(tmp_path / "no-model"), "--decision-log", log]
    assert main([*serve, "--refit-every", "10", "--log-requests", "--refit-adapters"]) == 2
    assert "--refit-adapters: training an adapter needs peft" in capsys.readouterr().err
