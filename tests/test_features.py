"""Hidden-state features from the judging pass, on the real default model in float32.

The reference is transformers' own ``output_hidden_states=True`` over the tokens up to the
decision point, run as a plain causal pass with no packing, padding or cache. Every other path
(choice trees, batches, shared contexts, the prefix cache warm and cold) must give the same
rows as a lone judgment.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
from reference import shared_length

import judge.forward as forward
from judge import InvalidQueryError, Judge, Judgment, Query
from judge.engine import json_escape

MIDDLE, LAST = 15, 30  # the default model has 30 blocks
LAYERS = (MIDDLE, LAST)
PROMPT = "Is this SMS spam? WINNER!! Claim your free prize now, text WIN to 80082."
# Long enough to span several cache blocks of 4 tokens, short enough to keep the file fast.
RUBRIC = (
    "You grade answers for a customer-support team. An answer passes when it is polite, "
    "correct, and tells the customer what happens next. "
)


@pytest.fixture(scope="module")
def uncached(judge: Judge) -> Judge:
    """The session's model without a prefix cache: every judgment is one plain pass."""
    assert judge.num_layers == LAST and judge.hidden_size is not None
    return Judge(judge.model, judge.tokenizer, model_id=judge.model_id, prefix_cache_mb=0)


def cached(judge: Judge) -> Judge:
    """The session's model with a cache of its own; blocks of 4, so short prompts use many."""
    return Judge(
        judge.model,
        judge.tokenizer,
        model_id=judge.model_id,
        prefix_cache_mb=64,
        prefix_cache_block=4,
    )


def decision_ids(
    judge: Judge, judgment: Judgment, choices: Sequence[str], suffix: str
) -> list[int]:
    """The tokens up to and including the decision point, worked out from the tokenizer alone:
    the prefix every choice's path shares with the others and with the prompt's tokenization."""
    tok = judge.tokenizer
    prompt_ids = tok(judgment.prompt, add_special_tokens=False).input_ids
    paths = [
        tok(judgment.prompt + json_escape(c) + suffix, add_special_tokens=False).input_ids
        for c in choices
    ]
    start = min(shared_length(p, q) for p in paths for q in [*paths, prompt_ids])
    return list(paths[0][:start])


def reference_states(judge: Judge, ids: list[int], layers: Sequence[int]) -> dict[int, np.ndarray]:
    """transformers' ``hidden_states[l]`` at every position of ``ids`` (T, H), from one bare
    pass: the last row is the decision point's when ``ids`` ends there."""
    with torch.inference_mode():
        out = judge.model(torch.tensor([ids]), output_hidden_states=True)
    return {n: out.hidden_states[n][0].float().numpy() for n in layers}


def assert_same_features(got: Judgment, want: dict[int, np.ndarray] | Judgment) -> None:
    assert got.features is not None
    expected = want.features if isinstance(want, Judgment) else want
    assert expected is not None and set(got.features) == set(expected)
    for n, row in got.features.items():
        diff = np.max(np.abs(np.asarray(row) - np.asarray(expected[n])))
        assert diff < 1e-4, f"layer {n}: features differ by {diff}"


