"""The agent API: suspend and resume a group of CUDA processes in one call.

For a checkpoint agent (a node agent that also runs CRIU) that embeds the engine,
and for the CLI's ``suspend``, ``resume`` and ``status``:

- :func:`detect`: the fail-closed truth table (specs/detection.md). Control
  sockets are the only evidence.
- :class:`Manifest` (``manifest.json`` in the checkpoint directory): the group's
  opt-in (``requested``) and whether capture completed and the state file was
  written (``prepared``). :func:`resume` is driven by it.
- :func:`suspend`: detection, capture (when requested), native lock and checkpoint
  of every process, the manifest. A failure after capture undoes what was done
  (native restore and unlock, then the coordinator restore): the group runs as
  before, and :class:`SuspendFailed` says so with every step.
- :func:`resume`: native restore and unlock of every process, then the coordinator
  restore when the manifest says prepared.
- :func:`status`: every process's native state and shim phase.
- :func:`remove_stale_sockets`: frees the socket paths of processes a restore is
  about to recreate.

Every step is timed (:class:`Timing`), and every event (the machines' progress,
the bytes copied while SAVE/LOAD run, each agent step) goes to the caller's
callback and to the ``cuinterpose.agent`` logger with the event's fields in
``extra={"cuinterpose": {...}}``.
"""

from __future__ import annotations

import logging
import os
import socket
import stat
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Final, Literal

import attrs

from . import discovery
from .client import Endpoint, ParticipantError, call_all, endpoint_for, pid_visible
from .directory import checkpoint_dir_problem
from .errors import AgentError, CoordinatorError, PhaseFailed, not_quiet
from .manifest import (
    MANIFEST_FILE_NAME,
    Manifest,
    ManifestError,
    Participant,
    Process,
    Timing,
    read_manifest,
    restore_plan,
    resume_hint,
    write_manifest,
)
from .native import (
    DEFAULT_LOCK_TIMEOUT_MS,
    NativeBackend,
    NativeError,
    NativeGroupError,
    ProcessState,
    run_step,
    state_names,
    undo_suspend,
)
from .options import Options
from .progress import Event, PhaseEvent, StagingSummary
from .runner import CaptureResult, capture, restore
from .statefile import StateFileError, utc_timestamp
from .wire import InFlight, Op, Reply, Request, WireError

LOGGER_NAME: Final = "cuinterpose.agent"
_POLL_S: Final = 0.1
_COPY_OPS: Final = frozenset({Op.SAVE_ALLOCATIONS, Op.LOAD_ALLOCATIONS, Op.ROLLBACK_ALLOCATIONS})

Mode = Literal["cuinterpose", "native"]


# --------------------------------------------------------------- processes
@attrs.frozen
class Where:
    """Where the shims' sockets are: a control directory, reached directly or through
    ``proc_root/<observed pid>/root`` (a coordinator outside the containers)."""

    control_dir: Path = attrs.field(converter=Path)
    proc_root: Path | None = None

    def endpoint(self, process: Process) -> Endpoint:
        return endpoint_for(
            process.observed_pid,
            process.namespace_pid,
            control_dir=self.control_dir,
            proc_root=self.proc_root,
        )


def _processes(processes: Sequence[Process | tuple[int, int]]) -> tuple[Process, ...]:
    group = tuple(p if isinstance(p, Process) else Process(*p) for p in processes)
    if not group:
        raise ValueError("no processes given")
    for p in group:
        if group.count(p) > 1:
            raise ValueError(f"{p.describe()} is given twice")
    return group


# --------------------------------------------------------------- errors
class DetectionRefused(AgentError):
    """The sockets contradict the group's request (or each other): nothing was done."""


class StateRefused(AgentError):
    """A process is not in the native state the command needs: nothing was done."""


class SuspendFailed(AgentError):
    """A suspend failed; ``restored`` says whether the group runs as before."""

    def __init__(self, what: str, lines: Sequence[str], *, restored: bool) -> None:
        super().__init__(what, lines, changed=not restored)
        self.restored = restored


