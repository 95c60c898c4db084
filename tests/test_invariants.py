"""Invariants of the engine's results on the real default model."""

from __future__ import annotations

import copy
import hashlib
import math

import msgspec
import pytest
import torch

from judge import Fingerprint, Judge, Judgment, Query
from judge.packing import passes

PROMPT = "Is this SMS spam? Free entry in a weekly competition, text WIN to 80082 now!"


def test_probabilities_sum_to_one_and_follow_the_log_probabilities(judge: Judge) -> None:
    result = judge.judge(PROMPT, ["spam", "ham", "spam_risky", "unsure"])
    assert list(result.probabilities) == ["spam", "ham", "spam_risky", "unsure"]
    assert sum(result.probabilities.values()) == pytest.approx(1.0, abs=1e-9)
    logps = result.log_probabilities
    assert list(logps) == list(result.probabilities) and all(v < 0 for v in logps.values())
    norm = math.log(sum(math.exp(v) for v in logps.values()))
    for choice, p in result.probabilities.items():
        assert p == pytest.approx(math.exp(logps[choice] - norm), rel=1e-9)
    assert result.choice == max(result.probabilities, key=result.probabilities.__getitem__)
    assert result.confidence == result.probabilities[result.choice]
    assert 0.0 < result.choice_mass <= 1.0
    assert result.prompt.endswith('{"answer": "')
    assert result.prompt_tokens == len(
        judge.tokenizer(result.prompt, add_special_tokens=False).input_ids
    )
    assert result.latency_ms > 0
    assert result.model == judge.model_id


def test_reordering_choices_changes_nothing(judge: Judge) -> None:
    choices = ["1", "10", "100", "spam", "spam_risky", "예", "아니오"]
    forward = judge.judge(PROMPT, choices)
    backward = judge.judge(PROMPT, choices[::-1])
    assert list(backward.probabilities) == choices[::-1]
    for c in choices:
        assert backward.probabilities[c] == pytest.approx(forward.probabilities[c], abs=1e-6)


def test_batch_equals_single_judgments(judge: Judge) -> None:
    queries = [
        Query(prompt=PROMPT, choices=["spam", "ham"]),
        Query(prompt="A much longer prompt. " * 20 + "Which?", choices=["1", "10", "100"]),
        Query(prompt="Short?", choices=["yes", "yes!", "no"], system="Answer tersely."),
        Query(
            prompt="Is the sky blue?",
            choices=["yes", "no"],
            response_prefix="Answer: ",
            response_suffix="",
        ),
        Query(prompt="하늘은 파란색입니까?", choices=["예", "아니오"]),
    ]
    batched = judge.judge_batch([*queries, {"prompt": "Dict form?", "choices": ["a", "b"]}])
    alone = [judge.judge(**{f: getattr(q, f) for f in q.__struct_fields__}) for q in queries]
    alone.append(judge.judge("Dict form?", ["a", "b"]))
    assert len(batched) == len(alone)
    for b, a in zip(batched, alone, strict=True):
        assert b.prompt == a.prompt
        for c in a.probabilities:
            assert b.probabilities[c] == pytest.approx(a.probabilities[c], abs=1e-4)
        assert b.choice_mass == pytest.approx(a.choice_mass, rel=1e-3)


def test_batch_splits_into_bounded_chunks(judge: Judge) -> None:
    small = Judge(judge.model, judge.tokenizer, max_batch_size=2, max_batch_tokens=10**6)
    queries = [Query(prompt=f"Item {i}: is it spam?", choices=["spam", "ham"]) for i in range(5)]
    lengths = [small.prepare(q).tokens for q in queries]
    assert [len(c) for c in passes(lengths, 2, small.max_batch_tokens)] == [2, 2, 1]
    results = small.judge_batch(queries)
    for q, r in zip(queries, results, strict=True):
        assert r.probabilities["spam"] == pytest.approx(
            judge.judge(q.prompt, q.choices).probabilities["spam"], abs=1e-4
        )


def test_system_prompt_reaches_the_model(judge: Judge) -> None:
    result = judge.judge("Hi", ["a", "b"], system="You grade essays.")
    assert "You grade essays." in result.prompt


