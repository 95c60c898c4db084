"""A brute-force reference for choice probabilities, written independently of the engine.

For every branching node of the choices' token trie it runs one full forward pass over the
path up to that node (no cache, no packing, full vocabulary) and takes the softmax restricted
to the node's children. It shares no code with ``judge.trie`` or ``judge.forward``.
"""

from __future__ import annotations

import json
import math

import torch

from judge import Judge


def shared_length(a: list[int], b: list[int]) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def reference_probabilities(
    judge: Judge,
    prompt: str,
    choices: list[str],
    *,
    response_prefix: str | None = None,
    response_suffix: str = '"}',
) -> dict[str, float]:
    text = judge.render(prompt, response_prefix=response_prefix)
    tok = judge.tokenizer
    paths = [
        tok(
            text + json.dumps(c, ensure_ascii=False)[1:-1] + response_suffix,
            add_special_tokens=False,
        ).input_ids
        for c in choices
    ]
    prompt_ids = tok(text, add_special_tokens=False).input_ids
    # Constrained decoding starts after the tokens every path shares with each other and
    # with the prompt's own tokenization.
    start = min(shared_length(p, q) for p in paths for q in [*paths, prompt_ids])
    logits_after: dict[tuple[int, ...], torch.Tensor] = {}  # one pass per branching node
    logp = {c: 0.0 for c in choices}
    for c, path in zip(choices, paths, strict=True):
        for k in range(start, len(path)):
            siblings = {p[k] for p in paths if len(p) > k and p[:k] == path[:k]}
            if len(siblings) < 2:
                continue
            node = tuple(path[:k])
            if node not in logits_after:
                with torch.inference_mode():
                    logits_after[node] = judge.model(torch.tensor([node])).logits[0, -1].double()
            logits = logits_after[node]
            allowed = torch.tensor(sorted(siblings))
            restricted = torch.log_softmax(logits[allowed], dim=0)
            logp[c] += float(restricted[allowed.tolist().index(path[k])])
    total = math.log(sum(math.exp(v) for v in logp.values()))
    return {c: math.exp(v - total) for c, v in logp.items()}
