"""Attention over lanes: each query reads one key list, laid out as it would be alone.

A pass holds rows (judge.forward): a cached past, a plain causal chain, and after it one branch
per packed trie (that trie's own context and its choice tokens). A *lane* is one key list:
the row's past, its chain, then one trie's branch. A query of that branch reads that lane; a
chain query reads the row's first lane. A key sits in a lane at the index it would have if
its trie were judged alone, its prefix read from the cache or not: a chain key at its
position, a branch key right after the chain, in order. Only keys a query may not see differ
between those cases, and they weigh exactly zero.

``blocked_attention`` (the batch-invariant arithmetic) gives every query the same work
whatever surrounds it: PyTorch's fused attention (``scaled_dot_product_attention``) on blocks
of exactly ``QUERY_BLOCK`` queries of one lane, over that lane's keys from the first, padded
with hidden keys to a multiple of ``KEY_BLOCK``. On the CPU the fused kernel splits a call of
32 queries and 512·k keys into one block of queries and blocks of 512 keys, and folds the key
blocks in order into a running softmax, so a query's numbers depend on its own keys, in their
own places, and on nothing else: not on the other queries of its block, the other blocks or
lanes in the call, or how many blocks of keys it cannot see follow (they add exact zeros).
This is measured, not promised by PyTorch: ``tests/test_lean.py`` checks each of those cases
bit for bit, and ``tests/test_invariance.py`` whole judgments on the default model. A lane's
blocks of queries are grouped by the keys they need, so a long causal lane does not pay for the
masked half of its keys beyond one block of 512.

``lane_sdpa`` is the ordinary arithmetic over the same lanes: one fused call for all lanes,
keys padded only to a multiple of 64; faster for a batch, and not invariant.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.nn import functional as F

__all__ = ["KEY_BLOCK", "QUERY_BLOCK", "Lanes", "blocked_attention", "lane_sdpa"]

# Queries per call block, and the multiple the invariant arithmetic pads keys to: the fused
# kernel's own block sizes for calls of this shape, so that every call splits the same way.
QUERY_BLOCK = 32
KEY_BLOCK = 512
# Keys are padded to a multiple of this in the ordinary arithmetic.
ORDINARY_KEY_BLOCK = 64


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


@dataclass(frozen=True)
class _Call:
    """One fused call of the invariant arithmetic: query blocks [first, end) of one lane,
    over the lane's first ``keys`` keys."""

    lane: int
    first: int
    end: int
    queries: torch.Tensor  # ((end - first) * QUERY_BLOCK,) long: fed indices (padding: 0)
    visible: torch.Tensor  # (end - first, 1, QUERY_BLOCK, keys) bool
    keys: int


@dataclass(frozen=True)
class Lanes:
    """Which keys each lane holds and which queries read it, for one pass.

    Keys are indices into the pass's key bank, per layer the concatenation of every row's
    cached past, the fed tokens' own keys and ``pad_keys`` zero keys (the padding); queries are
    indices into the fed tokens (a padding slot reads query 0, and its result is never read).
    """

    key_index: torch.Tensor  # (L, S) long
    query_index: torch.Tensor  # (L, Q) long, Q a multiple of QUERY_BLOCK
    visible: torch.Tensor  # (L, Q, S) bool: the query may see the key
    n_fed: int
    # The invariant arithmetic's calls, and each fed token's row in their outputs, one call
    # after the other; without ``blocked``, each fed token's row in the (L * Q) lane outputs.
    calls: tuple[_Call, ...]
    back: torch.Tensor  # (n_fed,) long
    # Zero keys the bank must end with. One lane whose keys are the bank's own, in order (a
    # row alone, with or without its cached past), reads the bank as it is, padding and all,
    # instead of gathering a copy of it: then the bank ends with the lane's padding.
    pad_keys: int = 1
    contiguous: bool = False

    @classmethod
    def build(
        cls,
        lanes: Sequence[tuple[Sequence[int], Sequence[int], torch.Tensor]],
        n_fed: int,
        pad_key: int,
        blocked: bool = True,
    ) -> Lanes:
        """``lanes``: per lane, its keys (bank indices), its queries (fed indices) and which
        keys each query sees, (queries, keys) bool. Every fed token is the query of exactly
        one lane, and every query sees at least one key. ``blocked``: laid out for
        ``blocked_attention`` (keys padded to KEY_BLOCK), else for ``lane_sdpa``."""
        S = _round_up(
            max(len(k) for k, _, _ in lanes), KEY_BLOCK if blocked else ORDINARY_KEY_BLOCK
        )
        Q = _round_up(max(len(q) for _, q, _ in lanes), QUERY_BLOCK)
        L = len(lanes)
        key_index = torch.full((L, S), pad_key, dtype=torch.long)
        query_index = torch.zeros((L, Q), dtype=torch.long)  # padding reads query 0
        visible = torch.zeros((L, Q, S), dtype=torch.bool)
        visible[:, :, 0] = True  # a padding query sees the lane's first key: no empty softmax
        slot = torch.full((L, Q), -1, dtype=torch.long)  # which fed token sits where
        for lane, (keys, queries, seen) in enumerate(lanes):
            fed = torch.tensor(list(queries), dtype=torch.long)
            key_index[lane, : len(keys)] = torch.tensor(list(keys), dtype=torch.long)
            query_index[lane, : len(queries)] = fed
            visible[lane, : len(queries), : len(keys)] = seen
            slot[lane, : len(queries)] = fed
        calls: list[_Call] = []
        rows: list[torch.Tensor] = []  # per call, the fed token of each of its output rows
        if blocked:
            for lane, (_, queries, _) in enumerate(lanes):
                for call in _calls(lane, visible[lane], query_index[lane], len(queries)):
                    calls.append(call)
                    rows.append(slot[lane, call.first * QUERY_BLOCK : call.end * QUERY_BLOCK])
        else:
            rows = [slot.view(-1)]
        order = torch.cat(rows)
        back = torch.empty(n_fed, dtype=torch.long)
        real = order >= 0
        back[order[real]] = real.nonzero().view(-1)
        contiguous = L == 1 and list(lanes[0][0]) == list(range(pad_key))
        pad = S - pad_key if contiguous else 1
        return cls(key_index, query_index, visible, n_fed, tuple(calls), back, pad, contiguous)

    def to(self, device: torch.device) -> Lanes:
        if device.type == "cpu":
            return self
        calls = tuple(
            _Call(c.lane, c.first, c.end, c.queries.to(device), c.visible.to(device), c.keys)
            for c in self.calls
        )
        return Lanes(
            self.key_index.to(device),
            self.query_index.to(device),
            self.visible.to(device),
            self.n_fed,
            calls,
            self.back.to(device),
            self.pad_keys,
            self.contiguous,
        )


