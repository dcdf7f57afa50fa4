"""Traces: every transition of a run as JSON lines, and their replay.

A trace is one ``start`` line (machine, processes, timeout), one
``transition`` line per transition attempted (machine, trigger, from, to,
outcome, timing, and for wire steps every participant's request and reply or
error, records included so that a replay can answer with them), and one
``end`` line (outcome and problems).

:func:`replay` runs the engine again against fake participants that answer
every request from the trace, and reports where the new run diverges from the
recorded one: a different transition, request, reply, outcome or problem.
Timings, and the paths of the temporary sockets and checkpoint directory the
replay uses, are not compared.
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
import tempfile
import threading
from collections import defaultdict, deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Final, Protocol

import attrs

from .client import Endpoint, ParticipantError
from .errors import CoordinatorError, Problem
from .wire import (
    HEADER_SIZE,
    Op,
    Phase,
    Record,
    Reply,
    Request,
    Stats,
    Status,
    WireError,
    decode_request,
    socket_name,
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
) -> dict[str, Any]:
    return {
        "type": "start",
        "format": TRACE_FORMAT,
        "machine": machine,
        "processes": [
            {"observed_pid": e.observed_pid, "namespace_pid": e.namespace_pid, "path": str(e.path)}
            for e in endpoints
        ],
        "phase_timeout_s": phase_timeout,
        "content_mode": content_mode,
        "checkpoint_dir": str(checkpoint_dir),
        "checkpoint_dir_exists": checkpoint_dir.is_dir(),
    }


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
        entry["phase"] = error.phase
        entry["problems"] = [problem_entry(p) for p in error.problems]
    return entry


def problem_entry(problem: Problem) -> dict[str, Any]:
    return {"participant": problem.participant, "pid": problem.pid, "reason": problem.reason}


def reply_entry(reply: Reply) -> dict[str, Any]:
    return {
        "op": reply.op.name,
        "status": reply.status.name,
        "participant": reply.participant,
        "pid": reply.pid,
        "phase": reply.phase.name,
        "message": reply.message,
        "stats": attrs.asdict(reply.stats),
        "records": [r.encode().hex() for r in reply.records],
    }


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
        )
    except (KeyError, TypeError, ValueError) as exc:  # WireError is a ValueError
        raise TraceError(f"recorded reply is malformed: {exc!r}") from exc


def read_state_text(directory: Path) -> str | None:
    """The state file's bytes as text (``surrogateescape``, so any bytes survive JSON)."""
    from .state import STATE_FILE_NAME

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
    if start.get("machine") not in ("capture", "restore"):
        raise TraceError(f"{source}: unknown machine {start.get('machine')!r}")
    if not isinstance(start.get("phase_timeout_s"), int | float) or not isinstance(
        start.get("processes"), list
    ):
        raise TraceError(f"{source}: the start entry lacks phase_timeout_s or processes")


# -- replay ------------------------------------------------------------------------


@attrs.frozen
class Divergence:
    """Where the replay differs from the trace: entry index, what, recorded vs replayed."""

    index: int
    what: str
    recorded: str
    replayed: str

    def __str__(self) -> str:
        return (
            f"entry {self.index}: {self.what}\n  recorded: {self.recorded}\n"
            f"  replayed: {self.replayed}"
        )


@attrs.frozen
class ReplayReport:
    machine: str
    entries: int
    outcome: str
    divergences: tuple[Divergence, ...]

    @property
    def clean(self) -> bool:
        return not self.divergences


@attrs.frozen
class _Answer:
    """What a trace participant does with one expected request."""

    request: tuple[str, str]  # op name, participant
    reply: Reply | None
    error_kind: str | None
    error_reason: str


_WRONG_PARTICIPANT: Final = re.compile(r"reply comes from participant (\S+), expected")
_WRONG_OP: Final = re.compile(r"reply echoes op (\w+), expected")
_GARBAGE: Final = b"\xff" * HEADER_SIZE


class _TraceParticipant:
    """Answers the requests one endpoint received in the trace, in order, from the trace."""

    def __init__(self, path: Path, namespace_pid: int, answers: Iterable[_Answer]) -> None:
        self.path = path
        self.namespace_pid = namespace_pid
        self.answers: deque[_Answer] = deque(answers)
        self.unexpected: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(str(path))
        self._listener.listen(64)
        self._listener.settimeout(0.05)
        self._threads: list[threading.Thread] = []
        self._acceptor = threading.Thread(target=self._accept, daemon=True)
        self._acceptor.start()

    def stop(self) -> None:
        self._stop.set()
        self._acceptor.join()
        for thread in self._threads:
            thread.join()
        self._listener.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self._threads.append(thread)
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(0.05)
            raw = b""
            while len(raw) < HEADER_SIZE and not self._stop.is_set():
                try:
                    chunk = conn.recv(HEADER_SIZE - len(raw))
                except TimeoutError:
                    continue
                if not chunk:
                    return
                raw += chunk
            try:
                request, _ = decode_request(raw)
            except WireError as exc:
                self._note(f"received a malformed request: {exc}")
                return
            key = (request.op.name, request.participant)
            with self._lock:
                answer = self.answers.popleft() if self.answers else None
            if answer is None or answer.request != key:
                expected = "nothing" if answer is None else f"{answer.request[0]}"
                self._note(f"received {key[0]}, the trace has {expected} next")
                return
            self._answer(conn, request, answer)

    def _answer(self, conn: socket.socket, request: Request, answer: _Answer) -> None:
        if answer.reply is not None:
            with contextlib.suppress(OSError):  # the client may have given up already
                conn.sendall(answer.reply.encode())
        elif answer.error_kind == "ParticipantTimeout":
            while not self._stop.is_set():  # hold the connection until the client gives up
                try:
                    if not conn.recv(1):
                        return
                except TimeoutError:
                    continue
                except OSError:
                    return
        elif answer.error_kind == "BadReply":
            with contextlib.suppress(OSError):
                conn.sendall(self._bad_reply(request, answer.error_reason))
        # ParticipantHangup: close without a reply (the ``with`` does).

    def _bad_reply(self, request: Request, reason: str) -> bytes:
        phase = Phase.ACTIVE
        if match := _WRONG_PARTICIPANT.search(reason):
            return Reply(request.op, Status.OK, match.group(1), self.namespace_pid, phase).encode()
        if (match := _WRONG_OP.search(reason)) and match.group(1) in Op.__members__:
            other = Op[match.group(1)]
            return Reply(other, Status.OK, request.participant or "0" * 32, 1, phase).encode()
        return _GARBAGE

    def _note(self, text: str) -> None:
        with self._lock:
            self.unexpected.append(f"pid {self.namespace_pid}: {text}")


def _answers(entries: Sequence[Mapping[str, Any]]) -> dict[tuple[int, int], list[_Answer]]:
    answers: dict[tuple[int, int], list[_Answer]] = defaultdict(list)
    for entry in entries:
        for exchange in entry.get("exchanges", ()):
            try:
                key = (int(exchange["observed_pid"]), int(exchange["namespace_pid"]))
                request = (str(exchange["request"]["op"]), str(exchange["request"]["participant"]))
                error = exchange.get("error")
            except (KeyError, TypeError, ValueError) as exc:
                raise TraceError(f"malformed exchange in {entry.get('trigger')}: {exc!r}") from exc
            if error is None:
                answers[key].append(_Answer(request, reply_from_entry(exchange["reply"]), None, ""))
            else:
                answers[key].append(
                    _Answer(request, None, str(error.get("kind")), str(error.get("reason", "")))
                )
    return answers


def _comparable(entry: Mapping[str, Any], paths: Mapping[str, str]) -> str:
    kept = {k: v for k, v in entry.items() if k not in _UNCOMPARED}
    text = json.dumps(kept, sort_keys=True)
    for replayed, recorded in paths.items():
        text = text.replace(json.dumps(replayed)[1:-1], json.dumps(recorded)[1:-1])
    return text


def _label(entry: Mapping[str, Any]) -> str:
    if entry.get("type") == "transition":
        return f"{entry.get('trigger')} {entry.get('from')} -> {entry.get('to')}"
    return str(entry.get("type"))


