"""A process that is stopped (SIGSTOP, a debugger, a shell's Ctrl-Z: state T or t in
``/proc/PID/stat``) answers nothing, its shim's control thread and the simulated
driver's service included, until it is continued. The one command a person runs when
something is stuck must say so, not wait for it: a stopped process is named, and the
driver is not asked about it (a native call to it may block for as long as it stays
stopped).
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

# /proc/PID/stat's state letters of a stopped process: stopped by a signal, or by ptrace.
_STOPPED: Final = frozenset({"T", "t"})


def run_state(pid: int, proc_root: Path | None = None) -> str:
    """``pid``'s state letter (R, S, D, T, t, Z...), "" when it cannot be read."""
    try:
        text = (Path(proc_root or "/proc") / str(pid) / "stat").read_text()
    except (OSError, ValueError):
        return ""
    fields = text.rpartition(")")[2].split()
    return fields[0] if fields else ""


def stopped(pid: int, proc_root: Path | None = None) -> str:
    """Why ``pid`` cannot answer, when it is stopped ("" when it is not): its state, and
    what lets it go on."""
    state = run_state(pid, proc_root)
    if state not in _STOPPED:
        return ""
    by = "a signal (SIGSTOP, Ctrl-Z)" if state == "T" else "a debugger (ptrace)"
    return f"the process is stopped (state {state}, by {by}): `kill -CONT {pid}` lets it go on"
