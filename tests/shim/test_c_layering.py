"""The C files of the shim and of the simulated driver use each other one way: no circle."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "c_calls.py"
SHIM = ROOT / "shim_c"
SIM = ROOT / "shim_c" / "sim"


def _tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("c_calls", TOOL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


c_calls = _tool()


def check(directory: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(TOOL), str(directory)], capture_output=True, text=True, timeout=60
    )


def test_the_shim_has_no_circle() -> None:
    result = check(SHIM)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "acyclic" in result.stdout


def test_the_simulated_driver_has_no_circle() -> None:
    result = check(SIM)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "acyclic" in result.stdout


def cmake_sources(directory: Path, target: str) -> list[str]:
    text = (directory / "CMakeLists.txt").read_text()
    text = re.sub(r"#.*", "", text)
    match = re.search(rf"add_library\(\s*{target}\s+SHARED\s+([^)]*)\)", text)
    assert match, f"no add_library({target} SHARED ...) in {directory}/CMakeLists.txt"
    return match[1].split()


@pytest.mark.parametrize(("directory", "target"), [(SHIM, "cuinterpose"), (SIM, "cuinterpose_sim")])
def test_files_are_listed_bottom_to_top(directory: Path, target: str) -> None:
    # CMakeLists.txt lists the files in layers: each uses only files listed before it.
    order = cmake_sources(directory, target)
    assert sorted(order) == sorted(p.name for p in directory.glob("*.c"))
    graph = c_calls.build_graph(c_calls.read_dir(directory))
    upward = [
        f"{src} -> {dst} ({', '.join(sorted(names))})"
        for src, targets in graph.items()
        for dst, names in targets.items()
        if order.index(dst) > order.index(src)
    ]
    assert upward == [], "files that use a file listed after them"


def test_the_checker_sees_the_known_uses() -> None:
    # A parser that found nothing would call every directory acyclic.
    shim = c_calls.build_graph(c_calls.read_dir(SHIM))
    assert {"unicast_inspect", "unicast_prepare"} <= shim["control.c"]["unicast.c"]
    assert "app_gate_lock" in shim["unicast.c"]["state.c"]  # app_lock() is its macro
    assert "g" in shim["io.c"]["state.c"]  # a variable counts as much as a function
    assert "cuMemCreate" in shim["interpose.c"]["unicast.c"]  # taken as a pointer
    sim = c_calls.build_graph(c_calls.read_dir(SIM))
    assert "sim_meta_lock" in sim["multicast.c"]["meta.c"]


def test_the_checker_finds_a_circle(tmp_path: Path) -> None:
    (tmp_path / "a.c").write_text("int a(void);\nint b(void);\nint a(void) { return b(); }\n")
    (tmp_path / "b.c").write_text("int a(void);\nint b(void) { return a() + 1; }\n")
    (tmp_path / "c.c").write_text("int b(void);\nstatic int c(void) { return b(); }\n")
    result = check(tmp_path)
    assert result.returncode == 1
    assert "cycle: a.c -> b.c -> a.c" in result.stdout
    assert "c.c -> b.c: b" in result.stdout


def test_fields_comments_and_strings_are_not_uses(tmp_path: Path) -> None:
    (tmp_path / "a.c").write_text(
        "struct t { int (*b)(void); } real;\n"
        "int a(void) { return 0; }\n"
        "int x(void) { return real.b() + (&real)->b(); }\n"
    )
    (tmp_path / "b.c").write_text(
        "int a(void);\n"
        'static const char *s = "x() and a()";\n'
        "/* a() in a comment */\n"
        "// x() in a line comment\n"
        "int b(void) { return a() + (s != 0); }\n"
    )
    graph = c_calls.build_graph(c_calls.read_dir(tmp_path))
    assert graph == {"a.c": {}, "b.c": {"a.c": {"a"}}}
    assert c_calls.cycles(graph) == []
