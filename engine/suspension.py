"""``suspend``: detection, capture (when requested), native lock and checkpoint of every
process, the manifest; and the undo of a suspend whose native part failed.

A failure after capture undoes what was done (native restore and unlock, then the
coordinator restore): the group runs as before, and :class:`SuspendFailed` says so
with every step.

For the CRIU verbs the staged copies go to files of the checkpoint directory
(:mod:`.stored`) while the native lock and checkpoint run: a shim's STORE_STAGED makes
no CUDA call (its bounce buffers were zeroed by the SAVE), so the two overlap, and an
undo fetches what was stored before the coordinator restore.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import attrs

from . import quiesce
from .client import Endpoint, ParticipantError, call_all
from .detection import Detection, DetectionRefused, Where, detect, group_of
from .directory import require_trusted
from .discovery import DriverMismatch, DriverReport, pid_namespace, shim_drivers, start_ticks
from .driver_trust import trusted
from .errors import AgentError, CoordinatorError
from .events import AgentCallback, Reporter, StepEvent, bytes_moved, reporter
from .gpus import Gpu, parse_report
from .group_status import require_states, status_lines
from .manifest import (
    MANIFEST_FILE_NAME,
    Manifest,
    ManifestError,
    Origin,
    Participant,
    Process,
    Timing,
    read_manifest,
    resume_hint,
    write_manifest,
)
from .native_checkpoint import (
    DEFAULT_LOCK_TIMEOUT_MS,
    CudaBackend,
    NativeBackend,
    NativeGroupError,
    ProcessState,
    run_step,
    state_names,
    undo_suspend,
)
from .options import Options
from .progress import StagingSummary
from .released import Released, released
from .statefile import StateFileError, utc_timestamp
from .stopped import stopped
from .watch import CopyWatcher
from .wire import Op, Request, Status

if TYPE_CHECKING:
    from .stored import StoredFile

# The runner (the machines, transitions) is imported where the capture runs or is undone:
# a native checkpoint alone (--not-requested) and a suspend refused before its capture
# run no machine and load none (tests/engine/test_import_cost.py).


class SuspendFailed(AgentError):
    """A suspend failed, or (``stopped``) was stopped on request between its steps;
    ``restored`` says whether the group runs as before."""

    def __init__(
        self, what: str, lines: Sequence[str], *, restored: bool, stopped: bool = False
    ) -> None:
        super().__init__(what, lines, changed=not restored)
        self.restored = restored
        self.stopped = stopped


@attrs.frozen
class SuspendResult:
    manifest: Manifest
    manifest_path: Path
    timings: tuple[Timing, ...]
    # What the shims staged and left to the native checkpoint (None: nothing staged).
    staging: StagingSummary | None = None
    # The GPU memory the suspend released, from the capture's topology as the run held it.
    released: Released | None = None


@attrs.frozen
class DriverChoice:
    """The native calls chosen from the driver a suspend's shims report in its one STATUS
    round before HANDSHAKE (the command line's ``--driver``, frontends/drivers.py), so
    that whoever loads the driver asks the shims nothing of its own: ``choose`` is given
    the report (empty for a group without shims) and returns the backend."""

    choose: Callable[[DriverReport], NativeBackend]


@attrs.frozen
class _Asked:
    """What a suspend asks its shims before the capture, in one STATUS round asking the
    driver (``ask_driver``): each one's participant id (the copy watcher's and the
    manifest's) and the driver each loaded (the native calls', and the manifest's)."""

    ids: tuple[str, ...]
    report: DriverReport


def _ask_driver(endpoints: Sequence[Endpoint], timeout: float) -> _Asked:
    """The suspend's one STATUS round before HANDSHAKE; binds nothing (the capture's
    HANDSHAKE binds). It asks the driver only: its answer makes no driver call in the
    shim, so it is safe to ask a process whatever its native state, and it must come
    before ``require_states`` (which needs the driver loaded). The GPUs, whose report
    makes driver calls that a LOCKED or CHECKPOINTED process would hold, are asked once
    every process is known RUNNING, after the capture (:func:`_ask_gpus`)."""
    # A stopped process answers nothing until continued: named at once, not waited for.
    held = {e: stopped(e.observed_pid, e.proc_root()) for e in endpoints}
    asked = [e for e in endpoints if not held[e]]
    answers = iter(call_all([(e, Request(Op.STATUS, ask_driver=True), None) for e in asked],
                            timeout=timeout))  # fmt: skip
    ids: list[str] = []
    drivers: dict[int, str] = {}
    problems: list[str] = []
    for endpoint in endpoints:
        if held[endpoint]:
            problems.append(f"{endpoint.describe()}: {held[endpoint]}")
            continue
        reply = next(answers)
        if isinstance(reply, ParticipantError):
            problems.append(f"{reply} (looked in {endpoint.path.parent})")
        elif reply.status is not Status.OK:
            problems.append(f"{endpoint.describe()}: STATUS answered {reply.status.name}: "
                            f"{reply.message}")  # fmt: skip
        else:
            ids.append(reply.participant)
            if reply.message:  # empty: the application has not reached the driver yet
                drivers[endpoint.observed_pid] = reply.message
    if any(held.values()):
        raise DetectionRefused(
            "suspend refused, nothing was changed: a process of the group is stopped:", problems
        )
    if problems:
        raise DetectionRefused("a shim did not say which driver it loaded:", problems)
    report = DriverReport(drivers)
    try:
        report.one()
    except DriverMismatch as exc:
        raise DetectionRefused("suspend refused:", [f"{exc}: one suspend per driver"]) from None
    return _Asked(tuple(ids), report)


class _GpusUnknown(Exception):
    """A shim could not say which GPUs its process uses, after the capture: undone."""

    def __init__(self, lines: Sequence[str]) -> None:
        super().__init__(*lines)
        self.lines = list(lines)


def _ask_gpus(endpoints: Sequence[Endpoint], timeout: float) -> tuple[tuple[Gpu, ...], ...]:
    """The GPUs each process uses (STATUS ``ask_devices``), asked once the capture is done:
    every process is RUNNING (``require_states``) and no phase op runs, so the report's
    driver calls return. The manifest records them for a restore onto other GPUs."""
    replies = call_all([(e, Request(Op.STATUS, ask_devices=True), None) for e in endpoints],
                       timeout=timeout)  # fmt: skip
    gpus: list[tuple[Gpu, ...]] = []
    problems: list[str] = []
    for endpoint, reply in zip(endpoints, replies, strict=True):
        if isinstance(reply, ParticipantError):
            problems.append(f"{reply} (looked in {endpoint.path.parent})")
            continue
        if reply.status is not Status.OK:
            problems.append(f"{endpoint.describe()}: devices report: {reply.message}")
            continue
        try:
            gpus.append(parse_report(reply.message))
        except ValueError as exc:
            problems.append(f"{endpoint.describe()}: devices report refused: {exc}")
    if problems:
        raise _GpusUnknown(["a shim did not say which GPUs its process uses:", *problems])
    return tuple(gpus)


def _backend(
    native: NativeBackend | DriverChoice | None, report: DriverReport, where: Where
) -> NativeBackend:
    if isinstance(native, DriverChoice):
        return native.choose(report)
    if native is not None:
        return native
    return CudaBackend(trusted(report, where.proc_root))


def native_for(where: Where, processes: Sequence[Process | tuple[int, int]]) -> CudaBackend:
    """The native calls on the driver the processes' shims report (its own STATUS
    round: :func:`suspend` asks its shims once and needs none of this), held to the
    driver trust rule (:mod:`.driver_trust`: refused with
    :class:`~.native_checkpoint.NativeUnavailableError`, nothing loaded); none
    reporting, the loader's ``libcuda.so.1``."""
    endpoints = [where.endpoint(p) for p in group_of(processes)]
    return CudaBackend(trusted(shim_drivers(endpoints), where.proc_root))


def _fresh_directory(directory: Path) -> None:
    """Create the checkpoint directory, and refuse one holding a group never resumed."""
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


def suspend(
    processes: Sequence[Process | tuple[int, int]],
    checkpoint_dir: Path,
    *,
    where: Where,
    native: NativeBackend | DriverChoice | None = None,
    requested: bool = True,
    options: Options | None = None,
    lock_timeout_ms: int = DEFAULT_LOCK_TIMEOUT_MS,
    on_event: AgentCallback | None = None,
    logger: logging.Logger | None = None,
    store_beside: bool = False,
) -> SuspendResult:
    """Detect, capture (when requested), lock and checkpoint every process, write the
    manifest. On return every process is CHECKPOINTED and its GPU memory is free.

    ``native``: the native calls; a :class:`DriverChoice`, to choose them from the
    driver the shims report; None, those on that driver if it is one the coordinator
    trusts (:mod:`.driver_trust`: the system's or this installation's simulated one, by
    file identity; else :class:`~.native_checkpoint.NativeUnavailableError` before
    anything changes, nothing loaded), the loader's search when none reports one;
    an agent's own backend is used as given. The manifest records the driver with ``where``, for
    :func:`~.resumption.resume`. Before the capture's HANDSHAKE the shims are sent one
    STATUS, asking the driver; the GPUs are asked after the capture.

    Raises :class:`DetectionRefused` or :class:`StateRefused` (nothing changed),
    :class:`~.errors.CoordinatorError` from the capture (rolled back by the runner
    when it had changed anything), or :class:`SuspendFailed` when what followed the
    capture failed (the GPUs unknown, a native step, the manifest): what was done is
    undone first (``restored`` says whether it worked).

    ``store_beside`` (the CRIU verbs): once captured, every shim's staged copies go to
    its files of ``checkpoint_dir`` (:func:`.stored.store`, step ``store_staged``) on a
    thread of its own while the native lock and checkpoint run; an undo fetches them
    back first. A store that failed where the native steps did not raises its
    :class:`~.stored.StoreFailed` once the manifest is written: the group is suspended,
    and a resume fetches what was stored (who failed kept its copies in memory).
    """
    group = group_of(processes)
    directory = Path(checkpoint_dir)
    report = reporter(on_event, logger)
    options = options or Options()
    pids = [p.observed_pid for p in group]
    require_trusted("suspend", directory)
    _fresh_directory(directory)
    with report.step("detect"):
        detection = detect(requested, group, where)
        asked = _Asked((), DriverReport({}))
        if detection.mode == "cuinterpose":
            asked = _ask_driver(detection.endpoints, options.phase_timeout)
        backend = _backend(native, asked.report, where)
        require_states(
            backend,
            group,
            ProcessState.RUNNING,
            "suspend",
            "every process must be RUNNING (`cuinterpose status` shows the group; one "
            f"CHECKPOINTED by an earlier suspend comes back with {resume_hint(None)})",
        )
        ids: tuple[str | None, ...] = asked.ids or (None,) * len(group)
        # Absolute: a resume may run from any directory (``--control-dir ../../c``).
        origin = Origin(
            os.path.abspath(where.control_dir),
            None if where.proc_root is None else os.path.abspath(where.proc_root),
            asked.report.one(),
            tuple(start_ticks(p.observed_pid, where.proc_root) for p in group),
            tuple(pid_namespace(p.observed_pid, where.proc_root) for p in group),
            pid_namespace(os.getpid()),
        )
    prepared = False
    staging = None
    topology = None
    gpus: tuple[tuple[Gpu, ...], ...] = ((),) * len(group)
    undo = _Undo(group, detection, directory, backend, options, report, where)
    if detection.mode == "cuinterpose":
        from .runner import capture

        try:
            with report.step("capture") as moved:
                engine_options = attrs.evolve(options, on_progress=report.emit)
                bound = [(e, i) for e, i in zip(detection.endpoints, ids, strict=True) if i]
                attempt = partial(capture, detection.endpoints, directory, engine_options)
                with CopyWatcher(bound, report.emit):
                    result = quiesce.until_quiet(attempt, engine_options, report.logger)
                moved.append(bytes_moved(result.phases))
                staging = StagingSummary.from_phases(result.phases)
                topology = result.state.topology
                prepared = True
                gpus = _ask_gpus(detection.endpoints, options.phase_timeout)
        except _GpusUnknown as unknown:
            _undo(undo, unknown.lines)
    participants = tuple(
        Participant(p.observed_pid, p.namespace_pid, i, g)
        for p, i, g in zip(group, ids, gpus, strict=True)
    )
    storing = None
    if store_beside and prepared:
        staged = staging.allocation_bytes if staging else 0
        bare = Manifest(requested, prepared, participants, (), "", origin=origin)
        storing = _Storing.start(directory, bare, where, options, staged, report)
        undo = attrs.evolve(undo, storing=storing)
    try:
        _stop_before(undo, "native_lock")
        with report.step("native_lock"):
            run_step(backend, "lock", pids, lock_timeout_ms=lock_timeout_ms)
        _stop_before(undo, "native_checkpoint")
        with report.step("native_checkpoint"):
            run_step(backend, "checkpoint", pids)
    except NativeGroupError as failure:
        _undo(undo, list(failure.lines()))
    not_stored = storing.join() if storing else None
    try:
        manifest = Manifest(
            requested,
            prepared,
            participants,
            tuple(report.timings),
            utc_timestamp(),
            origin=origin,
        )
        path = write_manifest(directory, manifest)
    except (StateFileError, OSError) as failure:
        _undo(undo, [f"the manifest could not be written: {failure}"])
    if not_stored is not None:
        raise not_stored
    freed = released(topology, staging, len(group))
    return SuspendResult(manifest, path, tuple(report.timings), staging, freed)


@attrs.define
class _Storing:
    """STORE_STAGED to every shim (:func:`.stored.store`) on a thread of its own, beside
    the native lock and checkpoint. Its step, ``store_staged``, starts when the thread
    does and ends, timed from there, when it is joined: the timings keep their order."""

    manifest: Manifest
    report: Reporter
    thread: threading.Thread | None = None
    began: float = 0.0
    seconds: float = 0.0
    files: tuple[StoredFile, ...] = ()
    failure: AgentError | None = None
    joined: bool = False

    @classmethod
    def start(
        cls,
        directory: Path,
        manifest: Manifest,
        where: Where,
        options: Options,
        staged_bytes: int,
        report: Reporter,
    ) -> _Storing:
        from .stored import StoreFailed, store

        storing = cls(manifest, report)

        def run() -> None:
            try:
                storing.files = store(
                    directory, manifest, where=where, options=options, staged_bytes=staged_bytes
                )
            except AgentError as failure:
                storing.failure = failure
            except Exception as exc:  # said by the suspend, never lost with the thread
                storing.failure = StoreFailed(
                    "STORE_STAGED failed:", [f"{type(exc).__name__}: {exc}"], changed=True
                )
            storing.seconds = time.perf_counter() - storing.began

        report.emit(StepEvent("store_staged", "started"))
        storing.began = time.perf_counter()
        storing.thread = threading.Thread(target=run, name="cuinterpose-store", daemon=True)
        storing.thread.start()
        return storing

    def join(self) -> AgentError | None:
        """Wait for the store; its failure (reported), or None."""
        if self.thread is not None and not self.joined:
            self.thread.join()
            self.joined = True
            moved = sum(f.bytes for f in self.files)
            if self.failure is None:
                self.report.timings.append(Timing("store_staged", self.seconds, moved))
                self.report.emit(StepEvent("store_staged", "done", self.seconds, moved))
            else:
                detail = str(self.failure)
                self.report.emit(StepEvent("store_staged", "failed", self.seconds, detail=detail))
        return self.failure


@attrs.frozen
class _Undo:
    """What the undo of a suspend needs: the group, how it was detected, where its
    state file is, how the suspend reaches its processes and reports, and the store
    running beside the native steps, if any."""

    group: tuple[Process, ...]
    detection: Detection
    directory: Path
    native: NativeBackend
    options: Options
    report: Reporter
    where: Where
    storing: _Storing | None = None


def _fetch_back(undo: _Undo, lines: list[str]) -> bool:
    """Before an undo's coordinator restore: what the store beside the native steps put
    in files, back in the shims' memory. False (with the lines why) if it cannot be."""
    from .stored import StoreFailed, fetch, stored_files

    storing = undo.storing
    if storing is None:
        return True
    failure = storing.join()
    if failure is not None:
        lines += [f"store_staged: {line}" for line in failure.lines()]
    if not stored_files(undo.directory):
        return True
    try:
        with undo.report.step("undo_fetch_staged"):
            fetch(undo.directory, storing.manifest, undo.group, where=undo.where,
                  options=undo.options, missing_ok=True)  # fmt: skip
    except StoreFailed as error:
        lines += [f"fetch_staged: {line}" for line in error.lines()]
        return False
    return True


def _stop_before(undo: _Undo, step: str) -> None:
    """A run asked to stop (``Options.stop``: a signal) ends at a step boundary: before a
    native step, what the suspend did so far is undone (the capture's own steps stop
    in its machine, which rolls back)."""
    stop = undo.options.stop
    if stop is not None and stop.is_set():
        _undo(undo, [f"stopped on request before {step}"], stopped=True)


def _undo(undo: _Undo, lines: list[str], *, stopped: bool = False) -> NoReturn:
    """A native step of a suspend (or the manifest) failed: native restore and unlock what
    was done, then the coordinator restore (the stored copies fetched first); raise
    SuspendFailed with every step and every state. ``lines`` says what failed."""
    if undo.storing is not None:
        undo.storing.join()  # nothing is undone under a store still writing
    pids = [p.observed_pid for p in undo.group]
    with undo.report.step("undo_native"):
        lines += undo_suspend(undo.native, pids)
    now = state_names(undo.native, pids)
    back = all(s == ProcessState.RUNNING.name for s in now.values())
    if back and undo.detection.mode == "cuinterpose" and not _fetch_back(undo, lines):
        back = False
        lines.append("the coordinator restore was not run: the stored copies are not back")
    elif back and undo.detection.mode == "cuinterpose":
        from .runner import restore

        try:
            with undo.report.step("undo_coordinator_restore"):
                # An undo is never stopped half way: a second signal waits for it.
                options = attrs.evolve(undo.options, on_progress=undo.report.emit, stop=None)
                restore(undo.detection.endpoints, undo.directory, options)
            lines.append("coordinator restore done: bytes, VAs and sharing are back")
        except CoordinatorError as error:
            back = False
            lines += [f"coordinator restore: {line}" for line in error.lines()]
    elif not back:
        lines.append("the coordinator restore was not run: not every process is RUNNING")
    lines += [f"now {line}" for line in status_lines(undo.group, undo.where, undo.native)]
    if back:
        lines.append("the group runs as before the suspend")
    what = "suspend stopped on request:" if stopped else "suspend failed:"
    raise SuspendFailed(what, lines, restored=back, stopped=stopped)