class ResumeFailed(AgentError):
    """A resume failed; every process's native state and shim phase are in the lines.

    ``running`` says whether the group runs with its bytes (a coordinator restore
    rolled back); otherwise a native step ran, and ``cuinterpose recover`` (or
    ``restore``) is the way on."""

    def __init__(self, what: str, lines: Sequence[str], *, running: bool) -> None:
        super().__init__(what, lines, changed=True)
        self.running = running


# --------------------------------------------------------------- detection
@attrs.frozen
class Detection:
    """What the sockets say: ``cuinterpose`` (every process has a shim) or ``native``."""

    mode: Mode
    endpoints: tuple[Endpoint, ...]


def _socket_evidence(path: Path) -> Literal["socket", "absent", "other"]:
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return "absent"
    except OSError:
        return "other"
    return "socket" if stat.S_ISSOCK(info.st_mode) else "other"


# A live shim re-creates a removed socket within its heal period (specs/protocol.md).
_HEAL_WAIT_S: Final = 1.0


def _healed_evidence(endpoint: Endpoint) -> Literal["socket", "absent", "other"]:
    """An absent socket of a live process, looked at again while its shim may heal it."""
    if not pid_visible(endpoint.observed_pid):
        return "absent"
    deadline = time.monotonic() + _HEAL_WAIT_S
    evidence = _socket_evidence(endpoint.path)
    while evidence == "absent" and time.monotonic() < deadline:
        time.sleep(0.01)
        evidence = _socket_evidence(endpoint.path)
    return evidence


def detect(
    requested: bool, processes: Sequence[Process | tuple[int, int]], where: Where
) -> Detection:
    """The truth table of specs/detection.md, fail-closed.

    Requested and every process shows a control socket: ``cuinterpose``. Not requested
    and none does: ``native``. Anything else raises :class:`DetectionRefused` naming
    every process that broke the rule and how. Never reads ``/proc/*/environ``.
    """
    group = _processes(processes)
    endpoints = tuple(where.endpoint(p) for p in group)
    problems: list[str] = []
    for process, endpoint in zip(group, endpoints, strict=True):
        evidence = _socket_evidence(endpoint.path)
        if requested and evidence == "absent":
            evidence = _healed_evidence(endpoint)
        if evidence == "other":
            problems.append(f"{process.describe()}: {endpoint.path} is not a socket")
        elif requested and evidence == "absent":
            problems.append(
                f"{process.describe()}: no control socket at {endpoint.path}, yet the group "
                f"requested cuinterpose: {_no_shim_hint(process, endpoint, where)}"
            )
        elif not requested and evidence == "socket":
            problems.append(
                f"{process.describe()}: a control socket at {endpoint.path}, yet the group "
                "did not request cuinterpose (a native checkpoint would fail on its sharing)"
            )
    if problems:
        wanted = "requested" if requested else "not requested"
        raise DetectionRefused(f"detection refused (cuinterpose {wanted}):", problems)
    return Detection("cuinterpose" if requested else "native", endpoints)


def _no_shim_hint(process: Process, endpoint: Endpoint, where: Where) -> str:
    if not discovery.pid_exists(process.observed_pid, where.proc_root):
        return f"pid {process.observed_pid} does not exist"
    return discovery.missing_shim_hint(process.observed_pid, endpoint.path.parent)


