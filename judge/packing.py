"""Packing work under one token budget: which tries share a row, which rows share a pass.

A *row* is one sequence of the batch: a context fed once, then the choice tries of every
judgment packed after it (``judge.forward``). A *pass* is a batch of rows, and what it feeds
the model depends on the decoder that runs it (``pass_tokens``): the lean pass
(``judge.decoder``) lays the rows end to end with no padding, so it feeds the sum of their
lengths; the generic pass left-pads them to the longest, so it feeds ``len(rows) * longest
row`` tokens (``padded``). Both are bounded by the same budget, ``max_tokens``
(``Judge.max_batch_tokens``, the server's ``--max-batch-tokens``), and a pass by ``max_size``
rows as well.

The engine packs with these functions (``Judge.run``, ``Judge.run_shared``), and the service
plans its model jobs with the same ones and the same number (``service.web.batcher`` coalesces
single judgments while ``pass_fits``; ``service.web.serving`` splits shared-context questions into
``pack_rows``'s rows), so a job the service hands the engine is exactly one pass; both say
whether the pass pads (``Judge.decoder_pass``). Pure functions of token counts and token ids:
no torch here.
"""

from __future__ import annotations

from collections.abc import Sequence

from judge.trie import ChoiceTrie, common_prefix_length

__all__ = [
    "DEFAULT_MAX_BATCH_SIZE",
    "DEFAULT_MAX_BATCH_TOKENS",
    "pack_rows",
    "pass_fits",
    "pass_tokens",
    "passes",
    "row_length",
]

DEFAULT_MAX_BATCH_SIZE = 16  # rows per pass
# Tokens one pass may feed the model (``pass_tokens``: padding included where it pads). About
# 4,000 tokens take 3-4 s on 2 CPU cores (SmolLM2-135M, bfloat16), so no pass holds the model
# for long.
DEFAULT_MAX_BATCH_TOKENS = 4096


def row_length(tries: Sequence[ChoiceTrie]) -> int:
    """Tokens in one packed row: the context all ``tries`` share, once, then each one's rest.

    With n tries sharing s leading tokens: sum of their packed lengths - (n - 1) * s.
    """
    first = tries[0]
    shared = len(first.context)
    for t in tries[1:]:
        shared = min(shared, common_prefix_length(first.context, t.context))
    return shared + sum(t.packed_length - shared for t in tries)


def pack_rows(tries: Sequence[ChoiceTrie], max_tokens: int) -> list[list[int]]:
    """Consecutive tries grouped into rows of at most ``max_tokens`` tokens (``row_length``).

    Greedy and in order: a trie joins the current row when the row stays within the budget,
    else starts the next one. A trie longer than the budget gets a row of its own (the caller
    bounds single judgments). Returns the indices of each row's tries. Greedy from the first
    trie, so packing any run of whole rows again gives the same rows.
    """
    rows: list[list[int]] = []
    shared = total = 0
    for i, trie in enumerate(tries):
        if rows:
            first = tries[rows[-1][0]]
            s = min(shared, common_prefix_length(first.context, trie.context))
            if total + trie.packed_length - len(rows[-1]) * s <= max_tokens:
                rows[-1].append(i)
                shared, total = s, total + trie.packed_length
                continue
        rows.append([i])
        shared, total = len(trie.context), trie.packed_length
    return rows


def pass_tokens(lengths: Sequence[int], padded: bool = True) -> int:
    """Tokens a pass of rows of these lengths feeds the model: their sum where the rows are
    laid end to end (the lean pass), ``len(lengths) * max(lengths)`` where they are
    left-padded to the longest (``padded``, the generic pass)."""
    if not lengths:
        return 0
    return len(lengths) * max(lengths) if padded else sum(lengths)


def pass_fits(
    lengths: Sequence[int], max_size: int, max_tokens: int, *, padded: bool = True
) -> bool:
    """Whether rows of these lengths fit in one pass: at most ``max_size`` rows, and the
    pass's tokens (``pass_tokens``, padded or not) within ``max_tokens``. A single row always
    fits, however long: it cannot be split. ``padded`` defaults to the larger count, which
    never overfills either pass."""
    if len(lengths) <= 1:
        return True
    return len(lengths) <= max_size and pass_tokens(lengths, padded) <= max_tokens


def passes(
    lengths: Sequence[int], max_size: int, max_tokens: int, *, padded: bool = True
) -> list[list[int]]:
    """Rows grouped into passes that each ``pass_fits``; returns the row indices of each pass.

    Rows are taken shortest first and each joins the last pass while it still fits: padded,
    rows of similar length share a pass and padding wastes little; unpadded, the order costs
    nothing and keeps the grouping deterministic. Either way, rows that fit in one pass all
    together come back as that one pass.
    """
    groups: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lengths.__getitem__):
        last = [lengths[j] for j in groups[-1]] if groups else []
        if last and pass_fits([*last, lengths[i]], max_size, max_tokens, padded=padded):
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups
