"""The lean pass (judge.decoder) against transformers' own, and the lane attention it reads.

Tiny random models of each covered architecture (Llama, Mistral, Qwen2 with its q/k/v biases,
Qwen3 with its per-head norms) are judged by the lean pass and by the model's own decoder, and
checked against the brute-force reference; a model the lean pass does not cover (GPT-2, a
Mistral with a sliding window) takes the generic pass and is just as exact. The attention
over lanes is checked against attention by its definition, and its invariance on its own:
a query's result does not change with the lanes, padding and bank around it.
"""

from __future__ import annotations

import logging
import math
import os
import platform
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from cores import cpu_flags, shared, users_environ
from reference import reference_probabilities
from torch.nn import functional as F
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from judge import Judge, Query, decoder
from judge.attention import (
    KEY_BLOCK,
    KEY_STEP,
    MIN_KEYS,
    QUERY_BLOCK,
    SHORT_CANDIDATES,
    Blocking,
    Lanes,
    blocked_attention,
    lane_sdpa,
    measured_blocking,
)
from judge.batch_invariant import (
    GENERIC_INVARIANT,
    ORDINARY,
    measured_rows,
    measured_sizes,
    runs_in_words,
    split_rows,
)
from judge.decoder import _Product, lean_unsupported, packing_library
from judge.engine import shared_query

VOCAB = 49152  # the default tokenizer's ids
SHAPE: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
}


def tiny(kind: str, seed: int = 0) -> PreTrainedModel:
    torch.manual_seed(seed)
    model: PreTrainedModel
    if kind == "llama":
        rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0}
        rope |= {"low_freq_factor": 1.0, "high_freq_factor": 4.0}
        rope |= {"original_max_position_embeddings": 64}
        model = LlamaForCausalLM(LlamaConfig(**SHAPE, rope_parameters=rope))
    elif kind == "mistral":
        model = MistralForCausalLM(MistralConfig(**SHAPE, sliding_window=None))
    elif kind == "mistral, sliding window":
        model = MistralForCausalLM(MistralConfig(**SHAPE, sliding_window=16))
    elif kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**SHAPE))
    elif kind == "qwen2, one sliding layer":  # layer 1 full, layer 2 a window
        window: dict[str, Any] = {"use_sliding_window": True, "sliding_window": 16}
        window["max_window_layers"] = 1
        model = Qwen2ForCausalLM(Qwen2Config(**SHAPE, **window))
    elif kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**SHAPE, head_dim=16))
    else:
        config = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=512)
        model = GPT2LMHeadModel(config)
    # Random weights give near-uniform choices; larger ones give probabilities worth comparing.
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0)
    return model.eval()


PROMPT = "Is this SMS spam? WINNER!! Claim your free prize now, text WIN to 80082."
CASES = [
    (PROMPT, ["spam", "ham"]),  # single tokens
    ("Pick a number.", ["1", "10", "100", "2"]),  # a tree below the root
    ("Sentiment?", ["positive", "negative", "neutral", "mixed"]),
]
COVERED = ["llama", "mistral", "qwen2", "qwen3"]


@pytest.fixture(scope="module", params=COVERED)
def pair(request: pytest.FixtureRequest, judge: Judge) -> tuple[Judge, Judge]:
    """A tiny model of one covered architecture, judged by the lean pass and the generic one."""
    model = tiny(request.param)
    lean = Judge(model, judge.tokenizer, prefix_cache_mb=0)
    generic = Judge(model, judge.tokenizer, prefix_cache_mb=0, lean=False)
    assert (lean.decoder_pass, generic.decoder_pass) == ("lean", "generic")
    return lean, generic


def test_float32_products_run_on_oneDNN_except_on_an_intel_cpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """MKL's float32 kernels are Intel's fast path only: on another vendor's CPU the packed
    products are oneDNN's (bfloat16 always); the product and the arithmetic say which."""
    for vendor, float32 in (("GenuineIntel", "MKL"), ("AuthenticAMD", "oneDNN"), ("", "oneDNN")):
        monkeypatch.setattr(decoder, "cpu_vendor", lambda v=vendor: v)
        assert packing_library(torch.float32) == float32
        assert packing_library(torch.bfloat16) == "oneDNN"
        g = torch.Generator().manual_seed(4)
        w, x = torch.randn(48, 16, generator=g), torch.randn(37, 16, generator=g)
        product = _Product(w, None, rows=32)
        assert product.library == float32
        assert torch.allclose(product(x), F.linear(x, w), atol=1e-5)
    assert _Product(w, None, rows=32, pack=False).library == "F.linear"


def test_the_default_model_takes_the_lean_pass(judge: Judge) -> None:
    assert lean_unsupported(judge.model) is None
    assert judge.decoder_pass == "lean"
    assert f"products ({packing_library(judge.model.dtype)})" in judge.arithmetic
    variant = Judge(judge.model, judge.tokenizer, prefix_cache_mb=0, batch_invariant=False)
    assert variant.decoder_pass == "lean" and variant.arithmetic == ORDINARY


@pytest.mark.parametrize(("prompt", "choices"), CASES)
def test_lean_judgments_match_the_models_own_pass_and_the_reference(
    pair: tuple[Judge, Judge], prompt: str, choices: list[str]
) -> None:
    lean, generic = pair
    got, want = lean.judge(prompt, choices), generic.judge(prompt, choices)
    reference = reference_probabilities(lean, prompt, choices)
    for c in choices:
        assert got.probabilities[c] == pytest.approx(want.probabilities[c], abs=1e-5)
        assert got.probabilities[c] == pytest.approx(reference[c], abs=1e-5)
    assert got.choice_mass == pytest.approx(want.choice_mass, rel=1e-4)
    assert got.computed_tokens == want.computed_tokens


def test_lean_features_are_the_models_hidden_states(pair: tuple[Judge, Judge]) -> None:
    lean, generic = pair
    query = Query(prompt=PROMPT, choices=["spam", "ham"], feature_layers=(1, 2))
    got, want = lean.judge_batch([query])[0], generic.judge_batch([query])[0]
    assert got.features is not None and want.features is not None
    for layer in (1, 2):
        assert torch.allclose(
            torch.tensor(got.features[layer]), torch.tensor(want.features[layer]), atol=1e-4
        )


def test_lean_judgments_do_not_depend_on_their_batch(pair: tuple[Judge, Judge]) -> None:
    lean, _ = pair
    alone = [lean.judge(p, c).probs for p, c in CASES]
    queries = [Query(prompt=p, choices=c) for p, c in CASES]
    batched = lean.judge_batch([queries[2], queries[0], queries[1]])
    assert [batched[1].probs, batched[2].probs, batched[0].probs] == alone  # bit for bit
    shared = lean.judge_shared("Context: a long day.", queries)
    for query, result in zip(queries, shared, strict=True):
        alone_query = shared_query("Context: a long day.", query)
        assert result.probs == lean.judge_batch([alone_query])[0].probs


def test_the_modules_keep_views_of_the_fused_weights(judge: Judge) -> None:
    model = tiny("qwen2")
    ids = torch.tensor([[5, 17, 230, 41]])
    with torch.inference_mode():
        before = model(ids).logits
    Judge(model, judge.tokenizer, prefix_cache_mb=0)
    attn = model.model.layers[0].self_attn
    storage = attn.q_proj.weight.untyped_storage().data_ptr()
    assert attn.k_proj.weight.untyped_storage().data_ptr() == storage  # one copy, not two
    assert attn.v_proj.weight.untyped_storage().data_ptr() == storage
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, before)  # the model's own pass is unchanged


@pytest.mark.parametrize("change", ["in place", "load_state_dict", "a new parameter"])
def test_weights_changed_after_the_judge_was_built_are_the_ones_judged(
    judge: Judge, change: str
) -> None:
    """The packed weights are copies: a model changed afterwards is packed again."""
    model = tiny("llama")
    lean = Judge(model, judge.tokenizer, prefix_cache_mb=0)
    before = lean.judge(PROMPT, ["spam", "ham"]).probs
    other = tiny("llama", seed=5)
    with torch.no_grad():
        if change == "in place":
            for p, q in zip(model.parameters(), other.parameters(), strict=True):
                p.copy_(q)
        elif change == "load_state_dict":
            model.load_state_dict(other.state_dict())
        else:  # a module given another tensor: only a new Judge looks for that
            for name in ("q_proj", "o_proj"):
                old = getattr(other.model.layers[0].self_attn, name).weight
                setattr(model.model.layers[0].self_attn, name, torch.nn.Linear(32, 32, bias=False))
                getattr(model.model.layers[0].self_attn, name).weight.data = old.clone()
            lean = Judge(model, judge.tokenizer, prefix_cache_mb=0)
    after = lean.judge(PROMPT, ["spam", "ham"])
    generic = Judge(model, judge.tokenizer, prefix_cache_mb=0, lean=False)
    want = generic.judge(PROMPT, ["spam", "ham"])
    assert after.probs != before
    assert after.probs == pytest.approx(want.probs, abs=1e-5)


@pytest.mark.parametrize("kind", ["gpt2", "mistral, sliding window", "qwen2, one sliding layer"])
def test_a_model_the_lean_pass_does_not_cover_takes_the_generic_one(
    judge: Judge, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    model = tiny(kind)
    if "window" in kind or "sliding" in kind:
        assert len(judge.tokenizer(judge.render(PROMPT)).input_ids) > 16  # past the window
    reason = lean_unsupported(model)
    assert reason is not None and ("model_type" in reason or "sliding window" in reason)
    with caplog.at_level(logging.INFO, logger="judge"):
        fallback = Judge(model, judge.tokenizer, prefix_cache_mb=0)
    assert fallback.decoder_pass == "generic"
    assert fallback.arithmetic == GENERIC_INVARIANT  # what /ready says of it
    assert any("generic pass" in r.getMessage() for r in caplog.records)
    for prompt, choices in CASES:
        got = fallback.judge(prompt, choices)
        reference = reference_probabilities(fallback, prompt, choices)
        for c in choices:
            assert got.probabilities[c] == pytest.approx(reference[c], abs=1e-5)


# The lane attention on random tensors.


def _by_definition(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, seen: torch.Tensor, scale: float
) -> torch.Tensor:
    """q (n, Hq, D) over keys, values (Hkv, S, D) with seen (n, S): softmax in float64."""
    groups = q.shape[1] // keys.shape[0]
    k = keys.double().repeat_interleave(groups, dim=0)  # (Hq, S, D)
    v = values.double().repeat_interleave(groups, dim=0)
    scores = torch.einsum("nhd,hsd->hns", q.double(), k) * scale
    scores = scores.masked_fill(~seen[None], -math.inf)
    return torch.einsum("hns,hsd->nhd", scores.softmax(-1), v).reshape(q.shape[0], -1)


def _tree_lane(n: int, generator: torch.Generator) -> torch.Tensor:
    """(n, n) ancestry of a random tree over n tokens, parents before children."""
    seen = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        parent = int(torch.randint(0, i, (1,), generator=generator)) if i else -1
        if parent >= 0:
            seen[i] = seen[parent]
        seen[i, i] = True
    return seen


@pytest.mark.parametrize("length", [1, 5, QUERY_BLOCK + 3, KEY_BLOCK + 40])
def test_blocked_attention_is_attention(length: int) -> None:
    g = torch.Generator().manual_seed(length)
    Hq, Hkv, D = 6, 2, 8
    seen = _tree_lane(length, g)
    q = torch.randn(length, Hq, D, generator=g)
    keys = torch.randn(Hkv, length, D, generator=g)
    values = torch.randn(Hkv, length, D, generator=g)
    want = _by_definition(q, keys, values, seen, 0.3).float()
    junk = torch.randn(Hkv, 1, D, generator=g)
    blockings = (
        Blocking(),
        Blocking(queries=24),
        Blocking(short=()),
        Blocking(short=(144, 400)),
        Blocking(tails=tuple(range(4, QUERY_BLOCK))),  # a lane's last block in fewer queries
    )
    for blocking, attend in [*((b, blocked_attention) for b in blockings), (None, lane_sdpa)]:
        # The bank is the lane, or the lane's keys are gathered from behind another key.
        for first in (0, 1):
            lane_keys = range(first, first + length)
            lanes = Lanes.build(
                [(lane_keys, range(length), seen)], length, first + length, blocking
            )
            assert lanes.contiguous == (first == 0)
            bank_k = _padded(torch.cat([junk, keys], 1)[:, 1 - first :], lanes)
            bank_v = _padded(torch.cat([junk, values], 1)[:, 1 - first :], lanes)
            assert torch.allclose(attend(q, bank_k, bank_v, lanes, 0.3), want, atol=1e-5)


def _padded(bank: torch.Tensor, lanes: Lanes) -> torch.Tensor:
    """The (Hkv, K, D) bank with the zero keys the lanes pad it with."""
    return torch.cat([bank, bank.new_zeros(bank.shape[0], lanes.pad_keys, bank.shape[2])], 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_querys_attention_does_not_depend_on_what_surrounds_its_lane(dtype: torch.dtype) -> None:
    """The same lane alone; beside longer and shorter lanes (so padded to more key blocks,
    in calls of their own); behind a past of other rows in the bank; with its first keys as
    the cached past and only the rest fed: the same bits, in the blocks measured for these
    heads on this machine. The lane is long enough for short calls and calls of a second
    block of keys."""
    g = torch.Generator().manual_seed(7)
    Hq, Hkv, D, n = 6, 2, 16, KEY_BLOCK + 90
    blocking = measured_blocking(Hq, Hkv, D, dtype)
    seen = _tree_lane(n, g)
    keys = torch.randn(Hkv, n, D, generator=g).to(dtype)
    values = torch.randn(Hkv, n, D, generator=g).to(dtype)
    q = torch.randn(n, Hq, D, generator=g).to(dtype)

    def run(
        lanes: list[Any], q_all: torch.Tensor, bank_k: torch.Tensor, bank_v: torch.Tensor
    ) -> torch.Tensor:
        built = Lanes.build(lanes, q_all.shape[0], pad_key=bank_k.shape[1], blocking=blocking)
        bank_k, bank_v = _padded(bank_k, built), _padded(bank_v, built)
        return blocked_attention(q_all, bank_k, bank_v, built, 0.25)

    alone = run([(range(n), range(n), seen)], q, keys, values)  # the bank read as it is
    read = {c.keys for c in Lanes.build([(range(n), range(n), seen)], n, n, blocking).calls}
    assert len(read) >= 2 and max(read) == 2 * KEY_BLOCK

    # Beside two other lanes (one longer, one shorter), fed after them, with their past first.
    other = [(3 * KEY_BLOCK, 30), (7, 3)]  # (keys, queries) of each neighbour
    past = sum(k - qn for k, qn in other)
    fed_other = sum(qn for _, qn in other)
    bank_k = torch.cat([torch.randn(Hkv, past + fed_other, D).to(dtype), keys], 1)
    bank_v = torch.cat([torch.randn(Hkv, past + fed_other, D).to(dtype), values], 1)
    q_all = torch.cat([torch.randn(fed_other, Hq, D).to(dtype), q])
    lanes: list[Any] = []
    p0, f0 = 0, past
    for k_n, q_n in other:
        lane_keys = [*range(p0, p0 + k_n - q_n), *range(f0, f0 + q_n)]
        visible = torch.ones(q_n, k_n, dtype=torch.bool).tril(k_n - q_n)
        lanes.append((lane_keys, range(f0 - past, f0 - past + q_n), visible))
        p0, f0 = p0 + k_n - q_n, f0 + q_n
    lanes.append((range(f0, f0 + n), range(fed_other, fed_other + n), seen))
    beside = run(lanes, q_all, bank_k, bank_v)[fed_other:]  # keys gathered from the bank
    assert torch.equal(beside, alone)

    # The lane's first 40 keys as a cached past, only the other queries fed (so every query
    # sits at another slot of its block, beside other neighbours).
    cut = 40
    cached = run([(range(n), range(n - cut), seen[cut:])], q[cut:], keys, values)
    assert torch.equal(cached, alone[cut:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_products_give_a_row_the_same_bits_in_any_batch(dtype: torch.dtype) -> None:
    """At every slot of its chunk, in a chunk of its own, padded or not: a row's bits, in the
    chunk size measured for this (small) weight on this machine (32 where it holds)."""
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(96, 64, generator=g).to(dtype)
    bias = torch.randn(96, generator=g).to(dtype)
    product = _Product(weight, bias, rows=32)
    R = product.rows
    assert R is not None and R <= 64
    x = torch.randn(3 * R, 64, generator=g).to(dtype)
    full = product(x)
    assert torch.allclose(full.float(), F.linear(x, weight, bias).float(), atol=0.05, rtol=0.02)
    for start in (0, 5, R + 1):
        part = x[start : start + R]  # the same rows at other slots of their chunk
        zeros = [torch.zeros(n, 64, dtype=dtype) for n in (7, R - 7)]
        placed = torch.cat([zeros[0], part, zeros[1]])
        assert torch.equal(product(placed)[7 : 7 + R], full[start : start + R])
    one = product(torch.cat([x[3:4], x.new_zeros(R - 1, 64)]))[:1]
    assert torch.equal(one, full[3:4])
    assert torch.equal(product(x[3:5]), full[3:5])  # a short input is padded to a chunk
    assert torch.equal(product(x[: R + 8])[R:], full[R : R + 8])


def test_a_chunk_size_whose_last_slots_round_otherwise_is_not_used() -> None:
    """A product that gives the last two slots of a 32-row chunk other bits (as AVX2 kernels
    do for some shapes: rows six at a time, a tail of two another way) is measured, and the
    next size that holds is taken, once per shape."""
    weight = torch.randn(40, 16)
    made: list[int] = []

    def make(rows: int) -> Any:
        made.append(rows)

        def product(x: torch.Tensor) -> torch.Tensor:
            out = F.linear(x, weight)
            if rows % 6 in (1, 2, 3):  # the tail rows, rounded another way
                out[-(rows % 6) :] += 1e-3
            return out

        return product

    rows, product = measured_rows(make, 32, weight, "test tail")
    assert rows == 24 and made == [32, 24]
    x = torch.randn(24, 16)
    assert torch.equal(product(x.roll(5, 0)), product(x).roll(5, 0))
    again, _ = measured_rows(make, 32, weight, "test tail")
    assert again == 24 and made == [32, 24, 24]  # not measured twice
    # A product that holds at its preferred size keeps it (a row's own arithmetic only).
    assert measured_rows(lambda _: lambda x: x * 2, 32, weight, "test")[0] == 32


def test_a_pass_s_last_rows_run_unpadded_in_sizes_measured_to_give_the_chunk_s_bits() -> None:
    """Products of fewer rows than the chunk are used for a pass's last rows only where they
    give each row the chunk's bits: a size whose rows round otherwise is left out, and
    ``split_rows`` makes the rest from the others, padding only what they cannot make."""
    weight = torch.randn(40, 16)

    def product(x: torch.Tensor) -> torch.Tensor:
        out = (x[:, None, :] * weight[None]).sum(-1)  # each row's own sums, whatever the rows
        return out + 1e-3 if x.shape[0] == 2 else out  # two rows round otherwise

    sizes = measured_sizes(product, 32, weight, "test sizes")
    assert sizes == (32, *range(31, 2, -1), 1)
    assert runs_in_words(sizes) == "1, 3-32"  # as the arithmetic says them
    assert split_rows(117, sizes) == [32, 32, 32, 21]
    assert split_rows(2, sizes) == [1, 1] and split_rows(64, sizes) == [32, 32]
    assert split_rows(6, (32, 4)) == [4, 4]  # 2 left: the smallest size that holds it
    # The real thing: a product's rows get the same bits alone, at the end of a pass, or in a
    # whole chunk, in whatever sizes this machine measured.
    g = torch.Generator().manual_seed(5)
    w, x = torch.randn(96, 64, generator=g), torch.randn(71, 64, generator=g)
    chunked = _Product(w, None, rows=32)
    whole = chunked(x)
    for n in (1, 3, 7, 33, 70):
        assert torch.equal(chunked(x[:n]), whole[:n])
        assert torch.equal(chunked(x[71 - n :]), whole[71 - n :])


def test_a_size_that_rounds_otherwise_on_few_rows_is_left_out() -> None:
    """In bfloat16 a kernel that sums in another order shows it only on the rows where the
    rounding flips (about one in fifteen on an AMX Xeon): the sizes are measured on enough
    rows to see it. Here products of up to 8 rows round otherwise on one row in 16 (an
    all-or-nothing flag in its first column)."""
    weight = torch.randn(24, 16).to(torch.bfloat16)

    def product(x: torch.Tensor) -> torch.Tensor:
        out = (x.float() @ weight.float().T).to(torch.bfloat16)
        if x.shape[0] <= 8:
            flipped = x[:, 0].float() > 1.53  # ~1 row in 16 of a standard normal
            out[flipped] = out[flipped] * (1 + 2**-6)
        return out

    sizes = measured_sizes(product, 32, weight, "test few rows")
    assert sizes == tuple(range(32, 8, -1))


def test_a_tail_that_rounds_otherwise_on_few_queries_is_left_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The tails are tried at every query of a block: a one-query block whose result rounds
    otherwise for one query in eight is not taken."""
    sdpa = F.scaled_dot_product_attention

    def attend(q: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = sdpa(q, *args, **kwargs)
        if q.shape[2] == 1 and q[0, 0, 0, 0] > 1.15:  # ~1 query in 8
            out = out * (1 + 2**-6)
        return out

    monkeypatch.setattr(F, "scaled_dot_product_attention", attend)
    blocking = measured_blocking(5, 5, 16, torch.bfloat16)  # a shape no other test measures
    assert 1 not in blocking.tails


def test_the_measured_attention_blocks_give_every_slot_the_same_bits() -> None:
    blocking = measured_blocking(9, 3, 64, torch.float32)
    assert blocking is measured_blocking(9, 3, 64, torch.float32)  # measured once
    g = torch.Generator().manual_seed(3)
    B = blocking.queries
    q = torch.randn(1, 9, B, 64, generator=g)
    k, v = torch.randn(1, 3, 200, 64, generator=g), torch.randn(1, 3, 200, 64, generator=g)
    S = blocking.keys(200)
    k, v = F.pad(k, (0, 0, 0, S - 200)), F.pad(v, (0, 0, 0, S - 200))
    seen = torch.randint(1, 201, (B,), generator=g)
    mask = (torch.arange(S)[None, :] < seen[:, None])[None, None]

    def attend(q: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    want = attend(q, mask)
    for s in range(1, B):
        assert torch.equal(attend(q.roll(s, 2), mask.roll(s, 2)), want.roll(s, 2))


def test_lanes_lay_out_keys_queries_and_calls() -> None:
    """Every fed token is some lane's query, ``back`` finds each one's output row, and a
    lane's blocks of queries are grouped by the keys they read: a block that needs few keys
    reads the smallest short count that holds them (at least MIN_KEYS), one that needs more
    than the largest whole blocks of KEY_BLOCK."""
    seen = torch.ones(3, 5, dtype=torch.bool).tril(2)
    lanes = Lanes.build([([0, 1, 5, 6, 7], [2, 0, 1], seen)], n_fed=3, pad_key=8)
    assert lanes.key_index.shape == (1, MIN_KEYS)
    assert lanes.query_index.shape == (1, QUERY_BLOCK)
    assert lanes.back.tolist() == [1, 2, 0]  # fed token 2 is the lane's first query
    assert lanes.key_index[0, 5:].eq(8).all()  # padding reads the zero key
    assert not lanes.contiguous and lanes.pad_keys == 1
    whole = Lanes.build([(range(5), [0, 1, 2], seen)], n_fed=3, pad_key=5)
    assert whole.contiguous and whole.pad_keys == MIN_KEYS - 5  # the bank is the lane
    padded = Lanes.build([(range(5), [0, 1, 2], seen)], 3, 5, Blocking(short=()))
    assert padded.key_index.shape == (1, KEY_BLOCK)
    # Where only some short counts hold, a block reads the smallest that holds its keys.
    gaps = Blocking(short=(128, 144, 384))
    assert [gaps.keys(n) for n in (1, 128, 129, 145, 384, 385, 600)] == [
        128,
        128,
        144,
        384,
        384,
        512,
        1024,
    ]
    assert gaps.describe().startswith("short blocks read 128-144, 384 keys")
    n = 2 * KEY_BLOCK
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    long = Lanes.build([(range(n), range(n), causal)], n_fed=n, pad_key=n)
    B = QUERY_BLOCK
    short = SHORT_CANDIDATES[-1] // B  # blocks that need at most the largest short count
    assert tuple(range(MIN_KEYS, KEY_BLOCK, KEY_STEP)) == SHORT_CANDIDATES
    assert [(c.start // B, c.stop // B, c.keys) for c in long.calls] == [
        (0, MIN_KEYS // B, MIN_KEYS),  # the first blocks all read MIN_KEYS
        *((i, i + 1, (i + 1) * B) for i in range(MIN_KEYS // B, short)),
        (short, KEY_BLOCK // B, KEY_BLOCK),
        (KEY_BLOCK // B, n // B, n),
    ]
    blocks24 = Lanes.build([(range(n), range(n), causal)], n, n, Blocking(queries=24))
    assert blocks24.query_index.shape == (1, 1032)  # 43 blocks of 24
    assert all(c.visible.shape[2] == 24 for c in blocks24.calls)
    # A lane's last, partial block runs in the smallest tail that holds its queries; without
    # one, in a whole block.
    tails = Blocking(tails=tuple(range(4, B)))
    assert [tails.last(r) for r in (1, 3, 4, 17, B - 1)] == [4, 4, 4, 17, B - 1]
    assert Blocking().last(3) == B
    for rest, tail in ((3, 4), (17, 17)):
        m = B + rest
        seen = torch.ones(m, m, dtype=torch.bool).tril()
        tailed = Lanes.build([(range(m), range(m), seen)], m, m, tails)
        layout = [(c.start, c.stop, c.visible.shape[:3], c.keys) for c in tailed.calls]
        assert layout == [(0, B, (1, 1, B), MIN_KEYS), (B, B + tail, (1, 1, tail), MIN_KEYS)]
        assert tailed.back.tolist() == list(range(m))  # each fed token's row, in order
        whole = Lanes.build([(range(m), range(m), seen)], m, m, Blocking())
        assert [(c.start, c.stop) for c in whole.calls] == [(0, 2 * B)]
    assert "a lane's last block in 4-31 queries" in tails.describe()


# The kernels of an AVX2-only CPU, on any x86 machine: torch's own (ATEN_CPU_CAPABILITY),
# oneDNN's and MKL's. On an AVX2-only CPU they are the ones it runs anyway.
AVX2 = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "DNNL_MAX_CPU_ISA": "AVX2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
}
INVARIANCE = (
    "depend_on_their_batch or surrounds_its_lane or same_bits_in_any_batch "
    "or measured_attention_blocks or lone_bits or last_rows"
)


def _invariance_in_a_process(selection: str, files: list[str], environ: dict[str, str]) -> None:
    """The invariance tests ``selection`` of ``files`` (under tests/) in a process of their own."""
    here = Path(__file__).resolve().parent
    paths = [str(here / f) for f in files]
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", selection, *paths],
        env=environ,
        capture_output=True,
        text=True,
        cwd=here.parent,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert re.search(r"(\d+) passed", run.stdout) and " failed" not in run.stdout


def _runs_avx2_kernels() -> bool:
    """Whether this process runs an AVX2-only CPU's kernels already: it is one (torch
    dispatches to AVX2 and the CPU has no AVX-512), or the three variables of ``AVX2`` are set."""
    if str(torch.backends.cpu.get_cpu_capability()) != "AVX2":
        return False
    flags = cpu_flags()
    if not flags:  # unknown CPU: run the test
        return False
    if "avx512f" not in flags:
        return True
    return all(os.environ.get(k, "").upper() == v.upper() for k, v in AVX2.items())


def test_a_process_runs_avx2_kernels_on_an_avx2_cpu_or_with_all_three_variables(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    module = sys.modules[__name__]
    for name in AVX2:
        monkeypatch.delenv(name, raising=False)

    def machine(capability: str, flags: set[str]) -> None:
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
        monkeypatch.setattr(module, "cpu_flags", lambda: flags)

    machine("AVX512", {"avx2", "avx512f"})
    assert not _runs_avx2_kernels()
    machine("AVX2", {"avx2", "fma"})  # an AVX2-only CPU
    assert _runs_avx2_kernels()
    machine("AVX2", set())  # flags unknown: the rerun is not skipped
    assert not _runs_avx2_kernels()
    machine("AVX2", {"avx2", "avx512f"})  # torch limited, oneDNN and MKL not
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert not _runs_avx2_kernels()
    for name, value in AVX2.items():
        monkeypatch.setenv(name, value)
    assert _runs_avx2_kernels()


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 kernels only")
@pytest.mark.skipif(
    _runs_avx2_kernels(),
    reason="this process runs AVX2 kernels already: the invariance tests here (and, in `make "
    "bench-smoke`'s workers, test_the_invariance_holds_at_a_users_threads) are that run",
)
def test_the_invariance_holds_with_an_avx2_cpus_kernels() -> None:
    """The batch-invariance tests of the lean and the generic pass (tiny models) again in a
    process limited to AVX2 kernels, where a 32-row product and a 32-query attention block
    gave their last slots other bits: whatever this machine is, the arithmetic is measured for
    the kernels it runs. The process runs a user's threads, not a test worker's share."""
    files = ["test_lean.py", "test_generic_pass.py"]
    _invariance_in_a_process(INVARIANCE, files, users_environ(**AVX2))


@pytest.mark.slow
@pytest.mark.bench  # three files' tests again (minutes): in `make bench-smoke`'s workers
@pytest.mark.skipif(not shared(), reason="the suite runs at a user's threads here")
def test_the_invariance_holds_at_a_users_threads() -> None:
    """The suite's workers each run torch on their share of the cores (tests/cores.py), and
    a product or an attention call may split its work otherwise on more threads: the
    batch-invariance tests again, the real model's and the tiny models', in a process with the
    threads a user's process runs, on this machine's own kernels."""
    real = "match_lone_ones or features_match_across_batches"
    files = ["test_lean.py", "test_generic_pass.py", "test_invariance.py"]
    _invariance_in_a_process(f"{INVARIANCE} or {real}", files, users_environ())
