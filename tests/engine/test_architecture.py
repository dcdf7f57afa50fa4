"""specs/architecture.md names every module, each in its folder's section, and its
arrows are the code's: each arrow line is diffed against what tools/py_imports.py (the
Python modules' imports) and tools/c_calls.py (the C files' uses) find, so the
document cannot drift from the code."""

from __future__ import annotations

import importlib.util
import itertools
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType

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


# -- the arrows ---------------------------------------------------------------------


def _tool(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


Arrows = dict[str, set[str]]  # a room -> the rooms it uses
PYTHON_FOLDERS = {"phases/": "cuinterpose.phases", "engine/": "cuinterpose.engine",
                  "frontends/": "cuinterpose"}  # fmt: skip
ARROW = "→"


def _chain(text: str, into: Arrows) -> None:
    """``a, b → c, d → e``: a and b use c and d, c and d use e."""
    links = [[w.strip().removesuffix(".c") for w in part.split(",")] for part in text.split(ARROW)]
    for left, right in itertools.pairwise(links):
        for room in left:
            into.setdefault(room, set()).update(r for r in right if r != "nothing")


def written_python(section: str) -> Arrows:
    """The arrows of a Python folder's section: every backticked span and every line of
    a fenced block that holds an arrow."""
    found: Arrows = {}
    blocks = re.findall(r"^```\n(.*?)^```", section, flags=re.MULTILINE | re.DOTALL)
    lines = [line for block in blocks for line in block.splitlines() if ARROW in line]
    outside = re.sub(r"^```\n.*?^```", "", section, flags=re.MULTILINE | re.DOTALL)
    lines += [span for span in re.findall(r"`([^`]+)`", outside) if ARROW in span]
    for line in lines:
        _chain(line, found)
    return found


def written_c(section: str) -> Arrows:
    """``- `file.c`: what it is → b, c`` (or ``→ nothing``): one line per file."""
    found: Arrows = {}
    for name, uses in re.findall(r"^- `([\w]+)\.c`:.*" + ARROW + r"([^\n" + ARROW + r"]*)$",
                                 section, flags=re.MULTILINE):  # fmt: skip
        _chain(f"{name} {ARROW} {uses}", found)
        found.setdefault(name, set())
    return found


def python_rooms(edges: Mapping[str, set[str]], package: str) -> Arrows:
    """The package's modules as the spec names them: a module of the folder by its name
    (a subpackage as one room), another folder by its own name (engine, phases)."""

    def room(module: str) -> str | None:
        owners = [p for p in PYTHON_FOLDERS.values() if module == p or module.startswith(p + ".")]
        if not owners:
            return None
        owner = max(owners, key=len)
        if owner != package:
            return next(k for k, v in PYTHON_FOLDERS.items() if v == owner).rstrip("/")
        return module.removeprefix(package).lstrip(".").split(".")[0] or None

    found: Arrows = {}
    for module, targets in edges.items():
        mine = room(module)
        own = module == package or module.startswith(package + ".")
        if mine is None or not own or mine in PLUMBING or mine + "/" in PYTHON_FOLDERS:
            continue
        uses = found.setdefault(mine, set())
        for target in targets:
            used = room(target)
            if used is not None and used != mine and used not in PLUMBING:
                uses.add(used)
    return found


def c_rooms(directory: Path) -> Arrows:
    c_calls = _tool("c_calls")
    graph = c_calls.build_graph(c_calls.read_dir(directory))
    return {f.removesuffix(".c"): {u.removesuffix(".c") for u in uses} for f, uses in graph.items()}


def drift(written: Arrows, found: Arrows, folder: str) -> list[str]:
    """Each room whose written arrows are not what the code has, as a diff line."""
    lines = []
    for room in sorted(set(written) | {r for r, uses in found.items() if uses}):
        have, claim = found.get(room, set()), written.get(room, set())
        if room not in found:
            lines.append(f"{folder}{room}: written with arrows, but there is no such room")
        elif have != claim:
            missing, extra = sorted(have - claim), sorted(claim - have)
            lines.append(
                f"{folder}{room} {ARROW} {', '.join(sorted(have)) or 'nothing'}"
                + (f" (missing: {', '.join(missing)})" if missing else "")
                + (f" (not used: {', '.join(extra)})" if extra else "")
            )
    return lines


def arrow_drift(text: str, root: Path) -> list[str]:
    sections = _sections(text)
    edges = _tool("py_imports").graph(root)
    lines: list[str] = []
    for folder, package in PYTHON_FOLDERS.items():
        written = written_python(sections.get(folder, ""))
        lines += drift(written, python_rooms(edges, package), folder)
    for folder in ("shim_c/", "shim_c/sim/"):
        lines += drift(written_c(sections.get(folder, "")), c_rooms(root / folder), folder)
    return lines


def test_every_arrow_is_the_codes() -> None:
    assert arrow_drift(SPEC.read_text(encoding="utf-8"), ROOT) == []


def test_a_drifted_arrow_is_found() -> None:
    """The spec with one arrow taken away and one added fails, naming both."""
    text = SPEC.read_text(encoding="utf-8")
    c_line = next(line for line in text.splitlines() if line.startswith("- `lifecycle.c`"))
    assert ", handles," in c_line
    drifted = text.replace(c_line, c_line.replace(", handles,", ","))
    assert "`testing → engine, phases`" in drifted
    drifted = drifted.replace("`testing → engine, phases`", "`testing → engine, phases, launch`")
    assert arrow_drift(drifted, ROOT) == [
        "frontends/testing → engine, phases (not used: launch)",
        "shim_c/lifecycle → content, control, handles, keep, owned, settings, state, unowned, "
        "util "
        "(missing: handles)",
    ]


def test_the_arrow_readers() -> None:
    section = "`a, b → c → d`\n```\nx → y, z\n```\n"
    assert written_python(section) == {"a": {"c"}, "b": {"c"}, "c": {"d"}, "x": {"y", "z"}}
    c_section = "- `one.c`: first → nothing\n- `two.c`: it uses → one, util\n"
    assert written_c(c_section) == {"one": set(), "two": {"one", "util"}}
