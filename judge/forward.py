"""One forward pass over a batch of packed tries.

A batch row is a tree of tokens: a trie's context followed by its tree tokens, or several
tries' common context followed by each trie's own branch. Every token attends to its
ancestors and itself and sits at the position it would have in its own path, so every
branching node is scored exactly as a separate forward pass over its path would score it,
but each shared prefix is computed once. Rows are left-padded into one batch; a padding token
attends only to itself so that no softmax row is empty.

Logits are computed only where they are read: at each scored node, the vocabulary rows of its
children; at the root, the full vocabulary once, for the probability mass on the choices.

With a prefix cache (``judge.prefix_cache``), each row's leading plain-causal tokens are looked
up first; the cached keys and values go in as the model's past, right-aligned per row, and only
the rest of the row is fed, at the same positions it would have had. Every fed token attends to
its row's whole cached prefix (all of it is its ancestry) and to its ancestors among the fed
tokens. The pass returns its own keys and values, and the row's plain prefix is stored back.

Two decoders run the pass. For Llama-family models, ``judge.decoder``'s lean pass: the rows'
fed tokens laid end to end, each query reading its lane of keys (``judge.attention``): its row's
cached past, its chain and its own trie's branch. For any other causal LM, the model's own
decoder over left-padded rows with a 4-D mask (sliding windows included). Both are exact.

With ``batch_invariant`` (the default) a token's numbers do not depend on the other rows, the
padding or the cache split, so an item's judgment is the same in any pass: the lean pass runs
fixed-shape products and blocked attention, the generic one runs the decoder, the prefill and
the root's vocabulary-wide product under ``judge.batch_invariant.invariant_ops``.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
from transformers import DynamicCache

from judge.attention import Blocking, Lanes
from judge.batch_invariant import ROOT_ROWS, invariant_ops, span_mean
from judge.prefix_cache import Block, PrefixCache
from judge.trie import ChoiceTrie, common_prefix_length

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from judge.decoder import LeanDecoder

__all__ = ["TrieScores", "prefill", "score_rows"]


@dataclass(frozen=True)
class TrieScores:
    """The logits one item needs, as float64 numpy arrays."""

    node_logits: list[np.ndarray]  # per scored node: (n_children,) logits of its children
    root_mass: float  # full-vocabulary probability of the root's children
    cached_tokens: int = 0  # leading tokens of its row read from the prefix cache
    # Per requested layer: the (H,) float32 hidden state at the root (the decision point).
    features: dict[int, np.ndarray] = field(default_factory=dict)
    # Per requested span layer: the (H,) float32 mean of the hidden states over the trie's span.
    span_means: dict[int, np.ndarray] = field(default_factory=dict)


@dataclass(frozen=True)
class _Row:
    """One batch row: a tree of tokens, each attending to its ancestors and itself."""

    tokens: list[int]
    parents: list[int]  # index of each token's parent in the row, -1 for the first
    positions: list[int]  # position id: the token's depth in its path
    chain: int  # tokens[:chain] form a plain causal chain
    query_rows: list[list[int]]  # per trie, per scored node: where its logits are read
    # Per trie, the (start, end) of its branch: its own context after the chain, then its tree.
    branches: list[tuple[int, int]]
    # Per trie, where the tokens of its span sit in the row (None: it asks for no mean).
    spans: list[list[int] | None]


def _row(tries: Sequence[ChoiceTrie]) -> _Row:
    """Pack tries into one row: their common context once, then each trie's own branch."""
    shared = len(tries[0].context)
    for t in tries[1:]:
        shared = min(shared, common_prefix_length(tries[0].context, t.context))
    tokens = list(tries[0].context[:shared])
    parents = list(range(-1, shared - 1))
    positions = list(range(shared))
    query_rows = []
    branches = []
    spans: list[list[int] | None] = []
    for t in tries:
        start = len(tokens)
        # A context token sits in the shared chain, or after it in the trie's own branch.
        spans.append(
            None
            if t.span is None
            else [i if i < shared else start + i - shared for i in range(*t.span)]
        )
        last = shared - 1  # the trie's last context token, where its root is read
        for token in t.context[shared:]:
            tokens.append(token)
            parents.append(last)
            positions.append(positions[last] + 1 if last >= 0 else 0)
            last = len(tokens) - 1
        base = len(tokens)
        for token, parent in zip(t.tree_tokens, t.tree_parents, strict=True):
            at = last if parent < 0 else base + parent
            tokens.append(token)
            parents.append(at)
            positions.append(positions[at] + 1)
        query_rows.append([last if p < 0 else base + p for p in t.node_positions])
        branches.append((start, len(tokens)))
    return _Row(tokens, parents, positions, shared, query_rows, branches, spans)


