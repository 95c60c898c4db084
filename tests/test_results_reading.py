"""benchmarks/RESULTS.md's "Reading" summaries say only what their tables say.

Each summary bullet names the section it summarises (``from: "<heading>"``), and every figure in
it with a decimal point or of two digits or more must appear in that section: a summary that
outlives its table (a figure from an older run, a claim the table no longer makes) fails here.
"""

from __future__ import annotations

import re
from pathlib import Path

RESULTS = (Path(__file__).resolve().parent.parent / "benchmarks" / "RESULTS.md").read_text()
FIGURE = re.compile(r"(?<![\w.])\d+(?:,\d{3})*(?:\.\d+)?")


def section(heading: str) -> str:
    """The text under ``heading`` up to the next heading of its level or above."""
    lines = RESULTS.splitlines()
    start = lines.index(heading)
    level = len(heading) - len(heading.lstrip("#"))
    end = next(
        (
            i
            for i in range(start + 1, len(lines))
            if lines[i].startswith("#") and len(lines[i]) - len(lines[i].lstrip("#")) <= level
        ),
        len(lines),
    )
    return "\n".join(lines[start:end])


def bullets() -> list[str]:
    reading = section("## Reading")
    return [b.replace("\n", " ") for b in re.split(r"\n(?=- )", reading) if b.startswith("- ")]


def test_every_summary_names_an_existing_section() -> None:
    found = bullets()
    assert len(found) >= 5
    for bullet in found:
        cited = re.search(r'from: "(#+ .+?)"\s*$', bullet.strip())
        assert cited, f"no from: in {bullet[:60]!r}"
        heading = re.sub(r"\s+", " ", cited.group(1))
        assert heading in RESULTS.splitlines(), f"no section {heading!r}"


def test_every_figure_of_a_summary_is_in_its_section() -> None:
    for bullet in bullets():
        body, _, cited = bullet.strip().rpartition('from: "')
        text = section(re.sub(r"\s+", " ", cited.rstrip('"')))
        plain = re.sub(r"`[^`]*`", "", body)  # code (option_N, ...) is not a figure
        for figure in FIGURE.findall(plain):
            if "." not in figure and len(figure.replace(",", "")) < 2:
                continue  # a small count (2 cores, 4 of 7) says nothing checkable
            if figure in {"45", "47"}:  # issue numbers
                continue
            assert figure in text, (
                f"{figure} is in the summary but not in its section: {body[:80]!r}"
            )
