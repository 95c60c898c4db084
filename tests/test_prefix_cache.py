"""The prefix cache: exact on the real model, warm and cold, bounded, and never mutated."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from reference import reference_probabilities
from test_exactness import CASES

from judge import Judge, Query
from judge.prefix_cache import PrefixCache

RUBRIC = (
    "You grade answers for a customer-support team. An answer passes when it is polite, "
    "correct, and tells the customer what happens next. " * 6
)


def cached_judge(judge: Judge, mb: float = 64, block: int = 4) -> Judge:
    """The session's model with its own cache; small blocks, so short prompts use many."""
    return Judge(
        judge.model,
        judge.tokenizer,
        model_id=judge.model_id,
        prefix_cache_mb=mb,
        prefix_cache_block=block,
    )


@pytest.fixture
def uncached(judge: Judge) -> Iterator[Judge]:
    yield Judge(judge.model, judge.tokenizer, model_id=judge.model_id, prefix_cache_mb=0)


@pytest.mark.parametrize("name", list(CASES))
def test_cold_and_warm_match_the_reference(judge: Judge, name: str) -> None:
    prompt, choices = CASES[name]
    engine = cached_judge(judge)
    expected = reference_probabilities(judge, prompt, choices)
    cold = engine.judge(prompt, choices)
    warm = engine.judge(prompt, choices)
    assert warm.computed_tokens < cold.computed_tokens <= cold.prompt_tokens + 100
    assert warm.prompt_tokens == cold.prompt_tokens  # still the prompt's length
    for result in (cold, warm):
        for choice in choices:
            assert result.probabilities[choice] == pytest.approx(expected[choice], abs=1e-4)
        assert result.forward_passes == 1


def test_255_choices_and_a_merging_prefix_warm(judge: Judge, uncached: Judge) -> None:
    engine = cached_judge(judge)
    numbers = [str(i) for i in range(255)]
    for _ in range(2):
        got = engine.judge("Pick a perfect square below 255.", numbers)
        want = uncached.judge("Pick a perfect square below 255.", numbers)
        assert max(abs(got.probabilities[c] - want.probabilities[c]) for c in numbers) < 1e-4
        got = engine.judge("Is the sky blue?", ["yes", "no"], response_prefix="Answer: ")
        want = uncached.judge("Is the sky blue?", ["yes", "no"], response_prefix="Answer: ")
        assert got.probabilities["yes"] == pytest.approx(want.probabilities["yes"], abs=1e-4)


def test_batches_that_mix_hits_and_misses_and_shared_contexts(
    judge: Judge, uncached: Judge
) -> None:
    engine = cached_judge(judge)
    engine.judge(RUBRIC + "Answer: 'We will refund you tomorrow.'", ["pass", "fail"])
    items = [
        {"prompt": RUBRIC + "Answer: 'No.'", "choices": ["pass", "fail"]},  # a hit
        {"prompt": "Unrelated: is water wet?", "choices": ["yes", "no"]},  # a miss
        {
            "prompt": RUBRIC + "Answer: 'Thanks, a courier comes Monday.'",
            "choices": ["pass", "fail"],
        },
    ]
    got, want = engine.judge_batch(items), uncached.judge_batch(items)
    for g, w in zip(got, want, strict=True):
        assert g.probabilities == pytest.approx(w.probabilities, abs=1e-4)
        assert g.choice_mass == pytest.approx(w.choice_mass, rel=1e-3)
    assert got[0].computed_tokens < got[1].prompt_tokens + got[0].prompt_tokens // 2
    questions = [
        {"prompt": "Is it polite?", "choices": ["yes", "no"]},
        {"prompt": "Grade it.", "choices": ["A", "B", "C"]},
    ]
    for _ in range(2):
        got = engine.judge_shared(RUBRIC, questions)
        want = uncached.judge_shared(RUBRIC, questions)
        for g, w in zip(got, want, strict=True):
            assert g.probabilities == pytest.approx(w.probabilities, abs=1e-4)


