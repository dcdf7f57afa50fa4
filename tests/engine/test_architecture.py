"""specs/architecture.md names every module, each in its folder's section."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "specs" / "architecture.md"
# Package plumbing, not rooms: the public API is named by its folder's heading.
PLUMBING = frozenset({"__init__", "__main__"})


def _sections(text: str) -> dict[str, str]:
    """Each ``### `folder/` ...`` section's text, by folder."""
    found: dict[str, str] = {}
    parts = re.split(r"^#{2,3} ", text, flags=re.MULTILINE)
    for part in parts:
        heading = re.match(r"`([\w/]+/)`", part)
        if heading:
            found[heading.group(1)] = part
    return found


def _named(section: str) -> set[str]:
    return set(re.findall(r"`([\w./]+)`", section))


def missing(text: str, root: Path) -> list[str]:
    """Every module of the Python folders and every C file of the C folders that its
    section does not name."""
    sections = _sections(text)
    gaps: list[str] = []
    for folder in ("phases/", "engine/", "frontends/"):
        named = _named(sections.get(folder, ""))
        for path in sorted((root / folder).iterdir()):
            if path.suffix == ".py" and path.stem not in PLUMBING and path.stem not in named:
                gaps.append(f"{folder}{path.name}")
            elif path.is_dir() and (path / "__init__.py").is_file():
                if f"{path.name}/" not in named:
                    gaps.append(f"{folder}{path.name}/")
                gaps += [
                    f"{folder}{path.name}/{inner.name}"
                    for inner in sorted(path.glob("*.py"))
                    if inner.stem not in PLUMBING and inner.name not in named
                ]
    for folder in ("shim_c/", "shim_c/sim/"):
        named = _named(sections.get(folder, ""))
        gaps += [
            f"{folder}{path.name}"
            for path in sorted((root / folder).glob("*.c"))
            if path.name not in named
        ]
    return gaps


def test_every_module_is_named_in_the_architecture() -> None:
    assert missing(SPEC.read_text(encoding="utf-8"), ROOT) == []


def test_a_module_left_out_is_found(tmp_path: Path) -> None:
    for folder in ("phases", "engine", "frontends/demo", "shim_c/sim"):
        (tmp_path / folder).mkdir(parents=True)
    (tmp_path / "frontends" / "demo" / "__init__.py").write_text("")
    for name in ("engine/named.py", "engine/new.py", "frontends/demo/extra.py", "shim_c/sim/x.c"):
        (tmp_path / name).write_text("")
    text = "## Python\n### `engine/` (public)\n| `named` | it |\n### `shim_c/sim/`: sim\n"
    assert missing(text, tmp_path) == [
        "engine/new.py",
        "frontends/demo/",
        "frontends/demo/extra.py",
        "shim_c/sim/x.c",
    ]


@pytest.mark.parametrize("folder", ["phases/", "engine/", "frontends/", "shim_c/", "shim_c/sim/"])
def test_every_folder_has_its_section(folder: str) -> None:
    assert folder in _sections(SPEC.read_text(encoding="utf-8"))
