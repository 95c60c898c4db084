"""docs/tutorial.md, run as written: every command on the page, in order, on the example task
that ships with the repository, in a folder holding nothing else (no ``../shared``).

The page is read, not copied: its fenced blocks are run in order, so that the page and this
test cannot drift apart. A comment right above a block says how it is exercised:

    (none) on a ``sh`` block      run with bash in the folder; it must exit 0
    <!-- test: file PATH -->      the block is a file the page asks you to write: written there
    <!-- test: labeller -->       an interactive queue: run with a simulated person at its keys
    <!-- test: server -->         ``judge serve``, which runs until stopped: started on a free
                                  port, waited for, and stopped once the page is done
    <!-- test: output -->         a sample of the previous command's output: each of its lines
                                  must be a line of the real output, in order, its numbers
                                  any number (they are one run's), a trailing ``...`` a cut

Every block carries a marker or is a ``sh`` block, so no step of the page goes untried. The
commands run as a reader's do, with the virtual environment's ``bin`` first on PATH (what
``. .venv/bin/activate`` does); the page's ``http://127.0.0.1:8000`` becomes the test
server's address. Then the tests below check what the page says each step does.
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from server import READY_S, Server, free_port

from calibration import load_profile
from calibration.tasks import load_split, load_task
from service.log.backends import open_log

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "tutorial.md"
EXAMPLE = ROOT / "examples" / "reviews"
PAGE_URL = "http://127.0.0.1:8000"  # where the page's commands find the server
BIN = Path(sys.executable).parent  # the environment `judge` and `python` come from
ITEMS = 150  # the reviews the page labels (step 1)
SENT = 100  # the reviews its pipeline sends (step 9)

BLOCK = re.compile(
    r"^(?:<!-- test: (?P<marker>[^\n]*?) -->\n)?```(?P<lang>\w*)\n(?P<body>.*?)^```$",
    re.M | re.S,
)
NUMBER = r"[-+]?\d+(?:\.\d+)?"
# The page runs once for every test here (about 4 minutes on 2 cores): in `make bench-smoke`,
# which CI runs after `make test`.
pytestmark = pytest.mark.bench


@dataclass(frozen=True)
class Block:
    """A fenced block of the page and the marker comment right above it (None: none)."""

    lang: str
    body: str
    marker: str | None


@dataclass
class Step:
    """A command the page runs, and what it printed (stdout and stderr, as a terminal shows
    them)."""

    command: str
    output: str = ""
    seconds: float = 0.0  # how long it ran, printed for whoever watches the suite's budget
    samples: list[str] = field(default_factory=list)  # the page's samples of its output


@dataclass
class Tutorial:
    """The page, run: its folder, its commands in order, and what the labeller typed."""

    folder: Path
    steps: list[Step]
    typed: dict[str, list[tuple[str, str]]]  # per queue command, each (text, label) typed

    def step(self, start: str) -> Step:
        """The one command of the page that begins with ``start``."""
        found = [s for s in self.steps if s.command.startswith(start)]
        assert len(found) == 1, f"the page runs {len(found)} commands beginning {start!r}"
        return found[0]


def page_blocks() -> list[Block]:
    return [
        Block(m["lang"], m["body"], m["marker"]) for m in BLOCK.finditer(PAGE.read_text("utf-8"))
    ]


def truth() -> dict[str, str]:
    """Each of the example's texts and its true label: what the simulated person knows."""
    task = load_task(EXAMPLE)
    labels: dict[str, str] = {}
    for split in ("calibration", "test"):
        for item in load_split(task, split)[0]:
            labels[item.text] = item.label
    return labels


