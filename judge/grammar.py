"""Grammar-exact choice probabilities: what a masked decoder emits, computed as a reference.

judge reads each choice's *canonical* token path (``judge.trie``). A grammar-constrained
decoder does something else: at each step it allows every token whose bytes keep the output a
prefix of some ``escape(choice) + suffix`` (the closing suffix, ``'"}'`` by default), masks the
rest and renormalises over what it allows. A choice's probability is then the sum over *every*
token path that spells it (``s`` + ``pam``, ``spa`` + ``m"}``, a token that runs on into the
closing quote), not only the one the tokenizer would pick (issue 47). llguidance with its
``no_forcing`` option masks exactly so (``tests/test_grammar.py``); by default it tokenizes
bytes the grammar forces canonically, which differs only where the choices left after a
branch share bytes.

Once the output is consistent with one choice only, that choice is determined: every later
step is masked to tokens that continue it, so those steps sum to one. The distribution
therefore needs the model's next-token distribution only where the output is still
consistent with two or more choices: the nodes of ``GrammarTree``. A node is the output's
bytes, so its mask depends on the bytes alone; but the model's distribution there depends on
the token path that reached it, so each token path to a node is a position to read
(``GrammarTree.positions``).

``GrammarTree.packed`` lays those positions out as a ``ChoiceTrie`` after the prompt's own
tokens: every token path to a node is a tree token of the one packed pass, every node's
allowed tokens are its scored children, and each child slot leads to a choice or to a deeper
position, so ``ChoiceTrie.choice_logprobs`` sums every path. That is the engine's grammar-exact
mode (``Judge(choice_paths="grammar")``). ``grammar_probabilities`` is the reference: it
evaluates the tree with one plain forward pass per position, and ``tests/test_grammar.py``
checks its masks and numbers, and the engine's, against a real grammar engine.
"""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from judge.errors import AmbiguousChoicesError, EmptyContextError, TooManyPathsError
from judge.judgments import Query, json_escape
from judge.trie import ChoiceTrie

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from judge.judgments import Prepared


class _Judging(Protocol):
    """What the reference reads of a ``judge.Judge`` (named so, not imported: the engine
    imports this module)."""

    tokenizer: PreTrainedTokenizerBase
    model: Any
    response_suffix: str

    def prepare(self, query: Query) -> Prepared: ...


__all__ = [
    "MAX_POSITIONS",
    "GrammarNode",
    "GrammarTree",
    "GrammarVocabulary",
    "bytes_to_unicode",
    "choice_targets",
    "grammar_probabilities",
    "masked_distribution",
    "token_bytes",
]

# Token paths to tree nodes one judgment may read; past it, TooManyPathsError. Choices that
# share a long prefix multiply the paths (every way to spell the prefix), and each path is a
# position of its own in the packed pass (a forward pass of its own in the reference). The
# shared sets need at most 9 (benchmarks/RESULTS.md, "Grammar-exact cost").
MAX_POSITIONS = 512


@functools.cache
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's table from each byte to the character a byte-level BPE vocabulary spells it with.

    The published scheme (Radford et al. 2019, "Language Models are Unsupervised Multitask
    Learners"; ``bytes_to_unicode`` in openai/gpt-2's ``src/encoder.py``, which Hugging Face's
    ByteLevel pre-tokenizer reproduces): the printable bytes ``!``..``~``, ``¡``..``¬`` and
    ``®``..``ÿ`` stand for themselves; the other 68 (controls, space, soft hyphen) take the
    characters from U+0100 up, in byte order, so that a vocabulary entry never holds
    whitespace or a control character. Space is ``Ġ`` (U+0120), newline ``Ċ`` (U+010A).
    """
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def token_bytes(tokenizer: PreTrainedTokenizerBase) -> list[bytes | None]:
    """The bytes each token id of a byte-level BPE tokenizer adds to the output, by id.

    None for the added tokens (``<|im_end|>``, ``<|endoftext|>``, ...) and for ids the
    vocabulary skips: a grammar engine never lets a special token spell grammar text, and
    allows EOS only once the grammar is complete, which the tree never needs (it stops where
    a choice is determined). Raises ValueError for a vocabulary that is not byte-level (a
    SentencePiece ``▁``, say): its token texts are not bytes under GPT-2's table.
    """
    to_byte = {c: b for b, c in bytes_to_unicode().items()}
    added = set(tokenizer.added_tokens_decoder)
    vocab: dict[str, int] = tokenizer.get_vocab()
    pieces: list[bytes | None] = [None] * max(len(tokenizer), max(vocab.values()) + 1)
    for text, token in vocab.items():
        if token in added:
            continue
        try:
            pieces[token] = bytes(to_byte[c] for c in text)
        except KeyError as exc:
            raise ValueError(
                f"token {token} ({text!r}) holds {exc.args[0]!r}, which GPT-2's byte table "
                "has no byte for: grammar-exact probabilities need a byte-level BPE tokenizer"
            ) from None
    return pieces


@dataclass(frozen=True)
class GrammarNode:
    """Output bytes still consistent with two or more choices: decoding branches here.

    Every token a grammar engine allows at this output is in exactly one group: it
    determines a choice (after it, only that choice's text is still possible) or it leads to
    a deeper node.
    """

    output: bytes  # what was generated after the response prefix
    determines: dict[int, tuple[int, ...]]  # choice index -> token ids that settle on it
    children: dict[bytes, tuple[int, ...]]  # a deeper node's output -> token ids leading there

    @property
    def allowed(self) -> frozenset[int]:
        """The token ids the grammar's mask keeps at this node."""
        groups = [*self.determines.values(), *self.children.values()]
        return frozenset(t for group in groups for t in group)


@dataclass(frozen=True)
class GrammarTree:
    """The nodes of the grammar "one of ``targets``" over one vocabulary.

    ``targets[i]`` is choice i's text as the model writes it: the JSON-escaped choice and
    the response suffix, in UTF-8. ``nodes`` maps each node's output to it, the root
    (``b""``) first and every parent before its children (shorter outputs first).
    """

    targets: tuple[bytes, ...]
    nodes: dict[bytes, GrammarNode]

    @functools.cached_property
    def positions(self) -> dict[bytes, int]:
        """How many token paths reach each node: the logits a judgment must read there."""
        count = dict.fromkeys(self.nodes, 0)
        count[b""] = 1
        for output, node in self.nodes.items():  # parents first, so each count is final
            for child, tokens in node.children.items():
                count[child] += count[output] * len(tokens)
        return count

    def packed(self, context: Sequence[int], max_positions: int = MAX_POSITIONS) -> ChoiceTrie:
        """The tree as one packed pass after ``context`` (the prompt's own tokens, ending at
        the decision point): a position per token path to a node, breadth first, each node's
        allowed tokens its scored children. Raises TooManyPathsError past ``max_positions``
        and EmptyContextError for an empty context, before any model work."""
        self.check_positions(max_positions)
        if not context:
            raise EmptyContextError(
                "the rendered prompt has no token before the decision point; "
                "give a non-empty prompt or a response prefix"
            )
        tokens: list[int] = []
        parents: list[int] = []
        depths: list[int] = []
        node_positions: list[int] = []
        node_children: list[list[int]] = []
        slot_next: list[list[int]] = []
        # (output, where its logits are read, depth); a position's index among the scored
        # nodes is its place in this queue, so parents come before children.
        queue = [(b"", -1, 0)]
        for output, at, depth in queue:
            node = self.nodes[output]
            children: list[int] = []
            nexts: list[int] = []
            for choice, ids in node.determines.items():
                children += ids
                nexts += [-1 - choice] * len(ids)
            for child, ids in node.children.items():
                for token in ids:
                    tokens.append(token)
                    parents.append(at)
                    depths.append(depth + 1)
                    children.append(token)
                    nexts.append(len(queue))
                    queue.append((child, len(tokens) - 1, depth + 1))
            node_positions.append(at)
            node_children.append(children)
            slot_next.append(nexts)
        return ChoiceTrie(
            context=list(context),
            tree_tokens=tokens,
            tree_parents=parents,
            tree_depths=depths,
            node_positions=node_positions,
            node_children=node_children,
            slot_next=slot_next,
        )

    def check_positions(self, max_positions: int) -> None:
        """Raise TooManyPathsError when reading the tree takes more than ``max_positions``."""
        total = sum(self.positions.values())
        if total > max_positions:
            raise TooManyPathsError(
                f"the choices' grammar needs the model's distribution at {total} token paths, "
                f"over the limit of max_positions={max_positions}: shorten the prefix the "
                "choices share, or judge them on their canonical paths "
                "(choice_paths='canonical')",
                field="choices",
            )

    def determining_tokens(self) -> list[int]:
        """Per choice, how many (node, token) pairs settle on it, summed over the nodes."""
        total = [0] * len(self.targets)
        for node in self.nodes.values():
            for choice, tokens in node.determines.items():
                total[choice] += len(tokens)
        return total


class GrammarVocabulary:
    """A vocabulary's token bytes, indexed for the grammar's scan, with a cache of trees.

    The mask at a node keeps a token exactly when ``target.startswith(output + piece)`` for
    some target. Rather than test all of the vocabulary with ``bytes.startswith``, the scan
    looks up each prefix of each target's remainder in a table from bytes to token ids: the
    same set, in time that grows with the choices' length instead of the vocabulary's.
    """

    def __init__(self, pieces: Sequence[bytes | None], cache_size: int = 256) -> None:
        self.pieces = list(pieces)
        by_bytes: dict[bytes, list[int]] = {}
        for token, piece in enumerate(self.pieces):
            if piece:  # an empty piece would spell nothing and never end a path
                by_bytes.setdefault(piece, []).append(token)
        self._by_bytes = {piece: tuple(ids) for piece, ids in by_bytes.items()}
        self._longest = max(map(len, self._by_bytes), default=0)
        # Per (choices, suffix), as their targets: a task asks the same choices every item.
        self.tree = functools.lru_cache(maxsize=cache_size)(self._build)

    @classmethod
    def of(cls, tokenizer: PreTrainedTokenizerBase) -> GrammarVocabulary:
        """The vocabulary of ``tokenizer``, built once per tokenizer object (a full scan of
        49k tokens takes a tenth of a second; trees are then cached on it)."""
        found = _VOCABULARIES.get(tokenizer)
        if found is None:
            found = _VOCABULARIES[tokenizer] = cls(token_bytes(tokenizer))
        return found

    def _build(self, targets: tuple[bytes, ...]) -> GrammarTree:
        for i, a in enumerate(targets):
            for b in targets[i + 1 :]:
                short, long = sorted((a, b), key=len)
                if long.startswith(short):
                    raise AmbiguousChoicesError(
                        f"{short!r} is a prefix of {long!r}, so a grammar engine could stop "
                        "or go on after it; set a response suffix (the default is '\"}') "
                        "that closes every choice"
                    )
        nodes: dict[bytes, GrammarNode] = {}
        frontier = [b""]  # breadth first: a parent is always shorter than its children
        while frontier:
            deeper: set[bytes] = set()
            for output in frontier:
                node = self._node(output, targets)
                if not node.allowed:
                    raise ValueError(
                        f"no token of this vocabulary continues the output {output!r} toward "
                        "a choice, so masked decoding would stop there (a byte-level "
                        "vocabulary has a token for every byte and never does)"
                    )
                nodes[output] = node
                deeper.update(node.children)
            frontier = sorted(deeper, key=lambda o: (len(o), o))
        return GrammarTree(targets, nodes)

    def _node(self, output: bytes, targets: tuple[bytes, ...]) -> GrammarNode:
        n = len(output)
        pieces = {
            t[n:k]
            for t in targets
            if t.startswith(output)
            for k in range(n + 1, min(len(t), n + self._longest) + 1)
        }
        determines: dict[int, list[int]] = {}
        children: dict[bytes, list[int]] = {}
        for piece in sorted(pieces):
            tokens = self._by_bytes.get(piece)
            if tokens is None:
                continue
            after = output + piece
            consistent = [i for i, t in enumerate(targets) if t.startswith(after)]
            if len(consistent) == 1:
                determines.setdefault(consistent[0], []).extend(tokens)
            else:
                children.setdefault(after, []).extend(tokens)
        return GrammarNode(
            output,
            {c: tuple(sorted(ids)) for c, ids in sorted(determines.items())},
            {o: tuple(sorted(ids)) for o, ids in children.items()},
        )


def choice_targets(choices: Sequence[str], suffix: str) -> tuple[bytes, ...]:
    """Each choice's text as the model writes it after the response prefix: JSON-escaped,
    then the response suffix, in UTF-8 (a ``GrammarTree``'s targets)."""
    return tuple((json_escape(c) + suffix).encode() for c in choices)


_VOCABULARIES: weakref.WeakKeyDictionary[PreTrainedTokenizerBase, GrammarVocabulary] = (
    weakref.WeakKeyDictionary()
)


def masked_distribution(
    tree: GrammarTree,
    next_logprobs: Callable[[tuple[int, ...]], np.ndarray],
    max_positions: int = MAX_POSITIONS,
) -> np.ndarray:
    """Each choice's probability under masked decoding, in ``tree.targets`` order.

    ``next_logprobs(path)`` is the model's full-vocabulary log-softmax, shape (V,), after the
    prompt and the generated token ``path``. At each node the step's distribution is that,
    restricted to the node's allowed tokens and renormalised: what applying the grammar's
    mask to the logits and sampling does. A choice collects the probability of every path
    that determines it. Raises TooManyPathsError (a ValueError) when the tree has more than
    ``max_positions`` token paths to its nodes, before any model work.
    """
    tree.check_positions(max_positions)
    probs = np.zeros(len(tree.targets))
    stack: list[tuple[tuple[int, ...], bytes, float]] = [((), b"", 0.0)]
    while stack:
        path, output, logp = stack.pop()
        node = tree.nodes[output]
        lp = np.asarray(next_logprobs(path), dtype=np.float64)  # (V,)
        norm = float(np.logaddexp.reduce(lp[sorted(node.allowed)]))
        for choice, tokens in node.determines.items():
            probs[choice] += math.exp(logp + float(np.logaddexp.reduce(lp[list(tokens)])) - norm)
        for child, tokens in node.children.items():
            for t in tokens:
                stack.append(((*path, t), child, logp + float(lp[t]) - norm))
    return probs


def grammar_probabilities(
    judge: _Judging,
    prompt: str,
    choices: Sequence[str],
    *,
    system: str | None = None,
    response_prefix: str | None = None,
    response_suffix: str | None = None,
    max_positions: int = MAX_POSITIONS,
) -> dict[str, float]:
    """What grammar-constrained decoding emits for each choice: the reference, not the engine.

    The prompt is rendered and tokenized by ``judge.prepare`` and ``judge.tokens.PathEncoder``,
    as a judgment does, so the tokens before the decision point are the engine's own
    (``prepare`` also checks the query as ``judge`` would). Each position of the grammar tree
    then gets one plain forward pass over prompt + path (no cache, no packing), the
    full-vocabulary log-softmax in float64. Raises ValueError past ``max_positions``.
    """
    import torch

    from judge.tokens import PathEncoder

    query = Query(
        prompt=prompt,
        choices=list(choices),
        system=system,
        response_prefix=response_prefix,
        response_suffix=response_suffix,
    )
    prepared = judge.prepare(query)
    suffix = judge.response_suffix if response_suffix is None else response_suffix
    endings = [json_escape(c) + suffix for c in prepared.choices]
    prompt_ids = PathEncoder(judge.tokenizer).encode_paths(prepared.prompt, endings).prompt_ids
    tree = GrammarVocabulary.of(judge.tokenizer).tree(choice_targets(prepared.choices, suffix))
    device = judge.model.device

    @torch.inference_mode()
    def next_logprobs(path: tuple[int, ...]) -> np.ndarray:
        ids = torch.tensor([[*prompt_ids, *path]], device=device)  # (1, T)
        logits = judge.model(ids).logits[0, -1].double()  # (V,)
        return torch.log_softmax(logits, dim=-1).cpu().numpy()

    probs = masked_distribution(tree, next_logprobs, max_positions)
    return dict(zip(prepared.choices, probs.tolist(), strict=True))
