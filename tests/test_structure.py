"""The shape of the code: no import circle among the project's modules (counting imports made
only for the type checker and those a function makes when it runs), no class so long that
it holds several jobs, one builder each for a decision's log record and its response, and a
cascade's machinery out of the way of a server without one.

A circle makes the order of imports matter and hides which module is the lower layer (the
house style: ``service`` over ``calibration`` and ``judge``; ``calibration`` works on arrays).
An import deferred into a function is still a dependency: it only moves the circle from import
time to run time. The walk reads every import statement of each module, wherever it stands,
and finds strongly connected components of the graph.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("judge", "calibration", "service")


def _modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


def _imports(tree: ast.Module, known: set[str]) -> set[str]:
    """The project modules a module imports anywhere: at its top level, for the type checker,
    or inside a function."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found & known


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    circles.append(sorted(component))
    return circles


def test_no_import_circle_among_the_project_s_modules() -> None:
    modules = _modules()
    known = set(modules)
    graph = {
        name: _imports(ast.parse(path.read_text(encoding="utf-8")), known) - {name}
        for name, path in modules.items()
    }
    assert len(graph) > 50  # the walk found the project
    assert _circles(graph) == []


def test_an_import_inside_a_function_counts() -> None:
    tree = ast.parse("def run():\n    from service.cli import log\n")
    assert _imports(tree, {"service.cli", "service.cli.log"}) == {"service.cli", "service.cli.log"}


def test_the_walk_finds_a_circle() -> None:
    """The finder itself: a circle through three modules, and one beside a tail."""
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from x.y import Z\n")
    assert _imports(tree, {"x.y"}) == {"x.y"}


MAX_CLASS_LINES = 350


def _importers(top: str) -> list[str]:
    """The project modules that import the package ``top`` (or a module of it) anywhere."""
    out = []
    for name, path in sorted(_modules().items()):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            if any(n == top or n.startswith(top + ".") for n in names):
                out.append(name)
                break
    return out


def test_one_module_imports_peft() -> None:
    """The adapter's training is the one place that needs the `adapter` extra (issue 68):
    judging under an adapter, the gate and the engine never import it."""
    assert _importers("peft") == ["calibration.tasks.adapter.training"]
    assert _importers("msgspec")  # the walk finds imports at all


def test_no_class_is_over_350_lines() -> None:
    """A class that long does several jobs (``Service`` did six in 725 lines): cut it by job.
    400 held ``Policy`` at exactly 400, its checks beside its verdicts (issue 68)."""
    long = [
        f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines"
        for name, path in _modules().items()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.ClassDef)
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES
    ]
    assert long == []


def _calls(tree: ast.Module, target: str) -> bool:
    """Whether ``tree`` calls ``target``: a name (``LoggedDecision``, a constructor) or a
    dotted attribute of one (``LoggedDecision.of``), however the module imported it."""
    owner, _, attribute = target.partition(".")

    def named(node: ast.expr, name: str) -> bool:
        return (isinstance(node, ast.Name) and node.id == name) or (
            isinstance(node, ast.Attribute) and node.attr == name
        )

    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if attribute:
            if isinstance(f, ast.Attribute) and f.attr == attribute and named(f.value, owner):
                return True
        elif named(f, owner):
            return True
        elif named(f, "carry") and len(node.args) > 1 and named(node.args[1], owner):
            return True  # calibration.carry builds its second argument's type
    return False


def _callers(target: str) -> set[str]:
    """The project modules that call ``target``."""
    return {
        name
        for name, path in _modules().items()
        if _calls(ast.parse(path.read_text(encoding="utf-8")), target)
    }


def test_one_module_builds_a_decision_s_log_record() -> None:
    """Every route settles its verdict through ``GateContext.settle``, so the record of a
    decision (what it keeps of the request and of the hidden states) cannot differ by route
    (it had five copies, and MCP's missed the audit rate)."""
    assert _callers("LoggedDecision") == set()  # built by its classmethod, LoggedDecision.of
    assert _callers("LoggedDecision.of") == {"service.gate_context"}


def test_one_module_builds_a_response() -> None:
    """A response is shaped from the judgment and the verdict alone, in ``JudgeResponse.of``
    (``judge ask`` once printed fewer fields than ``POST /judge`` for the same profile)."""
    assert _callers("JudgeResponse") == set()  # only its classmethod builds one
    assert "service.gate_context" in _callers("JudgeResponse.of")  # the walk sees the core


# The three fronts of service/ (tests/test_exports.py holds their rings).
FRONTS = ("service.web", "service.mcp", "service.cli")


def _settles(tree: ast.Module) -> bool:
    """Whether ``tree`` calls a ``settle`` method, whatever owns it."""
    return any(
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "settle"
        for node in ast.walk(tree)
    )


