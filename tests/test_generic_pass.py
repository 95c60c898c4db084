"""The generic pass end to end, on tiny random models that the lean pass does not cover.

A GPT-2 (learned positions, fused attention projection), a Mistral whose layers see a sliding
window of 16 tokens and a Qwen2 whose second layer alone does (so each layer type gets its own
mask) take transformers' own decoder with the engine's 4-D mask; every prompt here is longer
than the window. In float32 and in bfloat16, with the batch-invariant arithmetic (the default),
an item gets the same bits (probabilities, log-probabilities, choice mass and hidden-state
features) judged alone, in a batch beside longer and shorter items at its first and last slot,
and as one of several questions sharing a context; each gets them on a cold and on a warm
prefix cache too (and in a pass whose rows read cached pasts of other lengths), the windowed
models over cached prefixes longer than their window. Choices
that share leading tokens ("8", "80", "800") make the pass descend the trie past its root. The
brute-force reference (``tests/reference.py``) and transformers' own hidden states agree within
the dtype's rounding.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import msgspec
import numpy as np
import pytest
import torch
from reference import reference_probabilities
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from judge import Judge, Judgment, Query
from judge.engine import shared_query

VOCAB = 49152  # the default tokenizer's ids
WINDOW = 16
SHAPE: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
}
KINDS = ["gpt2", "mistral, sliding window", "qwen2, one sliding layer"]
DTYPES = ["float32", "bfloat16"]
# The reference runs the model's plain pass in its own dtype, without the invariant arithmetic.
REFERENCE_TOLERANCE = {"float32": 1e-5, "bfloat16": 0.03}
LAYERS = (1, 2)

PROMPT = "Is this SMS spam? WINNER!! Claim your free prize now, text WIN to 80082."
ITEMS = [
    Query(prompt=PROMPT, choices=["spam", "spam_risky", "ham"], feature_layers=LAYERS),
    Query(prompt="How many legs does a spider have?", choices=["8", "80", "800"]),
    Query(prompt="Short?", choices=["yes", "no"], feature_layers=(2,)),
    Query(
        prompt="A longer item, so that the others are left-padded beside it. " * 3 + "Which?",
        choices=["1", "10", "100", "2"],
        feature_layers=(1,),
    ),
]
CONTEXT = "Read the message below, then answer each question about it.\n\n" + PROMPT


def tiny(kind: str, dtype: torch.dtype, window: int | None = WINDOW) -> PreTrainedModel:
    torch.manual_seed(0)
    model: PreTrainedModel
    if kind == "gpt2":
        config = GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=512)
        model = GPT2LMHeadModel(config)
    elif kind == "mistral, sliding window":
        model = MistralForCausalLM(MistralConfig(**SHAPE, sliding_window=window))
    else:  # layer 1 attends to the whole past, layer 2 to a window
        sliding = window is not None
        model = Qwen2ForCausalLM(
            Qwen2Config(
                **SHAPE, use_sliding_window=sliding, sliding_window=window, max_window_layers=1
            )
        )
    # Random weights give near-uniform choices; larger ones give probabilities worth comparing.
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0)
    return model.to(dtype).eval()  # type: ignore[arg-type]  # a dtype is a valid argument


class Engines(NamedTuple):
    plain: Judge  # the cache off
    cached: Judge  # asks for a cache of 64 MB in blocks of 4, so short prompts use many


@pytest.fixture(scope="module")
def engines(judge: Judge) -> Callable[[str, str], Engines]:
    """Two judges over one tiny model of each kind and dtype, built once for the module."""
    made: dict[tuple[str, str], Engines] = {}

    def get(kind: str, dtype: str) -> Engines:
        if (kind, dtype) not in made:
            model = tiny(kind, getattr(torch, dtype))
            plain = Judge(model, judge.tokenizer, model_id=kind, prefix_cache_mb=0)
            cached = Judge(
                model, judge.tokenizer, model_id=kind, prefix_cache_mb=64, prefix_cache_block=4
            )
            assert plain.batch_invariant and cached.batch_invariant  # the default
            assert plain.decoder_pass == cached.decoder_pass == "generic"
            made[kind, dtype] = Engines(plain, cached)
        return made[kind, dtype]

    return get


every_model = pytest.mark.parametrize(
    ("kind", "dtype"), [(k, d) for k in KINDS for d in DTYPES], ids=lambda v: str(v)
)


def assert_same_bits(got: Judgment, want: Judgment, how: str) -> None:
    """Bit for bit: floats compared with ==, features layer by layer."""
    assert got.choices == want.choices and got.prompt == want.prompt, how
    assert got.probs == want.probs, f"{how}: probs {got.probs} != {want.probs}"
    assert got.log_probs == want.log_probs, f"{how}: log_probs moved"
    assert got.choice_mass == want.choice_mass, f"{how}: choice_mass moved"
    assert got.features == want.features, f"{how}: features moved"


@every_model
def test_the_models_take_the_generic_pass_past_their_window(
    engines: Callable[[str, str], Engines], kind: str, dtype: str
) -> None:
    plain, cached = engines(kind, dtype)
    assert plain.decoder_pass == cached.decoder_pass == "generic"
    if kind.startswith("qwen2"):  # a mask per layer type
        assert plain.model.config.layer_types == ["full_attention", "sliding_attention"]
    assert str(plain.model.dtype) == f"torch.{dtype}"
    for q in ITEMS:
        prepared = plain.prepare(q)
        assert prepared.prompt_tokens > WINDOW  # the window hides some of every prompt
    # The choices that share leading tokens are scored below the root too.
    assert len(plain.prepare(ITEMS[1]).trie.node_children) == 3
    assert len(plain.prepare(ITEMS[3]).trie.node_children) == 3


@every_model
def test_an_item_gets_its_lone_bits_in_a_batch_at_either_end(
    engines: Callable[[str, str], Engines], kind: str, dtype: str
) -> None:
    plain, _ = engines(kind, dtype)
    lone = [plain.judge_batch([q])[0] for q in ITEMS]
    assert len({j.prompt_tokens for j in lone}) == len(ITEMS)  # so rows are padded
    assert [j.features is not None for j in lone] == [bool(q.feature_layers) for q in ITEMS]
    for i, q in enumerate(ITEMS):
        others = [o for o in ITEMS if o is not q]
        first = plain.judge_batch([q, *others])[0]
        last = plain.judge_batch([*others[::-1], q])[-1]
        assert first.forward_passes == last.forward_passes == 1  # one pass: beside the others
        assert_same_bits(first, lone[i], f"item {i}, first of {len(ITEMS)}")
        assert_same_bits(last, lone[i], f"item {i}, last of {len(ITEMS)}")


@every_model
def test_a_shared_context_question_gets_its_lone_bits(
    engines: Callable[[str, str], Engines], kind: str, dtype: str
) -> None:
    plain, _ = engines(kind, dtype)
    shared = plain.judge_shared(CONTEXT, ITEMS)
    assert all(j.forward_passes == 1 for j in shared)
    for i, (q, got) in enumerate(zip(ITEMS, shared, strict=True)):
        alone = plain.judge_batch([shared_query(CONTEXT, q)])[0]
        assert_same_bits(got, alone, f"question {i} of a shared context")


@every_model
def test_a_warm_prefix_cache_gives_the_cold_bits(
    engines: Callable[[str, str], Engines], kind: str, dtype: str
) -> None:
    """Windowed models too: the cache keeps every key of a prefix longer than the window (a
    sliding layer's own cache keeps only the window's), and the mask hides the rest."""
    plain, cached = engines(kind, dtype)
    cache = cached.prefix_cache
    assert cache is not None
    off = [plain.judge_batch([q])[0] for q in ITEMS]
    for i, q in enumerate(ITEMS):
        cache.clear()
        cold = cached.judge_batch([q])[0]
        warm = cached.judge_batch([q])[0]
        assert cold.cached_tokens == 0 and warm.cached_tokens >= warm.prompt_tokens - 4
        assert warm.computed_tokens == cold.computed_tokens - warm.cached_tokens
        assert_same_bits(cold, off[i], f"item {i}, cold cache")
        assert_same_bits(warm, off[i], f"item {i}, warm cache")
    # One pass whose rows read pasts of different lengths (right-aligned in the model's past):
    # the last item's whole prompt is cached, the others' chat-template head only.
    mixed = cached.judge_batch(ITEMS)
    assert mixed[-1].cached_tokens > max(j.cached_tokens for j in mixed[:-1]) > 0
    for i, got in enumerate(mixed):
        assert_same_bits(got, off[i], f"item {i}, in a pass of pasts of other lengths")
    # A batch on a cold head: the head runs in a pass of its own, every row reads it, and
    # the rows' prompts end at other offsets within a block of 4.
    cache.clear()
    questions = [shared_query(CONTEXT, q) for q in ITEMS]
    batched = cached.judge_batch(questions)
    assert len({j.prompt_tokens % 4 for j in batched}) > 1
    assert all(j.forward_passes == 2 and j.cached_tokens > 0 for j in batched)
    for i, (q, got) in enumerate(zip(questions, batched, strict=True)):
        assert_same_bits(got, plain.judge_batch([q])[0], f"item {i}, batch on a cold head")
    # A shared context read from a warm cache.
    for i, (got, want) in enumerate(
        zip(cached.judge_shared(CONTEXT, ITEMS), plain.judge_shared(CONTEXT, ITEMS), strict=True)
    ):
        assert got.cached_tokens > 0
        assert_same_bits(got, want, f"question {i}, shared context on a warm cache")
    stats = cache.stats()
    assert stats.hits > 0 and stats.tokens_reused > 0


@every_model
def test_judgments_match_the_reference(
    engines: Callable[[str, str], Engines], kind: str, dtype: str
) -> None:
    plain, _ = engines(kind, dtype)
    tolerance = REFERENCE_TOLERANCE[dtype]
    for q in ITEMS:
        got = plain.judge(q.prompt, q.choices).probabilities
        want = reference_probabilities(plain, q.prompt, q.choices)
        for c in q.choices:
            assert got[c] == pytest.approx(want[c], abs=tolerance), (q.prompt, c)


@pytest.mark.parametrize("kind", KINDS[1:])
def test_the_window_is_in_force(engines: Callable[[str, str], Engines], kind: str) -> None:
    """The same weights without a window judge otherwise: the window is not a no-op, and the
    reference (transformers' own windowed mask) agrees with the windowed judgment."""
    plain, _ = engines(kind, "float32")
    unwindowed = Judge(tiny(kind, torch.float32, window=None), plain.tokenizer, lean=False)
    assert unwindowed.decoder_pass == "generic"
    for q in ITEMS[:2]:
        windowed = plain.judge(q.prompt, q.choices).probs
        whole = unwindowed.judge(q.prompt, q.choices).probs
        assert max(abs(a - b) for a, b in zip(windowed, whole, strict=True)) > 0.01


def _hidden_states(judge: Judge, ids: Sequence[int]) -> dict[int, np.ndarray]:
    with torch.inference_mode():
        out = judge.model(torch.tensor([list(ids)]), output_hidden_states=True)
    return {n: out.hidden_states[n][0, -1].float().numpy() for n in LAYERS}


@every_model
def test_features_are_transformers_hidden_states(
    engines: Callable[[str, str], Engines], kind: str, dtype: str
) -> None:
    """At the decision point (here the prompt's last token: every choice starts a new token)."""
    plain, _ = engines(kind, dtype)
    query = msgspec.structs.replace(ITEMS[1], feature_layers=LAYERS)
    got = plain.judge_batch([query])[0]
    assert got.features is not None
    ids = plain.tokenizer(got.prompt, add_special_tokens=False).input_ids
    want = _hidden_states(plain, ids)
    tolerance = 1e-4 if dtype == "float32" else 0.05
    for n in LAYERS:
        scale = max(1.0, float(np.abs(want[n]).max()))
        diff = float(np.max(np.abs(np.asarray(got.features[n]) - want[n])))
        assert diff <= tolerance * scale, f"layer {n}: features differ by {diff}"
