"""Traces: every transition of a run as JSON lines.

A trace is one ``start`` line (machine, processes, timeout), one
``transition`` line per transition attempted (machine, trigger, from, to,
outcome, timing, and for wire steps every participant's request and reply or
error, records included so that a replay can answer with them), and one
``end`` line (outcome and problems).

:mod:`.replay` runs a trace's machine again and compares.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Final, Protocol

import attrs

from ..phases import MACHINES
from .client import Endpoint, ParticipantError
from .errors import CoordinatorError, Problem
from .statefile import STATE_FILE_NAME
from .wire import (
    Op,
    Phase,
    Record,
    Reply,
    ReplyFlag,
    Request,
    Stats,
    Status,
)

TRACE_FORMAT: Final = 1
# The largest state file a trace embeds (the state file's own cap is smaller).
_STATE_TEXT_MAX: Final = 64 << 20
# Keys that legitimately differ between a run and its replay.
_UNCOMPARED: Final = frozenset(
    {"started_s", "elapsed_s", "state_file", "state_path", "checkpoint_dir", "processes"}
)


class TraceError(ValueError):
    """A trace file that cannot be read or is not a trace."""


class TraceSink(Protocol):
    """Where a run writes its trace entries, in order."""

    def write(self, entry: Mapping[str, Any]) -> None: ...


@attrs.define
class TraceRecorder:
    """Keeps the entries in memory (for replay and tests)."""

    entries: list[dict[str, Any]] = attrs.field(factory=list)

    def write(self, entry: Mapping[str, Any]) -> None:
        # A JSON round trip, so that recorded and read-back entries compare alike.
        self.entries.append(json.loads(json.dumps(entry)))


class TraceWriter:
    """Writes one JSON object per line, flushed per entry (a crash keeps what happened)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._file = self.path.open("w", encoding="utf-8")

    def write(self, entry: Mapping[str, Any]) -> None:
        self._file.write(json.dumps(entry, allow_nan=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


# -- entries ---------------------------------------------------------------------


def start_entry(
    machine: str,
    endpoints: Sequence[Endpoint],
    *,
    phase_timeout: float,
    content_mode: str,
    checkpoint_dir: Path,
    rollback_on_failure: bool = False,
) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "type": "start",
        "format": TRACE_FORMAT,
        "machine": machine,
        # The machine's steps as this engine ran them: replay refuses a trace recorded
        # with other steps (an older engine's) instead of reporting every entry.
        "steps": [s.trigger for s in MACHINES[machine].steps],
        "processes": [
            {"observed_pid": e.observed_pid, "namespace_pid": e.namespace_pid, "path": str(e.path)}
            for e in endpoints
        ],
        "phase_timeout_s": phase_timeout,
        "content_mode": content_mode,
        "checkpoint_dir": str(checkpoint_dir),
        "checkpoint_dir_exists": checkpoint_dir.is_dir(),
    }
    if rollback_on_failure:  # the rollback's own entries follow the run's end entry
        entry["rollback_on_failure"] = True
    return entry


def transition_entry(
    machine: str,
    trigger: str,
    source: str,
    dest: str,
    outcome: str,
    started_s: float,
    elapsed_s: float,
    extra: Mapping[str, Any],
) -> dict[str, Any]:
    return {
        "type": "transition",
        "machine": machine,
        "trigger": trigger,
        "from": source,
        "to": dest,
        "outcome": outcome,
        "started_s": round(started_s, 6),
        "elapsed_s": round(elapsed_s, 6),
        **extra,
    }


def end_entry(
    machine: str, outcome: str, error: CoordinatorError | None, elapsed_s: float
) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "type": "end",
        "machine": machine,
        "outcome": outcome,
        "elapsed_s": round(elapsed_s, 6),
    }
    if error is not None:
        entry["phase"] = error.step  # the trace format keeps its key
        entry["problems"] = [problem_entry(p) for p in error.problems]
    return entry


def problem_entry(problem: Problem) -> dict[str, Any]:
    return {"participant": problem.participant, "pid": problem.pid, "reason": problem.reason}