def _diverge(
    index: int, recorded: Mapping[str, Any], replayed: Mapping[str, Any], paths: Mapping[str, str]
) -> Divergence | None:
    a, b = _comparable(recorded, {}), _comparable(replayed, paths)
    if a == b:
        return None
    ra, rb = json.loads(a), json.loads(b)
    keys = sorted(k for k in ra.keys() | rb.keys() if ra.get(k) != rb.get(k))
    what = f"{_label(recorded)}: {', '.join(keys)} differ"
    return Divergence(
        index,
        what,
        json.dumps({k: ra.get(k) for k in keys}, sort_keys=True)[:2000],
        json.dumps({k: rb.get(k) for k in keys}, sort_keys=True)[:2000],
    )


@contextlib.contextmanager
def _participants(
    start: Mapping[str, Any], entries: Sequence[Mapping[str, Any]], control_dir: Path
) -> Iterator[tuple[list[Endpoint], list[_TraceParticipant], dict[str, str]]]:
    answers = _answers(entries)
    endpoints: list[Endpoint] = []
    servers: list[_TraceParticipant] = []
    paths: dict[str, str] = {}
    try:
        for process in start.get("processes", ()):
            observed, namespace = int(process["observed_pid"]), int(process["namespace_pid"])
            path = control_dir / socket_name(namespace)
            endpoints.append(Endpoint(observed, namespace, path))
            paths[str(path)] = str(process.get("path", path))
            script = answers.get((observed, namespace), [])
            # A socket that was missing at the first request is left missing.
            if script and script[0].error_reason == "control socket does not exist":
                continue
            servers.append(_TraceParticipant(path, namespace, script))
        yield endpoints, servers, paths
    finally:
        for server in servers:
            server.stop()


def replay(entries: Sequence[Mapping[str, Any]]) -> ReplayReport:
    """Run the recorded machine again against participants answering from ``entries``."""
    from . import driver
    from .machine import MACHINES
    from .state import STATE_FILE_NAME

    check_entries(entries)
    start = entries[0]
    machine = str(start["machine"])
    recorder = TraceRecorder()
    with tempfile.TemporaryDirectory(prefix="cuip-replay-") as tmp:
        work = Path(tmp)
        control_dir = work / "control"
        control_dir.mkdir()
        checkpoint_dir = work / "checkpoint"
        if start.get("checkpoint_dir_exists", True):
            checkpoint_dir.mkdir()
        for entry in entries:
            if entry.get("trigger") == "READ_STATE" and entry.get("state_file") is not None:
                text = str(entry["state_file"])
                (checkpoint_dir / STATE_FILE_NAME).write_bytes(
                    text.encode("utf-8", "surrogateescape")
                )
        with _participants(start, entries, control_dir) as (endpoints, servers, paths):
            paths[str(checkpoint_dir)] = str(start.get("checkpoint_dir", checkpoint_dir))
            options = driver.Options(
                phase_timeout=float(start["phase_timeout_s"]),
                trace=recorder,
                content_mode="native" if start.get("content_mode") == "native" else "host",
            )
            spec = MACHINES[machine]
            try:
                driver.run_machine(spec, endpoints, checkpoint_dir, options)
            except CoordinatorError:
                pass  # the trace says whether it should have; the comparison tells
            except ValueError as exc:
                raise TraceError(f"the trace's processes cannot be replayed: {exc}") from exc
        unexpected = [note for server in servers for note in server.unexpected]
        leftover = [
            f"pid {server.namespace_pid}: the trace has {len(server.answers)} more request(s)"
            f" ({', '.join(a.request[0] for a in server.answers)}) that were never sent"
            for server in servers
            if server.answers
        ]
    replayed = recorder.entries
    divergences = [
        d
        for i, (a, b) in enumerate(zip(entries, replayed, strict=False))
        if (d := _diverge(i, a, b, paths)) is not None
    ]
    for i in range(len(replayed), len(entries)):
        divergences.append(Divergence(i, "missing from the replay", _label(entries[i]), "-"))
    for i in range(len(entries), len(replayed)):
        divergences.append(Divergence(i, "not in the trace", "-", _label(replayed[i])))
    for note in unexpected + leftover:
        divergences.append(Divergence(-1, "participant", "as traced", note))
    outcome = str(replayed[-1].get("outcome")) if replayed else "none"
    return ReplayReport(machine, len(entries), outcome, tuple(divergences))


def replay_file(path: Path) -> ReplayReport:
    return replay(read_trace(path))
