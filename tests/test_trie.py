"""The trie, checked against brute force on random token paths (no model needed)."""

from __future__ import annotations

import math
import zlib

from hypothesis import given, settings
from hypothesis import strategies as st

from judge.trie import ChoiceTrie, build_trie


def fake_logit(prefix: tuple[int, ...], token: int) -> float:
    """A deterministic stand-in for a model's logit of ``token`` after ``prefix``."""
    return (zlib.crc32(repr((prefix, token)).encode()) % 1000) / 100.0


def brute_force(paths: list[list[int]], start: int) -> list[float]:
    """Constrained decoding probabilities, straight from the definition."""
    out = []
    for path in paths:
        logp = 0.0
        for k in range(start, len(path)):
            siblings = sorted({p[k] for p in paths if len(p) > k and p[:k] == path[:k]})
            if len(siblings) > 1:
                z = [fake_logit(tuple(path[:k]), t) for t in siblings]
                logp += fake_logit(tuple(path[:k]), path[k]) - math.log(sum(math.exp(v) for v in z))
        out.append(logp)
    return out


def node_prefix(trie: ChoiceTrie, node: int) -> tuple[int, ...]:
    """The tokens a scored node's logits are conditioned on, rebuilt from the packed layout."""
    tokens = []
    j = trie.node_positions[node]
    while j >= 0:
        tokens.append(trie.tree_tokens[j])
        j = trie.tree_parents[j]
    return tuple(trie.context + tokens[::-1])


def trie_logprobs(trie: ChoiceTrie) -> list[float]:
    out = []
    for steps in trie.choice_steps:
        logp = 0.0
        for node, slot in steps:
            prefix = node_prefix(trie, node)
            z = [fake_logit(prefix, t) for t in trie.node_children[node]]
            logp += z[slot] - math.log(sum(math.exp(v) for v in z))
        out.append(logp)
    return out


# Paths over a tiny alphabet so that they share prefixes often; every path ends in a
# terminator token (0) that appears nowhere else, as the response suffix does.
tails = st.lists(st.integers(1, 3), min_size=0, max_size=5).map(lambda t: [*t, 0])


@settings(max_examples=300, deadline=None)
@given(st.lists(tails, min_size=2, max_size=12, unique_by=tuple), st.integers(1, 4))
def test_trie_matches_brute_force(tails_: list[list[int]], context_len: int) -> None:
    context = [7] * context_len
    paths = [context + t for t in tails_]
    trie = build_trie(paths, context, [str(i) for i in range(len(paths))])

    assert trie.context == context
    for got, want in zip(trie_logprobs(trie), brute_force(paths, context_len), strict=True):
        assert math.isclose(got, want, abs_tol=1e-12)
    assert math.isclose(sum(math.exp(v) for v in trie_logprobs(trie)), 1.0, rel_tol=1e-9)

    # Only the root and branching nodes are scored, each at its own position in the path.
    for node, children in enumerate(trie.node_children[1:], start=1):
        assert len(children) > 1
        prefix = node_prefix(trie, node)
        depth = trie.tree_depths[trie.node_positions[node]]
        assert len(prefix) == context_len + depth
        assert set(children) == {p[len(prefix)] for p in paths if tuple(p[: len(prefix)]) == prefix}
    # Parents come before children, and each packed token leads to a branching node.
    assert all(p < j for j, p in enumerate(trie.tree_parents))
    scored = set(trie.node_positions[1:])
    for j in range(len(trie.tree_tokens)):
        below = {j}
        for k in range(j + 1, len(trie.tree_tokens)):
            if trie.tree_parents[k] in below:
                below.add(k)
        assert below & scored


def test_root_moves_back_where_the_prompt_merges_with_the_choice() -> None:
    # The prompt alone ends in token 9; with the choices, 9 merged into 10 and 11.
    prompt_ids = [5, 6, 9]
    paths = [[5, 6, 10, 0], [5, 6, 11, 0]]
    trie = build_trie(paths, prompt_ids, ["x", "y"])
    assert trie.context == [5, 6]
    assert trie.node_children[0] == [10, 11]


def test_shared_first_token_packs_only_what_branches() -> None:
    # "spam" / "spam_risky" / "spa": the first token is shared, so the root has one child.
    paths = [[1, 20, 21, 0], [1, 20, 21, 22, 0], [1, 20, 23, 0]]
    trie = build_trie(paths, [1], ["spam", "spam_risky", "spa"])
    assert trie.node_children[0] == [20]
    assert trie.tree_tokens == [20, 21]  # the leaf chain after 22 is never fed
    assert trie.node_children[1:] == [[21, 23], [0, 22]]
