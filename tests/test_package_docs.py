"""A package docstring that lists its modules lists them all, and only modules that exist.

The convention: a package's docstring lists its modules in a table, one row per module: four
spaces (or none, where the formatter took away an indent that every line shared), the
module's name, bare (``stages``) or dotted from the package (``service.cascade.stages``), then
what it is, two spaces or more after a bare name. Further lines of a row are indented deeper. A docstring without such rows (``judge``, ``service``)
lists nothing and is not held to it. ``service/log/__init__.py`` named 3 of its 8 modules,
``service/cli/__init__.py`` 4 of 10, and ``service/web/__init__.py`` two that had moved.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = sorted(
    path.parent
    for top in ("judge", "calibration", "service")
    for path in (ROOT / top).rglob("__init__.py")
)
_ROW = re.compile(r"^(?: {4})?(?P<name>[a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)*)(?P<gap> +)\S")


def listed(docstring: str, package: str) -> set[str]:
    """The module names a package docstring's rows give, each without the package's prefix."""
    names = set()
    for line in docstring.splitlines():
        row = _ROW.match(line)
        if row is None:
            continue
        name, dotted = row["name"], row["name"].startswith(package + ".")
        if dotted:
            names.add(name.removeprefix(package + "."))
        elif "." not in name and len(row["gap"]) >= 2:
            names.add(name)
    return names


def _modules(folder: Path) -> set[str]:
    """A package's modules and subpackages, without ``__init__`` and ``__main__``."""
    files = {p.stem for p in folder.glob("*.py") if not p.stem.startswith("_")}
    return files | {p.parent.name for p in folder.glob("*/__init__.py")}


@pytest.mark.parametrize("folder", PACKAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_a_package_docstring_lists_its_modules_whole(folder: Path) -> None:
    package = ".".join(folder.relative_to(ROOT).parts)
    tree = ast.parse((folder / "__init__.py").read_text())
    docstring = ast.get_docstring(tree, clean=False) or ""  # as written: rows keep their indent
    names = listed(docstring, package)
    if not names:
        return  # lists nothing
    modules = _modules(folder)
    assert sorted(modules - names) == [], "modules the docstring leaves out"
    assert sorted(names - modules) == [], "names in the docstring that are no module here"


def test_the_walk_reads_rows() -> None:
    """The reader itself: bare and dotted rows, a deeper line and prose or code left out."""
    doc = (
        "A package.\n\n"
        "    stages        the stages\n"
        "                  and more about them\n"
        "    pkg.sub.escalation the escalation\n"
        "    gate = Gate(load_profile(path))\n"
        "    other.pkg.name  another package's module\n"
        "Prose that names stages  twice.\n"
        "health   at the margin, as service/log/__init__.py had it\n"
        "prose with one space between words\n"
    )
    assert listed(doc, "pkg.sub") == {"stages", "escalation", "health"}
    assert len(PACKAGES) >= 10  # the walk found the packages