class Labeller:
    """A person at ``judge label --queue``: reads each card as the queue prints it (a
    ``[stream: N left] ...`` header, the item's text, the model's probabilities, then the
    keys), and types the key its keys line gives the item's true label.

    When the queue says it began a fit, the person waits for its result before the next key,
    as one slower than the fit would: the fits then read the same labels on every run. Once
    a fit says the gate opens, the person quits (q), as the page says to. The page asks for
    labels only, so an item the person does not know is an error, not a skip."""

    HEADER = re.compile(r"^\[(audit|teach): \d+ left\] ")
    KEYS = re.compile(r"^  (?P<keys>\d .+?) · s skip · q quit$")

    def __init__(self, labels: dict[str, str]) -> None:
        self.labels = labels

    def run(
        self, command: str, cwd: Path, env: dict[str, str]
    ) -> tuple[int, str, list[tuple[str, str]]]:
        """Run ``command`` with this person at its keys: its exit status, everything it
        printed, and each (text, label) typed."""
        process = subprocess.Popen(
            ["bash", "-c", command],
            cwd=cwd,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
        )
        assert process.stdin is not None and process.stdout is not None
        lines: queue.Queue[str | None] = queue.Queue()

        def read(stream: Iterator[str]) -> None:
            for line in stream:
                lines.put(line.rstrip("\n"))
            lines.put(None)

        threading.Thread(target=read, args=(process.stdout,), daemon=True).start()
        printed: list[str] = []
        typed: list[tuple[str, str]] = []
        text: str | None = None  # the text of the card on screen
        keys: dict[str, str] | None = None  # its keys, once shown: a card waiting for one
        fitting = opened = False
        previous = ""
        while (line := lines.get(timeout=READY_S)) is not None:  # a watchdog, not a speed
            printed.append(line)
            if self.HEADER.match(previous):
                text = line[2:]
            elif m := self.KEYS.match(line):
                # "1 negative · 2 positive": each choice's key
                pairs = (k.split(" ", 1) for k in m["keys"].split(" · "))
                keys = {choice: digit for digit, choice in pairs}
            elif "fitting a profile on the" in line:
                fitting = True
            elif line.startswith("[fit on "):
                fitting = False
                opened = opened or "the gate opens" in line
            previous = line
            if keys is None or fitting:
                continue
            if opened:
                key = "q"
            else:
                assert text in self.labels, (
                    f"the queue showed an item the person never saw: {text!r}"
                )
                label = self.labels[text]
                key = keys[label]
                typed.append((text, label))
            process.stdin.write(key + "\n")
            process.stdin.flush()
            keys = None
        process.stdin.close()
        return process.wait(timeout=READY_S), "\n".join(printed), typed


def run_page(folder: Path) -> Tutorial:
    """Every block of the page, in order, in ``folder``: see the module docstring."""
    env = {
        **os.environ,
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        "VIRTUAL_ENV": str(BIN.parent),
        "PYTHONUNBUFFERED": "1",  # each line as it is printed, as on a terminal
    }
    labeller = Labeller(truth())
    tutorial = Tutorial(folder, [], {})
    url = PAGE_URL
    server: Server | None = None
    try:
        for block in page_blocks():
            body = block.body.replace(PAGE_URL, url)
            marker = block.marker
            if marker is not None and marker.startswith("file "):
                path = folder / marker.removeprefix("file ")
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(body)
                continue
            if marker == "output":
                assert tutorial.steps, "a sample output before any command"
                tutorial.steps[-1].samples.append(block.body)
                continue
            assert block.lang == "sh", f"a {block.lang} block the test does not run: {body!r}"
            step = Step(body.strip())
            tutorial.steps.append(step)
            began = time.monotonic()
            if marker == "server":
                assert server is None, "the page starts one server"
                assert step.command.startswith("judge serve") and "\n" not in step.command
                port = free_port()
                # Server starts its process with the suite's environment; the page's is the
                # reader's, with the virtual environment first on PATH.
                reader = [f"{name}={env[name]}" for name in ("PATH", "VIRTUAL_ENV")]
                command = ["env", *reader, "bash", "-c", f"{step.command} --port {port}"]
                server = Server(command, port, cwd=str(folder))
                server.wait_ready()
                url = server.url
            elif marker == "labeller":
                rc, step.output, tutorial.typed[step.command] = labeller.run(body, folder, env)
                assert rc == 0, step.output[-4000:]
            else:
                assert marker is None, f"unknown marker {marker!r}"
                done = subprocess.run(
                    ["bash", "-e", "-o", "pipefail", "-c", body],
                    cwd=folder,
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    timeout=READY_S,
                )
                step.output = done.stdout
                assert done.returncode == 0, f"{step.command}\n{done.stdout[-4000:]}"
            step.seconds = time.monotonic() - began
            # Kept beside the folder (not in it), for whoever reads a failure.
            kept = folder.parent / "outputs" / f"{len(tutorial.steps):02d}.txt"
            kept.parent.mkdir(exist_ok=True)
            kept.write_text(f"$ {step.command}\n{step.output}")
            print(f"{step.seconds:6.1f} s  {step.command.splitlines()[0]}")
    finally:
        if server is not None:
            server.stop()
    return tutorial


