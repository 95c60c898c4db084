"""A model served over the OpenAI-compatible completions endpoint, judged as a loaded one is.

Against a real server (llama-cpp-python's, on the default model's own GGUF file): the
probabilities agree with the local engine's within the quantization difference, the tokens
hashed are the same, the judgment names the server and hashes no weights, ``judge serve`` and
``judge calibrate`` run on it, and a server killed mid-request is an error, never a number.

Against a fake one (``httpx.MockTransport``, whose log-probabilities are a known function of
position and token): each step is read at its position, and every way a server can answer
wrongly is a ``ModelServerError`` that says what went wrong.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from llama_server import LlamaServer
from server import Server, free_port

from calibration import PolicyDefaults, load_profile, make_policy
from calibration.tasks import TaskError, judge_labeled, load_split, load_task, task_prompt
from judge import InvalidQueryError, Judge, ModelServerError, Query
from judge.engines import open_engine
from judge.server_engine import ServerEngine, ServerModel
from service.log.backends import open_log

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
# The served model runs the GGUF's 4-bit weights in llama.cpp's arithmetic, the local engine
# their float32 de-quantization in torch's: 0.097 apart at most over 100 + 100 items of every
# shared set (benchmarks/bench_server.py, RESULTS.md), 0.059 on this module's items.
TOLERANCE = 0.1
# The tests against llama.cpp's real server (minutes on 2 cores: llama-cpp-python sorts the
# vocabulary in Python for every echoed token) run in `make bench-smoke`, which CI runs after
# `make test`; the fakes' run in `make test`.
SERVED = pytest.mark.bench


# --- a fake server: log-probabilities that are a known function of where they are read ------


VOCABULARY = 49152  # the default model's


def _logits(row: int) -> np.ndarray:
    """The fake's next-token logits after the first row + 1 tokens, over the vocabulary: a
    known function of row and token."""
    tokens = np.arange(VOCABULARY)
    return ((tokens * 7 + row * 13) % 29) / 10


def _logprob(row: int, token: int) -> float:
    """The fake's log P(token | the first row + 1 tokens)."""
    z = _logits(row)
    return float(z[token] - np.logaddexp.reduce(z))


class FakeServer:
    """The completions endpoint over the local tokenizer. ``shift``: echo each token's
    log-probability from one row late (llama-cpp-python's echo where a prompt does not
    start with BOS); ``rename``: write the tokens' text otherwise (another tokenizer)."""

    GENERATED = " blue"

    def __init__(self, tokenizer: Any, **faults: Any) -> None:
        self.tokenizer = tokenizer
        self.faults = faults
        self.requests: list[dict[str, Any]] = []
        self.generated = tokenizer(self.GENERATED, add_special_tokens=False).input_ids[0]

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/models"):
            names = self.faults.get("models", ["fake"])
            return httpx.Response(200, json={"data": [{"id": n} for n in names]})
        fault = self.faults.get("respond")
        if fault is not None:
            return fault(request)
        together = self.faults.get("together")
        if together is not None:
            together.wait()  # until as many requests as it holds are in flight
        body = json.loads(request.content)
        self.requests.append(body)
        ids = self.tokenizer(body["prompt"], add_special_tokens=False).input_ids
        last = _logprob(len(ids) - 1, self.generated)  # the token it generates, at the end
        logprobs: dict[str, list[Any]] = {"tokens": [self.GENERATED], "token_logprobs": [last]}
        if not body["echo"]:  # the top next tokens, by text, as llama-cpp-python writes them
            z = _logits(len(ids) - 1)
            z = z - np.logaddexp.reduce(z)
            order = np.argsort(-z, kind="stable")[: body["logprobs"]]
            top = {self.tokenizer.decode([int(t)]): float(z[t]) for t in order}
            top.update(self.faults.get("also", {}))
            logprobs["top_logprobs"] = [top]
        if body["echo"]:
            late = 1 if self.faults.get("shift") else 0
            echoed = [_logprob(k - 1 + late, t) for k, t in enumerate(ids)][1:]
            texts = [self.tokenizer.decode([t]) for t in ids]
            if self.faults.get("rename"):
                texts = [t.upper() for t in texts]
            logprobs = {
                "tokens": [*texts, self.GENERATED],
                "token_logprobs": [None, *echoed, last],
            }
        if self.faults.get("no_logprobs"):
            return httpx.Response(200, json={"choices": [{"text": self.GENERATED}]})
        choice = {"text": self.GENERATED, "index": 0, "logprobs": logprobs}
        usage = {"prompt_tokens": len(ids) + self.faults.get("count_off", 0)}
        return httpx.Response(200, json={"choices": [choice], "usage": usage})