def _calls(lane: int, seen: torch.Tensor, queries: torch.Tensor, n: int) -> list[_Call]:
    """The calls for one lane's first ``n`` queries: runs of query blocks that need the same
    number of keys, rounded up to KEY_BLOCK."""
    blocks = _round_up(n, QUERY_BLOCK) // QUERY_BLOCK
    S = seen.shape[1]
    by_block = seen[: blocks * QUERY_BLOCK].view(blocks, QUERY_BLOCK, S).any(dim=1)
    needed = [_round_up(int(b.nonzero()[-1]) + 1, KEY_BLOCK) for b in by_block]
    out: list[_Call] = []
    first = 0
    for i in range(1, blocks + 1):
        if i == blocks or needed[i] != needed[first]:
            keys = needed[first]
            window = seen[first * QUERY_BLOCK : i * QUERY_BLOCK, :keys]
            out.append(
                _Call(
                    lane=lane,
                    first=first,
                    end=i,
                    queries=queries[first * QUERY_BLOCK : i * QUERY_BLOCK].clone(),
                    visible=window.reshape(i - first, 1, QUERY_BLOCK, keys).clone(),
                    keys=keys,
                )
            )
            first = i
    return out


def _lane_keys(bank: torch.Tensor, lanes: Lanes) -> torch.Tensor:
    """(Hkv, K, D) bank -> (L, Hkv, S, D): each lane's keys in its own order."""
    L, S = lanes.key_index.shape
    if lanes.contiguous:
        return bank[None]  # the bank is the lane
    picked = bank.index_select(1, lanes.key_index.view(-1))
    return picked.view(bank.shape[0], L, S, -1).transpose(0, 1)


def blocked_attention(
    q: torch.Tensor, bank_k: torch.Tensor, bank_v: torch.Tensor, lanes: Lanes, scale: float
) -> torch.Tensor:
    """Batch-invariant attention: q (N, Hq, D) over each lane's keys in the (Hkv, K, D) banks;
    returns (N, Hq * D) in q's dtype."""
    Hq, D = q.shape[1:]
    keys, values = _lane_keys(bank_k, lanes), _lane_keys(bank_v, lanes)  # (L, Hkv, S, D)
    outs = []
    for call in lanes.calls:
        blocks = call.visible.shape[0]
        qc = q.index_select(0, call.queries).view(blocks, QUERY_BLOCK, Hq, D).transpose(1, 2)
        # The lane's keys, shared (stride 0) by the call's query blocks.
        kc = keys[call.lane : call.lane + 1, :, : call.keys].expand(blocks, -1, -1, -1)
        vc = values[call.lane : call.lane + 1, :, : call.keys].expand(blocks, -1, -1, -1)
        out = F.scaled_dot_product_attention(
            qc, kc, vc, attn_mask=call.visible, scale=scale, enable_gqa=True
        )  # (blocks, Hq, Bq, D)
        outs.append(out.transpose(1, 2).reshape(blocks * QUERY_BLOCK, Hq * D))
    return torch.cat(outs).index_select(0, lanes.back)


def lane_sdpa(
    q: torch.Tensor, bank_k: torch.Tensor, bank_v: torch.Tensor, lanes: Lanes, scale: float
) -> torch.Tensor:
    """The ordinary arithmetic over the same lanes: one fused call in q's dtype."""
    Hq, D = q.shape[1:]
    ql = q[lanes.query_index].transpose(1, 2)  # (L, Hq, Q, D)
    out = F.scaled_dot_product_attention(
        ql,
        _lane_keys(bank_k, lanes),
        _lane_keys(bank_v, lanes),
        attn_mask=lanes.visible[:, None],
        scale=scale,
        enable_gqa=True,
    )  # (L, Hq, Q, D)
    return out.transpose(1, 2).reshape(-1, Hq * D).index_select(0, lanes.back)
