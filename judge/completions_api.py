"""The OpenAI-compatible completions endpoint, as ``judge.server_engine`` asks it.

Two calls: one greedy token after a text, with log-probabilities (``POST /completions``:
``echo`` for the text's own tokens, ``logprobs`` for the top next tokens), and the server's
one model (``GET /models``). Each answer is decoded as far as it is read, its types checked by
msgspec. A server that is down, slower than the timeout, answers with an error status or
malformed JSON, or drops the connection mid-request raises ``ModelServerError`` (HTTP 502 from
``judge serve``). What the numbers mean for a judgment, and the checks on them, are the
engine's.
"""

from __future__ import annotations

from typing import Any

import httpx
import msgspec

from judge.errors import ModelServerError

__all__ = ["Completion", "CompletionsAPI", "Logprobs"]


# The completions endpoint's answer, as far as it is read.
class Logprobs(msgspec.Struct):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] | None = None


class _Choice(msgspec.Struct):
    text: str = ""
    index: int = 0
    logprobs: Logprobs | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int


class Completion(msgspec.Struct):
    choices: list[_Choice]  # one: ``complete`` refuses another count
    usage: _Usage | None = None


class _Model(msgspec.Struct):
    id: str


class _Models(msgspec.Struct):
    data: list[_Model]


class CompletionsAPI:
    """One server's completions API, over one HTTP client (``close`` it when done)."""

    def __init__(
        self, base_url: str, *, timeout_s: float, transport: httpx.BaseTransport | None = None
    ) -> None:
        self.base_url = base_url  # e.g. http://127.0.0.1:8080/v1, without a trailing /
        self.timeout_s = timeout_s
        self._client = httpx.Client(timeout=timeout_s, transport=transport)

    def close(self) -> None:
        self._client.close()

    def complete(self, model: str, text: str, *, echo: bool, top: int = 1) -> Completion:
        """One completion of ``text`` by ``model``: greedy, one token, ``top``
        log-probabilities, and with ``echo`` those of ``text``'s own tokens before it."""
        body: dict[str, Any] = {
            "model": model,
            "prompt": text,
            "max_tokens": 1,  # 0 means "no limit" to some servers
            "temperature": 0,
            "logprobs": top,
            "echo": echo,
        }
        data = self._call("POST", "/completions", body)
        try:
            completion = msgspec.json.decode(data, type=Completion)
        except msgspec.DecodeError as exc:
            raise ModelServerError(
                f"the model server at {self.base_url} answered /completions with malformed "
                f"JSON: {exc}"
            ) from None
        if len(completion.choices) != 1:
            raise ModelServerError(
                f"the model server at {self.base_url} answered one prompt with "
                f"{len(completion.choices)} completions"
            )
        return completion

    def only_model(self) -> str:
        """The name of the server's one model (``GET /models``)."""
        data = self._call("GET", "/models", None)
        try:
            models = msgspec.json.decode(data, type=_Models).data
        except msgspec.DecodeError as exc:
            raise ModelServerError(
                f"the model server at {self.base_url} answered /models with malformed JSON: {exc}"
            ) from None
        if len(models) != 1:
            names = ", ".join(m.id for m in models) or "none"
            raise ModelServerError(
                f"the model server at {self.base_url} serves {len(models)} models ({names}); "
                "name one with model= in the model spec"
            )
        return models[0].id

    def _call(self, method: str, path: str, body: dict[str, Any] | None) -> bytes:
        url = self.base_url + path
        try:
            response = self._client.request(method, url, json=body)
        except httpx.TimeoutException:
            raise ModelServerError(
                f"the model server at {self.base_url} did not answer {path} within "
                f"{self.timeout_s:g} s"
            ) from None
        except httpx.HTTPError as exc:
            raise ModelServerError(
                f"the model server at {self.base_url} could not be reached or dropped the "
                f"connection ({type(exc).__name__}: {exc})"
            ) from None
        if response.status_code >= 400:
            raise ModelServerError(
                f"the model server at {self.base_url} answered {path} with HTTP "
                f"{response.status_code}: {response.text[:300]}"
            )
        return response.content
