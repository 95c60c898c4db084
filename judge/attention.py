"""Attention over lanes: each query reads one key list, laid out as it would be alone.

A pass holds rows (judge.forward): a cached past, a plain causal chain, and after it one branch
per packed trie (that trie's own context and its choice tokens). A *lane* is one key list:
the row's past, its chain, then one trie's branch. A query of that branch reads that lane; a
chain query reads the row's first lane. A key sits in a lane at the index it would have if
its trie were judged alone, its prefix read from the cache or not: a chain key at its
position, a branch key right after the chain, in order. Only keys a query may not see differ
between those cases, and they weigh exactly zero.

``blocked_attention`` (the batch-invariant arithmetic) computes every lane the same way: in
float32, queries in blocks of ``QUERY_BLOCK`` and keys in blocks of ``KEY_BLOCK``, so every
matrix product has one fixed shape; a block's scores, its exponentials and its weighted values
then do not depend on the other blocks in the product (measured: a batched float32 product
gives each block the same bits whatever the batch count or the block's place in it). The
softmax takes the exact maximum over all of a query's keys, and the blocks' sums are added in
key order, one block after the other; a block of keys a query cannot see adds an exact zero.
So a query's result depends on its own keys only, not on its neighbours, the padding, the
number of lanes or how much of its prefix came from the cache. A group of query blocks stops
at the last key block any of its queries sees, which skips the masked half of a long causal
pass without changing a sum.

``lane_sdpa`` is the ordinary arithmetic over the same lanes: PyTorch's fused attention in the
model's dtype, faster and not invariant.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.nn import functional as F

__all__ = ["KEY_BLOCK", "QUERY_BLOCK", "QUERY_GROUP", "Lanes", "blocked_attention", "lane_sdpa"]

# Queries and keys per block of the invariant attention: every product is (G*32, D) x (D, 64)
# or (G*32, 64) x (64, D) for G query heads per key head.
QUERY_BLOCK = 32
KEY_BLOCK = 64
# Query blocks whose scores exist at once: (heads, lanes, 256 queries, keys) floats.
QUERY_GROUP = 8


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


@dataclass(frozen=True)
class Lanes:
    """Which keys each lane holds and which queries read it, for one pass.

    Keys are indices into the pass's key bank, per layer the concatenation of every row's
    cached past, the fed tokens' own keys and one zero key (the padding); queries are indices
    into the fed tokens (a padding slot reads query 0, and its result is never read).
    """

    key_index: torch.Tensor  # (L, S) long, S a multiple of KEY_BLOCK
    query_index: torch.Tensor  # (L, Q) long, Q a multiple of QUERY_BLOCK
    visible: torch.Tensor  # (L, Q, S) bool: the query may see the key
    back: torch.Tensor  # (n_fed,) long: each fed token's row in the (L * Q) lane outputs
    n_fed: int
    # Per group of query blocks: (first block, end block, key blocks any of its queries sees).
    groups: tuple[tuple[int, int, int], ...]

    @classmethod
    def build(
        cls,
        lanes: Sequence[tuple[Sequence[int], Sequence[int], torch.Tensor]],
        n_fed: int,
        pad_key: int,
    ) -> Lanes:
        """``lanes``: per lane, its keys (bank indices), its queries (fed indices) and which
        keys each query sees, (queries, keys) bool. Every fed token is the query of exactly
        one lane, and every query sees at least one key."""
        S = _round_up(max(len(k) for k, _, _ in lanes), KEY_BLOCK)
        Q = _round_up(max(len(q) for _, q, _ in lanes), QUERY_BLOCK)
        L = len(lanes)
        key_index = torch.full((L, S), pad_key, dtype=torch.long)
        query_index = torch.zeros((L, Q), dtype=torch.long)  # padding reads query 0
        visible = torch.zeros((L, Q, S), dtype=torch.bool)
        visible[:, :, 0] = True  # a padding query sees the lane's first key: no empty softmax
        back = torch.empty(n_fed, dtype=torch.long)
        for lane, (keys, queries, seen) in enumerate(lanes):
            fed = torch.tensor(list(queries), dtype=torch.long)
            key_index[lane, : len(keys)] = torch.tensor(list(keys), dtype=torch.long)
            query_index[lane, : len(queries)] = fed
            visible[lane, : len(queries), : len(keys)] = seen
            back[fed] = lane * Q + torch.arange(len(queries))
        # Per query block, the key blocks up to the last one any of its queries sees.
        blocks = visible.view(L, Q // QUERY_BLOCK, QUERY_BLOCK, S // KEY_BLOCK, KEY_BLOCK)
        seen_blocks = blocks.any(dim=(0, 2, 4))  # (query blocks, key blocks)
        groups = []
        for first in range(0, Q // QUERY_BLOCK, QUERY_GROUP):
            end = min(first + QUERY_GROUP, Q // QUERY_BLOCK)
            columns = seen_blocks[first:end].any(dim=0).nonzero()
            groups.append((first, end, int(columns[-1]) + 1))
        return cls(key_index, query_index, visible, back, n_fed, tuple(groups))

    def to(self, device: torch.device) -> Lanes:
        if device.type == "cpu":
            return self
        return Lanes(
            self.key_index.to(device),
            self.query_index.to(device),
            self.visible.to(device),
            self.back.to(device),
            self.n_fed,
            self.groups,
        )


@dataclass(frozen=True)
class _Plan:
    """The lanes' masks in the blocked layout of one model's heads, made once per pass."""

    lanes: Lanes
    # Per group: (key blocks, 1, L * query blocks, QUERY_BLOCK * G, KEY_BLOCK) float32 (the 1
    # spans key heads), query rows in (query, head in group) order: ``bias`` is 0 where a
    # query sees a key and _HIDDEN where not, ``keep`` 1 and 0.
    bias: tuple[torch.Tensor, ...]
    keep: tuple[torch.Tensor, ...]


# A finite stand-in for minus infinity: exp() of an infinite or underflowing argument takes a
# slow path on x86 (12x and 180x measured), so masked scores are pushed far down, every
# exponent is clamped at _FLOOR (exp(-80) = 2e-35, far below a float32 sum's resolution of a
# softmax whose largest term is 1) and masked weights are then multiplied by exactly 0.
_HIDDEN = -1e30
_FLOOR = -80.0


def plan(lanes: Lanes, groups_per_head: int) -> _Plan:
    """Lay the masks out for ``blocked_attention`` with ``groups_per_head`` query heads per key
    head (grouped-query attention)."""
    L, Q, S = lanes.visible.shape
    G = groups_per_head
    seen = lanes.visible.view(L, Q // QUERY_BLOCK, QUERY_BLOCK, S // KEY_BLOCK, KEY_BLOCK)
    seen = seen.permute(3, 0, 1, 2, 4)  # (nk, L, nq, Bq, Bk)
    bias, keep = [], []
    for first, end, n_keys in lanes.groups:
        part = seen[:n_keys, :, first:end, :, None]  # (nkg, L, nqg, Bq, 1, Bk)
        part = part.expand(-1, -1, -1, -1, G, -1).reshape(
            n_keys, 1, L * (end - first), QUERY_BLOCK * G, KEY_BLOCK
        )
        keep.append(part.float())
        bias.append(torch.zeros(part.shape, device=part.device).masked_fill_(~part, _HIDDEN))
    return _Plan(lanes, tuple(bias), tuple(keep))


def _lane_keys(bank: torch.Tensor, lanes: Lanes) -> torch.Tensor:
    """(Hkv, K, D) bank -> (Hkv, L, S, D): each lane's keys in its own order."""
    L, S = lanes.key_index.shape
    return bank.index_select(1, lanes.key_index.view(-1)).view(bank.shape[0], L, S, -1)