def test_bfloat16_agrees_with_float32_roughly(judge: Judge) -> None:
    model = copy.deepcopy(judge.model)
    model.to(torch.bfloat16)  # type: ignore[arg-type]  # transformers types .to oddly
    bf16 = Judge(model, judge.tokenizer)
    assert bf16.dtype == "bfloat16"
    a = judge.judge(PROMPT, ["spam", "ham"])
    b = bf16.judge(PROMPT, ["spam", "ham"])
    assert b.choice == a.choice
    assert b.probabilities["spam"] == pytest.approx(a.probabilities["spam"], abs=0.05)


CONTEXT = (
    "Passage: The Amazon river flows through Brazil, Peru and Colombia and carries more water "
    "than any other river. Its basin is home to the largest rainforest on Earth."
)
QUESTIONS = [
    Query(prompt="Does the Amazon flow through Peru?", choices=["yes", "no"]),
    Query(prompt="How many countries are named?", choices=["1", "2", "3", "10"]),
    Query(prompt="Is the basin a desert?", choices=["yes", "yes!", "no"], system="Be careful."),
]


@pytest.mark.parametrize("budget", [8192, 150])
def test_shared_context_equals_separate_judgments(judge: Judge, budget: int) -> None:
    # A small token budget splits the questions over several rows.
    engine = Judge(judge.model, judge.tokenizer, model_id=judge.model_id, max_batch_tokens=budget)
    shared = engine.judge_shared(CONTEXT, QUESTIONS)
    for q, got in zip(QUESTIONS, shared, strict=True):
        alone = judge.judge(f"{CONTEXT}\n\n{q.prompt}", q.choices, system=q.system)
        assert got.prompt == alone.prompt
        for c in q.choices:
            assert got.probabilities[c] == pytest.approx(alone.probabilities[c], abs=1e-4)
        assert got.choice_mass == pytest.approx(alone.choice_mass, rel=1e-3)


def test_judge_each_isolates_bad_items(judge: Judge) -> None:
    from judge import DuplicateChoiceError, InvalidQueryError

    results = judge.judge_each(
        [
            Query(prompt=PROMPT, choices=["spam", "ham"]),
            Query(prompt="x", choices=["a", "a"]),
            {"prompt": 3, "choices": ["a", "b"]},
            Query(prompt="Is it?", choices=["1", "10"]),
        ]
    )
    assert isinstance(results[1], DuplicateChoiceError)
    assert isinstance(results[2], InvalidQueryError)
    first, last = results[0], results[3]
    assert not isinstance(first, Exception) and not isinstance(last, Exception)
    assert first.probabilities["spam"] == pytest.approx(
        judge.judge(PROMPT, ["spam", "ham"]).probabilities["spam"], abs=1e-4
    )
    assert last.probabilities["1"] == pytest.approx(
        judge.judge("Is it?", ["1", "10"]).probabilities["1"], abs=1e-4
    )


def test_logits_is_the_old_read_only_name_of_log_probabilities(judge: Judge) -> None:
    result = judge.judge(PROMPT, ["spam", "ham"])
    assert result.logits == result.log_probabilities
    with pytest.raises(AttributeError):
        result.logits = {}  # type: ignore[misc]
    encoded = msgspec.json.decode(msgspec.json.encode(result))
    # The JSON form carries the arrays in choice order; the dicts are views of them.
    assert (encoded["choices"], encoded["log_probs"]) == (result.choices, result.log_probs)
    assert dict(zip(encoded["choices"], encoded["log_probs"], strict=True)) == result.logits
    assert not {"logits", "log_probabilities", "probabilities"} & encoded.keys()
    assert msgspec.json.decode(msgspec.json.encode(result), type=Judgment) == result


def test_the_fingerprint_names_the_dtype_and_hashes_the_system_prompt(judge: Judge) -> None:
    assert judge.fingerprint() == Fingerprint(
        model=judge.model_id,
        model_sha256=judge.weights_sha256,
        dtype="float32",
        response_prefix=judge.response_prefix,
        response_suffix=judge.response_suffix,
        system_sha256=None,
        num_layers=30,  # the default model's shape, which a probe profile must match
        hidden_size=576,
    )
    brief = judge.fingerprint(system="Be brief.", response_suffix="!")
    assert brief.system_sha256 == hashlib.sha256(b"Be brief.").hexdigest()
    assert brief.first_difference(judge.fingerprint()) == "response_suffix"
