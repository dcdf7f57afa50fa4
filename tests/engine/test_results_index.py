"""bench/results/README.md indexes the raw results of each measuring round: a section headed
by a prefix (`2026-12-02-h200-load-release-*`) names its files by their tails (`-4-shapes.*`).
Every name it gives must match a file, so that no commit (a revert that took a run's
files with it) leaves the tables of docs/benchmarks.md without their source."""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"
HEADING = re.compile(r"^## .*`(?P<prefix>[0-9][^`]*?)-\*`\s*$")
TAIL = re.compile(r"`(?P<tail>-[^`\s]+)`")


def named_files(text: str) -> list[tuple[str, str]]:
    """(section prefix, glob) for every file tail named under a prefixed heading."""
    named: list[tuple[str, str]] = []
    prefix = ""
    for line in text.splitlines():
        if line.startswith("## "):
            m = HEADING.match(line)
            prefix = m["prefix"] if m else ""
            continue
        if prefix:
            # A command's option in the prose (`--quick`) names no file.
            tails = [t["tail"] for t in TAIL.finditer(line)]
            named += [(prefix, prefix + t) for t in tails if not t.startswith("--")]
    return named


def test_the_index_reads_a_sections_tails() -> None:
    text = "## A run (2026-x): `2026-x-*`\n- `-1-a.*`, `-1-b.log`: run `--quick`\n## Other\n`-z`\n"
    assert named_files(text) == [
        ("2026-x", "2026-x-1-a.*"),
        ("2026-x", "2026-x-1-b.log"),
    ]


def test_every_result_the_index_names_is_in_the_repository() -> None:
    files = [p.name for p in RESULTS.iterdir()]
    named = named_files((RESULTS / "README.md").read_text())
    assert len(named) > 40, "the index names fewer files than it did: parsed wrong?"
    missing = [glob for _, glob in named if not fnmatch.filter(files, glob)]
    assert not missing, f"bench/results/README.md names files that are not there: {missing}"


def titles_sent_to_docs(text: str) -> list[str]:
    """The titles of the index's sections that send the reader to "the section of the
    same title" in docs/benchmarks.md (the heading without its file prefix)."""
    titles: list[str] = []
    title = ""
    for line in text.splitlines():
        if line.startswith("## "):
            title = line[3:].split(": `", 1)[0]
        elif "the section of the same title" in line and title:
            titles.append(title)
    return titles


def test_every_section_the_index_sends_to_is_in_the_docs() -> None:
    docs = RESULTS.parents[1] / "docs" / "benchmarks.md"
    headings = {line.lstrip("#").strip() for line in docs.read_text().splitlines() if
                line.startswith("#")}  # fmt: skip
    titles = titles_sent_to_docs((RESULTS / "README.md").read_text())
    assert len(titles) >= 6, "the index sends to fewer sections than it did: parsed wrong?"
    missing = [t for t in titles if t not in headings]
    assert not missing, f"docs/benchmarks.md has no section titled: {missing}"