def blocked_attention(
    q: torch.Tensor,
    bank_k: torch.Tensor,
    bank_v: torch.Tensor,
    plan_: _Plan,
    scale: float,
) -> torch.Tensor:
    """Batch-invariant attention: q (N, Hq, D) over each lane's keys in the (Hkv, K, D) banks;
    returns (N, Hq * D) in q's dtype, computed in float32."""
    lanes = plan_.lanes
    N, Hq, D = q.shape
    Hkv = bank_k.shape[0]
    G = Hq // Hkv
    L, Q = lanes.query_index.shape
    S = lanes.key_index.shape[1]
    nq, rows = Q // QUERY_BLOCK, QUERY_BLOCK * G
    # (L * Q, Hkv, G, D) -> (Hkv, L, nq, Bq * G, D): a block's rows are its queries' heads of
    # one key head. A padding query reads query 0; its row is computed and never read.
    ql = (q.float() * scale).view(N, Hkv, G, D).index_select(0, lanes.query_index.view(-1))
    ql = ql.view(L, Q, Hkv, G, D).permute(2, 0, 1, 3, 4).reshape(Hkv, L, nq, rows, D)
    blocks = (Hkv, L, S // KEY_BLOCK, KEY_BLOCK, D)
    keys_t = _lane_keys(bank_k.float(), lanes).view(blocks).transpose(-1, -2)  # (.., D, Bk)
    values = _lane_keys(bank_v.float(), lanes).view(blocks)
    outs = []
    for (first, end, n_keys), bias, keep in zip(lanes.groups, plan_.bias, plan_.keep, strict=True):
        n = end - first
        batch = Hkv * L * n
        qg = ql[:, :, first:end].reshape(batch, rows, D)
        # Every product has one shape, (rows, D) x (D, Bk) and (rows, Bk) x (Bk, D): key block
        # by key block, the block's keys shared (stride 0) by the group's query blocks.
        scores = q.new_empty((n_keys, batch, rows, KEY_BLOCK), dtype=torch.float32)
        for block in range(n_keys):
            k = keys_t[:, :, block : block + 1].expand(Hkv, L, n, D, KEY_BLOCK)
            torch.bmm(qg, k.reshape(batch, D, KEY_BLOCK), out=scores[block])
        grid = scores.view(n_keys, Hkv, L * n, rows, KEY_BLOCK).add_(bias)
        top = grid.amax(dim=(0, 4), keepdim=True)  # exact, whatever the order
        grid.sub_(top).clamp_(min=_FLOOR).exp_().mul_(keep)
        weights = scores  # now exp(score - top), exactly 0 where the key is hidden
        sums = weights.sum(dim=-1)  # (nkg, batch, rows)
        # One key block after the other, in key order: the same additions for every layout.
        acc, total = None, sums[0]
        for block in range(n_keys):
            v = values[:, :, block : block + 1].expand(Hkv, L, n, KEY_BLOCK, D)
            part = torch.bmm(weights[block], v.reshape(batch, KEY_BLOCK, D))  # (batch, rows, D)
            acc = part if acc is None else acc.add_(part)
            if block:
                total = total + sums[block]
        assert acc is not None
        outs.append((acc / total[..., None]).view(Hkv, L, n, rows, D))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    out = out.view(Hkv, L * Q, G, D).transpose(0, 1).reshape(L * Q, Hq * D)
    return out.index_select(0, lanes.back).to(q.dtype)


def lane_sdpa(
    q: torch.Tensor,
    bank_k: torch.Tensor,
    bank_v: torch.Tensor,
    lanes: Lanes,
    scale: float,
) -> torch.Tensor:
    """The ordinary arithmetic over the same lanes: fused attention in q's dtype."""
    Hq, D = q.shape[1:]
    ql = q[lanes.query_index].transpose(1, 2)  # (L, Hq, Q, D)
    kl = _lane_keys(bank_k, lanes).transpose(0, 1)  # (L, Hkv, S, D)
    vl = _lane_keys(bank_v, lanes).transpose(0, 1)
    out = F.scaled_dot_product_attention(
        ql, kl, vl, attn_mask=lanes.visible[:, None], scale=scale, enable_gqa=True
    )  # (L, Hq, Q, D)
    return out.transpose(1, 2).reshape(-1, Hq * D)[lanes.back]
