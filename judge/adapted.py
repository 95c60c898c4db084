"""An adapter served in the one pass: its blocks merged into copies, the rest shared.

Serving LoRA unmerged adds two thin products per adapted linear to every pass; merged, the
pass is the model's own (``W + scale B A`` is one weight), so a judgment under an adapter runs
the same code, at the same cost and with the same batch invariance as one without. Only the
adapted blocks are copied (their weights in the model's dtype, and the lean pass's packed
copies of them); the embeddings, the other blocks and the LM head are the base model's own
tensors. ``model_with_blocks`` builds that model; ``Judge`` keeps a bounded table of them
(``MAX_ADAPTERS``), each with a prefix cache of its own, since the keys and values above the
first adapted block are not the base model's.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import torch

from judge.adapters import Adapter

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = [
    "MAX_ADAPTERS",
    "adapter_tensors",
    "merged_blocks",
    "model_with_blocks",
]

# Adapters merged and kept by one engine at once (least recently used out). Each costs its
# blocks once more in the model's dtype and again packed: for the default model, ten of its
# thirty blocks are 35 M parameters, about 71 MB in bfloat16 and 142 MB in float32 (times two
# with the packed copies), plus its own prefix cache.
MAX_ADAPTERS = 4


def adapter_tensors(adapter: Adapter) -> dict[str, torch.Tensor]:
    """The adapter's A and B matrices by name (float32), read from its safetensors bytes."""
    from safetensors.torch import load

    return load(adapter.weights)


def decoder_blocks(model: PreTrainedModel) -> torch.nn.ModuleList:
    """The model's list of decoder blocks."""
    blocks: Any = model.get_decoder().layers
    return blocks


def merged_blocks(model: PreTrainedModel, adapter: Adapter) -> dict[int, torch.nn.Module]:
    """Copies of the adapter's blocks of ``model`` with ``W + scale B A`` in each target's
    weight (computed in float32, stored in the model's dtype); ValueError where the adapter
    does not fit the model's blocks."""
    blocks = decoder_blocks(model)
    if adapter.blocks[-1] >= len(blocks):
        raise ValueError(
            f"adapter {adapter.short} adapts block {adapter.blocks[-1]}, but the model has "
            f"{len(blocks)} blocks"
        )
    tensors = adapter_tensors(adapter)
    merged: dict[int, torch.nn.Module] = {}
    with torch.no_grad():
        for i in adapter.blocks:
            block = copy.deepcopy(blocks[i])
            for target in adapter.targets:
                linear: Any = block.get_submodule(_path(target))
                a, b = tensors[f"{i}.{target}.A"], tensors[f"{i}.{target}.B"]  # (r, in), (out, r)
                w = linear.weight  # (out, in)
                if a.shape != (adapter.rank, w.shape[1]) or b.shape != (w.shape[0], adapter.rank):
                    raise ValueError(
                        f"adapter {adapter.short}'s {i}.{target} is {tuple(b.shape)} x "
                        f"{tuple(a.shape)}, which does not fit a weight of {tuple(w.shape)}"
                    )
                new = w.float() + adapter.scale * (b @ a)  # (out, in)
                # A fresh tensor: the copy's weight may be a view of the base's fused one.
                linear.weight = torch.nn.Parameter(new.to(w.dtype), requires_grad=False)
            merged[i] = block
    return merged


def model_with_blocks(
    model: PreTrainedModel, blocks: dict[int, torch.nn.Module]
) -> PreTrainedModel:
    """A model that runs ``blocks`` in place of those at their indices and shares every other
    module and tensor with ``model`` (which is not changed)."""
    layers = decoder_blocks(model)
    return _with_layers(model, [blocks.get(i, block) for i, block in enumerate(layers)])


def _with_layers(model: PreTrainedModel, layers: list[torch.nn.Module]) -> PreTrainedModel:
    decoder: Any = model.get_decoder()
    name = next(n for n, m in model.named_children() if m is decoder)
    new_decoder = copy.copy(decoder)
    new_decoder._modules = dict(decoder._modules)
    new_decoder.layers = torch.nn.ModuleList(layers)
    new = copy.copy(model)
    new._modules = dict(model._modules)
    setattr(new, name, new_decoder)
    return new


def _path(target: str) -> str:
    """Where a target linear sits in a Llama-family block."""
    return (
        f"self_attn.{target}"
        if target.endswith(("q_proj", "k_proj", "v_proj", "o_proj"))
        else f"mlp.{target}"
    )
