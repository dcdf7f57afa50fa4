"""``suspend``: detection, capture (when requested), native lock and checkpoint of every
process, the manifest; and the undo of a suspend whose native part failed.

A failure after capture undoes what was done (native restore and unlock, then the
coordinator restore): the group runs as before, and :class:`SuspendFailed` says so
with every step.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import NoReturn

import attrs

from . import quiesce
from .client import Endpoint, ParticipantError, call_all
from .detection import Detection, DetectionRefused, Where, detect, group_of
from .directory import require_trusted
from .discovery import DriverMismatch, DriverReport, shim_drivers, start_ticks
from .errors import AgentError, CoordinatorError
from .events import AgentCallback, Reporter, bytes_moved, reporter
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
    NativeUnavailableError,
    ProcessState,
    run_step,
    state_names,
    undo_suspend,
)
from .options import Options
from .progress import StagingSummary
from .released import Released, released
from .statefile import StateFileError, utc_timestamp
from .watch import CopyWatcher
from .wire import Op, Request, Status

# The runner (the machines, transitions) is imported where the capture runs or is undone:
# a native checkpoint alone (--not-requested) and a suspend refused before its capture
# run no machine and load none (tests/engine/test_import_cost.py).


class SuspendFailed(AgentError):
    """A suspend failed; ``restored`` says whether the group runs as before."""

    def __init__(self, what: str, lines: Sequence[str], *, restored: bool) -> None:
        super().__init__(what, lines, changed=not restored)
        self.restored = restored


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
class _ShimReport:
    """What a suspend records of its shims before the capture: each one's participant id
    (the copy watcher's and the manifest's), the driver they loaded, and the GPUs each
    process uses (the remap's check on restore, gpus.resolve)."""

    ids: tuple[str, ...]
    driver: str | None
    gpus: tuple[tuple[Gpu, ...], ...]


def _shim_report(endpoints: Sequence[Endpoint], timeout: float) -> _ShimReport:
    """One STATUS round asking the driver and the devices together (protocol.h
    CUIP_ASK_ALL); every reply names its participant. Binds nothing: the capture's
    HANDSHAKE binds.

    Why one ask rather than the ids from HANDSHAKE: the driver and the GPUs must be
    known before anything changes (two drivers, or a shim that cannot say its GPUs, is
    refused with nothing done), so a round before HANDSHAKE stays whichever way the ids
    come; asking it everything at once makes it the only one, with no change to the
    runner and a copy watcher that starts with the capture, as it did. The native
    backend's own driver question (``native_for``, the CLI's late one) stays apart: it
    comes before ``require_states``, which must refuse a process not RUNNING before its
    shim is asked for GPUs (the devices report makes driver calls)."""
    asked = Request(Op.STATUS, ask_driver=True, ask_devices=True)
    replies = call_all([(e, asked, None) for e in endpoints], timeout=timeout)
    ids: list[str] = []
    drivers: dict[int, str] = {}
    gpus: list[tuple[Gpu, ...]] = []
    problems: list[str] = []
    for endpoint, reply in zip(endpoints, replies, strict=True):
        if isinstance(reply, ParticipantError):
            problems.append(f"{reply} (looked in {endpoint.path.parent})")
            continue
        if reply.status is not Status.OK:
            problems.append(f"{endpoint.describe()}: devices report: {reply.message}")
            continue
        driver, newline, devices = reply.message.partition("\n")
        if not newline:  # not this protocol's answer (an older shim refuses the ask)
            problems.append(
                f"{endpoint.describe()}: its STATUS reply has no driver line (a shim "
                "older than this engine?)"
            )
            continue
        try:
            gpus.append(parse_report(devices))
        except ValueError as exc:
            problems.append(f"{endpoint.describe()}: devices report refused: {exc}")
            continue
        ids.append(reply.participant)
        if driver:
            drivers[endpoint.observed_pid] = driver
    if problems:
        raise DetectionRefused(
            "a shim did not say which driver it loaded and which GPUs its process uses:",
            problems,
        )
    try:
        shared = DriverReport(drivers).one()
    except DriverMismatch as exc:
        raise DetectionRefused("suspend refused:", [f"{exc}: one suspend per driver"]) from None
    return _ShimReport(tuple(ids), shared, tuple(gpus))


def native_for(where: Where, processes: Sequence[Process | tuple[int, int]]) -> CudaBackend:
    """The native calls on the driver the processes' shims report (the command line's
    ``--driver auto``); none reporting, the loader's ``libcuda.so.1``."""
    endpoints = [where.endpoint(p) for p in group_of(processes)]
    try:
        return CudaBackend(shim_drivers(endpoints).one())
    except DriverMismatch as exc:
        raise NativeUnavailableError(f"{exc}: one driver per run") from exc


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
    native: NativeBackend | None = None,
    requested: bool = True,
    options: Options | None = None,
    lock_timeout_ms: int = DEFAULT_LOCK_TIMEOUT_MS,
    on_event: AgentCallback | None = None,
    logger: logging.Logger | None = None,
) -> SuspendResult:
    """Detect, capture (when requested), lock and checkpoint every process, write the
    manifest. On return every process is CHECKPOINTED and its GPU memory is free.

    ``native`` defaults to the driver the shims report (:func:`native_for`); the
    manifest records it with ``where``, for :func:`~.resumption.resume`.

    Raises :class:`DetectionRefused` or :class:`StateRefused` (nothing changed),
    :class:`~.errors.CoordinatorError` from the capture (rolled back by the runner
    when it had changed anything), or :class:`SuspendFailed` when a native step
    failed: what was done is undone first (``restored`` says whether it worked).
    """
    group = group_of(processes)
    directory = Path(checkpoint_dir)
    report = reporter(on_event, logger)
    options = options or Options()
    pids = [p.observed_pid for p in group]
    if native is None:
        native = native_for(where, group)
    require_trusted("suspend", directory)
    _fresh_directory(directory)
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
        shims = _ShimReport((), None, ((),) * len(group))
        if detection.mode == "cuinterpose":
            shims = _shim_report(detection.endpoints, options.phase_timeout)
        ids: tuple[str | None, ...] = shims.ids or (None,) * len(group)
        origin = Origin(
            str(where.control_dir),
            None if where.proc_root is None else str(where.proc_root),
            shims.driver,
            tuple(start_ticks(p.observed_pid, where.proc_root) for p in group),
        )
    prepared = False
    staging = None
    topology = None
    if detection.mode == "cuinterpose":
        from .runner import capture

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
    undo = _Undo(group, detection, directory, native, options, report, where)
    try:
        with report.step("native_lock"):
            run_step(native, "lock", pids, lock_timeout_ms=lock_timeout_ms)
        with report.step("native_checkpoint"):
            run_step(native, "checkpoint", pids)
        manifest = Manifest(
            requested,
            prepared,
            tuple(
                Participant(p.observed_pid, p.namespace_pid, i, g)
                for p, i, g in zip(group, ids, shims.gpus, strict=True)
            ),
            tuple(report.timings),
            utc_timestamp(),
            origin=origin,
        )
        path = write_manifest(directory, manifest)
    except NativeGroupError as failure:
        _undo(undo, list(failure.lines()))
    except (StateFileError, OSError) as failure:
        _undo(undo, [f"the manifest could not be written: {failure}"])
    freed = released(topology, staging, len(group))
    return SuspendResult(manifest, path, tuple(report.timings), staging, freed)


@attrs.frozen
class _Undo:
    """What the undo of a suspend needs: the group, how it was detected, where its
    state file is, and how the suspend reaches its processes and reports."""

    group: tuple[Process, ...]
    detection: Detection
    directory: Path
    native: NativeBackend
    options: Options
    report: Reporter
    where: Where


def _undo(undo: _Undo, lines: list[str]) -> NoReturn:
    """A native step of a suspend (or the manifest) failed: native restore and unlock what
    was done, then the coordinator restore; raise SuspendFailed with every step and every
    state. ``lines`` says what failed."""
    pids = [p.observed_pid for p in undo.group]
    with undo.report.step("undo_native"):
        lines += undo_suspend(undo.native, pids)
    now = state_names(undo.native, pids)
    back = all(s == ProcessState.RUNNING.name for s in now.values())
    if back and undo.detection.mode == "cuinterpose":
        from .runner import restore

        try:
            with undo.report.step("undo_coordinator_restore"):
                options = attrs.evolve(undo.options, on_progress=undo.report.emit)
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
    raise SuspendFailed("suspend failed:", lines, restored=back)
