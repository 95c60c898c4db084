"""The token trie over the choices' canonical tokenizations, and how any scored tree is read.

Constrained decoding over a set of token paths emits a choice with probability equal to the
product, over the *branching* nodes on its path, of the model's softmax restricted to that
node's children. Nodes with a single child contribute a factor of one, so only the root (the
decision point) and the branching nodes need logits, and only the tokens leading to a
branching node need to be fed to the model. This module works that out from token ids alone;
it knows nothing of torch.

A ``ChoiceTrie`` is also the packed form of the grammar-exact tree (``judge.grammar``), where
a choice is reached by many token paths: each scored node's slots say where each child token
leads (a deeper scored node, or a choice), and ``ChoiceTrie.choice_logprobs`` sums every path,
which for the canonical trie is its one path per choice.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from judge.errors import AmbiguousChoicesError, EmptyContextError

__all__ = ["ChoiceTrie", "build_trie", "common_prefix_length", "logsumexp"]


@dataclass(frozen=True)
class ChoiceTrie:
    """What one judgment feeds the model and where it reads the logits.

    The packed input is ``context + tree_tokens``: ``context`` is the token prefix shared by
    every choice's path (it ends at the decision point), ``tree_tokens`` are the trie nodes
    below it that lead to a branching node, parents before children.
    """

    context: list[int]
    tree_tokens: list[int]
    # Index into tree_tokens of each tree token's parent; -1 is the last context token.
    tree_parents: list[int]
    # Depth below the decision point, 1 for the first token after the context.
    tree_depths: list[int]
    # Scored nodes, the root first and every parent before its children: where its logits are
    # read (index into tree_tokens, -1 for the last context token) and the token ids of its
    # children.
    node_positions: list[int]
    node_children: list[list[int]]
    # Per scored node, per child slot, where that token leads: the index of the next scored
    # node on its way (always a later one), or ``-1 - i`` where it settles on choice i.
    slot_next: list[list[int]]
    # The [start, end) context tokens whose hidden states are averaged (the item's own text,
    # ``Query.item_span``); None: no mean is asked for.
    span: tuple[int, int] | None = None

    @property
    def packed_length(self) -> int:
        return len(self.context) + len(self.tree_tokens)

    @property
    def choice_steps(self) -> list[list[tuple[int, int]]]:
        """For each choice, the (scored node, child slot) pairs along its one path. Raises
        ValueError for a tree where a choice has several paths (the grammar-exact tree)."""
        steps: list[list[tuple[int, int]] | None] = [None] * self.n_choices
        stack: list[tuple[int, list[tuple[int, int]]]] = [(0, [])]
        while stack:
            node, path = stack.pop()
            for k, target in enumerate(self.slot_next[node]):
                if target >= 0:
                    stack.append((target, [*path, (node, k)]))
                elif steps[-1 - target] is not None:
                    raise ValueError(f"choice {-1 - target} has more than one token path")
                else:
                    steps[-1 - target] = [*path, (node, k)]
        return [s or [] for s in steps]

    @property
    def n_choices(self) -> int:
        return 1 + max(-1 - t for slots in self.slot_next for t in slots)

    def choice_logprobs(self, node_logits: Sequence[np.ndarray]) -> np.ndarray:
        """log P(choice) under decoding masked to this tree, from each scored node's logits of
        its children (``node_logits[n]``, in ``node_children[n]`` order).

        Each node's logits are log-softmaxed over its children (the mask), and the
        probability that reaches a node flows down each slot: the sum over every path to a
        choice of the product of its steps. A target reached once takes its one path's sum
        of steps as is, so the canonical trie's numbers are the plain sums along its paths,
        in the same order of additions as ever.
        """
        reach: list[float | None] = [None] * len(self.node_positions)
        reach[0] = 0.0
        out: list[float | None] = [None] * self.n_choices
        for n, z in enumerate(node_logits):
            above = reach[n]
            if above is None or not np.isfinite(z).any():
                # No path reaches it (not in a built tree), or no child's probability is
                # known (a served model's top tokens held none of them): its choices stay out.
                continue
            lp = z - logsumexp(z)
            for k, target in enumerate(self.slot_next[n]):
                x = above + float(lp[k])
                if target >= 0:
                    old = reach[target]
                    reach[target] = x if old is None else float(np.logaddexp(old, x))
                else:
                    old = out[-1 - target]
                    out[-1 - target] = x if old is None else float(np.logaddexp(old, x))
        return np.array([-math.inf if x is None else x for x in out])


def common_prefix_length(a: Sequence[int], b: Sequence[int], start: int = 0) -> int:
    """Length of the longest common prefix of ``a`` and ``b``, known to be at least ``start``."""
    n = min(len(a), len(b))
    i = start
    while i < n and a[i] == b[i]:
        i += 1
    return i


class _Node:
    __slots__ = ("children", "end", "token")

    def __init__(self, token: int) -> None:
        self.token = token
        self.children: dict[int, _Node] = {}
        self.end: int | None = None  # index of the choice whose path ends here


def build_trie(
    paths: Sequence[Sequence[int]],
    prompt_ids: Sequence[int],
    choices: Sequence[str],
    *,
    shared: int = 0,
) -> ChoiceTrie:
    """Build the trie for ``paths[i]``, the canonical tokenization of prompt + choice i + suffix.

    The root is the last token that every path shares, never past the end of the prompt's own
    tokenization: where the tokenizer merges the end of the prompt with a choice, the root
    moves back to before the merged token, so the result stays exact. ``shared`` is a number
    of leading tokens the caller knows all paths and ``prompt_ids`` have in common.
    """
    # Shared prefixes nest, so comparing everything with the first path finds the minimum.
    root = min(common_prefix_length(paths[0], p, shared) for p in [*paths, prompt_ids])
    if root == 0:
        raise EmptyContextError(
            "the rendered prompt has no token before the decision point; "
            "give a non-empty prompt or a response prefix"
        )

    top = _Node(-1)
    for i, path in enumerate(paths):
        node = top
        for token in path[root:]:
            node = node.children.setdefault(token, _Node(token))
        if node.end is not None:
            raise AmbiguousChoicesError(
                f"choices {choices[node.end]!r} and {choices[i]!r} tokenize to the same path; "
                "make them differ"
            )
        node.end = i

    # Parents before children (preorder), without recursion: paths can be thousands deep.
    order: list[tuple[_Node, _Node | None, int]] = []
    stack: list[tuple[_Node, _Node | None, int]] = [(top, None, 0)]
    while stack:
        node, parent, depth = stack.pop()
        order.append((node, parent, depth))
        stack.extend((c, node, depth + 1) for c in reversed(node.children.values()))

    # A node is fed to the model when it, or a node below it, branches.
    needed: set[int] = set()
    for node, parent, _ in reversed(order):
        if node.end is not None and node.children:
            raise AmbiguousChoicesError(
                f"the token path of choice {choices[node.end]!r} is a prefix of the path of "
                f"{choices[_first_end(node)]!r}, so decoding cannot tell where it ends; "
                "set a response suffix (the default is '\"}') that closes every choice"
            )
        if parent is not None and (len(node.children) > 1 or id(node) in needed):
            needed.add(id(parent))

    slots: dict[int, int] = {id(top): 0}
    packed: dict[int, int] = {id(top): -1}
    node_positions = [-1]
    node_children = [list(top.children)]
    tree_tokens: list[int] = []
    tree_parents: list[int] = []
    tree_depths: list[int] = []
    for node, parent, depth in order[1:]:
        if len(node.children) < 2 and id(node) not in needed:
            continue
        assert parent is not None
        packed[id(node)] = len(tree_tokens)
        tree_tokens.append(node.token)
        tree_parents.append(packed[id(parent)])
        tree_depths.append(depth)
        if len(node.children) > 1:
            slots[id(node)] = len(node_positions)
            node_positions.append(packed[id(node)])
            node_children.append(list(node.children))

    # Each scored node's slots: follow the child down its single-child run to the next scored
    # node or to the choice that ends there.
    slot_next: list[list[int]] = []
    scored = [top] + [node for node, _, _ in order[1:] if id(node) in slots]
    for node in scored:
        nexts = []
        for child in node.children.values():
            while id(child) not in slots and child.end is None:
                (child,) = child.children.values()
            if id(child) in slots:
                nexts.append(slots[id(child)])
            else:
                assert child.end is not None
                nexts.append(-1 - child.end)
        slot_next.append(nexts)

    return ChoiceTrie(
        context=list(paths[0][:root]),
        tree_tokens=tree_tokens,
        tree_parents=tree_parents,
        tree_depths=tree_depths,
        node_positions=node_positions,
        node_children=node_children,
        slot_next=slot_next,
    )


def logsumexp(x: np.ndarray) -> float:
    m = float(np.max(x))
    return m + math.log(float(np.sum(np.exp(x - m))))


def _first_end(node: _Node) -> int:
    """Index of some choice whose path ends strictly below ``node``."""
    stack = list(node.children.values())
    while stack:
        child = stack.pop()
        if child.end is not None:
            return child.end
        stack.extend(child.children.values())
    raise AssertionError("a node with children has a path ending below it")
