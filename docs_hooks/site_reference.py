"""The reference pages, generated from the code each time the site is built (a MkDocs hook,
``hooks:`` in mkdocs.yml): nothing here is written by hand, so nothing here can drift.

* ``reference/cli.md``: every ``judge`` command, flag, default and help text, from the
  argument parser itself (``service.cli.main.parser``).
* ``reference/http.md``: every route of the operation table (``service.operations``) with its
  parameters, request and response fields and statuses, from the OpenAPI document the server
  serves (``service.web.openapi``), and a request and response example for each route from
  ``http_examples.json`` beside this file: exchanges that tests/test_site_reference.py sends to a
  real server and compares with what it answers.
* ``reference/python.md``: the public names of each package (its ``__all__``), rendered from
  their docstrings by mkdocstrings.

tests/test_site_reference.py checks that each page names everything it should: a command, flag,
route, request field or public name without an entry fails it.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
EXAMPLES = HERE / "http_examples.json"

# The packages whose __all__ is the public Python API, in the order the page shows them.
PYTHON_PACKAGES = ("judge", "calibration", "calibration.tasks", "service", "service.client")

PAGES = {
    "reference/cli.md": "cli_page",
    "reference/http.md": "http_page",
    "reference/python.md": "python_page",
}


# --- the command line ---------------------------------------------------------------------


@functools.cache
def _subcommands() -> argparse._SubParsersAction[argparse.ArgumentParser]:
    """The ``judge`` parser's commands, built once per build (it imports every command)."""
    from service.cli.main import parser

    [sub] = [a for a in parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return sub


def commands() -> dict[str, argparse.ArgumentParser]:
    """Each ``judge`` command's parser, by name, in the order ``judge --help`` lists them."""
    return dict(_subcommands().choices)


def command_summaries() -> dict[str, str]:
    """Each command's one-line help, as ``judge --help`` lists it."""
    return {action.dest: action.help or "" for action in _subcommands()._choices_actions}


def documented_actions(command: argparse.ArgumentParser) -> list[argparse.Action]:
    """The arguments a command takes, less ``--help``."""
    return [a for a in command._actions if not isinstance(a, argparse._HelpAction)]


def flag_title(action: argparse.Action) -> str:
    """How an argument is written: ``--choice CHOICE``, ``--log-requests``, ``PROMPT``."""
    if not action.option_strings:
        return str(action.metavar or action.dest).upper()
    name = ", ".join(action.option_strings)
    if action.nargs == 0:
        return name
    if action.choices is not None and action.metavar is None:
        return f"{name} {{{','.join(map(str, action.choices))}}}"
    metavar = action.metavar or action.dest.upper()
    return f"{name} {'[' + str(metavar) + ']' if action.nargs == '?' else metavar}"


def cli_page() -> str:
    summaries = command_summaries()
    out = [
        "# Command-line reference",
        "",
        "Every `judge` command with every flag, its default and its help, generated from the "
        "command's own argument parser when this site is built (so it is what `judge COMMAND "
        "--help` prints). How the commands fit together: [Command line](../cli.md); a first "
        "task from start to end: [Your first task](../tutorial.md).",
        "",
    ]
    out += [f"- [`judge {name}`](#judge-{name}): {_md(summaries[name])}" for name in commands()]
    for name, command in commands().items():
        out += ["", f"## judge {name} {{#judge-{name}}}", "", _md(summaries[name]) + ".", ""]
        out += ["```text", command.format_usage().strip(), "```", ""]
        if command.description:
            out += [_md(command.description), ""]
        for group in command._action_groups:
            actions = [a for a in group._group_actions if not isinstance(a, argparse._HelpAction)]
            if not actions:
                continue
            title = {"options": "Options", "positional arguments": "Arguments"}.get(
                group.title or "", group.title or ""
            )
            out += [f"**{_md(title)}**", ""]
            if group.description:
                out += [_md(group.description), ""]
            for action in actions:
                out += [f"`{flag_title(action)}`", f":   {_md(_action_help(command, action))}", ""]
    return "\n".join(out) + "\n"


def _action_help(command: argparse.ArgumentParser, action: argparse.Action) -> str:
    """The help as ``--help`` prints it (``%(default)s`` expanded), with what it leaves
    implicit: the default, whether it is required or may repeat."""
    text = command._get_formatter()._expand_help(action) if action.help else ""
    notes = []
    if action.required and action.option_strings:
        notes.append("Required.")
    if isinstance(action, argparse._AppendAction):
        notes.append("May be repeated.")
    shown = action.default not in (None, False, argparse.SUPPRESS, [])
    if shown and "default" not in text:
        notes.append(f"Default: `{action.default}`.")
    return " ".join([text.rstrip(".") + "." if text else "", *notes]).strip()


# --- HTTP -----------------------------------------------------------------------------------


def operations() -> list[Any]:
    """The documented operations of the table, in its order."""
    from service.operations import OPERATIONS

    return [op for op in OPERATIONS if op.documented]


def load_examples() -> list[dict[str, Any]]:
    """The recorded exchanges: each ``operation``, ``path``, ``request`` (or none), ``status``
    and ``response`` (or none)."""
    exchanges: list[dict[str, Any]] = json.loads(EXAMPLES.read_text())
    return exchanges


def route_anchor(method: str, path: str) -> str:
    """A route's heading id: ``post-profiles-name-fit``."""
    return re.sub(r"[^a-z0-9]+", "-", f"{method} {path}".lower()).strip("-")


def http_page() -> str:
    from service.web.openapi import openapi_document

    document = openapi_document(secured=True)
    schemas = document["components"]["schemas"]
    examples: dict[str, list[dict[str, Any]]] = {}
    for exchange in load_examples():
        examples.setdefault(exchange["operation"], []).append(exchange)
    out = [
        "# HTTP reference",
        "",
        "Every route the server answers, generated from its table of operations and the OpenAPI "
        "document it serves at `/schema/openapi.json` when this site is built. Each route's "
        "example is an exchange a test sends to a real server on the default model and "
        "compares, field by field, with what the server answers (the numbers differ from "
        "machine to machine; the fields and their types do not). How the service behaves: "
        "[HTTP service](../http.md).",
        "",
        "With `--api-key-file`, every route but `/health` needs `Authorization: Bearer KEY`; "
        "without the key it answers 401. Every error is an `ErrorResponse` "
        "([below](#errorresponse)) whose `field` names the part of the request at fault.",
        "",
    ]
    for op in operations():
        out.append(
            f"- [`{op.method} {op.path}`](#{route_anchor(op.method, op.path)}): {op.summary}"
        )
    for op in operations():
        method = op.method.lower()
        spec = document["paths"][op.path][method]
        out += ["", f"## {op.method} {op.path} {{#{route_anchor(op.method, op.path)}}}", ""]
        out += [op.summary + ".", ""]
        params = spec.get("parameters", [])
        if params:
            out += ["**Parameters**", ""]
            for p in params:
                where = "path" if p["in"] == "path" else "header"
                what = p.get("description") or f"a name matching `{p['schema'].get('pattern')}`"
                out += [f"`{p['name']}` ({where})", f":   {what}", ""]
        body = spec.get("requestBody")
        if body is not None:
            out += ["**Request body**", ""]
            out += _body_fields(body["content"]["application/json"]["schema"], schemas)
        ok = str(op.ok[0])
        answer = spec["responses"][ok]
        out += [f"**Response {ok}**", ""]
        content = answer.get("content", {})
        if "application/json" in content:
            out += _body_fields(content["application/json"]["schema"], schemas)
        elif content:
            out += [f"`{next(iter(content))}`", ""]
        else:
            out += ["No body.", ""]
        out += ["**Errors**", ""]
        for status, response in spec["responses"].items():
            if status != ok:
                out += [f"`{status}`", f":   {response['description']}", ""]
        for exchange in examples.get(op.name, []):
            out += _example(op.method, exchange)
    out += ["", "## Bodies", "", "Every body a route takes or answers, by its schema's name.", ""]
    for name in sorted(schemas):
        out += _schema(name, schemas[name])
    return "\n".join(out) + "\n"


def _body_fields(schema: dict[str, Any], schemas: dict[str, Any]) -> list[str]:
    """What a route's body is: one or more named schemas (linked below) or an inline type."""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[1]
        return [f"[`{name}`](#{name.lower()})", ""]
    if "oneOf" in schema:
        names = [s["$ref"].rsplit("/", 1)[1] for s in schema["oneOf"] if "$ref" in s]
        return ["One of " + ", ".join(f"[`{n}`](#{n.lower()})" for n in names) + ".", ""]
    return [f"`{_type(schema)}`", ""]


def _schema(name: str, schema: dict[str, Any]) -> list[str]:
    out = [f"### {name} {{#{name.lower()}}}", ""]
    for paragraph in re.split(r"\n\s*\n", schema.get("description", "")):
        if paragraph.strip():
            out += [_md(_rst(paragraph)), ""]
    properties = schema.get("properties", {})
    required = set(schema.get("required", ()))
    if not properties:
        out += [f"`{_type(schema)}`", ""]
    for field, spec in properties.items():
        notes = ["required" if field in required else None, _constraints(spec)]
        if "default" in spec:
            notes.append(f"default `{json.dumps(spec['default'])}`")
        limits = "; ".join(n for n in notes if n) or "optional"
        said = _md(_rst(spec.get("description", "")))
        text = f"{said}. {limits[0].upper()}{limits[1:]}" if said else limits
        out += [f"`{field}`: `{_type(spec)}`", f":   {text}.", ""]
    return out


def _example(method: str, exchange: dict[str, Any]) -> list[str]:
    title = exchange.get("title") or "Example"
    out = [f"**{_md(title)}**", "", "```http", f"{method} {exchange['path']}"]
    request = exchange.get("request")
    if request == "{previous}":  # the test sends what the route before it answered
        out += ["Content-Type: application/json", "", "(the profile GET answered, as it was)"]
    elif request is not None:
        out += ["Content-Type: application/json", "", json.dumps(request, indent=2)]
    out += ["```", "", f"answers `{exchange['status']}`", ""]
    if exchange.get("response") is not None:
        out += ["```json", json.dumps(exchange["response"], indent=2), "```", ""]
    return out


def _type(spec: dict[str, Any]) -> str:
    """A schema's type in a few characters: ``string``, ``array[string]``, ``Gate | null``."""
    if "$ref" in spec:
        return str(spec["$ref"].rsplit("/", 1)[1])
    for key in ("anyOf", "oneOf"):
        if key in spec:
            return " | ".join(_type(s) for s in spec[key])
    if "enum" in spec:
        return " | ".join(json.dumps(v) for v in spec["enum"])
    if "const" in spec:
        return json.dumps(spec["const"])
    kind = spec.get("type", "any")
    if kind == "array" and "prefixItems" in spec:  # a tuple
        return "[" + ", ".join(_type(s) for s in spec["prefixItems"]) + "]"
    if kind == "array":
        return f"array[{_type(spec.get('items', {}))}]"
    if kind == "object" and isinstance(spec.get("additionalProperties"), dict):
        return f"object[string, {_type(spec['additionalProperties'])}]"
    return str(kind)


_CONSTRAINTS = {
    "minLength": "at least {} characters",
    "maxLength": "at most {} characters",
    "minItems": "at least {} items",
    "maxItems": "at most {} items",
    "minProperties": "at least {} entries",
    "maxProperties": "at most {} entries",
    "minimum": ">= {}",
    "maximum": "<= {}",
    "exclusiveMinimum": "> {}",
    "exclusiveMaximum": "< {}",
    "pattern": "matches `{}`",
}


def _constraints(spec: dict[str, Any]) -> str:
    """The limits the server enforces on a field (those of its non-null member)."""
    members = [s for s in spec.get("anyOf", [spec]) if s.get("type") != "null"]
    found = []
    for member in members:
        found += [text.format(member[key]) for key, text in _CONSTRAINTS.items() if key in member]
        if member.get("uniqueItems"):
            found.append("no repeats")
    return ", ".join(found)


# --- Python ---------------------------------------------------------------------------------


def python_page() -> str:
    import importlib

    out = [
        "# Python reference",
        "",
        "The public names of each package (its `__all__`), with their docstrings, generated "
        "when this site is built. How they fit together: [Python API](../python-api.md).",
        "",
    ]
    for package in PYTHON_PACKAGES:
        names = sorted(importlib.import_module(package).__all__, key=str.lower)
        out += [f"## {package}", ""]
        for name in names:
            if name.startswith("__"):
                continue
            out += [
                f"::: {package}.{name}",
                "    options:",
                "      heading_level: 3",
                "      show_root_full_path: true",
                "",
            ]
    return "\n".join(out) + "\n"


# --- the benchmarks ---------------------------------------------------------------------------

BENCHMARKS_MARK = (
    "<!-- benchmarks: generated from each script's docstring (docs_hooks/site_reference.py) -->"
)


def benchmark_list() -> str:
    """Each ``benchmarks/bench_*.py`` and the first paragraph of its docstring: what it
    measures, in its own words."""
    import ast

    out = []
    for script in sorted((HERE.parent / "benchmarks").glob("bench_*.py")):
        doc = ast.get_docstring(ast.parse(script.read_text())) or ""
        first = _md(_rst(doc.split("\n\n", 1)[0]))
        out += [f"`{script.name}`", f":   {first}", ""]
    return "\n".join(out)


# --- the hook --------------------------------------------------------------------------------


def _md(text: str) -> str:
    """Plain text as one Markdown paragraph: no HTML and no emphasis by accident; what is
    between backticks is left as it is."""
    parts = " ".join(text.split()).split("`")
    for i in range(0, len(parts), 2):  # outside code spans
        plain = parts[i].replace("<", "&lt;").replace("*", r"\*")
        parts[i] = re.sub(r"(?<![\w])_", r"\_", plain)
    return "`".join(parts)


def _rst(text: str) -> str:
    """A docstring's ``literal`` as Markdown's `literal`."""
    return re.sub(r"``([^`]+)``", r"`\1`", text)


def on_files(files: Any, config: Any) -> Any:
    """MkDocs: add the generated pages to the site's files (before the nav is read)."""
    from mkdocs.structure.files import File

    for uri, builder in PAGES.items():
        files.append(File.generated(config, uri, content=globals()[builder]()))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """MkDocs: the benchmarks page's list of scripts, from the scripts."""
    if page.file.src_uri == "benchmarks.md":
        if BENCHMARKS_MARK not in markdown:
            raise ValueError("docs/benchmarks.md lost the mark where the list of scripts goes")
        return markdown.replace(BENCHMARKS_MARK, benchmark_list())
    return markdown
