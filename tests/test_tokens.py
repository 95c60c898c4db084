"""Encoding a prompt's endings from a shared head gives the canonical tokenization."""

from __future__ import annotations

import pytest

from judge import Judge
from judge.tokens import PathEncoder

ENDINGS = ['spam"}', 'ham"}', '1"}', '10"}', '예"}', '\\"quoted\\""}', ' leading"}', '🎉"}']


@pytest.mark.parametrize("prefix", ['{"answer": "', "Answer: ", "", "<|im_end|>"])
def test_paths_equal_full_encodings(judge: Judge, prefix: str) -> None:
    encoder = PathEncoder(judge.tokenizer)
    prompt = judge.render("Is this spam? Call 0800 now!", response_prefix=prefix)
    encoded = encoder.encode_paths(prompt, ENDINGS)
    full = encoder.encode([prompt + e for e in ENDINGS])
    assert encoded.paths == full
    assert encoded.prompt_ids == encoder.encode([prompt])[0]
    assert encoded.head_length > 0  # the chat template's added tokens give a cut
    assert all(p[: encoded.head_length] == encoded.prompt_ids[: encoded.head_length] for p in full)
    assert encoder.round_trip_failures(prompt, ENDINGS, encoded) == []


def test_bad_cut_falls_back_to_full_encoding(judge: Judge, monkeypatch: pytest.MonkeyPatch) -> None:
    encoder = PathEncoder(judge.tokenizer)
    prompt = judge.render("Is this spam?")
    # A cut in the middle of a word changes how the text tokenizes: it must be caught.
    cut = prompt.index("helpful") + 2
    naive = encoder.encode([prompt[:cut]])[0] + encoder.encode([prompt[cut:] + ENDINGS[0]])[0]
    assert naive != encoder.encode([prompt + ENDINGS[0]])[0]
    monkeypatch.setattr(encoder, "cut", lambda text: cut)
    encoded = encoder.encode_paths(prompt, ENDINGS)
    assert encoded.head_length == 0
    assert encoded.paths == encoder.encode([prompt + e for e in ENDINGS])


def test_prompt_without_added_tokens(judge: Judge) -> None:
    encoder = PathEncoder(judge.tokenizer)
    encoded = encoder.encode_paths("plain text, answer: ", ENDINGS)
    assert encoded.head_length == 0
    assert encoded.paths == encoder.encode(["plain text, answer: " + e for e in ENDINGS])
