"""One forward pass over a batch of packed tries.

Each item is its context followed by its tree tokens. A tree token attends to the whole
context, to its ancestors in the trie and to itself, and sits at the position it would have
in its own path, so every branching node is scored exactly as a separate forward pass over
its path would score it, but the prompt is computed once. Items are left-padded into one
batch; a padding row attends only to itself so that no softmax row is empty.

Logits are computed only where they are read: at each scored node, the vocabulary rows of its
children; at the root, the full vocabulary once, for the probability mass on the choices.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from judge.trie import ChoiceTrie

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["TrieScores", "score_tries"]


@dataclass(frozen=True)
class TrieScores:
    """The logits one item needs, as float64 numpy arrays."""

    node_logits: list[np.ndarray]  # per scored node: (n_children,) logits of its children
    root_mass: float  # full-vocabulary probability of the root's children


@dataclass(frozen=True)
class _Packed:
    input_ids: torch.Tensor  # (B, T)
    position_ids: torch.Tensor | None  # (B, T)
    attention_mask: torch.Tensor | None  # (B, 1, T, T) additive
    query_rows: list[list[int]]  # per item, per scored node: its row in the padded input


def _pack(
    tries: Sequence[ChoiceTrie], pad_id: int, dtype: torch.dtype, device: torch.device
) -> _Packed:
    T = max(t.packed_length for t in tries)
    B = len(tries)
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    query_rows = []
    for b, t in enumerate(tries):
        offset, r = T - t.packed_length, len(t.context)
        ids[b, offset:] = torch.tensor(t.context + t.tree_tokens)
        query_rows.append([offset + r + p if p >= 0 else offset + r - 1 for p in t.node_positions])

    plain = all(not t.tree_tokens and t.packed_length == T for t in tries)
    if plain:
        # Nothing to pack and nothing padded: the model's own causal path, as a bare pass takes.
        return _Packed(ids.to(device), None, None, query_rows)

    positions = torch.zeros((B, T), dtype=torch.long)
    allowed = torch.zeros((B, T, T), dtype=torch.bool)
    for b, t in enumerate(tries):
        offset, r = T - t.packed_length, len(t.context)
        positions[b, offset : offset + r] = torch.arange(r)
        positions[b, offset + r :] = torch.tensor(t.tree_depths, dtype=torch.long) + (r - 1)
        allowed[b, offset : offset + r, offset : offset + r] = torch.ones(
            r, r, dtype=torch.bool
        ).tril()
        for j, parent in enumerate(t.tree_parents):
            row = offset + r + j
            # A tree token sees what its parent sees, plus itself.
            allowed[b, row] = allowed[b, offset + r + parent if parent >= 0 else offset + r - 1]
            allowed[b, row, row] = True
        pad = torch.arange(offset)
        allowed[b, pad, pad] = True
    mask = torch.zeros((B, 1, T, T), dtype=dtype)
    mask.masked_fill_(~allowed[:, None], torch.finfo(dtype).min)
    return _Packed(ids.to(device), positions.to(device), mask.to(device), query_rows)


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
def score_tries(
    model: PreTrainedModel, tries: Sequence[ChoiceTrie], pad_id: int
) -> list[TrieScores]:
    """Run one forward pass over ``tries`` and return the logits each one needs."""
    head = model.get_output_embeddings()
    W = head.weight  # (V, H)
    bias = getattr(head, "bias", None)
    packed = _pack(tries, pad_id, W.dtype, W.device)

    out = model.get_decoder()(
        input_ids=packed.input_ids,
        attention_mask=packed.attention_mask,
        position_ids=packed.position_ids,
        use_cache=False,
    )
    hidden = out.last_hidden_state  # (B, T, H)

    batch_index = [b for b, rows in enumerate(packed.query_rows) for _ in rows]
    row_index = [row for rows in packed.query_rows for row in rows]
    h = hidden[batch_index, row_index]  # (S, H) one row per scored node

    children = [c for t in tries for c in t.node_children]
    counts = torch.tensor([len(c) for c in children], device=h.device)
    child_ids = torch.tensor([tok for c in children for tok in c], device=h.device)
    # Children's rows only, in float32 whatever the model dtype: these logits are the result.
    h_rep = h.float().repeat_interleave(counts, dim=0)  # (C, H)
    child_logits = (h_rep * W[child_ids].float()).sum(-1)  # (C,)
    if bias is not None:
        child_logits = child_logits + bias[child_ids].float()
    child_logits = _finish_logits(model, child_logits)

    # The full vocabulary only at each root, for choice_mass.
    first_node = np.cumsum([0] + [len(t.node_positions) for t in tries[:-1]]).tolist()
    root_logits = _finish_logits(model, head(h[first_node])).float()  # (B, V)
    root_logprobs = torch.log_softmax(root_logits, dim=-1)  # (B, V)

    flat = child_logits.double().cpu().numpy()
    results = []
    start = 0
    for b, t in enumerate(tries):
        node_logits = []
        for c in t.node_children:
            node_logits.append(flat[start : start + len(c)])
            start += len(c)
        root_children = torch.tensor(t.node_children[0], device=root_logprobs.device)
        mass = float(torch.logsumexp(root_logprobs[b, root_children], dim=0).exp())
        # Rounding can push a mass of one a hair above it.
        results.append(TrieScores(node_logits=node_logits, root_mass=min(mass, 1.0)))
    return results