def _cut(row: _Row, cached: int) -> _Row:
    """The row without its first ``cached`` tokens, which come from the cache as the past.

    Only plain-chain tokens are cut, and never the last one (``cached < chain``), so every
    read position stays in the row; a parent index of -1 now means the past's last token.
    No span is cut either (``_Feed.of`` reads the cache only up to the first span).
    """
    if cached == 0:
        return row
    return _Row(
        tokens=row.tokens[cached:],
        parents=[p - cached if p >= cached else -1 for p in row.parents[cached:]],
        positions=row.positions[cached:],
        chain=row.chain - cached,
        query_rows=[[q - cached for q in qs] for qs in row.query_rows],
        branches=[(a - cached, b - cached) for a, b in row.branches],
        spans=[None if s is None else [i - cached for i in s] for s in row.spans],
    )


@dataclass(frozen=True)
class _Feed:
    """A pass's rows, what the prefix cache holds of each, and what is left to feed."""

    full: list[_Row]  # each row whole
    chains: list[list[Block]]  # each row's cached blocks of its plain prefix
    past: list[int]  # each row's cached tokens: the first ``past[b]`` of its chain
    fed: list[_Row]  # each row without its cached tokens: what the pass computes

    @classmethod
    def of(cls, rows: Sequence[Sequence[ChoiceTrie]], cache: PrefixCache | None) -> _Feed:
        full = [_row(r) for r in rows]
        # The last chain token is always fed: a root may be read there. So is every span's
        # first token and all after it: the mean reads their hidden states, which the cache
        # does not keep.
        chains = [cache.lookup(r.tokens, _feed_from(r)) if cache else [] for r in full]
        block = cache.block_tokens if cache else 0
        past = [len(c) * block for c in chains]
        fed = [_cut(r, p) for r, p in zip(full, past, strict=True)]
        return cls(full, chains, past, fed)


def _feed_from(row: _Row) -> int:
    """The first token of ``row`` that must be fed: its last chain token, or the first token of
    a span, if earlier."""
    return min([row.chain - 1, *(s[0] for s in row.spans if s)])


@dataclass(frozen=True)
class _Packed:
    input_ids: torch.Tensor  # (B, T)
    position_ids: torch.Tensor | None  # (B, T)
    # (B, 1, T, P + T) additive; per layer type where some layers see a sliding window only
    attention_mask: torch.Tensor | dict[str, torch.Tensor] | None
    query_rows: list[list[list[int]]]  # per row, per trie, per scored node: flat index b*T+t
    spans: list[list[int] | None]  # per trie (all rows'), its span's tokens: flat index b*T+t


def _pack(
    rows: Sequence[_Row],
    pad_id: int,
    dtype: torch.dtype,
    device: torch.device,
    past: Sequence[int] = (),
    window: int | None = None,
    layer_types: Sequence[str] = (),
) -> _Packed:
    """Left-pad rows into one batch; ``past[b]`` cached tokens precede row b (right-aligned
    in P = max(past) slots of the model's past). With a sliding ``window``, the mask of a
    sliding-attention layer (all layers, without ``layer_types``) also hides every key
    ``window`` or more positions back: transformers takes a 4-D mask as it is given."""
    T = max(len(r.tokens) for r in rows)
    B = len(rows)
    past = list(past) or [0] * B
    P = max(past)
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    query_rows = []
    spans: list[list[int] | None] = []
    for b, r in enumerate(rows):
        offset = T - len(r.tokens)  # left padding
        ids[b, offset:] = torch.tensor(r.tokens)
        query_rows.append([[b * T + offset + q for q in qs] for qs in r.query_rows])
        spans += [None if s is None else [b * T + offset + i for i in s] for s in r.spans]

    if all(r.chain == len(r.tokens) == T for r in rows) and all(p == P for p in past):
        # Nothing to pack, nothing padded and the same past everywhere: the model's own causal
        # path (after its past, at the positions that follow it), as a bare pass takes.
        return _Packed(ids.to(device), None, None, query_rows, spans)

    positions = torch.zeros((B, T), dtype=torch.long)
    allowed = torch.zeros((B, T, P + T), dtype=torch.bool)
    for b, r in enumerate(rows):
        o, n = T - len(r.tokens), r.chain
        positions[b, o:] = torch.tensor(r.positions)
        # Every fed token descends from the whole cached prefix of its row.
        allowed[b, o:, P - past[b] : P] = True
        c = P + o  # the row's first fed token, as a key column
        allowed[b, o : o + n, c : c + n] = torch.ones(n, n, dtype=torch.bool).tril()
        for i in range(n, len(r.tokens)):
            # A token sees what its parent sees, plus itself.
            if r.parents[i] >= 0:
                allowed[b, o + i] = allowed[b, o + r.parents[i]]
            allowed[b, o + i, c + i] = True
        pad = torch.arange(o)
        allowed[b, pad, P + pad] = True  # padding sees itself only, so no softmax row is empty
    mask = _additive(allowed, dtype).to(device)
    if window is None:
        return _Packed(ids.to(device), positions.to(device), mask, query_rows, spans)
    key_positions = torch.zeros((B, P + T), dtype=torch.long)
    for b in range(B):
        key_positions[b, P - past[b] : P] = torch.arange(past[b])
    key_positions[:, P:] = positions
    # (B, T, P + T); padding sits at position 0 and its own key too, so it still sees itself.
    near = positions[:, :, None] - key_positions[:, None, :] < window
    windowed = _additive(allowed & near, dtype).to(device)
    masks: torch.Tensor | dict[str, torch.Tensor] = windowed
    if layer_types:
        masks = {t: windowed if t == "sliding_attention" else mask for t in set(layer_types)}
    return _Packed(ids.to(device), positions.to(device), masks, query_rows, spans)


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(B, T, K) bool -> (B, 1, T, K): 0 where allowed, the dtype's minimum where not."""
    mask = torch.zeros((allowed.shape[0], 1, *allowed.shape[1:]), dtype=dtype)
    return mask.masked_fill_(~allowed[:, None], torch.finfo(dtype).min)


def _finish_logits(model: PreTrainedModel, logits: torch.Tensor) -> torch.Tensor:
    """Apply the output transforms some architectures put after the LM head."""
    config = model.config
    scale = getattr(config, "logit_scale", None)  # Cohere multiplies
    if isinstance(scale, int | float):
        logits = logits * scale
    scaling = getattr(config, "logits_scaling", None)  # Granite divides
    if isinstance(scaling, int | float):
        logits = logits / scaling
    cap = getattr(config, "final_logit_softcapping", None)  # Gemma 2 and 3
    if isinstance(cap, int | float) and cap > 0:
        logits = torch.tanh(logits / cap) * cap
    return logits


@torch.inference_mode()
def score_rows(
    model: PreTrainedModel,
    rows: Sequence[Sequence[ChoiceTrie]],
    pad_id: int,
    cache: PrefixCache | None = None,
    layers: Sequence[int] = (),
    batch_invariant: bool = True,
    lean: LeanDecoder | None = None,
    span_layers: Sequence[int] = (),
) -> list[list[TrieScores]]:
    """One forward pass; each batch row packs the tries of one inner list, sharing their
    common context. Returns the logits each trie needs, in the same nesting, and each trie's
    hidden state at its root for every one of ``layers`` (1..num_hidden_layers), and for each
    of ``span_layers`` the mean over its span where it has one. ``lean``: the model's
    ``judge.decoder`` pass, else the model's own decoder runs it."""
    head = model.get_output_embeddings()
    W = head.weight  # (V, H)
    bias = getattr(head, "bias", None)
    feed = _Feed.of(rows, cache)

    tries = [t for r in rows for t in r]
    # Each trie's root, the first of its scored nodes: the decision point.
    first_node = np.cumsum([0] + [len(t.node_positions) for t in tries[:-1]]).tolist()
    asked = _Asked(layers, first_node, span_layers if any(t.span for t in tries) else ())
    if lean is None:
        h, gathered, means = _generic_pass(model, feed, cache, pad_id, batch_invariant, asked)
    else:  # its arithmetic is the LeanDecoder's own, and it pads nothing
        h, gathered, means = _lean_pass(lean, model, feed, cache, asked)
    features = {n: g.cpu().numpy() for n, g in gathered.items()}  # each (N, H) float32
    # Per span layer, (n_spans, H): the tries with a span, in order.
    spanned = {n: iter(m.cpu().numpy()) for n, m in means.items()}
    span_means = [{n: next(it) for n, it in spanned.items()} if t.span else {} for t in tries]

    children = [c for t in tries for c in t.node_children]
    counts = torch.tensor([len(c) for c in children], device=h.device)
    child_ids = torch.tensor([tok for c in children for tok in c], device=h.device)
    # Children's rows only, in float64 whatever the model dtype: these logits are the result,
    # and a float64 sum rounds the same whatever order the kernel takes.
    h_rep = h.double().repeat_interleave(counts, dim=0)  # (C, H)
    child_logits = (h_rep * W[child_ids].double()).sum(-1)  # (C,)
    if bias is not None:
        child_logits = child_logits + bias[child_ids].double()
    child_logits = _finish_logits(model, child_logits)

    # The full vocabulary only at each root, for choice_mass.
    # A pass has one root per row, not one per token: a small chunk for the vocabulary-wide
    # product keeps a lone root from paying for ROWS of them.
    if lean is not None:
        vocabulary = lean.head(h[first_node])  # (N, V)
    else:
        with invariant_ops(ROOT_ROWS) if batch_invariant else contextlib.nullcontext():
            vocabulary = head(h[first_node])
    root_logits = _finish_logits(model, vocabulary).float()  # (N, V)
    root_logprobs = torch.log_softmax(root_logits, dim=-1)  # (N, V)

    flat = child_logits.double().cpu().numpy()
    scores = []
    start = 0
    # Per trie: its row's past.
    cached = [p for r, p in zip(rows, feed.past, strict=True) for _ in r]
    for n, t in enumerate(tries):
        node_logits = []
        for c in t.node_children:
            node_logits.append(flat[start : start + len(c)])
            start += len(c)
        root_children = torch.tensor(t.node_children[0], device=root_logprobs.device)
        mass = float(torch.logsumexp(root_logprobs[n, root_children], dim=0).exp())
        # Rounding can push a mass of one a hair above it.
        scores.append(
            TrieScores(
                node_logits=node_logits,
                root_mass=min(mass, 1.0),
                cached_tokens=cached[n],
                features={layer: f[n] for layer, f in features.items()},
                span_means=span_means[n],
            )
        )
    nested, k = [], 0
    for r in rows:
        nested.append(scores[k : k + len(r)])
        k += len(r)
    return nested


@dataclass(frozen=True)
class _Asked:
    """The hidden states a pass returns besides the logits."""

    layers: Sequence[int]  # at the roots
    first_node: Sequence[int]  # each trie's root: its first scored node
    span_layers: Sequence[int]  # averaged over each span


def _span_means(states: torch.Tensor, spans: Sequence[Sequence[int] | None]) -> torch.Tensor:
    """(n_spans, H): the mean of each span's rows of ``states`` (all the spans' rows, in
    order, (sum of lengths, H)), for the spans that are not None."""
    lengths = [len(s) for s in spans if s is not None]
    return torch.stack([span_mean(part) for part in states.split(lengths)])


def _generic_pass(
    model: PreTrainedModel,
    feed: _Feed,
    cache: PrefixCache | None,
    pad_id: int,
    batch_invariant: bool,
    asked: _Asked,
) -> tuple[torch.Tensor, dict[int, torch.Tensor], dict[int, torch.Tensor]]:
    """The model's own decoder over left-padded rows with a 4-D mask: any causal LM. Returns
    the final hidden state at each scored node (S, H), each requested layer's at the roots and
    each span layer's means over the spans."""
    W = model.get_output_embeddings().weight
    window = getattr(model.config, "sliding_window", None)
    types = getattr(model.config, "layer_types", None) or ()
    packed = _pack(feed.fed, pad_id, W.dtype, W.device, feed.past, window, types)
    flat_rows = [q for per_row in packed.query_rows for per_trie in per_row for q in per_trie]
    root_rows = torch.tensor([flat_rows[i] for i in asked.first_node], device=W.device)  # (N,)
    span_rows = torch.tensor([i for s in packed.spans if s for i in s], device=W.device)
    decoder = model.get_decoder()
    last = _num_layers(model)
    inner = [n for n in asked.layers if n != last]  # the last layer is read below
    inner_spans = [n for n in asked.span_layers if n != last]
    exact = invariant_ops() if batch_invariant else contextlib.nullcontext()
    with (
        exact,
        _gather_rows(decoder, last, inner, root_rows) as gathered,
        _gather_rows(decoder, last, inner_spans, span_rows) as span_states,
    ):
        out = decoder(
            input_ids=packed.input_ids,
            attention_mask=packed.attention_mask,
            position_ids=packed.position_ids,
            use_cache=cache is not None,
            **_past(decoder, cache, feed.chains, W.device),
        )
    if cache is not None:
        _store(cache, out, feed, packed.input_ids.shape[1])
    hidden = out.last_hidden_state.flatten(0, 1)  # (B*T, H)
    if len(inner) < len(asked.layers):
        gathered[last] = hidden[root_rows].float()  # (N, H)
    if len(inner_spans) < len(asked.span_layers):
        span_states[last] = hidden[span_rows]
    means = {n: _span_means(s, packed.spans) for n, s in span_states.items()}
    return hidden[flat_rows], gathered, means


def _lean_pass(
    lean: LeanDecoder,
    model: PreTrainedModel,
    feed: _Feed,
    cache: PrefixCache | None,
    asked: _Asked,
) -> tuple[torch.Tensor, dict[int, torch.Tensor], dict[int, torch.Tensor]]:
    """``judge.decoder``'s pass over the rows laid end to end, each query reading its lane.
    Returns what ``_generic_pass`` does."""
    device = model.get_output_embeddings().weight.device
    fed, past = feed.fed, feed.past
    offsets = np.cumsum([0] + [len(r.tokens) for r in fed]).tolist()
    flat_rows = [
        offsets[b] + q for b, r in enumerate(fed) for per_trie in r.query_rows for q in per_trie
    ]
    read = torch.tensor(flat_rows, device=device)  # (S,)
    roots = read[torch.tensor(asked.first_node, device=device)]  # (N,)
    spans = [
        torch.tensor([offsets[b] + i for i in s], device=device)
        for b, r in enumerate(fed)
        for s in r.spans
        if s is not None
    ]
    ids = torch.tensor([t for r in fed for t in r.tokens], device=device)
    positions = torch.tensor([p for r in fed for p in r.positions], device=device)
    lanes = _lanes(fed, past, offsets, lean.blocking).to(device)
    kv = cache.concatenated(feed.chains) if cache is not None and any(feed.chains) else None
    inner = [n for n in asked.layers if n != _num_layers(model)]  # the last layer is read below
    out = lean.run(
        ids,
        positions,
        lanes,
        kv,
        read,
        roots,
        inner,
        keep_kv=cache is not None,
        spans=spans,
        span_layers=asked.span_layers,
    )
    if cache is not None and out.kv is not None:
        for b, row in enumerate(feed.full):
            new = row.chain - past[b]  # its plain-prefix tokens computed in this pass
            start = offsets[b]
            layer_kv = [(k[:, start : start + new], v[:, start : start + new]) for k, v in out.kv]
            cache.store(row.tokens[: row.chain], feed.chains[b], layer_kv)
    gathered = dict(out.features)
    if len(inner) < len(asked.layers):
        gathered[_num_layers(model)] = out.hidden[list(asked.first_node)].float()  # (N, H)
    return out.hidden, gathered, out.span_means


def _lanes(
    fed: Sequence[_Row], past: Sequence[int], offsets: Sequence[int], blocking: Blocking | None
) -> Lanes:
    """Each row's lanes (``judge.attention``): per trie, the row's past and chain, then the
    trie's branch. The chain's queries read the first lane, each branch's its own. Keys index
    the bank of every row's past (in row order), then every fed token, then a zero key."""
    total_past = sum(past)
    past_start = np.cumsum([0, *past]).tolist()
    lanes = []
    for b, row in enumerate(fed):
        seen = _ancestry(row, past[b])  # (n, P + n)
        fed_key = total_past + offsets[b]  # the bank index of the row's first fed token
        chain_keys = list(range(past_start[b], past_start[b] + past[b]))
        chain_keys += range(fed_key, fed_key + row.chain)
        chain_cols = list(range(past[b] + row.chain))
        for j, (start, end) in enumerate(row.branches):
            queries = list(range(start, end)) if j else [*range(row.chain), *range(start, end)]
            cols = chain_cols + list(range(past[b] + start, past[b] + end))
            keys = chain_keys + list(range(fed_key + start, fed_key + end))
            visible = seen[queries][:, cols]
            lanes.append((keys, [offsets[b] + q for q in queries], visible))
    return Lanes.build(lanes, offsets[-1], pad_key=total_past + offsets[-1], blocking=blocking)


def _ancestry(row: _Row, past: int) -> torch.Tensor:
    """(n, past + n) bool: which of the row's cached and fed tokens each fed token attends to
    (its ancestors and itself)."""
    n, c = len(row.tokens), row.chain
    seen = torch.zeros((n, past + n), dtype=torch.bool)
    seen[:, :past] = True  # every fed token descends from the whole cached prefix
    seen[:c, past : past + c] = torch.ones(c, c, dtype=torch.bool).tril()
    for i in range(c, n):
        # A token sees what its parent sees, plus itself.
        if row.parents[i] >= 0:
            seen[i] = seen[row.parents[i]]
        seen[i, past + i] = True
    return seen


def _num_layers(model: PreTrainedModel) -> int:
    return int(model.config.num_hidden_layers)


def _blocks(decoder: torch.nn.Module, count: int) -> torch.nn.ModuleList:
    """The decoder's list of blocks: ``layers`` in most models (``h`` in GPT-2 and others)."""
    for child in decoder.children():
        if isinstance(child, torch.nn.ModuleList) and len(child) == count:
            return child
    raise NotImplementedError(
        f"{type(decoder).__name__} has no list of {count} blocks to read hidden states from"
    )


@contextlib.contextmanager
def _gather_rows(
    decoder: torch.nn.Module, num_layers: int, layers: Sequence[int], rows: torch.Tensor
) -> Iterator[dict[int, torch.Tensor]]:
    """While in the block, each of ``layers`` (1-based) gives its output's ``rows`` of the
    flattened (B*T, H) hidden states, in float32: only the rows read are kept, never the
    full sequence of every layer that ``output_hidden_states`` would hold."""
    gathered: dict[int, torch.Tensor] = {}
    if not layers:
        yield gathered
        return
    blocks = _blocks(decoder, num_layers)
    # The hooks sit on the shared model while they are registered: a pass that another thread
    # runs meanwhile fires them too, and must not write its rows into this call's features.
    owner = threading.get_ident()

    def keep(layer: int) -> object:
        def hook(module: torch.nn.Module, args: object, output: object) -> None:
            if threading.get_ident() != owner:
                return
            h = output[0] if isinstance(output, tuple) else output
            assert isinstance(h, torch.Tensor)
            gathered[layer] = h.flatten(0, 1)[rows].float()  # (N, H)

        return hook

    handles = [blocks[n - 1].register_forward_hook(keep(n)) for n in layers]  # type: ignore[arg-type]
    try:
        yield gathered
    finally:
        for handle in handles:
            handle.remove()


