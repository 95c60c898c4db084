"""The one module that packs work under a token budget: rows, passes, and their invariants."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

import judge.forward
from judge import Judge, Query
from judge.packing import pack_rows, pass_fits, pass_tokens, passes, row_length
from judge.trie import ChoiceTrie, build_trie

CHOICES = ["yes", "no"]


def trie(head: list[int], own: list[int]) -> ChoiceTrie:
    """Two choices after ``head + own``: the context is that prompt, no tree tokens."""
    prompt = [*head, *own]
    return build_trie([[*prompt, 1], [*prompt, 2]], prompt, CHOICES)


def test_row_length_counts_the_shared_head_once() -> None:
    head = list(range(10, 20))  # 10 shared tokens
    a, b, c = trie(head, [1, 2]), trie(head, [3]), trie(head, [4, 5, 6])
    assert (a.packed_length, b.packed_length, c.packed_length) == (12, 11, 13)
    assert row_length([a]) == 12
    assert row_length([a, b, c]) == 10 + 2 + 1 + 3
    # Nothing in common: every trie's full length.
    assert row_length([trie([7], [1]), trie([8], [2])]) == 4


def test_pack_rows_fills_rows_in_order_within_the_budget() -> None:
    head = list(range(100, 110))
    tries = [trie(head, [i] * 5) for i in range(6)]  # 15 tokens each, 10 of them shared
    assert pack_rows(tries, 24) == [[0, 1], [2, 3], [4, 5]]  # 10 + 5 + 5 = 20; a third is 25
    assert pack_rows(tries, 25) == [[0, 1, 2], [3, 4, 5]]
    assert pack_rows(tries, 14) == [[i] for i in range(6)]  # over the budget: a row each
    assert pack_rows([], 100) == []
    # Packing a run of whole rows again gives the same rows (the service relies on it).
    rows = pack_rows(tries, 25)
    assert pack_rows([tries[i] for i in rows[1]], 25) == [[0, 1, 2]]


def test_pass_tokens_sums_flat_rows_and_pads_the_others() -> None:
    assert pass_tokens([900, *[20] * 8], padded=False) == 1060  # laid end to end
    assert pass_tokens([900, *[20] * 8], padded=True) == 9 * 900  # left-padded to the longest
    assert pass_tokens([], padded=False) == pass_tokens([], padded=True) == 0


def test_pass_fits_counts_padding() -> None:
    assert pass_fits([300, 300, 300], max_size=16, max_tokens=1000, padded=True)
    assert not pass_fits([300, 300, 300, 300], max_size=16, max_tokens=1000, padded=True)
    assert not pass_fits([10, 600], max_size=16, max_tokens=1000, padded=True)  # 2 x 600
    assert not pass_fits([1, 1, 1], max_size=2, max_tokens=1000, padded=True)
    assert pass_fits([5000], max_size=1, max_tokens=1000, padded=True)  # cannot be split
    assert pass_fits([], max_size=1, max_tokens=1, padded=True)


def test_pass_fits_sums_a_flat_pass() -> None:
    # The lean pass feeds 900 + 8 x 20 = 1,060 tokens; padded, it would be 9 x 900.
    mixed = [900, *[20] * 8]
    assert pass_fits(mixed, max_size=16, max_tokens=1200, padded=False)
    assert not pass_fits(mixed, max_size=16, max_tokens=1200, padded=True)
    assert pass_fits([10, 600], max_size=16, max_tokens=1000, padded=False)
    assert not pass_fits([300] * 4, max_size=16, max_tokens=1000, padded=False)  # 1,200
    assert not pass_fits([1, 1, 1], max_size=2, max_tokens=1000, padded=False)  # rows bound too
    assert pass_fits([5000], max_size=1, max_tokens=1000, padded=False)


def test_passes_group_similar_lengths_shortest_first() -> None:
    assert passes([300] * 7, 16, 1000, padded=True) == [[0, 1, 2], [3, 4, 5], [6]]
    assert passes([5, 900, 6, 7], 16, 1000, padded=True) == [[0, 2, 3], [1]]
    assert passes([1] * 5, 2, 10**6, padded=True) == [[0, 1], [2, 3], [4]]


def test_passes_sum_a_flat_pass() -> None:
    mixed = [900, *[20] * 8]
    assert passes(mixed, 16, 1200, padded=False) == [[1, 2, 3, 4, 5, 6, 7, 8, 0]]
    assert passes(mixed, 16, 1200, padded=True) == [[1, 2, 3, 4, 5, 6, 7, 8], [0]]
    assert passes([5, 900, 6, 7], 16, 1000, padded=False) == [[0, 2, 3, 1]]
    assert passes([300] * 7, 16, 1000, padded=False) == [[0, 1, 2], [3, 4, 5], [6]]
    assert passes([1] * 5, 2, 10**6, padded=False) == [[0, 1], [2, 3], [4]]


lengths_st = st.lists(st.integers(1, 2000), max_size=40)


@given(lengths_st, st.integers(1, 8), st.integers(1, 4000), st.booleans())
def test_passes_cover_every_row_once_and_each_fits(
    lengths: list[int], max_size: int, max_tokens: int, padded: bool
) -> None:
    groups = passes(lengths, max_size, max_tokens, padded=padded)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        assert pass_fits([lengths[i] for i in g], max_size, max_tokens, padded=padded)


@given(lengths_st, st.integers(1, 8), st.integers(1, 4000), st.booleans())
def test_rows_that_fit_one_pass_run_as_one(
    lengths: list[int], max_size: int, max_tokens: int, padded: bool
) -> None:
    # What the batcher coalesces (pass_fits) the engine runs as one pass (passes).
    if lengths and pass_fits(lengths, max_size, max_tokens, padded=padded):
        assert len(passes(lengths, max_size, max_tokens, padded=padded)) == 1


@given(lengths_st, st.integers(1, 8), st.integers(1, 4000))
def test_a_flat_pass_never_needs_more_passes_than_a_padded_one(
    lengths: list[int], max_size: int, max_tokens: int
) -> None:
    flat = passes(lengths, max_size, max_tokens, padded=False)
    assert len(flat) <= len(passes(lengths, max_size, max_tokens, padded=True))


def scored_passes(monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """Every forward pass's row lengths, as the engine runs them."""
    seen: list[list[int]] = []
    score_rows = judge.forward.score_rows

    def spy(model: Any, rows: Sequence[Sequence[ChoiceTrie]], *args: Any, **kw: Any) -> Any:
        seen.append([row_length(r) for r in rows])
        return score_rows(model, rows, *args, **kw)

    monkeypatch.setattr(judge.forward, "score_rows", spy)
    return seen


