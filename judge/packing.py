"""Packing work under one token budget: which tries share a row, which rows share a pass.

A *row* is one sequence of the batch: a context fed once, then the choice tries of every
judgment packed after it (``judge.forward``). A *pass* is a batch of rows, left-padded to the
longest, so it feeds the model ``len(rows) * longest row`` tokens. Both are bounded by the
same budget, ``max_tokens`` (``Judge.max_batch_tokens``, the server's ``--max-batch-tokens``),
and a pass by ``max_size`` rows as well.

The engine packs with these functions (``Judge.run``, ``Judge.run_shared``), and the service
plans its model jobs with the same ones and the same number (``service.batcher`` coalesces
single judgments while ``pass_fits``; ``service.serving`` splits shared-context questions into
``pack_rows``'s rows), so a job the service hands the engine is exactly one pass. Pure
functions of token counts and token ids: no torch here.
"""

from __future__ import annotations

from collections.abc import Sequence

from judge.trie import ChoiceTrie, common_prefix_length

__all__ = [
    "DEFAULT_MAX_BATCH_SIZE",
    "DEFAULT_MAX_BATCH_TOKENS",
    "pack_rows",
    "pass_fits",
    "passes",
    "row_length",
]

DEFAULT_MAX_BATCH_SIZE = 16  # rows per pass
# Tokens one pass may feed the model, padding included. About 4,000 tokens take 3-4 s on 2
# CPU cores (SmolLM2-135M, bfloat16), so no pass holds the model for long.
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


def pass_fits(lengths: Sequence[int], max_size: int, max_tokens: int) -> bool:
    """Whether rows of these lengths fit in one pass: at most ``max_size`` rows, and the
    padded batch (``len(lengths) * max(lengths)``) within ``max_tokens``. A single row always
    fits, however long: it cannot be split."""
    if len(lengths) <= 1:
        return True
    return len(lengths) <= max_size and len(lengths) * max(lengths) <= max_tokens


def passes(lengths: Sequence[int], max_size: int, max_tokens: int) -> list[list[int]]:
    """Rows grouped into passes that each ``pass_fits``; returns the row indices of each pass.

    Rows are taken shortest first, so rows of similar length share a pass and padding wastes
    little. Rows that fit in one pass all together come back as that one pass.
    """
    groups: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lengths.__getitem__):
        # Shortest first: the newcomer is the longest, so the padded size is it times the count.
        if (
            groups
            and len(groups[-1]) < max_size
            and lengths[i] * (len(groups[-1]) + 1) <= max_tokens
        ):
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups
