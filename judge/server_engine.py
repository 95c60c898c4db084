"""Judging with a model served elsewhere, over the OpenAI-compatible completions endpoint.

A server that returns the log-probabilities of a prompt's own tokens (``echo`` with
``logprobs``: vLLM, SGLang, llama-cpp-python's server) gives the trie's numbers exactly. Each
choice's path (the rendered prompt and the choice's ending, as text) is sent once and comes
back with log P(token | the tokens before it) for each of its tokens; every child of the root
and of each branching node lies on some choice's path, so every masked decoding step the local
engine reads from logits is there (a log-probability differs from the logit by the node's
log-normaliser, which the log-softmax over the children cancels). One request per choice,
each the path's own tokens and nothing more; a server that caches prefixes computes the
shared prompt once. That is ``read="echo"``, the default.

``read="top"`` asks instead, for each scored node, the server's top next tokens after the
node's prefix (``logprobs`` without echo: any OpenAI-compatible server, and far cheaper on
llama-cpp-python's, whose echo sorts the vocabulary in Python for every echoed token). A child
is read by its text among them; where every child is listed the step is exact, else the
children not listed are bounded (each at most the least listed, all at most what the listed
ones leave) and ``Judgment.unknown_mass`` bounds the choices' share not read: the gate
escalates where it could change the decision (``partial_logprobs``), and a fit refuses it.

What is checked, so that no made-up probability comes out:

* each path's tokens on the server are the local tokenizer's (their number, and the text of
  every token that decodes to text): another tokenizer or model is an error, not a reading
  shifted by a token;
* once per engine, that the server's echo is aligned: the log-probability it echoes for a
  token equals the one it gives that token when generating it (llama-cpp-python shifts echoed
  log-probabilities by one position where a prompt does not start with the BOS token);
* every log-probability read is a finite number <= 0, and in ``read="top"`` the server
  counts the prefix's tokens as the local tokenizer does.

A server that is down, slower than the engine's timeout, answers with an error status or
malformed JSON, or drops the connection mid-request raises ``ModelServerError`` (HTTP 502
from ``judge serve``); ``judge.completions_api`` makes the calls and decodes the answers.

What cannot be known is said, not filled in: the weights are not hashed here (a judgment's
``model_sha256`` is empty, the fingerprint's None), the arithmetic is the server's (nothing
promises that a judgment does not depend on its batch), and a query that asks for hidden
states (``feature_layers``, ``span_layers``: what a probe reads) is refused. A calibration
profile names the server and its model (``model_id``), so one fitted on another refuses it.

Choose it with a model spec:
``openai+http://HOST:PORT/v1?model=NAME&tokenizer=SOURCE&read=echo|top&top=K``, where
``model`` is the served model's name (default: the server's only one), ``tokenizer`` what the
local tokenizer loads from, named as for ``Judge.load`` (default: the embedded
SmolLM2-135M-Instruct), and ``top`` the next tokens a top read asks for (default 20).
"""

from __future__ import annotations

import logging
import math
import threading
import time
import urllib.parse
from collections import Counter
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, get_args

import httpx
import numpy as np

from judge.base_engine import BaseEngine
from judge.completions_api import CompletionsAPI, Logprobs
from judge.errors import InvalidQueryError, ModelLoadError, ModelServerError
from judge.fingerprint import ChoicePaths
from judge.judgments import Judgment, Prepared, Query
from judge.packing import DEFAULT_MAX_BATCH_SIZE, DEFAULT_MAX_BATCH_TOKENS
from judge.trie import ChoiceTrie

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["SCHEME", "ServerEngine", "ServerModel", "is_server_model"]

log = logging.getLogger("judge")

SCHEME = "openai+"  # before http:// or https://: a model served over the completions API
DEFAULT_TIMEOUT_S = 60.0
DEFAULT_CONCURRENCY = 4  # requests in flight at once, per engine
# How the choices' log-probabilities are read: "echo", the prompt's own (exact, one request
# per choice); "top", each scored node's top next tokens (one request per scored node, exact
# where every child is among them, else bounded: ``Judgment.unknown_mass``).
Read = Literal["echo", "top"]
READS: tuple[Read, ...] = get_args(Read)
DEFAULT_TOP = 20  # next tokens asked for in "top" (vLLM's default cap; OpenAI's is 5)
# An echoed log-probability and the generated one of the same token agree to this (they are
# the same computation; llama.cpp's batched and single-token passes round apart by ~1e-5).
ALIGNMENT_TOLERANCE = 1e-3
# The log-probability a choice left out of a server's top tokens is given (it rounds to a
# probability of 0; ``Judgment.unknown_mass`` bounds what it could be).
UNREAD_LOGPROB = math.log(np.finfo(np.float64).tiny)
_PROBE = "Answer with one word: what colour is a clear daytime sky?"


def is_server_model(model: object) -> bool:
    """Whether ``model`` names a model served over the completions API (``SCHEME``)."""
    return isinstance(model, str) and model.startswith((f"{SCHEME}http://", f"{SCHEME}https://"))


@dataclass(frozen=True)
class ServerModel:
    """A parsed model spec: the API's base URL, the served model's name, the tokenizer."""

    base_url: str  # e.g. http://127.0.0.1:8080/v1
    model: str | None = None  # None: the server's only model
    tokenizer: str | None = None  # None: the embedded default model's
    read: Read = "echo"
    top: int = DEFAULT_TOP

    @classmethod
    def parse(cls, spec: str) -> ServerModel:
        """``openai+http://HOST:PORT/v1?model=NAME&tokenizer=SOURCE``; a ValueError says what
        is wrong with another."""
        if not is_server_model(spec):
            raise ValueError(f"a served model's spec starts with {SCHEME}http(s)://, got {spec!r}")
        parts = urllib.parse.urlsplit(spec.removeprefix(SCHEME))
        if not parts.hostname:
            raise ValueError(f"{spec!r} names no host")
        query = urllib.parse.parse_qs(parts.query, keep_blank_values=True)
        unknown = sorted(set(query) - {"model", "tokenizer", "read", "top"})
        if unknown:
            raise ValueError(
                f"{spec!r}: unknown parameter {unknown[0]!r} (the spec takes model=, "
                "tokenizer=, read= and top=)"
            )
        for key, values in query.items():
            if len(values) != 1 or not values[0]:
                raise ValueError(f"{spec!r}: {key}= takes one non-empty value")
        given = {key: values[0] for key, values in query.items()}
        read = given.get("read", "echo")
        if read not in READS:
            raise ValueError(f"{spec!r}: read= is one of {', '.join(READS)}, not {read!r}")
        top = given.get("top", str(DEFAULT_TOP))
        if not top.isdigit() or int(top) < 1:
            raise ValueError(f"{spec!r}: top= is a whole number >= 1, not {top!r}")
        base = urllib.parse.urlunsplit((parts.scheme, parts.netloc, parts.path.rstrip("/"), "", ""))
        return cls(base, given.get("model"), given.get("tokenizer"), read, int(top))


@dataclass(frozen=True)
class _Scores:
    """What one judgment's requests gave: each scored node's children's log-probabilities
    (-inf where not known), a bound on the unknown share, and what was sent."""

    node_logits: list[np.ndarray]
    unknown_mass: float
    requests: int
    tokens: int


@dataclass(frozen=True)
class _Read:
    """What one path's request gave: each of its tokens' log-probability (None where the
    server gave none: the first), indexed as the local tokenization."""

    logprobs: list[float | None]
    tokens: int  # tokens the request sent


class ServerEngine(BaseEngine):
    """An engine whose model is served over HTTP (see the module's docstring)."""

    def __init__(
        self,
        base_url: str,
        tokenizer: PreTrainedTokenizerBase,
        *,
        read: Read = "echo",
        top_logprobs: int = DEFAULT_TOP,
        model: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        concurrency: int = DEFAULT_CONCURRENCY,
        context_window: int | None = None,
        system: str | None = None,
        response_prefix: str = '{"answer": "',
        response_suffix: str = '"}',
        choice_paths: ChoicePaths = "canonical",
        max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
        max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        if not (isinstance(timeout_s, int | float) and timeout_s > 0):
            raise ValueError(f"timeout_s must be a number > 0, got {timeout_s!r}")
        if not (isinstance(concurrency, int) and concurrency >= 1):
            raise ValueError(f"concurrency must be a whole number >= 1, got {concurrency!r}")
        if read not in READS:
            raise ValueError(f"read must be one of {', '.join(READS)}, got {read!r}")
        if not (isinstance(top_logprobs, int) and top_logprobs >= 1):
            raise ValueError(f"top must be a whole number >= 1, got {top_logprobs!r}")
        super().__init__(
            tokenizer,
            system=system,
            response_prefix=response_prefix,
            response_suffix=response_suffix,
            context_window=context_window,
            num_layers=None,
            choice_paths=choice_paths,
        )
        self.base_url = base_url.rstrip("/")
        self.timeout_s = float(timeout_s)
        self.concurrency = concurrency
        self.read: Read = read
        self.top_logprobs = top_logprobs
        self._texts: dict[str, int] | None = None
        self.max_batch_size = max_batch_size
        self.max_batch_tokens = max_batch_tokens
        self._api = CompletionsAPI(self.base_url, timeout_s=self.timeout_s, transport=transport)
        self.served_model = model or self._api.only_model()
        self.model_id = f"{SCHEME}{self.base_url}?model={self.served_model}"
        self.weights_sha256: str | None = None
        self.hidden_size: int | None = None
        self._aligned = False
        self._lock = threading.Lock()

    def _read_choices_on(self, choice_paths: ChoicePaths) -> None:
        if choice_paths != "canonical":
            # Paths go to the server as text, which it tokenizes canonically; another path of
            # the same text would need prompts of token ids.
            raise ValueError(
                f"a served model is judged on canonical paths only, not {choice_paths!r}: "
                "each choice's path is sent as text"
            )
        super()._read_choices_on(choice_paths)

    @classmethod
    def open(cls, spec: str, **options: Any) -> ServerEngine:
        """The engine for a model spec (``ServerModel.parse``), its tokenizer loaded here."""
        from judge.loading import load_tokenizer

        try:
            parsed = ServerModel.parse(spec)
            tokenizer, window = load_tokenizer(parsed.tokenizer)
            options.setdefault("context_window", window)
            return cls(
                parsed.base_url,
                tokenizer,
                model=parsed.model,
                read=parsed.read,
                top_logprobs=parsed.top,
                **options,
            )
        except ValueError as exc:  # a bad spec or option: the model cannot be opened
            raise ModelLoadError(str(exc)) from None

    @property
    def dtype(self) -> str:
        return "server"  # the server's own; not known here

    @property
    def model_sha256(self) -> str:
        return ""  # the weights live on the server and are not hashed here

    @property
    def decoder_pass(self) -> str:
        return "server"

    @property
    def arithmetic(self) -> str:
        return (
            f"the server's at {self.base_url} (model {self.served_model}): its weights are not "
            "hashed here, and a judgment may depend on what the server batches it with"
        )

    def close(self) -> None:
        self._api.close()

    def prepare(self, query: Query | Mapping[str, Any]) -> Prepared:
        """As any engine's, but a query asking for hidden states is refused: a server returns
        log-probabilities only."""
        for name in ("feature_layers", "span_layers"):
            asked = getattr(query, name, None) if isinstance(query, Query) else None
            if isinstance(query, Mapping):
                asked = query.get(name)
            if asked:
                raise InvalidQueryError(
                    f"{name}: a model served over HTTP returns no hidden states; a probe "
                    "profile needs a model loaded here",
                    field=name,
                )
        return super().prepare(query)

    def _score(self, rows: list[list[Prepared]], start: float) -> list[Judgment]:
        """Every request of every item in one pool, ``concurrency`` in flight at once (a
        server that runs requests side by side answers a judgment in about one round trip),
        then each item's steps from its own answers."""
        prepared = [p for row in rows for p in row]
        if self.read == "echo":
            self._check_alignment()
        asks = [self._asks(p) for p in prepared]
        ask = self._read if self.read == "echo" else self._top_next
        with ThreadPoolExecutor(self.concurrency) as pool:
            answers = iter(list(pool.map(lambda a: ask(*a), [a for item in asks for a in item])))
        scores = [
            self._scores(p, [next(answers) for _ in item])
            for p, item in zip(prepared, asks, strict=True)
        ]
        latency_ms = (time.perf_counter() - start) * 1000
        return [self._result(p, s, latency_ms) for p, s in zip(prepared, scores, strict=True)]

    def _asks(self, prepared: Prepared) -> list[tuple[str, Any]]:
        """One item's requests, as (text, its tokens) for the echo (a choice's path each)
        and as (text, its token count) for the top read (a scored node's prefix each)."""
        if self.read == "echo":
            paths = self._encoder.encode_paths(prepared.prompt, list(prepared.endings)).paths
            texts = [prepared.prompt + ending for ending in prepared.endings]
            return [(text, list(ids)) for text, ids in zip(texts, paths, strict=True)]
        trie = prepared.trie
        prefixes = [[*trie.context, *_chain(trie, at)] for at in trie.node_positions]
        return [(str(self.tokenizer.decode(ids)), len(ids)) for ids in prefixes]

    def _scores(self, prepared: Prepared, answers: list[Any]) -> _Scores:
        """One item's steps from its requests' answers (``_asks``'s order)."""
        trie = prepared.trie
        if self.read == "echo":
            logits = _node_logprobs(trie, [r.logprobs for r in answers], self.base_url)
            return _Scores(logits, 0.0, len(answers), sum(r.tokens for r in answers))
        return self._read_nodes(trie, answers)

    def _read_nodes(self, trie: ChoiceTrie, tops: list[dict[str, float]]) -> _Scores:
        """Each scored node's children read by their text among its top next tokens
        (``tops``, a node each). A child not among them (or whose text another token shares)
        is not known: at most the least of the top ones, and all such children at most what
        the top ones leave."""
        logits: list[np.ndarray] = []
        unknown = 0.0
        texts = self._token_texts()
        for children, top in zip(trie.node_children, tops, strict=True):
            z = np.full(len(children), -math.inf)
            for k, child in enumerate(children):
                text = str(self.tokenizer.decode([child]))
                if texts.get(text) == 1 and text in top:
                    z[k] = top[text]
            missing = int(np.isinf(z).sum())
            if missing:
                listed = np.exp(np.array(list(top.values()), dtype=np.float64))
                bound = min(missing * float(listed.min()), max(0.0, 1.0 - float(listed.sum())))
                known = float(np.exp(z[np.isfinite(z)]).sum())
                unknown += bound / (known + bound) if known + bound > 0 else 1.0
            logits.append(z)
        sent = len(trie.context) * len(tops) + sum(
            trie.tree_depths[p] for p in trie.node_positions[1:]
        )
        return _Scores(logits, min(1.0, unknown), len(tops), sent)

    def _top_next(self, text: str, tokens: int) -> dict[str, float]:
        """The server's top next tokens after ``text`` (``tokens`` tokens here), by text."""
        completion = self._api.complete(self.served_model, text, echo=False, top=self.top_logprobs)
        if completion.usage is not None and completion.usage.prompt_tokens != tokens:
            raise ModelServerError(
                f"the model server at {self.base_url} tokenizes the text into "
                f"{completion.usage.prompt_tokens} tokens where the local tokenizer makes "
                f"{tokens}: it serves another tokenizer"
            )
        got = completion.choices[0].logprobs
        top = got.top_logprobs[0] if got is not None and got.top_logprobs else None
        if not top:
            raise ModelServerError(
                f"the model server at {self.base_url} returned no top log-probabilities"
            )
        for value in top.values():
            if not (math.isfinite(value) and value <= 1e-6):
                raise ModelServerError(
                    f"the model server at {self.base_url} returned a log-probability of {value}"
                )
        return top

    def _token_texts(self) -> dict[str, int]:
        """How many of the vocabulary's tokens decode to each text (once per engine): a text
        that several share cannot name one among a server's top tokens."""
        with self._lock:
            if self._texts is None:
                size = len(self.tokenizer)
                self._texts = dict(Counter(self.tokenizer.batch_decode([[i] for i in range(size)])))
            return self._texts

    def _read(self, text: str, ids: list[int]) -> _Read:
        """The server's echoed log-probabilities of ``text``'s tokens ``ids``, checked to be
        those tokens."""
        got = self._api.complete(self.served_model, text, echo=True).choices[0].logprobs
        if got is None or len(got.tokens) != len(got.token_logprobs):
            raise ModelServerError(
                f"the model server at {self.base_url} returned no prompt log-probabilities; it "
                "must support echo with logprobs on /completions (vLLM, SGLang, "
                "llama-cpp-python's server; llama.cpp's llama-server does not)"
            )
        return _Read(self._aligned_logprobs(got, ids), len(ids))

    def _aligned_logprobs(self, got: Logprobs, ids: list[int]) -> list[float | None]:
        """``got``'s log-probabilities laid on the local tokens ``ids``: the echo is those
        tokens, maybe without BOS tokens (llama-cpp-python leaves every one out), then what
        the server generated. Another tokenization is an error."""
        out: list[float | None] = []
        m = 0
        bos = self.tokenizer.bos_token_id
        for k, token in enumerate(ids):
            theirs = got.tokens[m] if m < len(got.tokens) else None
            ours = theirs is not None and self._same_token(token, theirs)
            if ours and (token != bos or theirs or self._next_is_not(ids, k, got.tokens, m)):
                out.append(got.token_logprobs[m])
                m += 1
                continue
            if token == bos:  # left out of the echo
                out.append(None)
                continue
            raise ModelServerError(
                f"the model server at {self.base_url} reads token {k} of the text as "
                f"{theirs!r} where the local tokenizer has {self.tokenizer.decode([token])!r}: "
                "it serves another tokenizer (name the served model's with tokenizer= in the "
                "model spec)"
            )
        if len(got.tokens) - m > 1:  # max_tokens is 1
            raise ModelServerError(
                f"the model server at {self.base_url} tokenizes the text into "
                f"{len(got.tokens) - 1} or more tokens where the local tokenizer makes "
                f"{len(ids)}: it serves another tokenizer"
            )
        return out

    def _same_token(self, token: int, theirs: str) -> bool:
        """Whether the server's text of a token can be local ``token``: the same text, or ""
        for a special token (servers write those as their name or as nothing), or any text
        for a piece of a character (U+FFFD here, "" or bytes on a server)."""
        mine = self.tokenizer.decode([token])
        special = token in self.tokenizer.all_special_ids
        return theirs == mine or "\ufffd" in mine or (special and theirs == "")

    def _next_is_not(self, ids: list[int], k: int, tokens: list[str], m: int) -> bool:
        """For a BOS token the server wrote as "": whether that entry is not in fact the
        next token's (then it is the BOS token's own)."""
        return k + 1 >= len(ids) or not self._same_token(ids[k + 1], tokens[m])

    def _check_alignment(self) -> None:
        """Once: the server's echoed log-probability of a token is the one it gives that
        token when it generates it (see the module's docstring)."""
        with self._lock:
            if self._aligned:
                return
            prompt = self.render(_PROBE)
            generated = (
                self._api.complete(self.served_model, prompt, echo=False).choices[0].logprobs
            )
            if generated is None or not generated.token_logprobs:
                raise ModelServerError(
                    f"the model server at {self.base_url} returned no log-probabilities"
                )
            token, want = generated.tokens[0], generated.token_logprobs[0]
            ids = self.tokenizer(prompt + token, add_special_tokens=False).input_ids
            if not token or self.tokenizer.decode(ids[-1:]) != token:
                # The probe's text tokenizes otherwise with the token: nothing to compare.
                log.warning("%s: the echo's alignment could not be checked", self.base_url)
                self._aligned = True
                return
            got = self._read(prompt + token, ids).logprobs[-1]
            if want is None or got is None or abs(got - want) > ALIGNMENT_TOLERANCE:
                raise ModelServerError(
                    f"the model server at {self.base_url} echoes log-probabilities that are not "
                    f"its tokens': {token!r} generated at {want}, echoed at {got}"
                )
            self._aligned = True

    def _result(self, prepared: Prepared, scores: _Scores, latency_ms: float) -> Judgment:
        logps = prepared.trie.choice_logprobs(scores.node_logits)
        unknown = scores.unknown_mass
        if not np.isfinite(logps).any():
            # None of the choices was among the top tokens: nothing is known of them. Equal
            # placeholders, with all of it unknown, so the gate escalates.
            logps, unknown = np.zeros(len(logps)), 1.0
        # A choice whose path the top tokens left out has no known probability: 0 here, and
        # ``unknown_mass`` says how much it could hold. Its log stays finite on the wire.
        logps = np.maximum(logps, UNREAD_LOGPROB)
        root = scores.node_logits[0]
        return self._judgment(
            prepared,
            logps,
            choice_mass=float(np.exp(root[np.isfinite(root)]).sum()),
            cached_tokens=0,  # the server's prefix cache, if any, is not reported
            computed_tokens=scores.tokens,  # the tokens sent
            forward_passes=scores.requests,  # the requests made
            latency_ms=latency_ms,
            model_sha256="",
            unknown_mass=unknown,
        )


def _chain(trie: ChoiceTrie, position: int) -> list[int]:
    """The tree tokens from the decision point down to ``position`` (an index into
    ``tree_tokens``; -1: none), in order."""
    out = []
    while position >= 0:
        out.append(trie.tree_tokens[position])
        position = trie.tree_parents[position]
    return out[::-1]


def _node_logprobs(
    trie: ChoiceTrie, paths: Sequence[list[float | None]], server: str
) -> list[np.ndarray]:
    """Each scored node's children's log-probabilities, in ``node_children`` order, read from
    the choices' paths (``paths[i][j]``: log P of choice i's token j): a node's child sits at
    the context's length plus the node's depth on every path through it."""
    position = [len(trie.context)]
    position += [len(trie.context) + trie.tree_depths[p] for p in trie.node_positions[1:]]
    values: list[list[float | None]] = [[None] * len(c) for c in trie.node_children]
    for i, steps in enumerate(trie.choice_steps):
        for node, slot in steps:
            if values[node][slot] is None:
                values[node][slot] = paths[i][position[node]]
    out = []
    for node, row in enumerate(values):
        for v in row:
            if not (isinstance(v, float | int) and math.isfinite(v) and v <= 1e-6):
                raise ModelServerError(
                    f"the model server at {server} gave no usable log-probability at the "
                    f"choices' step {node} (got {v!r})"
                )
        out.append(np.array(row, dtype=np.float64))
    return out
