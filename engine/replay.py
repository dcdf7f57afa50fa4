"""Replay: run a trace's machine again with every participant answering from the trace.

The run goes through :attr:`~.runner.Options.transport`: a transport built from
the trace hands each request the reply (or the error) that the same process
gave to the same request when the trace was recorded. No sockets, no timing:
a recorded timeout comes back at once, with its recorded reason. The replayed
entries are compared with the recorded ones; any difference in a transition,
request, reply, outcome or problem is a :class:`Divergence`. Timings and the
path of the temporary checkpoint directory the replay uses are not compared.
"""

from __future__ import annotations

import json
import tempfile
from collections import deque
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import attrs

from . import runner
from .client import (
    BadReply,
    Endpoint,
    ParticipantError,
    ParticipantGone,
    ParticipantHangup,
    ParticipantTimeout,
    ProtocolMismatch,
)
from .errors import CoordinatorError
from .fsm import MACHINES
from .statefile import STATE_FILE_NAME
from .trace import TraceError, TraceRecorder, check_entries, read_trace, reply_from_entry
from .wire import Op, Reply, Request

# Keys that legitimately differ between a run and its replay.
_UNCOMPARED: Final = frozenset(
    {
        "steps",  # checked before the replay: machine_mismatch
        "started_s",
        "elapsed_s",
        "state_file",
        "state_path",
        "intent_path",
        "checkpoint_dir",
        "processes",
    }
)
_ERRORS: Final[Mapping[str, type[ParticipantError]]] = {
    cls.__name__: cls
    for cls in (
        ParticipantError,
        ParticipantTimeout,
        ParticipantHangup,
        ParticipantGone,
        BadReply,
        ProtocolMismatch,
    )
}


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
    """What one process answered to one request when the trace was recorded."""

    request: tuple[str, str]  # op name, participant
    reply: Reply | None
    error: ParticipantError | None


_Key = tuple[int, int]  # observed pid, namespace pid


class TraceTransport:
    """A transport (``client.call_all``'s signature) answering every call from a trace."""

    def __init__(self, entries: Sequence[Mapping[str, Any]], endpoints: Sequence[Endpoint]):
        by_key = {(e.observed_pid, e.namespace_pid): e for e in endpoints}
        self.answers: dict[_Key, deque[_Answer]] = {key: deque() for key in by_key}
        for entry in entries:
            for exchange in entry.get("exchanges", ()):
                key, answer = _answer(entry, exchange, by_key)
                self.answers[key].append(answer)
        self.unexpected: list[str] = []

    def __call__(
        self, calls: Sequence[tuple[Endpoint, Request, str | None]], *, timeout: float
    ) -> list[Reply | ParticipantError]:
        return [self._one(endpoint, request, expect) for endpoint, request, expect in calls]

    def _one(
        self, endpoint: Endpoint, request: Request, expect: str | None
    ) -> Reply | ParticipantError:
        if request.op is Op.RELEASE:
            # Ending the lease is not a step and traces do not record it; the run
            # does not judge RELEASE's answers, so none is made up here.
            return ParticipantHangup(endpoint, request.op, "RELEASE is not replayed", expect)
        queue = self.answers.get((endpoint.observed_pid, endpoint.namespace_pid))
        answer = queue.popleft() if queue else None
        sent = (request.op.name, request.participant)
        if answer is None or answer.request != sent:
            recorded = "nothing" if answer is None else answer.request[0]
            self.unexpected.append(
                f"pid {endpoint.namespace_pid}: received {sent[0]}, the trace has {recorded} next"
            )
            return ParticipantHangup(endpoint, request.op, "not in the trace", expect)
        if answer.reply is not None:
            return answer.reply
        assert answer.error is not None
        return answer.error

    def leftovers(self) -> list[str]:
        """The recorded requests the replay never sent, per process."""
        return [
            f"pid {namespace}: the trace has {len(queue)} more request(s)"
            f" ({', '.join(a.request[0] for a in queue)}) that were never sent"
            for (_, namespace), queue in self.answers.items()
            if queue
        ]


def _answer(
    entry: Mapping[str, Any], exchange: Mapping[str, Any], endpoints: Mapping[_Key, Endpoint]
) -> tuple[_Key, _Answer]:
    try:
        key = (int(exchange["observed_pid"]), int(exchange["namespace_pid"]))
        request = (str(exchange["request"]["op"]), str(exchange["request"]["participant"]))
        error = exchange.get("error")
        endpoint = endpoints[key]
    except (KeyError, TypeError, ValueError) as exc:
        raise TraceError(f"malformed exchange in {entry.get('trigger')}: {exc!r}") from exc
    if error is None:
        return key, _Answer(request, reply_from_entry(exchange["reply"]), None)
    kind = _ERRORS.get(str(error.get("kind")))
    if kind is None:
        raise TraceError(f"exchange in {entry.get('trigger')}: unknown error {error.get('kind')!r}")
    participant = error.get("participant")
    try:
        op = Op[request[0]]
    except KeyError:
        raise TraceError(f"exchange in {entry.get('trigger')}: unknown op {request[0]!r}") from None
    failure = kind(endpoint, op, str(error.get("reason", "")), participant and str(participant))
    return key, _Answer(request, None, failure)