def test_eviction_between_calls_keeps_results_exact(judge: Judge, uncached: Judge) -> None:
    # A block of 16 tokens holds 720 KiB of float32 keys and values, so 1.5 MiB holds two:
    # the chat template's head and one question's next block. Each question evicts the last.
    engine = cached_judge(judge, mb=1.5, block=16)
    prompts = [f"Question {i}: {RUBRIC[: 60 + 20 * i]} Is that right?" for i in range(5)]
    for prompt in prompts * 2:
        got = engine.judge(prompt, ["yes", "no"])
        want = uncached.judge(prompt, ["yes", "no"])
        assert got.probabilities["yes"] == pytest.approx(want.probabilities["yes"], abs=1e-4)
    stats = engine.prefix_cache.stats() if engine.prefix_cache else None
    assert stats is not None and stats.evictions > 0
    assert stats.bytes <= stats.budget_bytes


def test_cached_tensors_are_never_written(judge: Judge) -> None:
    engine = cached_judge(judge)
    engine.judge(RUBRIC + "Answer: 'Yes.'", ["pass", "fail"])
    cache = engine.prefix_cache
    assert cache is not None
    before = {i: [(k.clone(), v.clone()) for k, v in b.kv] for i, b in cache._blocks.items()}
    engine.judge_batch(
        [{"prompt": RUBRIC + f"Answer: '{i}'", "choices": ["pass", "fail"]} for i in range(4)]
    )
    engine.judge_shared(RUBRIC, [{"prompt": "Polite?", "choices": ["yes", "no"]}])
    for i, kv in before.items():
        if i in cache._blocks:
            for (k, v), (k0, v0) in zip(cache._blocks[i].kv, kv, strict=True):
                assert torch.equal(k, k0) and torch.equal(v, v0)


def test_counters_and_turning_it_off(judge: Judge) -> None:
    engine = cached_judge(judge, block=8)
    assert engine.prefix_cache is not None
    engine.judge(RUBRIC + "One?", ["yes", "no"])
    engine.judge(RUBRIC + "Two?", ["yes", "no"])
    stats = engine.prefix_cache.stats()
    assert stats.hits >= 1 and stats.misses >= 1 and stats.tokens_reused >= 8
    assert stats.bytes > 0 and stats.blocks > 0 and stats.block_tokens == 8
    off = Judge(judge.model, judge.tokenizer, model_id=judge.model_id, prefix_cache_mb=0)
    assert off.prefix_cache is None
    result = off.judge(RUBRIC + "Two?", ["yes", "no"])
    assert result.computed_tokens >= result.prompt_tokens
    with pytest.raises(ValueError, match="prefix_cache_mb must be a number >= 0"):
        Judge(judge.model, judge.tokenizer, prefix_cache_mb=-1)