def remove_stale_sockets(
    processes: Sequence[Process | tuple[int, int]], where: Where
) -> tuple[Path, ...]:
    """Remove the control sockets of ``processes`` that nobody listens on any more, so
    that processes recreated by a restore (CRIU) can bind them. A socket a live shim
    still serves, or a path that is not a socket, is refused by name, nothing removed."""
    group = _processes(processes)
    stale: list[Path] = []
    problems: list[str] = []
    for process in group:
        path = where.endpoint(process).path
        evidence = _socket_evidence(path)
        if evidence == "absent":
            continue
        if evidence == "other":
            problems.append(f"{process.describe()}: {path} is not a socket; not removed")
            continue
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            try:
                probe.connect(str(path))
            except (ConnectionRefusedError, FileNotFoundError):
                stale.append(path)
                continue
            except OSError as exc:
                problems.append(f"{process.describe()}: {path}: {exc.strerror}; not removed")
                continue
        problems.append(f"{process.describe()}: {path} is served by a live shim; not removed")
    if problems:
        raise AgentError("stale socket removal refused:", problems)
    for path in stale:
        path.unlink(missing_ok=True)
    return tuple(stale)


# --------------------------------------------------------------- timings and events
@attrs.frozen
class StepEvent:
    """An agent step started, ended or failed."""

    step: str
    status: Literal["started", "done", "failed"]
    seconds: float = 0.0
    bytes: int = 0
    detail: str = ""

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"event": "step", "step": self.step, "status": self.status}
        out.update(seconds=self.seconds, bytes=self.bytes)
        if self.detail:
            out["detail"] = self.detail
        return out


@attrs.frozen
class CopyProgress:
    """Bytes copied so far by the phase op in flight, summed over the participants
    (from the shims' STATUS replies while SAVE/LOAD/ROLLBACK_ALLOCATIONS run)."""

    phase: str
    bytes_done: int
    bytes_total: int
    elapsed_s: float

    def to_json(self) -> dict[str, Any]:
        return {
            "event": "copy",
            "phase": self.phase,
            "bytes_done": self.bytes_done,
            "bytes_total": self.bytes_total,
            "elapsed_s": self.elapsed_s,
        }


AgentEvent = Event | StepEvent | CopyProgress
AgentCallback = Callable[[AgentEvent], None]


@attrs.define
class _Reporter:
    """Delivers every event to the callback and the logger; collects the timings.

    The copy watcher's thread emits too: deliveries are serialized, so a callback
    never runs twice at once.
    """

    callback: AgentCallback | None
    logger: logging.Logger
    clock: Callable[[], float] = time.perf_counter
    timings: list[Timing] = attrs.field(factory=list)
    lock: threading.Lock = attrs.field(factory=threading.Lock)

    def emit(self, event: AgentEvent) -> None:
        fields = event.to_json()
        failed = fields.get("event") == "failed" or fields.get("status") == "failed"
        level = logging.WARNING if failed else logging.INFO
        with self.lock:
            self.logger.log(
                level, "cuinterpose %s", _summary(fields), extra={"cuinterpose": fields}
            )
            if self.callback is not None:
                self.callback(event)

    @contextmanager
    def step(self, name: str) -> Iterator[list[int]]:
        """Time the block as step ``name``; the block may append bytes moved."""
        moved: list[int] = []
        self.emit(StepEvent(name, "started"))
        began = self.clock()
        try:
            yield moved
        except BaseException as exc:
            self.emit(StepEvent(name, "failed", self.clock() - began, sum(moved), str(exc)))
            raise
        seconds = self.clock() - began
        self.timings.append(Timing(name, seconds, sum(moved)))
        self.emit(StepEvent(name, "done", seconds, sum(moved)))


def _summary(fields: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in fields.items() if not isinstance(v, list | dict))