def test_the_fronts_only_translate() -> None:
    """HTTP, MCP and the command line open every gate and settle every decision through the
    decision core (``service.gate_context``: ``open``, ``open_profile``, ``respond``,
    ``answered``): none builds a ``Gate``, a response or a log record, nor settles itself. They
    had seven ways to open a gate and four sets of keywords for a response."""
    fronts = {
        name: ast.parse(path.read_text(encoding="utf-8"))
        for name, path in _modules().items()
        if name.startswith(tuple(f + "." for f in FRONTS))
    }
    assert "service.cli.ask" in fronts and "service.mcp.server" in fronts
    built = {
        name: [
            target
            for target in ("Gate", "JudgeResponse.of", "Answer.of", "LoggedDecision.of")
            if _calls(tree, target)
        ]
        + (["settle"] if _settles(tree) else [])
        for name, tree in fronts.items()
    }
    assert {name: found for name, found in built.items() if found} == {}
    assert _settles(ast.parse("context.settle(v, g)")) and not _settles(ast.parse("settle"))


# The decision core's steps a front can take for a judgment, one by one or through the
# planner (``service.planner``), counted by name wherever they are called.
CORE_STEPS = {
    "item_prompt", "scored", "open", "open_profile", "opened", "read", "opened_stages",
    "check_engine", "outside_template", "asks", "decide", "decide_many", "respond", "answered",
    "escalated", "plan", "plan_judgment", "item_alone",
}  # fmt: skip


def _core_steps(tree: ast.Module) -> int:
    """The calls in ``tree`` to a name in ``CORE_STEPS`` (a function or any object's method)."""
    count = 0
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", None)
            count += name in CORE_STEPS
    return count


def test_the_fronts_plan_judgments_through_the_core() -> None:
    """A judgment's steps before and after the model (the version read, the item rendered,
    the overrides checked, the gate opened and checked against the engine, the query asking
    for what it reads, the verdict, the response and the record) are sequenced once, in
    ``service.planner``: HTTP and MCP call it, the command line plans each line on its one
    gate. The three front modules made 40 calls into the core's steps before it (issue 68);
    they make at most 27, HTTP's judgments 4."""
    modules = _modules()
    fronts = ("service.web.serving_judge", "service.mcp.server", "service.cli.ask")
    counts = {m: _core_steps(ast.parse(modules[m].read_text(encoding="utf-8"))) for m in fronts}
    assert counts["service.web.serving_judge"] <= 4, counts
    assert sum(counts.values()) <= 27, counts
    assert _core_steps(ast.parse("g.open(n); scored(o, c); f(x)")) == 2


def _stage_types(tree: ast.Module) -> set[str]:
    """The classes of ``tree`` a cascade can hand an item to (an ``answer`` method that takes
    ``timeout_s``), and its type aliases whose name says stage (``X = A | B``)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for method in node.body:
                if (
                    isinstance(method, ast.FunctionDef)
                    and method.name == "answer"
                    and "timeout_s" in {a.arg for a in method.args.kwonlyargs}
                ):
                    found.add(node.name)
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.BinOp):
            found |= {t.id for t in node.targets if isinstance(t, ast.Name) and "Stage" in t.id}
    return found


# A cascade's stages: the protocol, a model in this process, another judge server, any System
# One server. Each takes a judgment and (judge's own two) a typed question.
STAGE_TYPES = {"Stage", "LocalStage", "RemoteStage", "SystemOneStage"}


def test_a_cascade_has_four_stage_types_and_one_escalation() -> None:
    """Judgments and typed questions escalate through one function
    (``service.cascade.escalation.escalated``) over the same stages: there were twelve names
    for a stage (a view per request and per item kind, aliases for their unions) and two
    outcome builders that each stepped the cascade."""
    stages = {
        name: found
        for name, path in _modules().items()
        if (found := _stage_types(ast.parse(path.read_text(encoding="utf-8"))))
    }
    assert set().union(*stages.values()) == STAGE_TYPES, stages
    # The stepping: the library's Cascade.judge, and the one escalation every front runs.
    assert _callers("run_stages") == {"calibration.cascade", "service.cascade.escalation"}
    assert _callers("Cascade") == set()  # the service never builds a library cascade
    assert {"service.mcp.server", "service.cli.decide", "service.cli.ask_cascade"} <= (
        _callers("escalated")
    )
    # The walk sees a view class and an alias of stages.
    view = "class ServedLocal:\n    def answer(self, item, *, timeout_s): ...\n"
    assert _stage_types(ast.parse(view + "ServedStage = ServedLocal | RemoteStage\n")) == {
        "ServedLocal",
        "ServedStage",
    }


def test_the_caller_walk_finds_calls() -> None:
    """The walk itself: a constructor by name or through its module, a classmethod, ``carry``
    into the type; a type passed to anything else is not a call of it."""
    tree = ast.parse("import d\nd.LoggedDecision(a=1)\nd.LoggedDecision.of(v)\n")
    assert _calls(tree, "LoggedDecision") and _calls(tree, "LoggedDecision.of")
    assert _calls(ast.parse("carry(verdict, LoggedDecision, model=m)\n"), "LoggedDecision")
    tree = ast.parse("msgspec.json.Decoder(LoggedDecision)\nLoggedDecision.replace(x)\n")
    assert not _calls(tree, "LoggedDecision") and not _calls(tree, "LoggedDecision.of")


# In a fresh interpreter: a server (on the fake engine) starts and answers one POST /judge,
# every call on every thread traced; it prints the project's cascade modules it imported and
# the project files it called into.
_TRACE = """
import json, sys, threading
from litestar.testing import TestClient
from fakes import FakeEngine
from server import wait_app_ready
from service import ServiceConfig, create_app