def _endpoints(start: Mapping[str, Any]) -> list[Endpoint]:
    try:
        return [
            Endpoint(int(p["observed_pid"]), int(p["namespace_pid"]), Path(str(p["path"])))
            for p in start["processes"]
        ]
    except (KeyError, TypeError, ValueError) as exc:
        raise TraceError(f"the trace's processes cannot be replayed: {exc!r}") from exc


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


def _stage_state_file(entries: Sequence[Mapping[str, Any]], checkpoint_dir: Path) -> None:
    for entry in entries:
        if entry.get("trigger") == "READ_STATE" and entry.get("state_file") is not None:
            text = str(entry["state_file"])
            (checkpoint_dir / STATE_FILE_NAME).write_bytes(text.encode("utf-8", "surrogateescape"))


def machine_mismatch(entries: Sequence[Mapping[str, Any]]) -> str | None:
    """Why ``entries`` were recorded with steps other than this engine's machine has, or
    None. A trace names its steps in its start entry; an older one without them is
    judged by the steps it went through, which must be the machine's, in order."""
    check_entries(entries)
    start = entries[0]
    machine = str(start["machine"])
    ours = [s.trigger for s in MACHINES[machine].steps]
    if "steps" in start:
        recorded = [str(s) for s in start["steps"]]
        if recorded == ours:
            return None
    else:
        recorded = []
        for entry in entries[1:]:
            if entry.get("type") == "end":
                break  # a rollback's entries may follow
            if entry.get("type") == "transition" and entry.get("trigger") in ours:
                recorded.append(str(entry["trigger"]))
        if recorded == ours[: len(recorded)]:
            return None
    return (
        f"the trace was recorded with the {machine} machine's steps {', '.join(recorded)}; "
        f"this engine's are {', '.join(ours)}: record it again"
    )


def replay(entries: Sequence[Mapping[str, Any]]) -> ReplayReport:
    """Run the recorded machine again against participants answering from ``entries``.

    Raises :class:`~.trace.TraceError` for a trace recorded with another machine
    (:func:`machine_mismatch`)."""
    check_entries(entries)
    mismatch = machine_mismatch(entries)
    if mismatch is not None:
        raise TraceError(mismatch)
    start = entries[0]
    machine = str(start["machine"])
    endpoints = _endpoints(start)
    transport = TraceTransport(entries, endpoints)
    recorder = TraceRecorder()
    with tempfile.TemporaryDirectory(prefix="cuip-replay-") as tmp:
        checkpoint_dir = Path(tmp) / "checkpoint"
        if start.get("checkpoint_dir_exists", True):
            checkpoint_dir.mkdir()
            _stage_state_file(entries, checkpoint_dir)
        paths = {str(checkpoint_dir): str(start.get("checkpoint_dir", checkpoint_dir))}
        options = runner.Options(
            phase_timeout=float(start["phase_timeout_s"]),
            trace=recorder,
            content_mode="native" if start.get("content_mode") == "native" else "host",
            transport=transport,
            rollback_on_failure=bool(start.get("rollback_on_failure", False)),
        )
        try:
            runner.run_machine(MACHINES[machine], endpoints, checkpoint_dir, options)
        except CoordinatorError:
            pass  # the trace says whether it should have; the comparison tells
        except ValueError as exc:
            raise TraceError(f"the trace's processes cannot be replayed: {exc}") from exc
    replayed = recorder.entries
    divergences = [
        d
        for i, (a, b) in enumerate(zip(entries, replayed, strict=False))
        if (d := _diverge(i, a, b, paths)) is not None
    ]
    divergences += [
        Divergence(i, "missing from the replay", _label(entries[i]), "-")
        for i in range(len(replayed), len(entries))
    ]
    divergences += [
        Divergence(i, "not in the trace", "-", _label(replayed[i]))
        for i in range(len(entries), len(replayed))
    ]
    divergences += [
        Divergence(-1, "participant", "as traced", note)
        for note in transport.unexpected + transport.leftovers()
    ]
    outcome = str(replayed[-1].get("outcome")) if replayed else "none"
    return ReplayReport(machine, len(entries), outcome, tuple(divergences))


def replay_file(path: Path) -> ReplayReport:
    return replay(read_trace(path))
