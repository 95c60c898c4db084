"""What pins a judgment: a unique, time-ordered id and the hash of the tokens it fed.

Plain Python and no torch, so that ``calibration`` and a client can recompute and check them.
The engine stamps every ``Judgment`` with ``new_judgment_id()`` and with ``tokens_sha256`` of
its query's token ids; the weights' hash is ``Judge.model_sha256``.
"""

from __future__ import annotations

import hashlib
import os
import time
import uuid
from collections.abc import Sequence

import msgspec

__all__ = ["listings_sha256", "new_judgment_id", "tokens_sha256"]


def new_judgment_id() -> str:
    """A fresh UUID version 7 (RFC 9562) as a string: unique, and sorted by creation time.

    48 bits of Unix time in milliseconds, the version (7), 12 random bits, the variant (0b10)
    and 62 random bits. Ids made in the same millisecond are unordered among themselves.
    (Python 3.14 has ``uuid.uuid7``; 3.11 does not.)
    """
    ms = time.time_ns() // 1_000_000
    rand = int.from_bytes(os.urandom(10), "big")  # 80 bits; 74 are used
    rand_a = rand >> 68  # 12 bits
    rand_b = rand & ((1 << 62) - 1)  # 62 bits
    value = (ms & ((1 << 48) - 1)) << 80 | 0x7 << 76 | rand_a << 64 | 0b10 << 62 | rand_b
    return str(uuid.UUID(int=value))


def tokens_sha256(
    prompt_ids: Sequence[int], choice_paths: Sequence[Sequence[int]], mode: str = "canonical"
) -> str:
    """The sha256 (hex) of the token ids a judgment reads, to recompute by hand.

    Hashed: the UTF-8 bytes of the compact JSON array ``[prompt_ids, [path_0, path_1, ...]]``
    (no spaces, e.g. ``[[1,2],[[1,2,3],[1,2,4]]]``), where ``prompt_ids`` is the tokenization
    of the rendered prompt (chat template, system, prompt and response prefix:
    ``Judgment.prompt``) and ``path_i`` the tokenization of that text followed by choice i
    (JSON-escaped) and the response suffix, in the order the choices were given; both without
    added special tokens (``tokenizer(text, add_special_tokens=False).input_ids``). The
    choices' order counts: the same choices listed otherwise hash differently. A judgment in
    the grammar-exact mode (``Judge(choice_paths="grammar")``, ``mode``), which reads every
    token path that spells a choice from the same tokens, hashes ``[prompt_ids, [path_0, ...],
    "grammar"]``: the same tokens read the other way are another judgment.
    """
    # Lists or tuples of Python ints, as tokenizers give them; msgspec writes the compact form.
    fed: list[object] = [prompt_ids, choice_paths]
    if mode != "canonical":
        fed.append(mode)
    return hashlib.sha256(msgspec.json.encode(fed)).hexdigest()


def listings_sha256(hashes: Sequence[str]) -> str:
    """What pins an answer judged under several listings of its options (``judge.answers``,
    ``order="invariant"``): the sha256 (hex) of the JSON list of the listings' own
    ``tokens_sha256``, in listing order. Every listing's tokens are pinned, and so is their
    order; a single listing keeps its own hash (this is not applied to it).
    """
    return hashlib.sha256(msgspec.json.encode(list(hashes))).hexdigest()
