"""A profile is a task: fitted by `judge calibrate --task`, it carries the prompt it was fitted on.

The path a new user takes, on the real default model and the example task that ships with
the repository: ``judge calibrate --task examples/reviews`` (its default fit), run as the
README writes it in a copy of the repository with nothing beside it (no ``../shared``), then
the item alone to
``judge ask --profile``, ``Gate.judge(engine, item=...)``, a JSONL line ``{"item": ...}`` and
``POST /judge {"profile", "item"}``. Each puts the item in the very prompt the certificate
covers, marks its span, and decides under the certified rule. A whole prompt must mark its item,
and one that is not the task's prompt is flagged ``outside_template``.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest
from litestar.testing import TestClient
from server import wait_app_ready as wait_ready

from calibration import Gate, ProfileMismatchError, load_profile
from calibration.tasks import load_task, task_item_span, task_prompt, task_template
from calibration.template import PromptTemplate
from judge import Judge
from service import ServiceConfig, create_app
from service.cli.main import main
from service.schemas import ErrorBody

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "reviews"
NEGATIVE = "The battery died after two days and the seller never answered my emails."
POSITIVE = "Works great, the sound is clear and it fits my ear perfectly."
OTHER = "Is this review bad?\n\n"  # not the task's prompt


def test_a_template_renders_the_item_and_marks_it() -> None:
    template = PromptTemplate(before="Spam?\n\n", after="\n\nAnswer: ham or spam.")
    prompt, span = template.render("hi there")
    assert prompt == "Spam?\n\nhi there\n\nAnswer: ham or spam." and span == (7, 15)
    assert prompt[span[0] : span[1]] == "hi there" and template.fits(prompt, span)
    assert template.render("") == ("Spam?\n\n\n\nAnswer: ham or spam.", None)
    assert not template.fits(prompt, None) and not template.fits("Ham?\n\nhi there", (6, 14))


def test_the_task_s_template_is_the_prompt_it_judged() -> None:
    task = load_task(EXAMPLE)
    for text in (NEGATIVE, POSITIVE, ""):
        assert task_template(task).render(text) == (
            task_prompt(task, text),
            task_item_span(task, text),
        )


def readme_calibration() -> list[str]:
    """The README's certified example's `judge calibrate` command, as words."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("To a certified accept:") :]
    commands = re.search(r"```sh\n(.*?)```", section, re.S)
    assert commands, "the README's certified example has a sh block"
    return shlex.split(commands.group(1).split("\n", 1)[0], comments=True)