@torch.inference_mode()
def prefill(
    model: PreTrainedModel,
    tokens: Sequence[int],
    cache: PrefixCache,
    batch_invariant: bool = True,
    lean: LeanDecoder | None = None,
) -> bool:
    """Compute and cache the whole blocks of ``tokens`` (a plain prompt prefix) not cached
    yet, keeping at least one token back (it is where a root may be read). Returns whether a
    pass ran; nothing runs when less than one block would be added."""
    b = cache.block_tokens
    chain = cache.lookup(tokens, len(tokens) - 1)
    end = (len(tokens) - 1) // b * b
    start = len(chain) * b
    if end - start < b:
        return False
    if lean is not None:
        n = end - start
        device = model.get_output_embeddings().weight.device
        causal = torch.ones(n, start + n, dtype=torch.bool).tril(start)
        lanes = Lanes.build([(range(start + n), range(n), causal)], n, start + n, lean.blocking)
        done = lean.run(
            ids=torch.tensor(list(tokens[start:end]), device=device),
            positions=torch.arange(start, end, device=device),
            lanes=lanes.to(device),
            past=cache.concatenated([chain]) if chain else None,
            read=torch.tensor([n - 1], device=device),
            roots=torch.tensor([n - 1], device=device),
            keep_kv=True,
        )
        assert done.kv is not None
        cache.store(tokens[:end], chain, done.kv)
        return True
    decoder = model.get_decoder()
    with invariant_ops() if batch_invariant else contextlib.nullcontext():
        out = decoder(
            input_ids=torch.tensor([list(tokens[start:end])], device=model.device),
            position_ids=torch.arange(start, end, device=model.device)[None],
            use_cache=True,
            **_past(decoder, cache, [chain], model.device),
        )
    layers = _returned_layers(out)
    if layers is None:
        return False
    kv = [(k[0, :, start:end], v[0, :, start:end]) for k, v in layers]
    cache.store(tokens[:end], chain, kv)
    return True


def _past(
    decoder: torch.nn.Module,
    cache: PrefixCache | None,
    chains: Sequence[Sequence[Block]],
    device: torch.device,
) -> dict[str, DynamicCache]:
    """The decoder's keyword argument carrying the rows' cached prefixes as its past (empty
    where nothing is cached); none without a prefix cache. transformers 5 renamed
    ``past_key_values`` to ``cache``.

    Always a cache of our own, without the model's config: given none, the decoder makes one
    from its config, whose sliding-window layers keep only their last ``window`` keys and
    values (Gemma 3), and the prefix cache would store a row's tail as its whole prefix. Ours
    keeps every key; the mask (``_pack``) hides what a sliding layer may not see."""
    if cache is None:
        return {}
    past_kv = DynamicCache()
    if any(chains):
        for i, (keys, values) in enumerate(cache.assemble(chains)[0]):
            past_kv.update(keys.to(device), values.to(device), i)
    names = inspect.signature(decoder.forward).parameters
    return {"cache" if "cache" in names else "past_key_values": past_kv}


def _returned_layers(out: object) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """Per layer, the keys and values a decoder call returns (under either name)."""
    returned = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
    if returned is None:
        return None
    return [(layer.keys, layer.values) for layer in returned.layers]


def _store(cache: PrefixCache, out: object, feed: _Feed, T: int) -> None:
    """Store each row's plain prefix: its keys and values were just computed (or cached)."""
    layers = _returned_layers(out)  # (B, H, P + T, D) each
    if layers is None:
        return
    P = max(feed.past)
    for b, (row, cut) in enumerate(zip(feed.full, feed.fed, strict=True)):
        start = P + T - len(cut.tokens)  # the row's first fed token, as a key column
        new = row.chain - feed.past[b]  # its plain-prefix tokens computed in this pass
        kv = [(k[b, :, start : start + new], v[b, :, start : start + new]) for k, v in layers]
        cache.store(row.tokens[: row.chain], feed.chains[b], kv)
