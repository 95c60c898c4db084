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
of exactly ``Blocking.queries`` queries of one lane, over that lane's keys from the first,
padded with hidden keys to ``Blocking.keys``: the smallest of the short key counts measured
to hold (multiples of ``KEY_STEP`` from ``MIN_KEYS``) that holds them, else a multiple of
``KEY_BLOCK``.
On the CPU the fused kernel splits a call into blocks of queries and blocks of at most 512
keys, and folds the key blocks in order into a running softmax, so a query's numbers depend on
its own keys, in their own places, and on nothing else: not on the other queries of its
block or their slots, the other blocks or lanes in the call, or how many hidden keys follow
(they add exact zeros).

That is measured, not promised by PyTorch, and it is not so on every CPU: with AVX2 kernels
(emulated on an AMX Xeon), 32 queries a block gave a query other bits at the block's last
slots, and 64 keys or fewer other bits than 512 on two threads. So each engine measures its own
``Blocking`` when it is built (``measured_blocking``: the model's head shapes and dtype, this
machine's kernels and threads), the first of ``QUERY_CANDIDATES`` whose every slot gives the
same bits, and the short key counts that give the bits of 512 (on an AMD EPYC only some do).
``tests/test_lean.py`` checks the cases bit for bit, and ``tests/test_invariance.py`` whole
judgments on the default model.
A lane's blocks of queries are grouped by the keys they need, so a long causal lane does not
pay for the masked half of its keys beyond one block of 512. A lane's last, partial block runs
in fewer queries where that count is measured to give each query a whole block's bits
(``Blocking.tails``; 4 to 31 of 32 on an AMD EPYC, AVX-512 and AVX2 kernels alike): a warm call
that computes 35 tokens over ~950 cached ones then attends in 35 queries, not 64 (the call
0.83x in bfloat16, 0.93x in float32, 0.90x with AVX2 kernels; a one-token pass 0.84-0.93x:
``benchmarks/bench_tails.py``).

``lane_sdpa`` is the ordinary arithmetic over the same lanes: one fused call for all lanes,
keys padded only to a multiple of 64; faster for a batch, and not invariant.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from judge.batch_invariant import kernel_setting, runs_in_words

__all__ = [
    "KEY_BLOCK",
    "QUERY_BLOCK",
    "Blocking",
    "Lanes",
    "blocked_attention",
    "lane_sdpa",
    "measured_blocking",
]

log = logging.getLogger("judge")

# Queries per block of the ordinary arithmetic's layout, and the invariant arithmetic's first
# candidate; the others are tried in order where a slot of the first gives other bits (a
# multiple of 6 first: AVX2 kernels compute rows six at a time, and a tail of 1-3 otherwise).
QUERY_BLOCK = 32
QUERY_CANDIDATES = (32, 24, 16, 8, 1)
# The fused kernel's block of keys: a call that needs more keys than the short counts below
# it is padded to a multiple of it.
KEY_BLOCK = 512
# The key counts below KEY_BLOCK a call may read instead, where measured to give the bits of
# KEY_BLOCK keys: multiples of KEY_STEP from MIN_KEYS. A ~100-token judgment then reads 128
# keys instead of 512 (its attention 3.7x faster, AVX2 kernels on an Intel Xeon).
KEY_STEP = 16
MIN_KEYS = 128
SHORT_CANDIDATES = tuple(range(MIN_KEYS, KEY_BLOCK, KEY_STEP))
# Keys are padded to a multiple of this in the ordinary arithmetic.
ORDINARY_KEY_BLOCK = 64


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


@dataclass(frozen=True)
class Blocking:
    """How the batch-invariant attention cuts its calls: ``queries`` per block, and the key
    counts below ``KEY_BLOCK`` (ascending) a block that needs few keys may read (``short``);
    a block that needs more than the largest reads a multiple of ``KEY_BLOCK``, like any.
    ``tails``: the query counts below ``queries`` (ascending) at which a block gives each query
    the bits a whole block gives it, so that a lane's last, partial block is computed in the
    smallest that holds its queries instead of padded to a whole one."""

    queries: int = QUERY_BLOCK
    short: tuple[int, ...] = SHORT_CANDIDATES
    tails: tuple[int, ...] = ()

    def last(self, n: int) -> int:
        """The queries a lane's last block of ``n`` real queries is computed in."""
        return next((t for t in self.tails if t >= n), self.queries)

    def keys(self, n: int) -> int:
        """The keys a block of queries that needs the first ``n`` keys of its lane reads."""
        for size in self.short:
            if size >= n:
                return size
        return _round_up(n, KEY_BLOCK)

    def describe(self) -> str:
        """The short key counts in words: runs of KEY_STEP, as "128-256, 384"; and the
        tails, as "a lane's last block in 4-31 queries"."""
        tails = (
            f"; a lane's last block in {runs_in_words(self.tails)} queries" if self.tails else ""
        )
        if not self.short:
            return f"keys in blocks of {KEY_BLOCK}{tails}"
        spans = runs_in_words(self.short, KEY_STEP)
        return (
            f"short blocks read {spans} keys (steps of {KEY_STEP}), longer multiples of "
            f"{KEY_BLOCK}{tails}"
        )


_MEASURED: dict[tuple[object, ...], Blocking] = {}


def measured_blocking(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> Blocking:
    """The ``Blocking`` under which the fused kernel gives a query the same bits wherever it
    sits, measured on this machine for these head shapes, in ``dtype``, at this number of
    threads (once per process and shape, ~0.3 s): the first of ``QUERY_CANDIDATES`` whose
    every slot gives the same bits over one and two blocks of ``KEY_BLOCK`` keys, and the
    short key counts at which, too, every slot gives the same bits, and those of ``KEY_BLOCK``
    keys to every query that may read them (``_short_keys_hold``), and the smaller blocks that
    give a query the bits of a whole one (``_tails``).

    Which short counts hold is the CPU's: on an Intel Xeon every count from 128 to 256 did
    (AVX-512 and AVX2 kernels); on an AMD EPYC only some do (float32: 128 to 192 and 384 up;
    the fused kernel's products over keys are MKL's, whose blocking of them is not Intel's
    there)."""
    key = (heads, kv_heads, head_dim, dtype, *kernel_setting())
    if key not in _MEASURED:
        g = torch.Generator().manual_seed(0)
        q = torch.randn(1, heads, max(QUERY_CANDIDATES), head_dim, generator=g).to(dtype)
        k = torch.randn(1, kv_heads, 2 * KEY_BLOCK, head_dim, generator=g).to(dtype)
        v = torch.randn(1, kv_heads, 2 * KEY_BLOCK, head_dim, generator=g).to(dtype)
        # The last candidate, one query, holds by definition: its block has one slot.
        queries = next(
            b
            for b in QUERY_CANDIDATES
            if all(_slots_hold(q[:, :, :b], k, v, s) for s in (KEY_BLOCK, 2 * KEY_BLOCK))
        )
        block = q[:, :, :queries]
        short = tuple(
            size
            for size in SHORT_CANDIDATES
            if _short_keys_hold(block, k, v, size) and _slots_hold(block, k, v, size)
        )
        if short != SHORT_CANDIDATES:
            log.info("attention: %s here", Blocking(queries, short).describe())
        reads = (short[:1] or (KEY_BLOCK,)) + (KEY_BLOCK, 2 * KEY_BLOCK)
        tails = _tails(block, k, v, reads)
        _MEASURED[key] = Blocking(queries=queries, short=short, tails=tails)
    return _MEASURED[key]


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
    """Attention of q (1, Hq, B, D) over the first S keys of k and v, each query seeing its
    first ``seen`` (B,) of them: the call ``blocked_attention`` makes."""
    S = k.shape[2]
    mask = (torch.arange(S)[None, :] < seen[:, None])[None, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.125, enable_gqa=True)


def _slots_hold(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: int) -> bool:
    """Whether each query gets the same bits at every slot of its block, over ``keys`` keys."""
    B = q.shape[2]
    seen = torch.arange(B) * (keys - 1) // max(B - 1, 1) + 1  # from 1 key to all of them
    k, v = k[:, :, :keys], v[:, :, :keys]
    want = _sdpa(q, k, v, seen)
    return all(
        torch.equal(_sdpa(q.roll(s, 2), k, v, seen.roll(s)), want.roll(s, 2)) for s in range(1, B)
    )


def _tails(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, reads: Sequence[int]
) -> tuple[int, ...]:
    """The query counts below the block ``q``'s at which a block gives each query the bits the
    whole block gives it, at each of ``reads`` key counts: the block's queries cut into
    blocks of that count from the first, and its last ones, each seeing from one key to all
    of them. With AVX2 kernels (and AVX-512 ones, on an AMD EPYC) 4 to 31 of 32 did; 1 to 3
    did not (those kernels compute a tail of 1-3 rows another way). Every query is tried, not
    only the first and last few: in bfloat16 a tail that sums otherwise shows it on few queries
    once rounded (one query in three or four, for one-query tails on an Intel Xeon with AMX),
    and a check of the first and last took the one-query tail on some draws."""
    B = q.shape[2]
    holding = set(range(1, B))
    for keys in reads:
        seen = torch.arange(B) * (keys - 1) // max(B - 1, 1) + 1
        kk, vv = k[:, :, :keys], v[:, :, :keys]
        want = _sdpa(q, kk, vv, seen)
        for t in sorted(holding):
            for a in sorted({*range(0, B - t + 1, t), B - t}):
                got = _sdpa(q[:, :, a : a + t], kk, vv, seen[a : a + t])
                if not torch.equal(got, want[:, :, a : a + t]):
                    holding.discard(t)
                    break
    return tuple(sorted(holding))


def _short_keys_hold(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, size: int) -> bool:
    """Whether a block of queries that reads ``size`` keys gets the bits of ``KEY_BLOCK`` and
    ``2 KEY_BLOCK`` keys, for each need that reads ``size`` (one key more than the count below
    it, up to ``size``) and the queries of a block seeing from one key to all it needs."""
    B = q.shape[2]
    for need in (size - KEY_STEP + 1, size):
        seen = torch.arange(B) * (need - 1) // max(B - 1, 1) + 1
        outs = [_sdpa(q, k[:, :, :S], v[:, :, :S], seen) for S in (size, KEY_BLOCK)]
        outs.append(_sdpa(q, k, v, seen))
        if not all(torch.equal(o, outs[0]) for o in outs[1:]):
            return False
    return True


@dataclass(frozen=True)
class _Call:
    """One fused call of the invariant arithmetic: the query slots [start, stop) of one lane,
    in blocks of B (a whole block, or a lane's last in ``Blocking.last`` queries), over the
    lane's first ``keys`` keys."""

    lane: int
    start: int
    stop: int
    queries: torch.Tensor  # (stop - start,) long: fed indices (padding: 0)
    visible: torch.Tensor  # ((stop - start) / B, 1, B, keys) bool
    keys: int


@dataclass(frozen=True)
class Lanes:
    """Which keys each lane holds and which queries read it, for one pass.

    Keys are indices into the pass's key bank, per layer the concatenation of every row's
    cached past, the fed tokens' own keys and ``pad_keys`` zero keys (the padding); queries are
    indices into the fed tokens (a padding slot reads query 0, and its result is never read).
    """

    key_index: torch.Tensor  # (L, S) long
    query_index: torch.Tensor  # (L, Q) long, Q a multiple of the block of queries
    visible: torch.Tensor  # (L, Q, S) bool: the query may see the key
    n_fed: int
    # The invariant arithmetic's calls, and each fed token's row in their outputs, one call
    # after the other; without a blocking, each fed token's row in the (L * Q) lane outputs.
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
        blocking: Blocking | None = Blocking(),
    ) -> Lanes:
        """``lanes``: per lane, its keys (bank indices), its queries (fed indices) and which
        keys each query sees, (queries, keys) bool. Every fed token is the query of exactly
        one lane, and every query sees at least one key. ``blocking``: laid out for
        ``blocked_attention`` in these blocks, else (None) for ``lane_sdpa``."""
        longest = max(len(k) for k, _, _ in lanes)
        S = blocking.keys(longest) if blocking else _round_up(longest, ORDINARY_KEY_BLOCK)
        block = blocking.queries if blocking else QUERY_BLOCK
        Q = _round_up(max(len(q) for _, q, _ in lanes), block)
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
        if blocking:
            for lane, (_, queries, _) in enumerate(lanes):
                for call in _calls(lane, visible[lane], query_index[lane], len(queries), blocking):
                    calls.append(call)
                    rows.append(slot[lane, call.start : call.stop])
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
            _Call(c.lane, c.start, c.stop, c.queries.to(device), c.visible.to(device), c.keys)
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


def _calls(
    lane: int, seen: torch.Tensor, queries: torch.Tensor, n: int, blocking: Blocking
) -> list[_Call]:
    """The calls for one lane's first ``n`` queries: runs of whole query blocks that read the
    same number of keys (``blocking.keys``), and the last, partial block in a call of its own
    where a tail holds its queries (``blocking.last``)."""
    B = blocking.queries
    whole, rest = divmod(n, B)
    tail = blocking.last(rest) if rest else 0
    if tail == B:  # no tail holds it: a whole block, its padding included
        whole, tail = whole + 1, 0
    S = seen.shape[1]
    by_block = seen[: whole * B].view(whole, B, S).any(dim=1)
    needed = [blocking.keys(int(b.nonzero()[-1]) + 1) for b in by_block]
    out: list[_Call] = []
    first = 0
    for i in range(1, whole + 1):
        if i == whole or needed[i] != needed[first]:
            out.append(_call(lane, seen, queries, first * B, i * B, B, needed[first]))
            first = i
    if tail:
        start = whole * B
        keys = blocking.keys(int(seen[start : start + tail].any(dim=0).nonzero()[-1]) + 1)
        out.append(_call(lane, seen, queries, start, start + tail, tail, keys))
    return out


def _call(
    lane: int, seen: torch.Tensor, queries: torch.Tensor, start: int, stop: int, B: int, keys: int
) -> _Call:
    """The call for a lane's query slots [start, stop), in blocks of ``B``, over ``keys``."""
    window = seen[start:stop, :keys]
    return _Call(
        lane=lane,
        start=start,
        stop=stop,
        queries=queries[start:stop].clone(),
        visible=window.reshape((stop - start) // B, 1, B, keys).clone(),
        keys=keys,
    )


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
        blocks, _, B, _ = call.visible.shape
        qc = q.index_select(0, call.queries).view(blocks, B, Hq, D).transpose(1, 2)
        # The lane's keys, shared (stride 0) by the call's query blocks.
        kc = keys[call.lane : call.lane + 1, :, : call.keys].expand(blocks, -1, -1, -1)
        vc = values[call.lane : call.lane + 1, :, : call.keys].expand(blocks, -1, -1, -1)
        out = F.scaled_dot_product_attention(
            qc, kc, vc, attn_mask=call.visible, scale=scale, enable_gqa=True
        )  # (blocks, Hq, Bq, D)
        outs.append(out.transpose(1, 2).reshape(blocks * B, Hq * D))
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