class _CopyWatcher:
    """Asks every shim STATUS while a machine runs, and reports the bytes copied by the
    SAVE/LOAD/ROLLBACK_ALLOCATIONS in flight. Progress only: a shim that does not answer
    is left out of that sample (the machine itself reports failures)."""

    def __init__(
        self, bound: Sequence[tuple[Endpoint, str]], emit: Callable[[CopyProgress], None]
    ) -> None:
        self.bound = tuple(bound)
        self.emit = emit
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="cuinterpose-status", daemon=True)
        self.last: tuple[str, int] | None = None

    def __enter__(self) -> _CopyWatcher:
        if self.bound:
            self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        if self.thread.is_alive():
            self.thread.join()

    def _run(self) -> None:
        calls = [(e, Request(Op.STATUS, participant=p), p) for e, p in self.bound]
        while not self.stop.wait(_POLL_S):
            try:
                flights = [
                    InFlight.from_stats(r.stats)
                    for r in call_all(calls, timeout=1.0)
                    if isinstance(r, Reply) and r.status == 0
                ]
            except WireError:  # a shim naming an op this engine does not know: no sample
                continue
            copying = [f for f in flights if f.op in _COPY_OPS]
            if not copying:
                continue
            op = copying[0].op
            assert op is not None
            done = sum(f.bytes_done for f in copying)
            sample = (op.name, done)
            if sample != self.last:
                self.last = sample
                self.emit(
                    CopyProgress(
                        op.name,
                        done,
                        sum(f.bytes_total for f in copying),
                        max(f.elapsed_ns for f in copying) / 1e9,
                    )
                )


# --------------------------------------------------------------- status
@attrs.frozen
class ProcessStatus:
    """One process as :func:`status` found it."""

    process: Process
    native_state: str  # a ProcessState name, or "unknown (<why>)"
    shim_phase: str | None  # None: no control socket
    participant: str | None = None
    in_flight: InFlight | None = None
    problem: str = ""  # why the shim did not answer, or its stored failure reason

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "observed_pid": self.process.observed_pid,
            "namespace_pid": self.process.namespace_pid,
            "native_state": self.native_state,
            "shim_phase": self.shim_phase,
            "participant": self.participant,
        }
        if self.in_flight is not None and self.in_flight.op is not None:
            out["in_flight"] = {
                "op": self.in_flight.op.name,
                "bytes_done": self.in_flight.bytes_done,
                "bytes_total": self.in_flight.bytes_total,
                "elapsed_s": self.in_flight.elapsed_ns / 1e9,
            }
        if self.problem:
            out["problem"] = self.problem
        return out

    def describe(self) -> str:
        shim = self.shim_phase or "no shim socket"
        text = f"{self.process.describe()}: native {self.native_state}, shim {shim}"
        return f"{text} ({self.problem})" if self.problem else text


def status(
    processes: Sequence[Process | tuple[int, int]],
    where: Where,
    native: NativeBackend,
    *,
    timeout: float = 5.0,
) -> tuple[ProcessStatus, ...]:
    """Every process's native state and its shim's phase and op in flight (STATUS, which
    changes and binds nothing and is served while a phase op runs)."""
    group = _processes(processes)
    states = state_names(native, [p.observed_pid for p in group])
    endpoints = [where.endpoint(p) for p in group]
    present = [_socket_evidence(e.path) == "socket" for e in endpoints]
    asked = [e for e, here in zip(endpoints, present, strict=True) if here]
    answers = iter(call_all([(e, Request(Op.STATUS), None) for e in asked], timeout=timeout))
    out: list[ProcessStatus] = []
    for process, here in zip(group, present, strict=True):
        native_state = states[process.observed_pid]
        if not here:
            out.append(ProcessStatus(process, native_state, None))
            continue
        reply = next(answers)
        if isinstance(reply, ParticipantError):
            out.append(ProcessStatus(process, native_state, "not answering", problem=reply.reason))
            continue
        if reply.status != 0:
            problem = f"STATUS answered {reply.status.name}: {reply.message}"
            out.append(ProcessStatus(process, native_state, reply.phase.name, problem=problem))
            continue
        out.append(
            ProcessStatus(
                process,
                native_state,
                reply.phase.name,
                reply.participant,
                InFlight.from_stats(reply.stats),
                reply.message,
            )
        )
    return tuple(out)


def _status_lines(
    group: Sequence[Process], where: Where | None, native: NativeBackend
) -> list[str]:
    if where is None:
        states = state_names(native, [p.observed_pid for p in group])
        return [f"{p.describe()}: native {states[p.observed_pid]}" for p in group]
    return [s.describe() for s in status(group, where, native)]


