"""A bounded cache of attention keys and values for prompt prefixes, shared across calls.

Judge workloads repeat a long head (chat template, system prompt, rubric, worked examples) in
front of a short item. The keys and values a causal model computes for a token depend only on
the tokens up to it, so the head's can be computed once and reused by every later prompt that
starts with the same token ids.

Design (after vLLM's automatic prefix caching, which hashes fixed-size blocks, and SGLang's
RadixAttention, which shares prefixes in a tree):

* The prefix is cut into blocks of ``block_tokens`` token ids. A block is keyed by its parent
  block and its own ids, so the blocks form a tree in which a path from the root is a prefix;
  a lookup walks it one block at a time and reuses the longest chain of whole blocks. Keys are
  token ids of the prompt's own tokenization, never text, so a prefix is reused only by a
  prompt whose tokenization starts with exactly those ids.
* Each block holds, per layer, its keys and values (kv_heads, block_tokens, head_dim), copied
  out of the pass that computed them; later calls copy them into their own tensors and never
  write to them.
* Memory is bounded by ``budget_bytes``. Blocks are evicted least recently used first, and a
  block is evicted with its descendants (they are unreachable without it). A use touches a
  chain from its deepest block up to the root, so a parent is always more recent than its
  children and eviction takes leaves first. A block that cannot fit even in an empty cache is
  not stored: caching is skipped for that prefix, nothing fails.
* A call assembles its rows' chains into the model's past. For one row the assembly is kept
  (the last one only, counted in the budget and dropped first when room is needed), because
  a pipeline's calls share one head and copying it again on every call would cost a
  noticeable share of a warm call.
* One lock guards the structure; the tensors themselves are read-only once stored.

Whole blocks only: a prefix shorter than a block is not cached, and at least the last token of
a context is always computed, since its hidden state is where the choices are read.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    import torch

__all__ = ["ATTENDING_LAYERS", "PrefixCache", "PrefixCacheStats", "cacheable"]

KV = list[tuple["torch.Tensor", "torch.Tensor"]]  # per layer: (keys, values), (heads, t, head_dim)

# Layer types (transformers' ``config.layer_types``) whose state after a prefix is its keys and
# values. A sliding-window layer's is too: the cache keeps every key, and the pass's mask hides
# those out of the window (``judge.forward._pack``).
ATTENDING_LAYERS = frozenset({"full_attention", "sliding_attention"})


def cacheable(config: object) -> bool:
    """Whether a model with ``config`` carries a prefix forward in its keys and values alone,
    so that the prefix cache can stand in for it: every layer attends to its past, whole or
    through a sliding window (Gemma 3, Mistral). Another kind of layer (a recurrent state,
    chunked attention) keeps something a key cache does not."""
    types = getattr(config, "layer_types", None) or []
    return all(t in ATTENDING_LAYERS for t in types)


class PrefixCacheStats(msgspec.Struct, frozen=True, kw_only=True):
    """Counters since the cache was made, and what it holds now."""

    hits: int  # lookups that reused at least one block
    misses: int  # lookups that reused nothing
    tokens_reused: int  # prompt tokens read from the cache instead of computed
    evictions: int  # blocks evicted to stay within the budget
    blocks: int  # blocks held now
    bytes: int  # bytes of keys and values held now
    budget_bytes: int
    block_tokens: int


@dataclass(eq=False)
class Block:
    key: tuple[int, tuple[int, ...]]  # (parent block id, this block's token ids)
    id: int
    parent: Block | None
    kv: KV
    nbytes: int
    children: set[int] = field(default_factory=set)


class PrefixCache:
    """Keys and values of prompt prefixes, in blocks of ``block_tokens`` token ids."""

    def __init__(self, budget_bytes: int, block_tokens: int = 32) -> None:
        if budget_bytes < 0 or block_tokens < 1:
            raise ValueError("budget_bytes must be >= 0 and block_tokens >= 1")
        self.budget_bytes = int(budget_bytes)
        self.block_tokens = int(block_tokens)
        self._blocks: OrderedDict[int, Block] = OrderedDict()  # LRU order, oldest first
        self._index: dict[tuple[int, tuple[int, ...]], Block] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._bytes = self._hits = self._misses = self._reused = self._evictions = 0
        # The last one-row assembly of a chain (block ids, per-layer tensors), see assemble().
        self._memo: tuple[tuple[int, ...], KV] | None = None
        self._memo_bytes = 0

    def lookup(self, tokens: Sequence[int], limit: int) -> list[Block]:
        """The longest chain of cached blocks that is a prefix of ``tokens[:limit]``."""
        b = self.block_tokens
        chain: list[Block] = []
        with self._lock:
            parent = 0
            for start in range(0, limit - b + 1, b):
                block = self._index.get((parent, tuple(tokens[start : start + b])))
                if block is None:
                    break
                chain.append(block)
                parent = block.id
            self._touch(chain)
            if chain:
                self._hits += 1
                self._reused += len(chain) * b
            else:
                self._misses += 1
        return chain

    def store(self, tokens: Sequence[int], chain: Sequence[Block], kv: KV) -> None:
        """Add the whole blocks of ``tokens`` that follow ``chain``.

        ``kv`` holds, per layer, keys and values (heads, t, head_dim) for the tokens from
        ``len(chain) * block_tokens`` on (at least as many as are stored).
        """
        b = self.block_tokens
        start = len(chain) * b
        with self._lock:
            path = list(chain)
            if any(block.id not in self._blocks for block in path):
                return  # part of the chain was evicted meanwhile: its children are unreachable
            parent = path[-1] if path else None
            for first in range(start, len(tokens) - b + 1, b):
                key = (parent.id if parent else 0, tuple(tokens[first : first + b]))
                block = self._index.get(key)
                if block is None:
                    at = first - start
                    # Copies, so the block keeps nothing of the pass's tensors alive.
                    piece = [(k[:, at : at + b].clone(), v[:, at : at + b].clone()) for k, v in kv]
                    nbytes = sum(k.nbytes + v.nbytes for k, v in piece)
                    if not self._make_room(nbytes, keep=path):
                        break  # too large for the budget: this prefix is not cached further
                    block = Block(key, next(self._ids), parent, piece, nbytes)
                    self._blocks[block.id] = block
                    self._index[key] = block
                    self._bytes += nbytes
                    if parent is not None:
                        parent.children.add(block.id)
                path.append(block)
                parent = block
            self._touch(path)

    def stats(self) -> PrefixCacheStats:
        with self._lock:
            return PrefixCacheStats(
                hits=self._hits,
                misses=self._misses,
                tokens_reused=self._reused,
                evictions=self._evictions,
                blocks=len(self._blocks),
                bytes=self._bytes,
                budget_bytes=self.budget_bytes,
                block_tokens=self.block_tokens,
            )

    def clear(self) -> None:
        """Drop every block (the counters stay)."""
        with self._lock:
            self._blocks.clear()
            self._index.clear()
            self._memo, self._memo_bytes = None, 0
            self._bytes = 0

    def assemble(self, chains: Sequence[Sequence[Block]]) -> tuple[KV, int]:
        """Per layer, keys and values (B, heads, P, head_dim) for a batch: each row's cached
        prefix right-aligned in P = longest-chain slots (zeros before it).

        The tensors are fresh or, for one row, the last one-row assembly when its chain
        starts with the same blocks: a pipeline's calls share one head, and concatenating it
        again each call would copy the whole head once more per call. Nothing written to them
        afterwards (the model's cache concatenates, it does not write in place).
        """
        import torch

        b = self.block_tokens
        P = max(len(c) for c in chains) * b
        if len(chains) == 1:
            ids = tuple(block.id for block in chains[0])
            with self._lock:
                memo = self._memo
            if memo is not None and memo[0][: len(ids)] == ids:
                return [(k[:, :, :P], v[:, :, :P]) for k, v in memo[1]], P
            layers = [
                (
                    torch.cat([blk.kv[i][0] for blk in chains[0]], dim=1)[None],
                    torch.cat([blk.kv[i][1] for blk in chains[0]], dim=1)[None],
                )
                for i in range(len(chains[0][0].kv))
            ]
            with self._lock:
                self._drop_memo()
                nbytes = sum(k.nbytes + v.nbytes for k, v in layers)
                if self._bytes + nbytes <= self.budget_bytes:  # counted like any block
                    self._memo, self._memo_bytes = (ids, layers), nbytes
                    self._bytes += nbytes
            return layers, P
        first = next(c for c in chains if c)[0].kv
        out: KV = []
        for i, (k0, v0) in enumerate(first):
            heads, _, dim = k0.shape
            keys = k0.new_zeros((len(chains), heads, P, dim))  # (B, H, P, D)
            values = v0.new_zeros((len(chains), heads, P, dim))
            for row, chain in enumerate(chains):
                if chain:
                    n = len(chain) * b
                    keys[row, :, P - n :] = torch.cat([blk.kv[i][0] for blk in chain], dim=1)
                    values[row, :, P - n :] = torch.cat([blk.kv[i][1] for blk in chain], dim=1)
            out.append((keys, values))
        return out, P

    def concatenated(self, chains: Sequence[Sequence[Block]]) -> KV:
        """Per layer, keys and values (heads, P, head_dim) of every chain one after the other,
        P the sum of their lengths (one row's: the assembly that ``assemble`` keeps)."""
        import torch

        used = [c for c in chains if c]
        if len(used) == 1:
            return [(k[0], v[0]) for k, v in self.assemble(used)[0]]
        blocks = [blk for chain in used for blk in chain]
        return [
            (
                torch.cat([blk.kv[i][0] for blk in blocks], dim=1),
                torch.cat([blk.kv[i][1] for blk in blocks], dim=1),
            )
            for i in range(len(blocks[0].kv))
        ]

    def _drop_memo(self) -> None:
        if self._memo is not None:
            self._bytes -= self._memo_bytes
            self._memo, self._memo_bytes = None, 0

    def _touch(self, chain: Sequence[Block]) -> None:
        for block in reversed(chain):  # deepest first: the root ends up most recent
            if block.id in self._blocks:
                self._blocks.move_to_end(block.id)

    def _make_room(self, nbytes: int, keep: Sequence[Block]) -> bool:
        if nbytes > self.budget_bytes:
            return False
        kept = {block.id for block in keep}
        if self._bytes + nbytes > self.budget_bytes:
            self._drop_memo()  # a derived copy goes first
        while self._bytes + nbytes > self.budget_bytes:
            victim = next((blk for i, blk in self._blocks.items() if i not in kept), None)
            if victim is None:
                return False
            self._evict(victim)
        return True

    def _evict(self, block: Block) -> None:
        if self._memo is not None and block.id in self._memo[0]:
            self._drop_memo()
        for child in list(block.children):
            if child in self._blocks:
                self._evict(self._blocks[child])
        del self._blocks[block.id]
        del self._index[block.key]
        self._bytes -= block.nbytes
        self._evictions += 1
        if block.parent is not None:
            block.parent.children.discard(block.id)