@pytest.fixture(scope="module")
def tutorial(tmp_path_factory: pytest.TempPathFactory) -> Tutorial:
    """The page, run once in a folder holding only the example task (the page's one input),
    so that nothing is written into the repository and nothing beside it is read."""
    folder = tmp_path_factory.mktemp("tutorial") / "work"  # its outputs go beside it
    shutil.copytree(EXAMPLE, folder / "examples" / "reviews")
    assert not (folder.parent / "shared").exists()
    return run_page(folder)


def shown(output: str) -> list[str]:
    """The lines a terminal would show: a progress bar's redrawn line is its last state."""
    return [line.rsplit("\r", 1)[-1] for line in output.splitlines()]


def sample_pattern(line: str) -> re.Pattern[str]:
    """A sample line as a pattern: its numbers any number, a trailing ``...`` a cut."""
    cut = line.endswith("...")
    text = line.removesuffix("...") if cut else line
    body = NUMBER.join(re.escape(part) for part in re.split(NUMBER, text))
    return re.compile(body if cut else body + r"\s*$")


@pytest.mark.slow
def test_every_sample_output_is_what_its_command_printed(tutorial: Tutorial) -> None:
    checked = 0
    for step in tutorial.steps:
        lines = shown(step.output)
        for sample in step.samples:
            at = 0
            for line in sample.splitlines():
                if not line.strip() or line == "...":
                    continue
                pattern = sample_pattern(line)
                found = next((i for i in range(at, len(lines)) if pattern.match(lines[i])), None)
                assert found is not None, (
                    f"the page shows {line!r} from `{step.command}`, which printed (all of it "
                    f"in {tutorial.folder.parent / 'outputs'}):\n" + "\n".join(lines[at:])[:6000]
                )
                at = found + 1
                checked += 1
    assert checked >= 10  # the page's samples were read, not skipped


@pytest.mark.slow
def test_the_items_file_has_texts_and_no_labels(tutorial: Tutorial) -> None:
    rows = [json.loads(line) for line in (tutorial.folder / "items.jsonl").read_text().splitlines()]
    examples = load_split(load_task(EXAMPLE), "calibration")[0]
    assert rows == [{"id": item.id, "text": item.text} for item in examples[:ITEMS]]
    task = load_task(tutorial.folder / "my_reviews")  # the page's task.json, as judge reads it
    assert task.name == "my_reviews" and task.choices == ["negative", "positive"]


@pytest.mark.slow
def test_the_queue_takes_each_true_label_into_the_split(tutorial: Tutorial) -> None:
    step = tutorial.step("judge label --queue --items")
    typed = tutorial.typed[step.command]
    task = load_task(tutorial.folder / "my_reviews")
    labelled, _ = load_split(task, "labelled")
    # Every key the person typed is a line of the split, with the label they meant.
    assert [(item.text, item.label) for item in labelled] == typed
    streams = {item.taught for item in labelled}
    assert streams == {True, False}  # both streams, in turn
    # The page labels the whole file unless a fit opens the gate first.
    lines = shown(step.output)
    opened = any("the gate opens" in line for line in lines)
    assert opened or len(typed) == ITEMS
    assert any(line.startswith("[fit on ") for line in lines)
    looks = json.loads((tutorial.folder / "my_reviews" / ".looks" / "labelled.json").read_text())
    assert looks["delta"] == 0.1  # the page keeps the default delta, fixed at the queue's start