def _kv(tokens: int, value: float = 0.0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Two layers of (heads=1, tokens, dim=2) keys and values: 32 bytes per token."""
    return [(torch.full((1, tokens, 2), value), torch.full((1, tokens, 2), value))] * 2


def test_lookup_store_and_lru_eviction_by_hand() -> None:
    cache = PrefixCache(budget_bytes=64 * 6, block_tokens=2)  # room for six blocks
    a = [1, 2, 3, 4, 5, 6]
    cache.store(a, [], _kv(6))
    assert [b.key[1] for b in cache.lookup(a, 6)] == [(1, 2), (3, 4), (5, 6)]
    assert len(cache.lookup(a, 5)) == 2  # whole blocks within the limit only
    assert cache.lookup([9, 9], 2) == []
    chain = cache.lookup([1, 2, 3, 4, 7, 7], 6)
    assert len(chain) == 2
    cache.store([1, 2, 3, 4, 7, 7, 8, 8], chain, _kv(4, 1.0))  # two more blocks: five in all
    assert cache.stats().blocks == 5 and cache.stats().evictions == 0
    # Two new blocks need room for one more: the least recently used leaf, (5, 6), goes; the
    # shared head (1, 2), (3, 4) was used since, and parents are never older than children.
    cache.store([5, 5, 6, 6], [], _kv(4))
    stats = cache.stats()
    assert stats.blocks == 6 and stats.bytes == stats.budget_bytes and stats.evictions == 1
    assert len(cache.lookup(a, 6)) == 2
    assert len(cache.lookup([1, 2, 3, 4, 7, 7, 8, 8], 8)) == 4
    assert len(cache.lookup([5, 5, 6, 6], 4)) == 2
    # Evicting a block evicts its descendants: they are unreachable without it.
    cache._evict(cache.lookup(a, 2)[0])
    assert cache.stats().blocks == 2 and cache.lookup([1, 2, 3, 4, 7, 7, 8, 8], 8) == []
    # A block larger than the whole budget is not stored, and nothing fails.
    tiny = PrefixCache(budget_bytes=63, block_tokens=2)
    tiny.store(a, [], _kv(6))
    assert tiny.stats().blocks == 0 and tiny.lookup(a, 6) == []


def test_one_row_assembly_is_reused_and_counted() -> None:
    cache = PrefixCache(budget_bytes=64 * 8, block_tokens=2)
    cache.store([1, 2, 3, 4, 5, 6], [], _kv(6, 2.0))
    chain = cache.lookup([1, 2, 3, 4, 5, 6], 6)
    first, P = cache.assemble([chain])
    assert P == 6 and first[0][0].shape == (1, 1, 6, 2)
    assert cache.stats().bytes == 64 * 3 + 64 * 3  # three blocks and their one assembly
    again, _ = cache.assemble([chain[:2]])  # a prefix of the last chain: a view of it
    assert again[0][0].data_ptr() == first[0][0].data_ptr() and again[0][0].shape[2] == 4
    assert torch.equal(first[0][0], torch.full((1, 1, 6, 2), 2.0))
    batch, P = cache.assemble([chain, chain[:1]])  # two rows: fresh, right-aligned
    assert P == 6 and torch.equal(batch[0][0][1, :, :4], torch.zeros(1, 4, 2))
    cache.store([7, 7, 8, 8], [], _kv(4))  # fits beside the assembly: the budget is full
    assert cache.stats().bytes == 64 * 5 + 64 * 3 == cache.budget_bytes
    cache.store([9, 9], [], _kv(2))  # room is made by dropping the assembly, not a block
    assert cache.stats().evictions == 0 and cache.stats().bytes == 64 * 6


def test_a_batch_computes_its_common_head_once(judge: Judge, uncached: Judge) -> None:
    engine = cached_judge(judge, block=8)
    prompts = [RUBRIC + f"Answer {i}: 'Sure.'" for i in range(3)]
    items = [Query(prompt=p, choices=["pass", "fail"]) for p in prompts]
    got, want = engine.judge_batch(items), uncached.judge_batch(items)
    for g, w in zip(got, want, strict=True):
        assert g.probabilities == pytest.approx(w.probabilities, abs=1e-4)
        # The head ran in a pass of its own; each row then read it from the cache.
        assert g.forward_passes == 2 and g.cached_tokens > len(RUBRIC) // 8
        assert g.computed_tokens < 40
    again = engine.judge_batch([Query(prompt=p + "!", choices=["pass", "fail"]) for p in prompts])
    assert all(r.forward_passes == 1 for r in again)  # the head is cached now


@pytest.mark.parametrize(
    ("layer_types", "expected"),
    [
        (None, True),  # no per-layer types: every layer attends (Llama, GPT-2)
        (["sliding_attention", "full_attention"], True),  # Gemma 3
        (["linear_attention", "full_attention"], False),  # a recurrent state beside attention
        (["full_attention", "chunked_attention"], False),
    ],
)
def test_a_model_with_layers_that_do_not_attend_runs_without_the_cache(
    judge: Judge, monkeypatch: pytest.MonkeyPatch, layer_types: list[str] | None, expected: bool
) -> None:
    monkeypatch.setattr(judge.model.config, "layer_types", layer_types, raising=False)
    engine = cached_judge(judge)
    assert (engine.prefix_cache is not None) is expected