def require_states(
    native: NativeBackend,
    processes: Sequence[Process | tuple[int, int]],
    wanted: ProcessState,
    command: str,
    hint: str,
) -> None:
    """Refuse (:class:`StateRefused`, nothing changed) unless every process is ``wanted``;
    the message names each other one and says what to run."""
    group = _processes(processes)
    states = state_names(native, [p.observed_pid for p in group])
    odd = [p for p in group if states[p.observed_pid] != wanted.name]
    # The driver could not say (a state it names is a live process's), and no process
    # has the pid: it is gone, which the driver's error does not say.
    gone = [
        p
        for p in odd
        if states[p.observed_pid] not in ProcessState.__members__
        and not pid_visible(p.observed_pid)
    ]
    wrong = [
        f"{p.describe()} is gone (no process has pid {p.observed_pid})"
        if p in gone
        else f"{p.describe()} is {states[p.observed_pid]}, not {wanted.name}"
        for p in odd
    ]
    if gone:
        wrong.append(
            "a process that is gone cannot take part: `cuinterpose recover` brings the "
            "survivors back (specs/recovery.md)"
        )
    if wrong:
        raise StateRefused(f"{command} refused: {hint}", wrong)


# --------------------------------------------------------------- suspend
@attrs.frozen
class SuspendResult:
    manifest: Manifest
    manifest_path: Path
    timings: tuple[Timing, ...]
    # What the shims staged and left to the native checkpoint (None: nothing staged).
    staging: StagingSummary | None = None


def _trusted_directory(command: str, directory: Path) -> None:
    problem = checkpoint_dir_problem(directory)
    if problem is not None:
        raise AgentError(f"{command} refused:", [problem, "nothing was changed"])


def _participant_ids(endpoints: Sequence[Endpoint], timeout: float) -> tuple[str, ...]:
    """Each shim's id, from STATUS (binds nothing: the capture's HANDSHAKE binds)."""
    replies = call_all([(e, Request(Op.STATUS), None) for e in endpoints], timeout=timeout)
    ids: list[str] = []
    problems: list[str] = []
    for reply in replies:
        if isinstance(reply, ParticipantError):
            problems.append(str(reply))
        else:
            ids.append(reply.participant)
    if problems:
        raise DetectionRefused("a shim did not answer STATUS:", problems)
    return tuple(ids)


