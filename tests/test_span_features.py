"""The item's own tokens: hidden states averaged over a span of the prompt, from the same pass.

The reference is transformers' own ``output_hidden_states=True`` over the rendered prompt, a
plain causal pass, averaged over the tokens that hold a character of the item (the tokenizer's
offsets say which). Batches, shared contexts and the prefix cache must give a span the lone
judgment's means bit for bit, and the cache must never serve a token the mean reads.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import judge.forward as forward
from judge import InvalidQueryError, Judge, Judgment, Query
from judge.engine import shared_query

MIDDLE, LAST = 15, 30  # the default model has 30 blocks
LAYERS = (MIDDLE, LAST)
ITEM = "The film was a delight from start to finish, and the cast is superb."
INSTRUCTION = (
    "You label the sentiment of movie reviews for a research team. Read the review below and "
    "say whether it is positive or negative."
)
PROMPT = f"{INSTRUCTION}\n\n{ITEM}\n\nAnswer with one of: positive, negative."
SPAN = (PROMPT.index(ITEM), PROMPT.index(ITEM) + len(ITEM))
CHOICES = ["positive", "negative"]


@pytest.fixture(scope="module")
def uncached(judge: Judge) -> Judge:
    assert judge.num_layers == LAST
    return Judge(judge.model, judge.tokenizer, model_id=judge.model_id, prefix_cache_mb=0)


def reference_means(judge: Judge, prompt: str, span: tuple[int, int]) -> dict[int, np.ndarray]:
    """transformers' hidden states of the rendered prompt, averaged over the tokens with a
    character in ``span`` (characters of ``prompt``)."""
    rendered = judge.render(prompt)
    at = rendered.rindex(prompt)
    first, last = at + span[0], at + span[1]
    encoded = judge.tokenizer(rendered, add_special_tokens=False, return_offsets_mapping=True)
    inside = [t for t, (a, b) in enumerate(encoded.offset_mapping) if a < last and b > first]
    with torch.inference_mode():
        states = judge.model(
            torch.tensor([encoded.input_ids]), output_hidden_states=True
        ).hidden_states
    return {n: states[n][0, inside].double().mean(dim=0).numpy() for n in LAYERS}


def assert_close(got: Judgment, want: dict[int, np.ndarray]) -> None:
    assert got.span_features is not None and sorted(got.span_features) == sorted(want)
    for n, ref in want.items():
        gap = np.abs(np.asarray(got.span_features[n]) - ref).max()
        assert gap <= 1e-4 * max(1.0, np.abs(ref).max()), f"layer {n}: span means differ by {gap}"


@pytest.mark.parametrize("lean", [True, False], ids=["lean pass", "generic pass"])
def test_span_means_are_transformers_hidden_states_over_the_item(judge: Judge, lean: bool) -> None:
    engine = Judge(judge.model, judge.tokenizer, prefix_cache_mb=0, lean=lean)
    got = engine.judge(PROMPT, CHOICES, span_layers=LAYERS, item_span=SPAN)
    assert got.item_span == SPAN
    assert_close(got, reference_means(judge, PROMPT, SPAN))
    # The tolerance tells the item from the whole prompt.
    with pytest.raises(AssertionError, match="span means differ"):
        assert_close(got, reference_means(judge, PROMPT, (0, len(PROMPT))))


def test_no_item_span_is_the_whole_prompt(uncached: Judge) -> None:
    whole = uncached.judge(PROMPT, CHOICES, span_layers=LAYERS)
    assert whole.item_span is None
    marked = uncached.judge(PROMPT, CHOICES, span_layers=LAYERS, item_span=(0, len(PROMPT)))
    assert whole.span_features == marked.span_features


def test_asking_for_span_means_leaves_the_rest_alone(uncached: Judge) -> None:
    plain = uncached.judge(PROMPT, CHOICES, feature_layers=LAYERS)
    spanned = uncached.judge(PROMPT, CHOICES, feature_layers=LAYERS, span_layers=(MIDDLE,))
    assert plain.span_features is None
    assert spanned.probs == plain.probs and spanned.features == plain.features
    assert spanned.span_features is not None and list(spanned.span_features) == [MIDDLE]


def test_batches_give_each_span_its_lone_means(uncached: Judge) -> None:
    lone = uncached.judge(PROMPT, CHOICES, span_layers=LAYERS, item_span=SPAN)
    others = [
        Query(prompt="Short?", choices=["yes", "no"]),
        Query(prompt="A longer one, " * 12 + "which?", choices=["1", "10"], span_layers=(LAST,)),
    ]
    item = Query(prompt=PROMPT, choices=CHOICES, span_layers=LAYERS, item_span=SPAN)
    for slot in range(3):
        batch = [*others[:slot], item, *others[slot:]]
        got = uncached.judge_batch(batch)
        assert got[slot].span_features == lone.span_features, f"slot {slot}"
        assert got[slot].probs == lone.probs
        assert [g.span_features is None for g in got] == [not q.span_layers for q in batch]


def test_the_cache_serves_only_the_tokens_before_the_span(judge: Judge, uncached: Judge) -> None:
    engine = Judge(judge.model, judge.tokenizer, prefix_cache_mb=64, prefix_cache_block=4)
    lone = uncached.judge(PROMPT, CHOICES, span_layers=LAYERS, item_span=SPAN)
    rendered = judge.render(PROMPT)
    before = rendered[: rendered.rindex(PROMPT) + SPAN[0]]
    span_start = len(judge.tokenizer(before, add_special_tokens=False).input_ids)
    engine.judge(PROMPT, CHOICES)  # caches the whole chain, the item's tokens included
    warm = engine.judge(PROMPT, CHOICES, span_layers=LAYERS, item_span=SPAN)
    # The instruction before the item still comes from the cache, the item never does.
    assert 0 < warm.cached_tokens <= span_start
    assert warm.span_features == lone.span_features and warm.probs == lone.probs
    # Without a span the same query reads the cache up to its last token's block.
    assert engine.judge(PROMPT, CHOICES).cached_tokens > span_start


def test_shared_questions_carry_their_own_spans(uncached: Judge) -> None:
    context = f"{INSTRUCTION}\n\n{ITEM}"
    question = "Is the review positive or negative?"
    questions = [
        Query(prompt=question, choices=CHOICES, span_layers=LAYERS, item_span=(0, 6)),
        Query(prompt="Is it about a film?", choices=["yes", "no"], span_layers=(MIDDLE,)),
    ]
    shared = uncached.judge_shared(context, questions)
    for q, got in zip(questions, shared, strict=True):
        alone = uncached.judge_batch([shared_query(context, q)])[0]
        assert got.span_features == alone.span_features and got.probs == alone.probs
    # A question's span moves with its prompt behind the context.
    composed = shared_query(context, questions[0])
    assert composed.item_span is not None
    assert composed.prompt[slice(*composed.item_span)] == question[:6]


@pytest.mark.parametrize(
    ("fields", "field", "match"),
    [
        ({"item_span": (5, 5)}, "item_span", "not a span"),
        ({"item_span": (0, len(PROMPT) + 1)}, "item_span", "not a span"),
        ({"item_span": (-1, 3)}, "item_span", "not a span"),
        ({"item_span": [1, 2, 3]}, "item_span", "length 2"),
        ({"item_span": ["a", "b"]}, "item_span", "Expected `int`"),
        ({"span_layers": [0]}, "span_layers", "not a layer"),
        ({"span_layers": "15"}, "span_layers", "Expected `array`"),
    ],
)
def test_a_bad_span_fails_before_the_pass_and_names_its_field(
    uncached: Judge, monkeypatch: pytest.MonkeyPatch, fields: dict, field: str, match: str
) -> None:
    calls: list[int] = []
    monkeypatch.setattr(forward, "score_rows", lambda *a, **k: calls.append(1))
    query = {"prompt": PROMPT, "choices": CHOICES, "span_layers": [MIDDLE], **fields}
    with pytest.raises(InvalidQueryError, match=match) as raised:
        uncached.judge_batch([query])
    assert raised.value.field == field
    assert calls == []


def test_a_typed_query_with_a_bad_span_names_its_field(uncached: Judge) -> None:
    """A Query built in code skips msgspec's checks: the engine's own catch it."""
    query = Query(prompt=PROMPT, choices=CHOICES, span_layers=(MIDDLE,), item_span=(3, 2))
    with pytest.raises(InvalidQueryError, match="not a span") as raised:
        uncached.judge_batch([query])
    assert raised.value.field == "item_span"