def clean_copy(into: Path) -> Path:
    """The repository's files as a clone has them (tracked, and new ones not ignored), in
    ``into/judge``: a checkout with nothing beside it, no ``../shared`` in particular."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    copy = into / "judge"
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        if source.is_file():
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, copy / name)
    assert not (copy.parent / "shared").exists()
    return copy


@pytest.fixture(scope="module")
def calibrated(judge: Judge, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The README's `judge calibrate --task examples/reviews`, as written, run in a clean copy
    of the repository (the session's model in place of a fresh load): the default fit, every
    item; the folder it wrote the profile to."""
    words = readme_calibration()
    assert words[:2] == [".venv/bin/judge", "calibrate"]
    copy = clean_copy(tmp_path_factory.mktemp("clone"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Judge, "load", staticmethod(lambda model=None, **options: judge))
        patch.chdir(copy)
        assert main(words[1:]) == 0
    return copy / "profiles"


def test_calibrate_then_ask_with_the_item_alone_gives_a_certified_decision(
    calibrated: Path,
    judge: Judge,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    path = calibrated / "reviews.json"
    profile = load_profile(path)
    assert profile.template == task_template(load_task(EXAMPLE))
    assert profile.threshold.threshold is not None, profile.threshold.reason
    monkeypatch.setattr(Judge, "load", staticmethod(lambda model=None, **options: judge))
    capsys.readouterr()
    assert main(["ask", "--profile", str(path), NEGATIVE]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["certified"] is True and answer["profile"] == "reviews"
    assert "outside_template" not in answer  # omitted: it is the task's own prompt
    # The same verdict as the whole prompt, its item marked, decided in Python.
    task = load_task(EXAMPLE)
    whole = Gate(profile).judge(
        judge, task_prompt(task, NEGATIVE), item_span=task_item_span(task, NEGATIVE)
    )
    alone = Gate(profile).judge(judge, item=NEGATIVE)
    assert alone.decision == whole.decision == answer["decision"]
    assert alone.probs == pytest.approx(whole.probs, abs=1e-6)
    assert answer["probabilities"] == pytest.approx(alone.probabilities, abs=1e-6)
    assert not alone.outside_template and not whole.outside_template

    # A JSONL line may be an item alone; a whole prompt must mark its item.
    lines = tmp_path / "in.jsonl"
    other = f"{OTHER}{POSITIVE}"  # marked, but not the task's prompt
    rows = [
        {"id": "a", "item": POSITIVE},
        {"id": "b", "prompt": task_prompt(task, POSITIVE)},
        {"id": "c", "prompt": other, "item_span": [len(OTHER), len(OTHER) + len(POSITIVE)]},
    ]
    lines.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out.jsonl"
    args = ["ask", "--input", str(lines), "--output", str(out), "--profile", str(path)]
    assert main(args) == 0
    first, second, third = (json.loads(line) for line in out.read_text().splitlines())
    assert first["id"] == "a" and first["certified"] is True
    assert "outside_template" not in first
    assert second["error"]["field"] == "item_span"
    assert third["id"] == "c" and third["outside_template"] is True


def test_a_whole_prompt_must_mark_its_item_and_is_flagged_outside_the_template(
    calibrated: Path, judge: Judge
) -> None:
    gate = Gate(load_profile(calibrated / "reviews.json"))
    with pytest.raises(ProfileMismatchError) as refused:
        gate.judge(judge, f"Is this review bad? {NEGATIVE}")
    assert refused.value.field == "item_span"
    other = f"{OTHER}{NEGATIVE}"
    verdict = gate.judge(judge, other, item_span=(len(OTHER), len(OTHER) + len(NEGATIVE)))
    assert verdict.outside_template
    with pytest.raises(ProfileMismatchError, match="no profile") as no_template:
        Gate(None).judge(judge, item=NEGATIVE, choices=["negative", "positive"])
    assert no_template.value.field == "item"


def test_post_judge_takes_the_item_alone(calibrated: Path, judge: Judge) -> None:
    task = load_task(EXAMPLE)
    config = ServiceConfig(profiles_dir=calibrated)
    with TestClient(app=create_app(judge, config=config)) as c:
        wait_ready(c)
        alone = c.post("/judge", json={"profile": "reviews", "item": NEGATIVE})
        assert alone.status_code == 200, alone.text
        whole = {
            "prompt": task_prompt(task, NEGATIVE),
            "choices": ["positive", "negative"],
            "profile": "reviews",
            "item_span": list(task_item_span(task, NEGATIVE) or ()),
        }
        marked = c.post("/judge", json=whole)
        body: dict[str, Any] = alone.json()
        assert body["certified"] is True and "outside_template" not in body
        assert list(body["probabilities"]) == ["negative", "positive"]  # the profile's choices
        assert body["probabilities"] == pytest.approx(marked.json()["probabilities"], abs=1e-6)
        assert body["decision"] == marked.json()["decision"]

        refusals = {
            "profile": {"item": NEGATIVE},
            "item_span": {**whole, "item_span": None},
            "prompt": {**whole, "item": NEGATIVE},  # both shapes' keys
        }
        for field, request in refusals.items():
            r = c.post("/judge", json=request)
            assert 400 <= r.status_code < 500 and r.json()["field"] == field, (field, r.text)
        flagged = c.post(
            "/judge",
            json={
                **whole,
                "prompt": f"{OTHER}{NEGATIVE}",
                "item_span": [len(OTHER), len(OTHER) + len(NEGATIVE)],
            },
        ).json()
        assert flagged["outside_template"] is True


def test_a_batch_takes_items_alone(calibrated: Path, judge: Judge) -> None:
    task = load_task(EXAMPLE)
    whole = {
        "prompt": task_prompt(task, NEGATIVE),
        "choices": ["positive", "negative"],
        "profile": "reviews",
        "item_span": list(task_item_span(task, NEGATIVE) or ()),
    }
    config = ServiceConfig(profiles_dir=calibrated)
    with TestClient(app=create_app(judge, config=config)) as c:
        wait_ready(c)
        single = c.post("/judge", json={"profile": "reviews", "item": POSITIVE}).json()
        items = [
            {"profile": "reviews", "item": POSITIVE},
            whole,
            {"profile": "no_such_profile", "item": POSITIVE},  # refused in its place
            {"item": POSITIVE},  # no profile: refused in its place, naming it
        ]
        r = c.post("/judge/batch", json={"items": items})
        assert r.status_code == 200, r.text
        alone, marked, missing, unnamed = r.json()["results"]
        assert alone["probabilities"] == pytest.approx(single["probabilities"], abs=1e-6)
        assert alone["decision"] == single["decision"] and alone["certified"] is True
        assert "outside_template" not in alone and "outside_template" not in marked
        assert list(marked["probabilities"]) == [
            "positive",
            "negative",
        ]  # a whole request's own order
        assert missing["type"] == "error" and missing["status_code"] == 404
        assert unnamed["type"] == "error" and unnamed["field"] == "profile"

        # An item of neither shape, or of both, refuses the batch before any work, naming it.
        for bad, field in (
            ({"choices": ["positive", "negative"]}, "items[1].prompt"),
            ({**whole, "item": POSITIVE}, "items[1].prompt"),
            ({"item": 7, "profile": "reviews"}, "items[1].item"),
            (42, "items[1]"),
        ):
            r = c.post("/judge/batch", json={"items": [items[0], bad]})
            assert r.status_code == 400 and r.json()["field"] == field, (bad, r.text)


def test_the_client_gates_items_alone(calibrated: Path, judge: Judge) -> None:
    from service.client import ItemRequest, JudgeClient

    config = ServiceConfig(profiles_dir=calibrated)
    with TestClient(app=create_app(judge, config=config)) as c:
        wait_ready(c)
        raw = [
            c.post("/judge", json={"profile": "reviews", "item": t}).json()
            for t in (POSITIVE, NEGATIVE)
        ]
        sent: list[bytes] = []

        def forward(request: httpx.Request) -> httpx.Response:
            sent.append(request.content)
            r = c.request(request.method, request.url.path, content=request.content)
            return httpx.Response(r.status_code, content=r.content, headers=r.headers)

        with JudgeClient("http://judge.test", transport=httpx.MockTransport(forward)) as client:
            gated = list(client.gate([POSITIVE, NEGATIVE], profile="reviews"))
            batch = client.judge_batch([ItemRequest(item=POSITIVE, profile="reviews")])
            with pytest.raises(ValueError, match="system"):
                list(client.gate([POSITIVE], profile="reviews", system="You are terse."))
    # The strings went out as items alone, and came back as the single requests do.
    assert b'"item":' in sent[-3] and b'"prompt":' not in sent[-3]
    for (item, result), single in zip(gated, raw, strict=True):
        assert not isinstance(result, ErrorBody) and result.certified is True, item
        assert result.probabilities == pytest.approx(single["probabilities"], abs=1e-6)
    assert not isinstance(batch[0], ErrorBody)
    assert batch[0].probabilities == pytest.approx(raw[0]["probabilities"], abs=1e-6)


def test_the_client_sends_the_item_alone(calibrated: Path, judge: Judge) -> None:
    from service.client import JudgeClient

    config = ServiceConfig(profiles_dir=calibrated)
    with TestClient(app=create_app(judge, config=config)) as c:
        wait_ready(c)
        raw = c.post("/judge", json={"profile": "reviews", "item": POSITIVE}).json()

        def forward(request: httpx.Request) -> httpx.Response:
            r = c.request(request.method, request.url.path, content=request.content)
            return httpx.Response(r.status_code, content=r.content, headers=r.headers)

        with JudgeClient("http://judge.test", transport=httpx.MockTransport(forward)) as client:
            got = client.judge_item(POSITIVE, "reviews")
    assert got.decision == raw["decision"] and got.certified is raw["certified"] is True
    assert got.probabilities == pytest.approx(raw["probabilities"], abs=1e-9)


def test_the_readme_s_way_to_a_certified_accept(calibrated: Path, judge: Judge) -> None:
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = readme[readme.index("To a certified accept:") :]
    commands = re.search(r"```sh\n(.*?)```", section, re.S)
    shown = re.search(r"```json\n(.*?)```", section, re.S)
    assert commands and shown
    _, curl = commands.group(1).split("\n", 1)
    # The fixture ran exactly this calibration, in a copy of the repository.
    assert readme_calibration()[1:] == ["calibrate", "--task", "examples/reviews"]
    body = json.loads(shlex.split(curl.replace("\\\n", " "))[-1])
    with TestClient(app=create_app(judge, config=ServiceConfig(profiles_dir=calibrated))) as c:
        wait_ready(c)
        answer = c.post("/judge", json=body).json()
    example = json.loads(shown.group(1))
    assert set(answer) == set(example)
    for field in ("decision", "choice", "certified", "threshold", "profile", "prediction_set"):
        assert answer[field] == example[field], field


def test_the_readme_s_command_line_and_python_give_the_same_certified_accept(
    calibrated: Path,
    judge: Judge,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The quickstart's ``judge ask --profile`` line and its Python block, as written, run from
    a folder holding ``profiles/reviews.json``: both accept the item, certified, as positive."""
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = readme[readme.index("The same decision from the command line:") :]
    command = re.search(r"```sh\n(.*?)```", section, re.S)
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert command and code
    words = shlex.split(command.group(1))
    assert words[:2] == [".venv/bin/judge", "ask"]
    monkeypatch.setattr(Judge, "load", staticmethod(lambda model=None, **options: judge))
    monkeypatch.chdir(calibrated.parent)
    (calibrated.parent / "profiles").mkdir(exist_ok=True)
    (calibrated.parent / "profiles" / "reviews.json").write_bytes(
        (calibrated / "reviews.json").read_bytes()
    )
    capsys.readouterr()
    assert main(words[1:]) == 0
    answer = json.loads(capsys.readouterr().out)
    namespace: dict[str, Any] = {}
    exec(compile(code.group(1), "README.md", "exec"), namespace)
    verdict = namespace["verdict"]
    assert answer["decision"] == verdict.decision == "accept"
    assert answer["choice"] == verdict.choice == "positive"
    assert answer["certified"] is verdict.certified is True
    assert answer["confidence"] == pytest.approx(verdict.confidence, abs=1e-6)


def test_a_typed_question_under_a_task_profile_is_flagged_outside_the_template(
    calibrated: Path, judge: Judge
) -> None:
    """A System One question is asked in its own prompt, never the task's: under a profile
    fitted on a task its answer says the certificate was measured on other prompts."""
    config = ServiceConfig(profiles_dir=calibrated)
    question = {
        "type": "choice",
        "instructions": "Is this review negative?",
        "criteria": {"negative": None, "positive": None},
    }
    with TestClient(app=create_app(judge, config=config)) as c:
        wait_ready(c)
        asked = {"state": NEGATIVE, "questions": {"gated": {**question, "profile": "reviews"}}}
        r = c.post("/v1/systemone", json=asked)
        assert r.status_code == 200, r.text
        assert r.json()["answers"]["gated"]["outside_template"] is True
        bare = c.post("/v1/systemone", json={"state": NEGATIVE, "questions": {"bare": question}})
        assert bare.json()["answers"]["bare"]["outside_template"] is False