def suspend(
    processes: Sequence[Process | tuple[int, int]],
    checkpoint_dir: Path,
    *,
    where: Where,
    native: NativeBackend,
    requested: bool = True,
    options: Options | None = None,
    lock_timeout_ms: int = DEFAULT_LOCK_TIMEOUT_MS,
    on_event: AgentCallback | None = None,
    logger: logging.Logger | None = None,
) -> SuspendResult:
    """Detect, capture (when requested), lock and checkpoint every process, write the
    manifest. On return every process is CHECKPOINTED and its GPU memory is free.

    Raises :class:`DetectionRefused` or :class:`StateRefused` (nothing changed),
    :class:`~.errors.CoordinatorError` from the capture (rolled back by the runner
    when it had changed anything), or :class:`SuspendFailed` when a native step
    failed: what was done is undone first (``restored`` says whether it worked).
    """
    group = _processes(processes)
    directory = Path(checkpoint_dir)
    report = _Reporter(on_event, logger or logging.getLogger(LOGGER_NAME))
    options = options or Options()
    pids = [p.observed_pid for p in group]
    _trusted_directory("suspend", directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise AgentError(
            f"suspend refused: checkpoint directory {directory}:", [str(exc)]
        ) from None
    if (directory / MANIFEST_FILE_NAME).exists():
        held = read_manifest(directory)
        if not held.resumed_at:
            raise ManifestError(
                f"suspend refused: {directory} holds the manifest of a group never resumed:",
                [
                    *(p.describe() for p in held.processes()),
                    f"resume it first (cuinterpose resume --checkpoint-dir {directory}), "
                    "or suspend into another directory",
                ],
            )
    with report.step("detect"):
        detection = detect(requested, group, where)
        require_states(
            native,
            group,
            ProcessState.RUNNING,
            "suspend",
            "every process must be RUNNING (`cuinterpose status` shows the group; one "
            f"CHECKPOINTED by an earlier suspend comes back with {resume_hint(None)})",
        )
        ids: tuple[str | None, ...] = (None,) * len(group)
        if detection.mode == "cuinterpose":
            ids = _participant_ids(detection.endpoints, options.phase_timeout)
    prepared = False
    staging = None
    if detection.mode == "cuinterpose":
        with report.step("capture") as moved:
            engine_options = attrs.evolve(options, on_progress=report.emit)
            bound = [(e, i) for e, i in zip(detection.endpoints, ids, strict=True) if i]
            with _CopyWatcher(bound, report.emit):
                result = _capture_quiet(
                    detection.endpoints, directory, engine_options, report.logger
                )
            moved.append(_bytes_moved(result.phases))
            staging = StagingSummary.from_phases(result.phases)
        prepared = True
    try:
        with report.step("native_lock"):
            run_step(native, "lock", pids, lock_timeout_ms=lock_timeout_ms)
        with report.step("native_checkpoint"):
            run_step(native, "checkpoint", pids)
        manifest = Manifest(
            requested,
            prepared,
            tuple(
                Participant(p.observed_pid, p.namespace_pid, i)
                for p, i in zip(group, ids, strict=True)
            ),
            tuple(report.timings),
            utc_timestamp(),
        )
        path = write_manifest(directory, manifest)
    except NativeGroupError as failure:
        _undo(list(failure.lines()), group, detection, directory, native, options, report, where)
    except (StateFileError, OSError) as failure:
        lines = [f"the manifest could not be written: {failure}"]
        _undo(lines, group, detection, directory, native, options, report, where)
    return SuspendResult(manifest, path, tuple(report.timings), staging)


# QUIESCE rounds bring a team a collective apart to a quiet point (engine/quiesce.py).
# A capture still refused as not quiet (an application that did not synchronize for
# a shim's whole deadline; ranks whose synchronizations interleave so that every
# advance overtakes the other) changed nothing, and its gates open as the run ends:
# the capture starts over once, closing the gates at another moment.
QUIESCE_ATTEMPTS: Final = 2


def _capture_quiet(
    endpoints: Sequence[Endpoint], directory: Path, options: Options, log: logging.Logger
) -> CaptureResult:
    for attempt in range(1, QUIESCE_ATTEMPTS + 1):
        try:
            return capture(endpoints, directory, options)
        except PhaseFailed as error:
            stopped = options.stop is not None and options.stop.is_set()
            if attempt == QUIESCE_ATTEMPTS or stopped or not not_quiet(error):
                raise
            log.warning("capture attempt %d of %d not quiet: %s", attempt, QUIESCE_ATTEMPTS,
                        error.reason)  # fmt: skip
    raise AssertionError("unreachable: the last attempt returns or raises")


def _bytes_moved(phases: Sequence[PhaseEvent]) -> int:
    return sum(p.transfer.allocation_bytes for p in phases if p.transfer is not None)


def _undo(
    lines: list[str],
    group: Sequence[Process],
    detection: Detection,
    directory: Path,
    native: NativeBackend,
    options: Options,
    report: _Reporter,
    where: Where,
) -> None:
    """A native step of a suspend (or the manifest) failed: native restore and unlock what
    was done, then the coordinator restore; raise SuspendFailed with every step and every
    state. ``lines`` says what failed."""
    with report.step("undo_native"):
        undone = undo_suspend(native, [p.observed_pid for p in group])
    lines += undone
    now = state_names(native, [p.observed_pid for p in group])
    back = all(s == ProcessState.RUNNING.name for s in now.values())
    if back and detection.mode == "cuinterpose":
        try:
            with report.step("undo_coordinator_restore"):
                restore(
                    detection.endpoints, directory, attrs.evolve(options, on_progress=report.emit)
                )
            lines.append("coordinator restore done: bytes, VAs and sharing are back")
        except CoordinatorError as error:
            back = False
            lines += [f"coordinator restore: {line}" for line in error.lines()]
    elif not back:
        lines.append("the coordinator restore was not run: not every process is RUNNING")
    lines += [f"now {line}" for line in _status_lines(group, where, native)]
    if back:
        lines.append("the group runs as before the suspend")
    raise SuspendFailed("suspend failed:", lines, restored=back)


# --------------------------------------------------------------- resume
def _natively_checkpointed(
    native: NativeBackend, group: Sequence[Process], restored: bool
) -> list[Process]:
    """The processes whose native restore and unlock are to come: all of them, each
    CHECKPOINTED; after a restore by CRIU, whose CUDA plugin (where installed) restores
    and unlocks by itself, those still CHECKPOINTED, the others RUNNING."""
    hint = "every process must be CHECKPOINTED by `cuinterpose suspend`"
    if not restored:
        require_states(native, group, ProcessState.CHECKPOINTED, "resume", hint)
        return list(group)
    states = state_names(native, [p.observed_pid for p in group])
    fine = (ProcessState.CHECKPOINTED.name, ProcessState.RUNNING.name)
    wrong = [
        f"{p.describe()} is {states[p.observed_pid]}, not CHECKPOINTED (nor RUNNING, "
        "restored natively by CRIU's CUDA plugin)"
        for p in group
        if states[p.observed_pid] not in fine
    ]
    if wrong:
        raise StateRefused(f"resume refused: {hint}", wrong)
    return [p for p in group if states[p.observed_pid] == ProcessState.CHECKPOINTED.name]


def _recreated(recorded: Sequence[Process], given: Sequence[Process]) -> tuple[Process, ...]:
    """The manifest's processes in its order, with the observed pids a restore gave them."""
    by_namespace = {p.namespace_pid: p for p in given}
    if len(by_namespace) != len(given) or set(by_namespace) != {p.namespace_pid for p in recorded}:
        raise ManifestError(
            "resume refused: the restored processes' namespace pids are not the manifest's "
            f"({', '.join(p.describe() for p in given)})",
            [f"the manifest holds {p.describe()}" for p in recorded],
        )
    return tuple(by_namespace[p.namespace_pid] for p in recorded)


@attrs.frozen
class ResumeResult:
    manifest: Manifest
    coordinator_restored: bool
    timings: tuple[Timing, ...]
    # What the shims loaded (None: nothing).
    staging: StagingSummary | None = None
    # Late steps that did not go through after the group ran (the directory is usable).
    warnings: tuple[str, ...] = ()


def resume(
    checkpoint_dir: Path,
    *,
    where: Where,
    native: NativeBackend,
    processes: Sequence[Process | tuple[int, int]] | None = None,
    restored: bool = False,
    options: Options | None = None,
    on_event: AgentCallback | None = None,
    logger: logging.Logger | None = None,
) -> ResumeResult:
    """Native restore and unlock of every process of the manifest, then the coordinator
    restore when it says prepared. On return every process is RUNNING with its bytes,
    VAs and sharing back.

    ``processes``, when given, must be the manifest's. With ``restored`` they are the
    processes a restore (CRIU) recreated: matched to the manifest's by namespace pid,
    their observed pids may be new, and those already natively RUNNING (restored and
    unlocked by CRIU's CUDA plugin) skip the native steps (specs/criu.md). Raises
    :class:`ManifestError` or :class:`StateRefused` (nothing changed),
    :class:`ResumeFailed` naming every process's native state and shim phase.
    """
    directory = Path(checkpoint_dir)
    report = _Reporter(on_event, logger or logging.getLogger(LOGGER_NAME))
    options = options or Options()
    _trusted_directory("resume", directory)
    manifest = read_manifest(directory)
    if manifest.resumed_at:
        raise ManifestError(
            f"resume refused: the group in {directory} was resumed at {manifest.resumed_at}:",
            ["suspend it again first"],
        )
    group = manifest.processes()
    if processes is not None and restored:
        group = _recreated(group, _processes(processes))
    elif processes is not None and set(_processes(processes)) != set(group):
        given = ", ".join(p.describe() for p in _processes(processes))
        raise ManifestError(
            f"resume refused: the processes given are not the manifest's ({given})",
            [f"the manifest holds {p.describe()}" for p in group],
        )
    coordinate = restore_plan(manifest, directory)
    pids = [p.observed_pid for p in _natively_checkpointed(native, group, restored)]
    endpoints = [where.endpoint(p) for p in group]
    staging = None
    try:
        if pids:
            with report.step("native_restore"):
                run_step(native, "restore", pids)
            with report.step("native_unlock"):
                run_step(native, "unlock", pids)
        if coordinate:
            ids = tuple(p.participant or "" for p in manifest.participants)
            with report.step("coordinator_restore") as moved:
                engine_options = attrs.evolve(options, on_progress=report.emit)
                with _CopyWatcher(list(zip(endpoints, ids, strict=True)), report.emit):
                    result = restore(endpoints, directory, engine_options)
                moved.append(_bytes_moved(result.phases))
                staging = StagingSummary.from_phases(result.phases)
    except (NativeGroupError, CoordinatorError) as failure:
        lines = list(failure.lines())
        running = isinstance(failure, CoordinatorError) and failure.rolled_back
        if running:
            lines.append("rolled back: every process runs with the bytes it had at suspend")
        else:
            lines.append(
                "the native restore ran: the group is not as it was suspended, nor running "
                "with its bytes"
            )
        lines += [f"now {line}" for line in _status_lines(group, where, native)]
        raise ResumeFailed("resume failed:", lines, running=running) from failure
    warnings = (*(result.warnings if coordinate else ()), *_mark_resumed(directory, manifest))
    return ResumeResult(manifest, coordinate, tuple(report.timings), staging, warnings)


def _mark_resumed(directory: Path, manifest: Manifest) -> tuple[str, ...]:
    """Record the resume in the manifest, or, when it cannot be written, remove the
    manifest, so that the directory takes a new suspend either way. Never raises: the
    group runs already."""
    try:
        write_manifest(directory, attrs.evolve(manifest, resumed_at=utc_timestamp()))
        return ()
    except StateFileError as exc:
        problem = str(exc)
    path = directory / MANIFEST_FILE_NAME
    try:
        path.unlink(missing_ok=True)
    except OSError as exc:
        return (
            f"the group runs, but {problem}, and {path} could not be removed either "
            f"({exc.strerror}): suspend into another directory next time",
        )
    return (f"the group runs, but {problem}; {path} was removed instead",)


__all__ = [
    "DEFAULT_LOCK_TIMEOUT_MS",
    "LOGGER_NAME",
    "MANIFEST_FILE_NAME",
    "AgentCallback",
    "AgentError",
    "AgentEvent",
    "CopyProgress",
    "Detection",
    "DetectionRefused",
    "Manifest",
    "ManifestError",
    "NativeError",
    "Participant",
    "Process",
    "ProcessStatus",
    "ResumeFailed",
    "ResumeResult",
    "StateRefused",
    "StepEvent",
    "SuspendFailed",
    "SuspendResult",
    "Timing",
    "Where",
    "detect",
    "read_manifest",
    "remove_stale_sockets",
    "require_states",
    "restore_plan",
    "resume",
    "status",
    "suspend",
    "write_manifest",
]