called = set()

def trace(frame, event, arg):
    if event == "call":
        called.add(frame.f_code.co_filename)

config = ServiceConfig(cascade=json.loads(sys.argv[1]))
threading.setprofile(trace)
sys.setprofile(trace)
with TestClient(app=create_app(FakeEngine(), config=config)) as client:
    wait_app_ready(client)
    r = client.post("/judge", json={"prompt": "Spam? hi", "choices": ["spam", "ham"]})
    assert r.status_code == 200, r.text
sys.setprofile(None)
threading.setprofile(None)
modules = ["service.web.serving_cascade", "service.cascade.escalation", "service.cascade.stages", "service.cascade.system_one_stage"]
print(json.dumps({"imported": [m for m in modules if m in sys.modules],
                  "called": sorted(called)}))
"""

CASCADE_FILES = (
    "service/web/serving_cascade.py",
    "service/cascade/escalation.py",
    "service/cascade/stages.py",
    "calibration/cascade.py",
)


def _traced(cascade: dict[str, str]) -> tuple[list[str], set[str]]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)])}
    out = subprocess.run(
        [sys.executable, "-c", _TRACE, json.dumps(cascade)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    files = {f for f in CASCADE_FILES if any(c.endswith(f) for c in seen["called"])}
    return seen["imported"], files


@pytest.mark.parametrize("cascade", [False, True], ids=["no cascade", "a cascade"])
def test_a_request_without_a_cascade_neither_imports_nor_calls_it(cascade: bool) -> None:
    """``serving_cascade.py`` was read on every ``POST /judge``; with a cascade configured (a
    remote stage that is down: the item escalates to it) the same trace sees all three."""
    imported, called = _traced({"big": "http://127.0.0.1:9"} if cascade else {})
    if cascade:
        assert imported == [
            "service.web.serving_cascade",
            "service.cascade.escalation",
            "service.cascade.stages",
        ]
        assert called == set(CASCADE_FILES)
    else:
        assert imported == [] and called == set()


def _polls_ready(tree: ast.Module) -> list[int]:
    """Lines of loops that poll ``/ready``: a ``get`` of a path ending in ``/ready`` (a
    literal or an f-string) and a ``sleep``, in one loop."""

    def named(call: ast.Call, name: str) -> bool:
        f = call.func
        return (isinstance(f, ast.Attribute) and f.attr == name) or (
            isinstance(f, ast.Name) and f.id == name
        )

    def ready_path(node: ast.expr) -> bool:
        if isinstance(node, ast.JoinedStr) and node.values:
            node = node.values[-1]
        return (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and node.value.endswith("/ready")
        )

    lines = []
    for loop in ast.walk(tree):
        if not isinstance(loop, ast.For | ast.While):
            continue
        calls = [n for n in ast.walk(loop) if isinstance(n, ast.Call)]
        asks = any(named(c, "get") and c.args and ready_path(c.args[0]) for c in calls)
        if asks and any(named(c, "sleep") for c in calls):
            lines.append(loop.lineno)
    return lines


def test_the_ready_poll_lives_once_in_the_tests() -> None:
    """Waiting for a server lives in tests/server.py (``wait_app_ready``, ``settled``,
    ``wait_url_ready``, ``Server.wait_ready``): it had grown six copies, each with its own
    bound, some too short for a slow machine."""
    copies = {
        path.name: lines
        for path in (ROOT / "tests").glob("*.py")
        if path.name != "server.py"
        and (lines := _polls_ready(ast.parse(path.read_text(encoding="utf-8"))))
    }
    assert copies == {}
    assert _polls_ready(ast.parse((ROOT / "tests" / "server.py").read_text())) != []
    looped = 'while c.get(f"{url}/ready").status_code != 200:\n    time.sleep(0.1)\n'
    assert _polls_ready(ast.parse(looped)) == [1]
    listed = 'for path in ("/ready", "/metrics"):\n    assert c.get(path).status_code == 200\n'
    assert _polls_ready(ast.parse(listed)) == []