@pytest.mark.slow
def test_calibrate_reports_what_the_page_reads_from_it(tutorial: Tutorial) -> None:
    output = tutorial.step("judge calibrate --task").output
    lines = shown(output)
    queue = shown(tutorial.step("judge label --queue --items").output)
    looks_before = sum(1 for line in queue if re.match(r"^\[fit on .*\] look \d+", line))
    # The labels came from the queue: this is the next look of their lineage.
    assert f"this is look {looks_before + 1} of its lineage" in output
    profile = load_profile(tutorial.folder / "profiles" / "my_reviews.json")
    assert profile.recertification is not None
    assert profile.recertification.look == looks_before + 1
    assert profile.n_examples == len(
        tutorial.typed[tutorial.step("judge label --queue --items").command]
    )
    # What the page says happened: nothing certified at 0.9, and the report says what next.
    assert profile.threshold.threshold is None
    assert any(line.startswith("no certified threshold: ") for line in lines)
    assert sum(line.startswith("next: ") for line in lines) >= 1
    # The metrics as the page reads them: the raw model worse than a coin, the map better.
    assert profile.metrics_before is not None and profile.metrics_after is not None
    assert profile.metrics_before.accuracy.value < 0.5 < profile.metrics_after.accuracy.value
    assert "wrote profiles/my_reviews.json, .report.md, .reliability.png" in lines


@pytest.mark.slow
def test_the_server_escalates_what_no_certificate_covers(tutorial: Tutorial) -> None:
    answer = json.loads(tutorial.step("curl -s").output)
    assert answer["decision"] in {"accept", "escalate"}
    assert answer["profile"] == "my_reviews" and answer["choice"] in {"negative", "positive"}
    # The profile certified nothing (above): its decisions escalate, and say why.
    assert answer["decision"] == "escalate" and answer["certified"] is False
    assert answer["reason_codes"] == ["no_certified_threshold"]
    printed = tutorial.step("python pipeline.py").output.strip()
    assert printed == f"accepted 0, escalated {SENT} (see to_review.jsonl)"
    lines = (tutorial.folder / "to_review.jsonl").read_text().splitlines()
    review = [json.loads(line) for line in lines]
    assert len(review) == SENT
    assert all("no_certified_threshold" in row["why"] for row in review)


@pytest.mark.slow
def test_the_log_holds_every_decision_and_the_refit_reads_its_labels(tutorial: Tutorial) -> None:
    with open_log(str(tutorial.folder / "decisions.db")) as log:
        decisions = log.decisions(profile="my_reviews")
    assert len(decisions) == 1 + SENT  # the curl's, and the pipeline's
    audited = [d for d in decisions if d.audit]
    assert 0 < len(audited) < len(decisions)  # a share of them, drawn for audit
    # The queue over the log labelled each of them, with its true label.
    labels = truth()
    step = tutorial.step("judge label --queue --log")
    typed = tutorial.typed[step.command]
    assert len(typed) == len(decisions) and all(labels[text] == label for text, label in typed)
    for d in decisions:  # its item, as --log-requests kept it, and the label it was given
        assert d.request is not None
        start, end = d.request["query"]["item_span"]
        assert d.label == labels[d.request["query"]["prompt"][start:end]]
    assert shown(step.output)[-1] == (
        f"labelled {len(decisions)} (audit {len(audited)}, teach {len(decisions) - len(audited)}); "
        "left: audit 0, teach 0"
    )
    # The refit: the next look of the lineage, on the log's labels, the audited ones certifying.
    refit = load_profile(tutorial.folder / "profiles" / "my_reviews-2.json")
    served = load_profile(tutorial.folder / "profiles" / "my_reviews.json")
    assert served.recertification is not None and refit.recertification is not None
    assert refit.recertification.look == served.recertification.look + 1
    assert refit.n_examples == len(decisions)
    assert "probe" in refit.cv_nll  # tried: 100 labelled decisions or more kept their states
    assert refit.split.taught == len(decisions) - len(audited)
    output = tutorial.step("judge calibrate --from-log").output
    assert f"look {refit.recertification.look} of the lineage of 'my_reviews'" in output