def _fake_engine(
    judge: Judge, read: str = "echo", top: int = 20, **faults: Any
) -> tuple[ServerEngine, FakeServer]:
    fake = FakeServer(judge.tokenizer, **faults)
    transport = httpx.MockTransport(fake)
    engine = ServerEngine(
        "http://fake/v1",
        judge.tokenizer,
        transport=transport,
        read=read,  # type: ignore[arg-type]
        top_logprobs=top,
    )
    return engine, fake


def test_each_step_is_read_at_its_position(judge: Judge) -> None:
    engine, fake = _fake_engine(judge)
    prompt = "Is this SMS spam? WINNER!! Claim your prize."
    got = engine.judge(prompt, ["spam", "ham"])
    rendered = judge.render(prompt)
    n = len(judge.tokenizer(rendered, add_special_tokens=False).input_ids)
    first = [
        judge.tokenizer(rendered + c, add_special_tokens=False).input_ids[n]
        for c in ("spam", "ham")
    ]
    logps = np.array([_logprob(n - 1, t) for t in first])
    want = np.exp(logps - np.logaddexp.reduce(logps))
    assert got.probs == pytest.approx(want.tolist(), abs=1e-12)
    assert got.choice_mass == pytest.approx(float(np.exp(logps).sum()), abs=1e-12)
    # One request per choice, each the choice's whole path, after the one alignment check.
    paths = [r["prompt"] for r in fake.requests if r["echo"]]  # in flight at once: any order
    assert sorted(paths[-2:]) == sorted([rendered + 'spam"}', rendered + 'ham"}'])
    assert got.forward_passes == 2
    # What cannot be known is not filled in; what can be is the local engine's.
    assert got.model_sha256 == "" and got.model == "openai+http://fake/v1?model=fake"
    assert got.tokens_sha256 == judge.judge(prompt, ["spam", "ham"]).tokens_sha256
    fingerprint = engine.fingerprint()
    assert fingerprint.model_sha256 is None and fingerprint.dtype == "server"
    assert fingerprint.num_layers is None and fingerprint.hidden_size is None


def test_a_judgment_s_requests_are_in_flight_at_once(judge: Judge) -> None:
    """The choices' requests go out side by side (``concurrency``): a server that answers
    the two only once both are in flight answers the judgment."""
    engine, fake = _fake_engine(judge)
    engine.judge("Is the sky blue?", ["yes", "no"])  # the echo's alignment checked first
    fake.faults["together"] = threading.Barrier(2, timeout=60)
    assert engine.judge("Is the sky blue?", ["yes", "no"]).forward_passes == 2


def _respond(status: int, content: bytes) -> Callable[[httpx.Request], httpx.Response]:
    return lambda request: httpx.Response(status, content=content)


def _timeout(request: httpx.Request) -> httpx.Response:
    raise httpx.ReadTimeout("timed out", request=request)


@pytest.mark.parametrize(
    ("faults", "says"),
    [
        ({"shift": True}, "echoes log-probabilities that are not its tokens'"),
        ({"rename": True}, "serves another tokenizer"),
        ({"no_logprobs": True}, "returned no log-probabilities"),
        ({"respond": _respond(500, b"model crashed")}, "HTTP 500: model crashed"),
        ({"respond": _respond(200, b"{not json")}, "malformed JSON"),
        ({"respond": _respond(200, b'{"choices": []}')}, "with 0 completions"),
        ({"respond": _timeout}, "did not answer /completions within 60 s"),
    ],
    ids=["misaligned echo", "other tokenizer", "no logprobs", "500", "not json", "empty", "slow"],
)
def test_a_server_that_answers_wrongly_is_an_error_not_a_number(
    judge: Judge, faults: dict[str, Any], says: str
) -> None:
    engine, _ = _fake_engine(judge, **faults)
    with pytest.raises(ModelServerError, match=says.replace("(", r"\(")):
        engine.judge("Is the sky blue?", ["yes", "no"])