def reply_entry(reply: Reply) -> dict[str, Any]:
    entry = {
        "op": reply.op.name,
        "status": reply.status.name,
        "participant": reply.participant,
        "pid": reply.pid,
        "phase": reply.phase.name,
        "message": reply.message,
        "stats": attrs.asdict(reply.stats),
        "records": [r.encode().hex() for r in reply.records],
    }
    if reply.flags:  # protocol version 2's reply flags; absent: none
        entry["flags"] = int(reply.flags)
    return entry


def exchange_entry(
    endpoint: Endpoint, request: Request, result: Reply | ParticipantError
) -> dict[str, Any]:
    """One participant's part of a wire step: its request, and its reply or error."""
    entry: dict[str, Any] = {
        "observed_pid": endpoint.observed_pid,
        "namespace_pid": endpoint.namespace_pid,
        "request": {"op": request.op.name, "participant": request.participant},
    }
    if isinstance(result, ParticipantError):
        entry["error"] = {
            "kind": type(result).__name__,
            "reason": result.reason,
            "participant": result.participant,
        }
    else:
        entry["reply"] = reply_entry(result)
    return entry


def reply_from_entry(entry: Mapping[str, Any]) -> Reply:
    """The reply an exchange entry recorded; raises :class:`TraceError` if it is not one."""
    try:
        return Reply(
            op=Op[entry["op"]],
            status=Status[entry["status"]],
            participant=str(entry["participant"]),
            pid=int(entry["pid"]),
            phase=Phase[entry["phase"]],
            message=str(entry["message"]),
            stats=Stats(**entry["stats"]),
            records=tuple(Record.decode(bytes.fromhex(r)) for r in entry["records"]),
            flags=ReplyFlag(int(entry.get("flags", 0))),
        )
    except (KeyError, TypeError, ValueError) as exc:  # WireError is a ValueError
        raise TraceError(f"recorded reply is malformed: {exc!r}") from exc


def read_state_text(directory: Path) -> str | None:
    """The state file's bytes as text (``surrogateescape``, so any bytes survive JSON)."""
    path = Path(directory) / STATE_FILE_NAME
    try:
        with path.open("rb") as f:
            raw = f.read(_STATE_TEXT_MAX + 1)
    except OSError:
        return None
    return raw[:_STATE_TEXT_MAX].decode("utf-8", "surrogateescape")


# -- reading -----------------------------------------------------------------------


def read_trace(path: Path) -> list[dict[str, Any]]:
    """The entries of a trace file, checked for shape: start first, end last."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceError(f"cannot read trace {path}: {exc}") from exc
    entries: list[dict[str, Any]] = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceError(f"{path}:{number}: not JSON: {exc}") from exc
        if not isinstance(entry, dict) or entry.get("type") not in ("start", "transition", "end"):
            raise TraceError(f"{path}:{number}: not a trace entry (no start/transition/end type)")
        entries.append(entry)
    check_entries(entries, str(path))
    return entries


def check_entries(entries: Sequence[Mapping[str, Any]], source: str = "trace") -> None:
    """Refuse entries that are not a whole trace: start first, end last, a known machine."""
    if not entries or entries[0].get("type") != "start":
        raise TraceError(f"{source}: a trace begins with a start entry")
    start = entries[0]
    if start.get("format") != TRACE_FORMAT:
        raise TraceError(
            f"{source}: trace format {start.get('format')!r}, this engine reads {TRACE_FORMAT}"
        )
    if entries[-1].get("type") != "end":
        raise TraceError(f"{source}: the trace has no end entry (the run was interrupted?)")
    if start.get("machine") not in ("capture", "restore", "rollback"):
        raise TraceError(f"{source}: unknown machine {start.get('machine')!r}")
    if not isinstance(start.get("phase_timeout_s"), int | float) or not isinstance(
        start.get("processes"), list
    ):
        raise TraceError(f"{source}: the start entry lacks phase_timeout_s or processes")
