"""README.md's table of environment variables names every one the code reads."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NAME = r"((?:SNAPSHOT|CUINTERPOSE)_[A-Z0-9_]+)"
# How the code reads one: the shim's and the protocol's defines, the simulator's reads,
# the Python constants and environment look-ups.
READS = (
    re.compile(r'#define \w+_ENV "' + NAME + '"'),
    re.compile(r'(?:getenv|sim_env_long)\("' + NAME + '"'),
    re.compile(r'Final = "' + NAME + '"'),
    re.compile(r'environ(?:\.get)?\(\s*"' + NAME + '"'),
)


def read_by_code() -> set[str]:
    found: set[str] = set()
    for folder, pattern in (("shim_c", "*.[ch]"), ("engine", "*.py"), ("frontends", "*.py"),
                            ("tests", "*.py")):  # fmt: skip
        for path in (ROOT / folder).rglob(pattern):
            text = path.read_text(encoding="utf-8", errors="replace")
            for read in READS:
                found |= set(read.findall(text))
    return found


def in_readme_table() -> set[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## Environment variables", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `" + NAME + "`", section, flags=re.MULTILINE))


def test_every_variable_is_in_the_readme_table() -> None:
    code = read_by_code()
    assert {"SNAPSHOT_CONTROL_DIR", "SNAPSHOT_SHIM_GATE", "CUINTERPOSE_SIM_DEVICES"} <= code
    assert sorted(code - in_readme_table()) == []


def test_the_table_names_nothing_the_code_does_not_read() -> None:
    assert sorted(in_readme_table() - read_by_code()) == []