@pytest.mark.parametrize("lean", [True, False])
def test_the_engine_budgets_passes_as_its_decoder_feeds_them(
    judge: Judge, monkeypatch: pytest.MonkeyPatch, lean: bool
) -> None:
    # One long query and short ones: their sum fits the budget, rows x longest does not.
    queries = [
        Query(prompt="Is this long message spam? " + "word " * 120, choices=["spam", "ham"]),
        *(Query(prompt=f"Item {i}: spam?", choices=["spam", "ham"]) for i in range(6)),
    ]
    probe = Judge(judge.model, judge.tokenizer, prefix_cache_mb=0, lean=lean)
    lengths = [probe.prepare(q).tokens for q in queries]
    budget = sum(lengths)
    assert len(lengths) * max(lengths) > budget
    engine = Judge(
        judge.model, judge.tokenizer, max_batch_tokens=budget, prefix_cache_mb=0, lean=lean
    )
    assert engine.decoder_pass == ("lean" if lean else "generic")
    seen = scored_passes(monkeypatch)
    results = engine.run([engine.prepare(q) for q in queries])
    assert all(r.forward_passes == 1 for r in results)
    if lean:  # laid end to end: every row in one pass
        assert len(seen) == 1 and sorted(seen[0]) == sorted(lengths)
    else:  # left-padded: the long row goes alone
        assert len(seen) == 2 and seen[1] == [max(lengths)]
    for p in seen:
        assert pass_tokens(p, padded=not lean) <= budget


@given(
    st.lists(st.tuples(st.integers(0, 3), st.integers(1, 30)), min_size=1, max_size=30),
    st.integers(1, 200),
)
def test_packed_rows_stay_within_the_budget(shapes: list[tuple[int, int]], budget: int) -> None:
    # Tries over a few heads (shared prefixes of 0..30 tokens) with tails of their own.
    heads = [list(range(1000, 1000 + 10 * k)) for k in range(4)]
    tries = [trie([7, *heads[h]], [3] * n) for h, n in shapes]
    rows = pack_rows(tries, budget)
    assert [i for r in rows for i in r] == list(range(len(tries)))  # in order, each once
    for r in rows:
        assert len(r) == 1 or row_length([tries[i] for i in r]) <= budget
