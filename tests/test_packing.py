"""The one module that packs work under a token budget: rows, passes, and their invariants."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from judge.packing import pack_rows, pass_fits, passes, row_length
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


def test_pass_fits_counts_padding() -> None:
    assert pass_fits([300, 300, 300], max_size=16, max_tokens=1000)
    assert not pass_fits([300, 300, 300, 300], max_size=16, max_tokens=1000)
    assert not pass_fits([10, 600], max_size=16, max_tokens=1000)  # padded to 2 x 600
    assert not pass_fits([1, 1, 1], max_size=2, max_tokens=1000)
    assert pass_fits([5000], max_size=1, max_tokens=1000)  # one row cannot be split
    assert pass_fits([], max_size=1, max_tokens=1)


def test_passes_group_similar_lengths_shortest_first() -> None:
    assert passes([300] * 7, max_size=16, max_tokens=1000) == [[0, 1, 2], [3, 4, 5], [6]]
    assert passes([5, 900, 6, 7], max_size=16, max_tokens=1000) == [[0, 2, 3], [1]]
    assert passes([1] * 5, max_size=2, max_tokens=10**6) == [[0, 1], [2, 3], [4]]


lengths_st = st.lists(st.integers(1, 2000), max_size=40)


@given(lengths_st, st.integers(1, 8), st.integers(1, 4000))
def test_passes_cover_every_row_once_and_each_fits(
    lengths: list[int], max_size: int, max_tokens: int
) -> None:
    groups = passes(lengths, max_size, max_tokens)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        assert pass_fits([lengths[i] for i in g], max_size, max_tokens)


@given(lengths_st, st.integers(1, 8), st.integers(1, 4000))
def test_rows_that_fit_one_pass_run_as_one(
    lengths: list[int], max_size: int, max_tokens: int
) -> None:
    # What the batcher coalesces (pass_fits) the engine runs as one pass (passes).
    if lengths and pass_fits(lengths, max_size, max_tokens):
        assert len(passes(lengths, max_size, max_tokens)) == 1


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