@pytest.fixture
def forward_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Counts the forward passes while the test runs: every pass is a ``score_rows`` or a
    ``prefill`` that ran, whichever decoder (lean or the model's own) computes it."""
    calls: list[int] = []
    score_rows, prefill = forward.score_rows, forward.prefill

    def counted_rows(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return score_rows(*args, **kwargs)

    def counted_prefill(*args: Any, **kwargs: Any) -> bool:
        ran = prefill(*args, **kwargs)
        calls.extend([1] * ran)
        return ran

    monkeypatch.setattr(forward, "score_rows", counted_rows)
    monkeypatch.setattr(forward, "prefill", counted_prefill)
    yield calls


@pytest.mark.parametrize(
    ("choices", "response_prefix", "suffix"),
    [
        (["spam", "ham"], None, '"}'),  # single tokens: the root is the last prompt token
        (["1", "10", "2"], None, '"}'),  # a tree below the root
        (["spam", "spam_risky", "ham"], None, '"}'),
        # "Answer: " ends in a space that merges into " yes": the root moves back one token.
        (["yes", "no"], "Answer: ", ""),
    ],
    ids=["single tokens", "digits tree", "shared prefix tree", "merging prefix"],
)
def test_features_are_transformers_hidden_states_at_the_decision_point(
    judge: Judge,
    uncached: Judge,
    choices: list[str],
    response_prefix: str | None,
    suffix: str,
) -> None:
    result = uncached.judge(
        PROMPT,
        choices,
        response_prefix=response_prefix,
        response_suffix=suffix,
        feature_layers=LAYERS,
    )
    ids = decision_ids(judge, result, choices, suffix)
    prompt_ids = judge.tokenizer(result.prompt, add_special_tokens=False).input_ids
    if response_prefix is None:
        assert ids == prompt_ids  # the decision point is the prompt's last token
    else:
        assert ids == prompt_ids[:-1]  # ... or the one before a merged space
    assert result.features is not None
    assert all(len(row) == judge.hidden_size for row in result.features.values())
    assert all(isinstance(v, float) for v in result.features[MIDDLE])
    states = reference_states(judge, ids, LAYERS)
    assert_same_features(result, {n: rows[-1] for n, rows in states.items()})
    # The tolerance tells neighbouring positions apart: the row before the root fails it.
    with pytest.raises(AssertionError, match="features differ"):
        assert_same_features(result, {n: rows[-2] for n, rows in states.items()})


def test_a_padded_batch_gives_each_item_its_lone_features(uncached: Judge) -> None:
    queries = [
        Query(prompt=PROMPT, choices=["spam", "ham"], feature_layers=LAYERS),
        Query(
            prompt="A longer prompt, so that the others are left-padded. " * 4 + "Which?",
            choices=["1", "10", "2"],
            feature_layers=(LAST, MIDDLE),
        ),
        Query(prompt="Short?", choices=["yes", "no"]),  # asks for none, in the same pass
        Query(prompt="Is it?", choices=["spam", "spam_risky", "ham"], feature_layers=(MIDDLE,)),
    ]
    batched = uncached.judge_batch(queries)
    assert len({r.prompt_tokens for r in batched}) == len(queries)
    for q, got in zip(queries, batched, strict=True):
        alone = uncached.judge(q.prompt, q.choices, feature_layers=q.feature_layers)
        if q.feature_layers:
            assert got.features is not None and sorted(got.features) == sorted(q.feature_layers)
            assert_same_features(got, alone)
        else:
            assert got.features is None
        assert got.probabilities == pytest.approx(alone.probabilities, abs=1e-4)


def test_shared_context_questions_give_their_lone_features(uncached: Judge) -> None:
    context = RUBRIC + "Answer: 'We will refund you tomorrow.'"
    questions = [
        Query(prompt="Is it polite?", choices=["yes", "no"], feature_layers=LAYERS),
        Query(prompt="Grade it.", choices=["A", "B", "C"], feature_layers=(MIDDLE,)),
        Query(prompt="Score it from 1 to 10.", choices=["1", "10", "2"], feature_layers=LAYERS),
    ]
    shared = uncached.judge_shared(context, questions)
    assert all(r.forward_passes == 1 for r in shared)
    for q, got in zip(questions, shared, strict=True):
        alone = uncached.judge(
            f"{context}\n\n{q.prompt}", q.choices, feature_layers=q.feature_layers
        )
        assert got.prompt == alone.prompt
        assert_same_features(got, alone)


def test_prefix_cache_cold_and_warm_give_the_lone_features(judge: Judge, uncached: Judge) -> None:
    engine = cached(judge)
    prompt = RUBRIC + "Answer: 'Thanks, a courier comes Monday.'"
    alone = uncached.judge(prompt, ["pass", "fail"], feature_layers=LAYERS)
    cold = engine.judge(prompt, ["pass", "fail"], feature_layers=LAYERS)
    warm = engine.judge(prompt, ["pass", "fail"], feature_layers=LAYERS)
    assert cold.cached_tokens == 0 and warm.cached_tokens > len(RUBRIC) // 8
    assert_same_features(cold, alone)
    assert_same_features(warm, alone)
    # A batch on a cold head: the head runs in a pass of its own, each row reads it from the
    # cache. The answers' lengths put the root at every offset within a block of 4.
    fresh = cached(judge)
    by_offset: dict[int, str] = {}
    for k in range(4):
        p = RUBRIC + "Reply: " + "yes " * k + "sure."
        ids = judge.tokenizer(judge.render(p), add_special_tokens=False).input_ids
        by_offset.setdefault(len(ids) % 4, p)
    prompts = list(by_offset.values())
    items = [Query(prompt=p, choices=["pass", "fail"], feature_layers=LAYERS) for p in prompts]
    got = fresh.judge_batch(items)
    assert {r.prompt_tokens % 4 for r in got} == {0, 1, 2, 3}
    assert all(r.forward_passes == 2 and r.cached_tokens > 0 for r in got)
    for p, g in zip(prompts, got, strict=True):
        assert_same_features(g, uncached.judge(p, ["pass", "fail"], feature_layers=LAYERS))


@pytest.mark.parametrize("choices", [["spam", "ham"], ["spam", "spam_risky", "ham"]])
def test_asking_for_features_leaves_the_probabilities_alone(
    uncached: Judge, choices: list[str]
) -> None:
    plain = uncached.judge(PROMPT, choices)
    assert plain.features is None
    with_features = uncached.judge(PROMPT, choices, feature_layers=(10, 15, 20, 25, 30))
    assert with_features.probabilities == pytest.approx(plain.probabilities, abs=1e-9, rel=0)
    logps = plain.log_probabilities
    assert with_features.log_probabilities == pytest.approx(logps, abs=1e-9, rel=0)
    assert with_features.choice_mass == pytest.approx(plain.choice_mass, abs=1e-9, rel=0)


def test_only_the_requested_layers_come_back_each_once(uncached: Judge) -> None:
    result = uncached.judge(PROMPT, ["spam", "ham"], feature_layers=[20, 1, 20, 30, 1])
    assert result.features is not None and sorted(result.features) == [1, 20, 30]
    assert all(len(row) == uncached.hidden_size for row in result.features.values())
    # The layers are distinct rows of the residual stream, not one row under several keys.
    assert result.features[1] != result.features[20] != result.features[30]
    # Plain data: the JSON form gives back the same layers and values.
    assert msgspec.json.decode(msgspec.json.encode(result), type=Judgment) == result
    one = uncached.judge_batch(
        [{"prompt": PROMPT, "choices": ["spam", "ham"], "feature_layers": [7]}]
    )
    assert one[0].features is not None and list(one[0].features) == [7]


BAD_LAYERS: list[Any] = [0, LAST + 1, -1, True, "3"]


@pytest.mark.parametrize("bad", BAD_LAYERS, ids=repr)
def test_invalid_layers_fail_before_any_forward_pass(
    uncached: Judge, forward_calls: list[int], bad: Any
) -> None:
    with pytest.raises(InvalidQueryError) as info:
        uncached.judge(PROMPT, ["spam", "ham"], feature_layers=[MIDDLE, bad])
    assert info.value.field == "feature_layers" and repr(bad) in str(info.value)
    good = Query(prompt=PROMPT, choices=["spam", "ham"], feature_layers=LAYERS)
    bad_query = Query(prompt="Short?", choices=["yes", "no"], feature_layers=(bad,))
    with pytest.raises(InvalidQueryError) as info:
        uncached.judge_batch([good, bad_query])
    assert info.value.field == "feature_layers"
    assert forward_calls == []


def test_judge_each_puts_each_bad_layer_in_its_place(
    uncached: Judge, forward_calls: list[int]
) -> None:
    good = Query(prompt=PROMPT, choices=["spam", "ham"], feature_layers=LAYERS)
    bad = [Query(prompt="Short?", choices=["yes", "no"], feature_layers=(b,)) for b in BAD_LAYERS]
    results = uncached.judge_each([good, *bad, good])
    assert len(forward_calls) == 1  # the two good items, in one pass
    for r in results[1:-1]:
        assert isinstance(r, InvalidQueryError) and r.field == "feature_layers"
    for r in (results[0], results[-1]):
        assert isinstance(r, Judgment) and r.features is not None
        assert sorted(r.features) == list(LAYERS)


def test_feature_layers_must_be_a_list(uncached: Judge, forward_calls: list[int]) -> None:
    not_lists: list[Any] = ["15", 15]
    for bad in not_lists:
        query = Query(prompt=PROMPT, choices=["spam", "ham"], feature_layers=bad)
        with pytest.raises(InvalidQueryError) as info:
            uncached.judge_batch([query])
        assert info.value.field == "feature_layers"
    assert forward_calls == []


@pytest.mark.parametrize("bad", [True, "3"], ids=repr)
def test_invalid_layers_in_a_mapping_name_the_field(uncached: Judge, bad: object) -> None:
    with pytest.raises(InvalidQueryError) as info:
        uncached.judge_batch([{"prompt": PROMPT, "choices": ["a", "b"], "feature_layers": [bad]}])
    assert info.value.field == "feature_layers"


def test_another_threads_pass_does_not_write_into_the_features(judge: Judge) -> None:
    """The generic pass gathers features with hooks that sit on the shared model during a call
    (the lean pass needs none): a pass another thread runs meanwhile (a different prompt, no
    features asked) fires them too, and must not overwrite this call's rows. The other pass
    is made to run inside this call, after its layer MIDDLE and before its hooks come off."""
    import threading

    generic = Judge(
        judge.model, judge.tokenizer, model_id=judge.model_id, prefix_cache_mb=0, lean=False
    )
    assert generic.decoder_pass == "generic"
    want = generic.judge(PROMPT, ["spam", "ham"], feature_layers=[MIDDLE])
    this_thread = threading.get_ident()
    others: list[Judgment] = []

    def other() -> None:
        others.extend(
            generic.judge_batch([{"prompt": RUBRIC + "Is it?", "choices": ["yes", "no"]}])
        )

    def meanwhile(module: torch.nn.Module, args: object, output: object) -> None:
        if threading.get_ident() == this_thread and not others:
            thread = threading.Thread(target=other)
            thread.start()
            thread.join()

    last_block = judge.model.get_decoder().layers[LAST - 1]
    handle = last_block.register_forward_hook(meanwhile)
    try:
        got = generic.judge(PROMPT, ["spam", "ham"], feature_layers=[MIDDLE])
    finally:
        handle.remove()
    assert len(others) == 1 and others[0].features is None  # it ran, with the hooks on
    assert_same_features(got, want)
