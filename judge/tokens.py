"""Tokenizing one prompt with many endings, exactly and fast.

Every choice's path is the canonical tokenization of ``prompt + choice + suffix``. Encoding
hundreds of full prompts costs more than the forward pass saves, so the prompt is cut right
after its last added token (the chat template's ``<|im_start|>`` and the like): tokenizers
split their input at added tokens before anything else, so the text before the cut encodes
the same whatever follows it. The head is encoded once and only the short tails per choice.
Each call checks the cut against one full encoding and falls back to full encodings where a
tokenizer behaves otherwise (an added token that strips the whitespace beside it, say).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from judge.errors import InvalidQueryError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["Encoded", "PathEncoder"]


class Encoded:
    """The token paths of one prompt's endings and of the prompt alone."""

    __slots__ = ("head_length", "paths", "prompt_ids")

    def __init__(self, paths: list[list[int]], prompt_ids: list[int], head_length: int) -> None:
        self.paths = paths
        self.prompt_ids = prompt_ids
        # Every path and prompt_ids start with the same head_length tokens.
        self.head_length = head_length


class PathEncoder:
    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        # The Rust tokenizer itself: the Python wrapper re-walks every id list it returns.
        self._backend = tokenizer.backend_tokenizer if tokenizer.is_fast else None
        self._added = sorted(tokenizer.added_tokens_encoder, key=len, reverse=True)

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        if self._backend is not None:
            return [
                e.ids for e in self._backend.encode_batch(list(texts), add_special_tokens=False)
            ]
        return [
            list(ids) for ids in self.tokenizer(list(texts), add_special_tokens=False)["input_ids"]
        ]

    def decode(self, paths: Sequence[Sequence[int]]) -> list[str]:
        if self._backend is not None:
            return list(
                self._backend.decode_batch([list(p) for p in paths], skip_special_tokens=False)
            )
        return [
            str(s)
            for s in self.tokenizer.batch_decode(
                [list(p) for p in paths],
                skip_special_tokens=False,
                clean_up_tokenization_spaces=False,
            )
        ]

    def token_ends(self, text: str, ids: Sequence[int]) -> list[int]:
        """Where each of ``ids`` (``text``'s tokens) ends in ``text``, in characters: the fast
        tokenizer's offsets where it encodes ``text`` to these ids, else (a slow tokenizer) the
        length of each prefix decoded, which a character split over tokens may blur by one."""
        if self._backend is not None:
            encoding = self._backend.encode(text, add_special_tokens=False)
            if list(encoding.ids) == list(ids):
                # Running maximum: a byte-level token inside a character ends where it does.
                ends, reach = [], 0
                for _, end in encoding.offsets:
                    reach = max(reach, end)
                    ends.append(reach)
                return ends
        return [len(t) for t in self.decode([ids[: k + 1] for k in range(len(ids))])]

    def item_tokens(
        self,
        user: str,
        item_span: tuple[int, int] | None,
        rendered: str,
        prompt_ids: Sequence[int],
        limit: int,
    ) -> tuple[int, int]:
        """The [start, end) tokens of ``prompt_ids`` (the tokenized ``rendered`` prompt) with a
        character in the item: ``item_span`` of the ``user`` prompt (None: all of it), among
        the first ``limit`` (those before the decision point)."""
        at = rendered.rfind(user)  # the user's message is the template's last
        if at < 0:
            raise InvalidQueryError(
                "this model's chat template changes the prompt's text, so the item's tokens "
                "cannot be found in what the model reads; ask for no span_layers",
                field="span_layers",
            )
        first, last = item_span or (0, len(user))
        first, last = at + first, at + last
        ends = self.token_ends(rendered, prompt_ids)
        inside = [
            t
            for t, end in enumerate(ends[:limit])
            if end > first and (t == 0 or ends[t - 1] < last)
        ]
        if not inside:
            raise InvalidQueryError(
                "the item's span holds no token of the prompt", field="item_span"
            )
        return inside[0], inside[-1] + 1

    def cut(self, prompt: str) -> int:
        """Character offset just after the last added token in ``prompt`` (0 if none)."""
        return max((prompt.rfind(t) + len(t) for t in self._added if t in prompt), default=0)

    def encode_paths(self, prompt: str, endings: Sequence[str]) -> Encoded:
        """Canonical tokenizations of ``prompt + e`` for each ending, and of ``prompt``."""
        cut = self.cut(prompt)
        if cut > 0:
            head, tail = prompt[:cut], prompt[cut:]
            head_ids = self.encode([head])[0]
            tails = self.encode([tail + e for e in endings] + [tail])
            paths = [head_ids + t for t in tails[:-1]]
            if self.encode([prompt + endings[0]])[0] == paths[0]:
                return Encoded(paths, head_ids + tails[-1], len(head_ids))
        encoded = self.encode([prompt + e for e in endings] + [prompt])
        return Encoded(encoded[:-1], encoded[-1], 0)

    def round_trip_failures(
        self, prompt: str, endings: Sequence[str], encoded: Encoded
    ) -> list[int]:
        """Indices of endings whose path does not decode back to ``prompt + ending``."""
        n = encoded.head_length
        head = self.decode([encoded.paths[0][:n]])[0] if n else ""
        if prompt.startswith(head):
            rest = prompt[len(head) :]
            tails = self.decode([p[n:] for p in encoded.paths])
            suspects = [
                i for i, (t, e) in enumerate(zip(tails, endings, strict=True)) if t != rest + e
            ]
        else:
            suspects = list(range(len(endings)))
        if not suspects:
            return []
        # A decoder may treat the start of a sequence specially: judge on the whole path.
        full = self.decode([encoded.paths[i] for i in suspects])
        return [i for i, text in zip(suspects, full, strict=True) if text != prompt + endings[i]]
