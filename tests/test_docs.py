"""The front door and the documentation site: a README a newcomer reads in minutes, and a
site (MkDocs with Material, ``mkdocs.yml``) that builds with every warning an error."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README_LINES = 250


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    site = tmp_path_factory.mktemp("site")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return site, done.stdout + done.stderr


def test_the_site_builds_without_a_warning(built: tuple[Path, str]) -> None:
    site, log = built
    assert "WARNING" not in log, log
    # Every page of docs/ is in the site (an omitted page is a warning too).
    for page in (ROOT / "docs").glob("*.md"):
        name = "" if page.stem == "index" else page.stem + "/"
        assert (site / name / "index.html").is_file(), page.name


def test_the_site_s_quickstart_is_the_readme_s(built: tuple[Path, str]) -> None:
    """The quickstart page includes the README's, so the two cannot drift apart."""
    site, _ = built
    readme = (ROOT / "README.md").read_text()
    part = re.search(r"\[start:quickstart\] -->\n(.*?)<!-- --8<-- \[end:quickstart\]", readme, re.S)
    assert part, "README marks its quickstart for the site"
    page = (site / "quickstart" / "index.html").read_text()
    for command in re.findall(r"```sh\n(.*?)```", part.group(1), re.S):
        first = command.splitlines()[0].split("#")[0].strip()
        assert first.split()[0] in page, first
    assert "Set up: two commands" in page and "One certified decision, end to end" in page


def test_the_results_and_the_changelog_are_in_the_site(built: tuple[Path, str]) -> None:
    site, _ = built
    assert "Benchmark results" in (site / "results" / "index.html").read_text()
    assert "Changelog" in (site / "changelog" / "index.html").read_text()


def test_the_readme_is_short_and_links_only_what_exists() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= README_LINES
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme)
    local = [link for link in links if not link.startswith("http")]
    assert local, "the README points into the docs"
    assert [link for link in local if not (ROOT / link).exists()] == []


def test_the_glossary_defines_each_word_once() -> None:
    glossary = (ROOT / "docs" / "glossary.md").read_text()
    terms = re.findall(r"^\*\*(.+?)\*\*$", glossary, re.M)
    words = [word.strip() for term in terms for word in term.split(",")]
    assert len(words) == len(set(words))
    for word in ("judgment", "gate", "decide", "decision", "verdict", "settle", "answer"):
        assert word in words, word


def test_make_bench_runs_every_benchmark_script() -> None:
    """docs/benchmarks.md says `make bench` runs every script: each is in its recipe (or in
    bench-cpu's, which it runs first)."""
    makefile = (ROOT / "Makefile").read_text()
    recipes = re.findall(r"^(bench-cpu|bench):[^\n]*\n((?:\t[^\n]*\n)+)", makefile, re.M)
    assert {name for name, _ in recipes} == {"bench", "bench-cpu"}
    run = set(re.findall(r"benchmarks/(bench_\w+\.py)", "".join(body for _, body in recipes)))
    scripts = {p.name for p in (ROOT / "benchmarks").glob("bench_*.py")}
    assert scripts - run == set()


def test_the_generated_reference_is_in_the_site(built: tuple[Path, str]) -> None:
    """The hook's pages are built, and mkdocstrings rendered an entry (an anchor) for every
    public name: a name griffe cannot resolve would have no anchor."""
    import importlib

    site, _ = built
    cli = (site / "reference" / "cli" / "index.html").read_text()
    assert 'id="judge-calibrate"' in cli and "--target-precision" in cli
    http = (site / "reference" / "http" / "index.html").read_text()
    assert 'id="post-judge"' in http and 'id="judgerequest"' in http
    python = (site / "reference" / "python" / "index.html").read_text()
    anchors = set(re.findall(r'id="([^"]+)"', python))
    for package in ("judge", "calibration", "calibration.tasks", "service", "service.client"):
        for name in importlib.import_module(package).__all__:
            if not name.startswith("__"):
                assert f"{package}.{name}" in anchors, f"{package}.{name}"


def test_every_glossary_entry_names_code_that_exists() -> None:
    """Each entry points at the code it describes (a dotted name in backticks, a module's
    attribute chain), and each such name resolves: a rename leaves no word behind."""
    import importlib

    glossary = (ROOT / "docs" / "glossary.md").read_text()
    entries = re.findall(r"^\*\*(.+?)\*\*\n((?::   |    ).*(?:\n    .*)*)", glossary, re.M)
    assert len(entries) >= 20
    for term, text in entries:
        names = re.findall(r"`((?:judge|calibration|service)(?:\.\w+)+)`", text)
        assert names, f"{term}: names no code"
        for name in names:
            parts = name.split(".")
            for cut in range(len(parts), 0, -1):  # the longest importable module first
                try:
                    found: object = importlib.import_module(".".join(parts[:cut]))
                except ImportError:
                    continue
                for attribute in parts[cut:]:
                    assert hasattr(found, attribute), f"{term}: {name}"
                    found = getattr(found, attribute)
                break
            else:
                raise AssertionError(f"{term}: {name} is not importable")
    for word in ("policy", "overrides", "hold", "cascade", "template", "version", "look"):
        assert f"**{word}**" in glossary, word