def test_partial_echo_is_an_error(judge: Judge) -> None:
    """Log-probabilities for fewer tokens than the path: the alignment check passes (it
    reads a short path), the judgment's own read does not."""
    engine, fake = _fake_engine(judge)
    engine.judge("Is the sky blue?", ["yes", "no"])  # checked and aligned

    def partial(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        ids = judge.tokenizer(body["prompt"], add_special_tokens=False).input_ids[:-3]
        texts = [judge.tokenizer.decode([t]) for t in ids]
        logprobs = {"tokens": texts, "token_logprobs": [None] + [-1.0] * (len(ids) - 1)}
        return httpx.Response(200, json={"choices": [{"text": "", "logprobs": logprobs}]})

    fake.faults["respond"] = partial
    with pytest.raises(ModelServerError, match="reads token"):
        engine.judge("Is the sky blue?", ["yes", "no"])


def test_an_unreachable_server_is_an_error_within_its_timeout() -> None:
    port = free_port()  # nothing listens there
    start = time.monotonic()
    with pytest.raises(ModelServerError, match="could not be reached"):
        open_engine(f"openai+http://127.0.0.1:{port}/v1", timeout_s=5)
    assert time.monotonic() - start < 120  # a hang bound: the tokenizer's load included


def test_a_spec_names_what_is_wrong_with_it() -> None:
    assert ServerModel.parse("openai+http://h:1/v1/?model=m&tokenizer=t") == ServerModel(
        "http://h:1/v1", "m", "t"
    )
    for spec, says in [
        ("openai+http:///v1", "names no host"),
        ("openai+http://h:1/v1?models=m", "unknown parameter 'models'"),
        ("openai+http://h:1/v1?model=", "takes one non-empty value"),
        ("http://h:1/v1", "starts with openai+"),
    ]:
        with pytest.raises(ValueError, match=says):
            ServerModel.parse(spec)


def test_several_served_models_must_be_named(judge: Judge) -> None:
    transport = httpx.MockTransport(FakeServer(judge.tokenizer, models=["a", "b"]))
    with pytest.raises(ModelServerError, match=r"serves 2 models \(a, b\); name one"):
        ServerEngine("http://fake/v1", judge.tokenizer, transport=transport)
    named = ServerEngine("http://fake/v1", judge.tokenizer, model="b", transport=transport)
    assert named.model_id.endswith("?model=b")


def test_a_served_model_reads_canonical_paths_only(judge: Judge) -> None:
    """Paths go to the server as text, which it tokenizes canonically: the grammar-exact
    mode is refused when the engine is built and when it is switched to."""
    engine, _ = _fake_engine(judge)
    with pytest.raises(ValueError, match="canonical paths only, not 'grammar'"):
        engine.with_choice_paths("grammar")
    transport = httpx.MockTransport(FakeServer(judge.tokenizer))
    with pytest.raises(ValueError, match="canonical paths only"):
        ServerEngine("http://fake/v1", judge.tokenizer, choice_paths="grammar", transport=transport)


def test_an_adapter_is_refused_naming_the_field(judge: Judge) -> None:
    from test_adapter import random_adapter

    engine, fake = _fake_engine(judge)
    with pytest.raises(InvalidQueryError, match="cannot judge under a low-rank adapter") as caught:
        engine.judge("Is the sky blue?", ["yes", "no"], adapter=random_adapter(judge, [2]))
    assert caught.value.field == "adapter"
    assert fake.requests == []  # refused before any request


def test_hidden_states_are_refused(judge: Judge) -> None:
    engine, fake = _fake_engine(judge)
    for options in ({"feature_layers": [3]}, {"span_layers": [3]}):
        with pytest.raises(InvalidQueryError, match="returns no hidden states") as caught:
            engine.judge("Is the sky blue?", ["yes", "no"], **options)  # type: ignore[arg-type]
        assert caught.value.field == next(iter(options))
    assert fake.requests == []  # refused before any request


# --- a real server ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama() -> Iterator[LlamaServer]:
    server = LlamaServer()
    yield server
    server.kill()


@pytest.fixture(scope="module")
def served(llama: LlamaServer) -> Iterator[ServerEngine]:
    # A watchdog, not a speed: on 2 AVX2 cores beside the other worker's passes, a long item's
    # echoes queued behind each other at the one-slot server took past the default 60 s.
    engine = open_engine(llama.spec, timeout_s=900)
    assert isinstance(engine, ServerEngine)
    yield engine
    engine.close()


def _items() -> list[tuple[str, list[str]]]:
    """Two to five choices, and choices that share leading tokens (the trie descended)."""
    items = []
    for name, count in (("sst2", 1), ("commonsense_qa", 1)):
        task = load_task(DATA / name)
        for item in load_split(task, "test", limit=count)[0]:
            items.append((task_prompt(task, item.text), list(task.choices)))
    items.append(("How many legs does a spider have? Answer with a number.", ["8", "80", "800"]))
    return items


@SERVED
def test_the_served_model_agrees_with_the_local_one(served: ServerEngine, judge: Judge) -> None:
    for prompt, choices in _items():
        got, local = served.judge(prompt, choices), judge.judge(prompt, choices)
        assert got.choices == local.choices
        gap = max(abs(a - b) for a, b in zip(got.probs, local.probs, strict=True))
        assert gap <= TOLERANCE, (prompt[:60], got.probs, local.probs)
        assert abs(got.choice_mass - local.choice_mass) <= TOLERANCE
        assert got.tokens_sha256 == local.tokens_sha256  # the same tokens, read elsewhere
        assert got.forward_passes == len(choices)  # one request per choice path
        assert got.model == served.model_id == f"openai+{served.base_url}?model=smollm2"


@SERVED
def test_calibrate_then_serve_the_served_model_and_a_dead_one_is_a_502(
    judge: Judge, tmp_path: Path
) -> None:
    """`judge calibrate --model openai+...` fits a profile that names the served model (no
    weights hash; `auto` chooses among the scalar maps and says why) and that a model loaded
    here refuses; `judge serve --model openai+...` decides with it, the answer and its log
    row naming the server; the server killed in the middle of a request is a 502 that says
    so."""
    llama = LlamaServer()  # its own: this test kills it
    # Read from the top 1000 next tokens: both choices' tokens among them on these items
    # (calibrate refuses an item read in part), 20x faster than the echo here.
    spec = llama.spec + "?read=top&top=1000"
    served_as = llama.spec + "?model=smollm2"
    profiles = tmp_path / "profiles"
    command = [sys.executable, "-m", "service.cli.main", "calibrate", "--model", spec]
    command += ["--task", str(DATA / "sms_spam"), "--limit", "20", "--profiles-dir", str(profiles)]
    done = subprocess.run(command, capture_output=True, text=True, check=False, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    profile = load_profile(profiles / "sms_spam.json")
    assert profile.fingerprint.model == served_as
    assert profile.fingerprint.model_sha256 is None and profile.fingerprint.dtype == "server"
    assert profile.fingerprint.num_layers is None
    assert "a model served over HTTP returns log-probabilities only" in profile.note
    assert profile.fingerprint.first_difference(judge.fingerprint()) == "model"

    port = free_port()
    log_path = tmp_path / "decisions.sqlite"
    command = [sys.executable, "-m", "service.cli.main", "serve", "--port", str(port)]
    command += ["--model", spec, "--decision-log", str(log_path)]
    command += ["--profiles-dir", str(profiles)]
    judge_server = Server(command, port)
    echo_port = free_port()
    command = [sys.executable, "-m", "service.cli.main", "serve", "--port", str(echo_port)]
    command += ["--model", llama.spec, "--profiles-dir", str(profiles)]
    echo_server = Server(command, echo_port)  # the echo: seconds per long item here
    try:
        judge_server.wait_ready()
        body = {"item": "WINNER!! Claim your prize now", "profile": "sms_spam"}
        # In the fitted prompt. The timeout is a watchdog (httpx's default of 5 s was passed
        # on a busy 2-core AVX2 machine).
        ok = httpx.post(f"{judge_server.url}/judge", json=body, timeout=600)
        assert ok.status_code == 200, ok.text
        answer = ok.json()
        assert answer["model"] == served_as and answer["model_sha256"] == ""
        assert answer["profile"] == "sms_spam" and answer["temperature"] is not None
        with open_log(str(log_path)) as decisions:
            row = decisions.get(answer["judgment_id"])
        assert row is not None and row.model == served_as  # the log row names the server

        # A long prompt keeps the server busy; it is killed while the request is in flight.
        echo_server.wait_ready()
        long_body = {"prompt": "Review: a long, slow film. " * 150, "choices": ["good", "bad"]}
        answers: list[httpx.Response] = []
        sent = threading.Thread(
            target=lambda: answers.append(
                httpx.post(f"{echo_server.url}/judge", json=long_body, timeout=300)
            )
        )
        sent.start()
        time.sleep(2)
        llama.kill()
        sent.join(300)
        assert answers and answers[0].status_code == 502, answers[0].text if answers else None
        assert "could not be reached or dropped the connection" in answers[0].json()["detail"]
    finally:
        echo_server.stop()
        judge_server.stop()
        llama.kill()


@SERVED
def test_qualify_runs_on_the_served_model(llama: LlamaServer, tmp_path: Path) -> None:
    """`judge qualify openai+...`: the suite runs through the server, and its record names
    the served model and says whose arithmetic it was."""
    out = tmp_path / "qualify.json"
    command = [sys.executable, "-m", "service.cli.main", "qualify"]
    command += [llama.spec + "?read=top&top=1000", "--task", str(DATA / "sms_spam")]
    command += ["--limit", "20", "--fit-limit", "20", "--json", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, check=False, timeout=900)
    assert done.returncode in (0, 1), done.stdout[-2000:] + done.stderr[-2000:]  # 1: misses
    record = json.loads(out.read_text())
    assert record["fingerprint"]["model"] == llama.spec + "?model=smollm2"
    assert record["arithmetic"].startswith("the server's at ")
    assert [t["task"] for t in record["tasks"]] == ["sms_spam"]


# --- read from the top next tokens ------------------------------------------------------------

SPIDER = ("How many legs does a spider have? Answer with a number.", ["8", "80", "800"])


def test_the_top_next_tokens_give_the_echo_s_numbers_where_every_child_is_among_them(
    judge: Judge,
) -> None:
    """Choices that share leading tokens ("8", "80", "800"): the root, the "8" node and the
    "80" node are a request each, and where every node's children are among the top tokens
    (here the whole vocabulary is listed) the numbers are the echo's, exactly."""
    echo, _ = _fake_engine(judge)
    top, fake = _fake_engine(judge, read="top", top=VOCABULARY)
    want, got = echo.judge(*SPIDER), top.judge(*SPIDER)
    assert got.unknown_mass == 0.0
    assert got.probs == pytest.approx(want.probs, abs=1e-9)
    assert got.choice_mass == pytest.approx(want.choice_mass, abs=1e-12)
    assert got.forward_passes == len(fake.requests) == 3
    rendered = judge.render(SPIDER[0])
    sent = sorted(r["prompt"] for r in fake.requests)  # in flight at once: any order
    assert sent == [rendered, rendered + "8", rendered + "80"]
    assert all(not r["echo"] for r in fake.requests)


def test_a_child_left_out_of_the_top_tokens_is_bounded_not_made_up(judge: Judge) -> None:
    prompt = "Is this SMS spam? WINNER!! Claim your prize."
    rendered = judge.render(prompt)
    n = len(judge.tokenizer(rendered, add_special_tokens=False).input_ids)
    first = {
        c: judge.tokenizer(rendered + c, add_special_tokens=False).input_ids[n]
        for c in ("spam", "ham")
    }
    z = _logits(n - 1)
    z = z - np.logaddexp.reduce(z)
    # Ask for as many top tokens as reach the more probable choice's, not the other's.
    ranks = {
        c: int(np.flatnonzero(np.argsort(-z, kind="stable") == t)[0]) for c, t in first.items()
    }
    listed, left_out = sorted(ranks, key=ranks.get)  # type: ignore[arg-type]
    assert ranks[listed] < ranks[left_out]  # the fake's logits tell the two apart
    k = ranks[listed] + 1
    engine, _ = _fake_engine(judge, read="top", top=k)
    got = engine.judge(prompt, ["spam", "ham"])
    assert got.probabilities[left_out] < 1e-300  # not read: no probability made up for it
    assert got.probabilities[listed] == 1.0
    kth = float(np.exp(np.sort(z)[::-1][k - 1]))
    known = float(np.exp(z[first[listed]]))
    assert got.unknown_mass == pytest.approx(kth / (known + kth), rel=1e-9)
    assert got.choice_mass == pytest.approx(known, rel=1e-9)


def test_a_server_that_counts_other_tokens_is_an_error(judge: Judge) -> None:
    engine, _ = _fake_engine(judge, read="top", count_off=1)
    with pytest.raises(ModelServerError, match="serves another tokenizer"):
        engine.judge("Is the sky blue?", ["yes", "no"])


@SERVED
def test_read_from_its_top_tokens_a_served_model_agrees_or_escalates(
    llama: LlamaServer, judge: Judge
) -> None:
    """`read=top`: one request per scored node. Where the top 20 hold every choice's token
    the numbers agree with the local engine's; with the top 1 the others are not read, and a
    decision the unread share could change escalates with its own reason."""
    wide = open_engine(llama.spec + "?read=top&top=20")
    narrow = open_engine(llama.spec + "?read=top&top=1")
    assert isinstance(wide, ServerEngine) and isinstance(narrow, ServerEngine)
    task = load_task(DATA / "sst2")
    for item in load_split(task, "test", limit=2)[0]:
        prompt = task_prompt(task, item.text)
        got, local = wide.judge(prompt, list(task.choices)), judge.judge(prompt, task.choices)
        assert got.unknown_mass == 0.0 and got.forward_passes == 1
        assert max(abs(a - b) for a, b in zip(got.probs, local.probs, strict=True)) <= TOLERANCE
    task = load_task(DATA / "commonsense_qa")
    item = load_split(task, "test", limit=1)[0][0]
    partial = narrow.judge(task_prompt(task, item.text), list(task.choices))
    assert 0 < partial.unknown_mass <= 1 and partial.confidence == pytest.approx(1.0)
    verdict = make_policy(None, defaults=PolicyDefaults(uncertified_threshold=0.95)).decide(partial)
    # Read alone, the one choice read holds all the probability; the unread share decides.
    if partial.unknown_mass >= 0.05:
        assert verdict.reason_codes == ["partial_logprobs"], verdict.reasons
    else:
        assert verdict.decision == "accept"
    wide.close()
    narrow.close()


def test_nothing_read_is_all_unknown_and_labeled_items_read_in_part_are_refused(
    judge: Judge,
) -> None:
    """No choice's token among the top ones: equal placeholders, all of it unknown, and the
    gate escalates. A fit or a qualification refuses judgments read in part."""
    engine, _ = _fake_engine(judge, read="top", top=1)
    prompt = "Is this SMS spam? WINNER!! Claim your prize."
    got = engine.judge(prompt, ["spam", "ham"])
    assert got.unknown_mass == 1.0 and got.probs == [0.5, 0.5] and got.choice_mass == 0.0
    verdict = make_policy(None, defaults=PolicyDefaults(uncertified_threshold=0.5)).decide(got)
    assert verdict.decision == "escalate"
    queries = [Query(prompt=prompt, choices=["spam", "ham"])] * 3
    with pytest.raises(
        TaskError, match="item 0 \\(and 2 more of 3 in its batch\\) was read only in part"
    ):
        judge_labeled(engine, queries, ["spam"] * 3, ["spam", "ham"])
