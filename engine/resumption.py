"""``resume``: native restore and unlock of every process of the manifest, then the
coordinator restore when the manifest says prepared; the manifest marked resumed."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Final, NoReturn

import attrs

from . import discovery
from .detection import Where, group_of
from .directory import require_trusted
from .driver_trust import LateBackend, reported_or_recorded
from .errors import AgentError, CoordinatorError, Interrupted
from .events import AgentCallback, Reporter, bytes_moved, reporter
from .gpus import Gpu, GpuMap, GpuMapRefused, checkpointed, resolve, resolve_gpus
from .group_status import StateRefused, require_states, status_lines
from .lease import LeaseRefused, release_lease, take_lease
from .manifest import (
    MANIFEST_FILE_NAME,
    Manifest,
    ManifestError,
    Process,
    Timing,
    read_manifest,
    recover_hint,
    restore_plan,
    write_manifest,
)
from .native_checkpoint import (
    NativeBackend,
    NativeError,
    NativeGroupError,
    ProcessState,
    RemappingBackend,
    run_step,
    state_names,
)
from .options import Options
from .progress import StagingSummary
from .statefile import StateFileError, utc_timestamp
from .stored import (
    IDENTITY_FILE_NAME,
    StoreFailed,
    check_parts,
    fetch,
    recorded_identity,
    stored_files,
)
from .watch import CopyWatcher

# The runner and recovery (the machines, transitions) are imported where the coordinator
# restore or recover runs: the native restore alone of a native suspend runs no machine
# and loads none (tests/engine/test_import_cost.py).

# A shim answers STATUS at once (its control thread runs while the process is
# natively CHECKPOINTED, as on the H200): no need to wait a phase timeout for one.
_PREFLIGHT_S: Final = 10.0


class ResumeFailed(AgentError):
    """A resume failed; every process's native state and shim phase are in the lines.

    ``running`` says whether the group runs with its bytes (a coordinator restore
    rolled back); otherwise a native step ran, and ``cuinterpose recover`` (or
    ``restore``) is the way on."""

    def __init__(
        self, what: str, lines: Sequence[str], *, running: bool, lost: Sequence[Process] = ()
    ) -> None:
        super().__init__(what, lines, changed=True)
        self.running = running
        self.lost = tuple(lost)  # members gone since the suspend: the survivors came back


class ResumeStopped(AgentError):
    """A resume stopped on request (``Options.stop``) before its native restore: nothing
    was changed."""


@attrs.frozen
class ResumeResult:
    manifest: Manifest
    coordinator_restored: bool
    timings: tuple[Timing, ...]
    # What the shims loaded (None: nothing).
    staging: StagingSummary | None = None
    # Late steps that did not go through after the group ran (the directory is usable).
    warnings: tuple[str, ...] = ()
    # Resumed onto other GPUs (``gpu_map``): each process, the GPUs it left and those it
    # runs on now; () when the map was not given.
    moved: tuple[Moved, ...] = ()


@attrs.frozen
class GpuMove:
    """A GPU a process used at suspend (the manifest's) and the one of this node that
    took its place."""

    left: Gpu
    now: Gpu


@attrs.frozen
class Moved:
    """A process resumed onto other GPUs: each GPU it left and the one it runs on now."""

    pid: int
    ns_pid: int
    gpus: tuple[GpuMove, ...]

    def describe(self) -> str:
        who = Process(self.pid, self.ns_pid).describe()
        if not self.gpus:
            return f"{who} used no GPU at suspend: nothing moved"
        moves = "; ".join(f"left {m.left.describe()}, runs on {m.now.describe()}"
                          for m in self.gpus)  # fmt: skip
        return f"{who}: {moves}"


def _moved(
    manifest: Manifest, group: Sequence[Process], mapped: Sequence[tuple[Gpu, Gpu]]
) -> tuple[Moved, ...]:
    """Which GPU each process left and which it runs on now (``group``: the manifest's
    processes in its order, with the pids they have now)."""
    onto = {was.uuid: now for was, now in mapped}
    moved = []
    for p, part in zip(group, manifest.participants, strict=True):
        pairs = tuple(GpuMove(g, onto[g.uuid]) for g in part.gpus if g.uuid in onto)
        moved.append(Moved(p.observed_pid, p.namespace_pid, pairs))
    return tuple(moved)


def _way_back(
    group: Sequence[Process],
    states: Mapping[int, str],
    directory: Path,
    where: Where,
    prepared: bool,
) -> str:
    """The one command that takes a group stopped midway back: ``recover`` for a group
    captured (it needs the shims: it takes the native states back too); for a group
    checkpointed natively only, the native steps on the processes that need them."""
    if prepared:
        recover = recover_hint(directory, where.control_dir, where.proc_root)
        return f"bring it back with `{recover}` (it takes the native states back too)"
    checkpointed = [p for p in group if states[p.observed_pid] == ProcessState.CHECKPOINTED.name]
    held = [p for p in group if states[p.observed_pid] != ProcessState.RUNNING.name]
    steps = [
        *(f"`cuinterpose native --action restore {_named(p)}`" for p in checkpointed),
        *(f"`cuinterpose native --action unlock {_named(p)}`" for p in held),
    ]
    return (
        "a group checkpointed natively only has no shims for `cuinterpose recover`: bring "
        "it back running with " + ", then ".join(steps)
    )


def _named(process: Process) -> str:
    """The native verb's words for ``process``."""
    if process.observed_pid == process.namespace_pid:
        return f"--pid {process.observed_pid}"
    return f"--process {process.observed_pid} {process.namespace_pid}"


def _natively_checkpointed(
    native: NativeBackend,
    group: Sequence[Process],
    restored: bool,
    directory: Path,
    where: Where,
    prepared: bool = True,
) -> list[Process]:
    """The processes whose native restore and unlock are to come: all of them, each
    CHECKPOINTED; after a restore by CRIU, whose CUDA plugin (where installed) restores
    and unlocks by itself, those still CHECKPOINTED, the others RUNNING. A group of
    the manifest not all CHECKPOINTED but each RUNNING, LOCKED or CHECKPOINTED stopped
    midway (a resume or suspend whose coordinator was killed between or after its
    native steps): refused, naming the way back (``_way_back``)."""
    hint = "every process must be CHECKPOINTED by `cuinterpose suspend`"
    states = state_names(native, [p.observed_pid for p in group])
    if not restored:
        held = (ProcessState.RUNNING.name, ProcessState.LOCKED.name, ProcessState.CHECKPOINTED.name)
        found = {states[p.observed_pid] for p in group}
        if found <= set(held) and found != {ProcessState.CHECKPOINTED.name}:
            raise StateRefused(
                "resume refused, nothing was changed: the group is not as its suspend left "
                "it (a resume or suspend of it stopped midway, its coordinator gone):",
                [
                    *(f"{p.describe()} is natively {states[p.observed_pid]}" for p in group),
                    _way_back(group, states, directory, where, prepared),
                ],
            )
        require_states(native, group, ProcessState.CHECKPOINTED, "resume", hint)
        return list(group)
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


def _group(
    manifest: Manifest,
    directory: Path,
    processes: Sequence[Process | tuple[int, int]] | None,
    restored: bool,
    where: Where,
) -> tuple[Process, ...]:
    """The manifest's processes, checked against (or, after a restore, matched to)
    those given; the survivors alone may be given once the others are gone."""
    if manifest.resumed_at and not (restored and manifest.resumed_from_images):
        raise ManifestError(
            f"resume refused: the group in {directory} was resumed at {manifest.resumed_at}:",
            ["suspend it again first"],
        )
    group = manifest.processes()
    if processes is not None and restored:
        return _recreated(group, group_of(processes))
    given_set = set(group_of(processes)) if processes is not None else set(group)
    survivors = (  # a native-only group has no survivors' way (lost_members)
        manifest.requested
        and given_set < set(group)
        and all(_gone(manifest, p, where) for p in group if p not in given_set)
    )
    if processes is not None and given_set != set(group) and not survivors:
        given = ", ".join(p.describe() for p in group_of(processes))
        raise ManifestError(
            f"resume refused: the processes given are not the manifest's ({given})",
            [f"the manifest holds {p.describe()}" for p in group],
        )
    return group


def recorded_where(manifest: Manifest, directory: Path) -> Where:
    """Where the manifest says the group lives; a manifest of before issue 29 records
    nowhere, and the caller must say."""
    if manifest.origin is None:
        raise ManifestError(
            f"resume refused: the manifest in {directory} does not record where the group "
            "lives (suspended by an older cuinterpose):",
            ["name its control directory (--control-dir DIR, or where=Where(DIR))"],
        )
    origin = manifest.origin
    return Where(origin.control_dir, None if origin.proc_root is None else Path(origin.proc_root))


def _gone(manifest: Manifest, process: Process, where: Where) -> bool:
    """Whether the manifest's ``process`` is gone: its pid names no process, or another
    one (started at another time than the one suspended)."""
    started = manifest.origin.started if manifest.origin is not None else ()
    ticks = dict(zip(manifest.processes(), started, strict=False))
    return not discovery.same_process(process.observed_pid, ticks.get(process, 0), where.proc_root)


def lost_members(
    manifest: Manifest, group: Sequence[Process], where: Where, *, timeout: float = 10.0
) -> tuple[list[Process], list[str]]:
    """The processes gone since the suspend (a shim that does not answer, in a process
    that is gone), and a line for each living one whose shim does not answer (a wrong
    control directory: refused before anything changes). A native-only group has no
    shims to ask: its native states say (a gone process is refused by name there)."""
    if not manifest.requested:
        return [], []
    endpoints = {where.endpoint(p): p for p in group}
    silent = discovery.unanswered(list(endpoints), timeout=timeout)
    lost = [endpoints[e] for e in silent if _gone(manifest, endpoints[e], where)]
    return lost, [line for e, line in silent.items() if endpoints[e] not in lost]


def _preflight(
    manifest: Manifest, group: Sequence[Process], where: Where, timeout: float
) -> list[Process]:
    """What must hold before anything changes: the processes gone since the suspend
    (returned: the survivors come back without them), and a shim answering in every
    living one (a wrong control directory is refused here, not after the native restore)."""
    lost, silent = lost_members(manifest, group, where, timeout=timeout)
    if silent:
        recorded = (
            f"the manifest records the control directory {manifest.origin.control_dir}"
            if manifest.origin is not None
            else "the manifest records no control directory"
        )
        raise AgentError(
            "resume refused, nothing was changed: a process of the group is alive but "
            "its shim does not answer",
            [
                *silent,
                recorded,
                "give the directory its shims serve in (--control-dir DIR, or --proc-root); "
                f"`{_status_words(where, group)}` shows them",
            ],
        )
    if len(lost) == len(group):
        raise ManifestError(
            "resume refused: every process of the group is gone:",
            [f"{p.describe()}: no such process now" for p in group] + _elsewhere(manifest),
        )
    return lost


def _trusted_native(manifest: Manifest, group: Sequence[Process], where: Where) -> NativeBackend:
    """The native calls an agent gets by default: on the driver the shims report now (the
    manifest's record when none says), held to the driver trust rule
    (:mod:`.driver_trust`), chosen at the first native call: a refusal comes before
    anything changes, and nothing untrusted is loaded."""
    recorded = manifest.origin.driver if manifest.origin is not None else None

    def choose() -> str | None:
        endpoints = [where.endpoint(p) for p in group]
        return reported_or_recorded(endpoints, recorded, where.proc_root)

    return LateBackend(choose)


def resume(
    checkpoint_dir: Path,
    *,
    where: Where | None = None,
    native: NativeBackend | None = None,
    processes: Sequence[Process | tuple[int, int]] | None = None,
    restored: bool = False,
    gpu_map: GpuMap | None = None,
    options: Options | None = None,
    on_event: AgentCallback | None = None,
    logger: logging.Logger | None = None,
) -> ResumeResult:
    """Native restore and unlock of every process of the manifest, then the coordinator
    restore when it says prepared. On return every process is RUNNING with its bytes,
    VAs and sharing back.

    ``where`` and ``native`` default to what the manifest recorded at suspend (the
    control directory; the driver the shims report now, else the one recorded, loaded
    only if the coordinator trusts it: :mod:`.driver_trust`, else
    :class:`~.native_checkpoint.NativeUnavailableError` with nothing changed). Before
    anything changes, every living process's shim must answer (else
    :class:`AgentError`, nothing changed); a process gone since the suspend does not
    strand the others: the survivors are
    natively restored and unlocked, then rolled back to their bytes (the lost one named),
    and :class:`ResumeFailed` (``running``) says so.

    ``processes``, when given, must be the manifest's. With ``restored`` they are the
    processes a restore (CRIU) recreated: matched to the manifest's by namespace pid,
    their observed pids may be new, and those already natively RUNNING (restored and
    unlocked by CRIU's CUDA plugin) skip the native steps (specs/criu.md). Raises
    :class:`ManifestError` or :class:`StateRefused` (nothing changed),
    :class:`ResumeFailed` naming every process's native state and shim phase.

    ``gpu_map`` restores onto other GPUs (the native restore's gpuPairs, checked by
    every shim's LOAD): refused with :class:`~.gpus.GpuMapRefused` before anything
    changes when it does not fit the GPUs the manifest records and those here.
    """
    directory = Path(checkpoint_dir)
    report = reporter(on_event, logger)
    options = options or Options()
    require_trusted("resume", directory)
    manifest = read_manifest(directory)
    if where is None:
        where = recorded_where(manifest, directory)
    group = _group(manifest, directory, processes, restored, where)
    coordinate = restore_plan(manifest, directory)
    if native is None:
        native = _trusted_native(manifest, group, where)
    timeout = min(options.phase_timeout, _PREFLIGHT_S)
    lost = [] if restored else _preflight(manifest, group, where, timeout)
    if lost:
        return _survivors(manifest, directory, group, lost, where, native, options, report)
    if coordinate and stored_files(directory):
        _parts_fetchable(directory, manifest)
    held = _natively_checkpointed(native, group, restored, directory, where, manifest.prepared)
    pids = [p.observed_pid for p in held]
    mapped = gpu_pairs(manifest, native, gpu_map) if gpu_map else ()
    pairs = tuple((was.uuid, now.uuid) for was, now in mapped)
    if pids and not gpu_map:
        require_same_gpus(manifest, native)
    endpoints = [where.endpoint(p) for p in group]
    staging = None
    # The lease before the first native step: a stray HANDSHAKE cannot then make the
    # coordinator restore fail once the native restore ran (lease.py).
    token = None
    if pids and coordinate:
        try:
            token = take_lease(endpoints, options.phase_timeout)
        except LeaseRefused as refused:
            raise AgentError("resume refused, nothing was changed:", refused.lines()) from None
    if options.stop is not None and options.stop.is_set():  # a signal before any change
        if token is not None:
            release_lease(endpoints, token)
        raise ResumeStopped("resume stopped on request before its native restore:",
                            ["nothing was changed: the group is suspended as it was"])  # fmt: skip
    try:
        if pids:
            with report.step("native_restore"):
                run_step(native, "restore", pids, gpu_pairs=pairs)
            with report.step("native_unlock"):
                run_step(native, "unlock", pids)
        if coordinate and stored_files(directory):
            # A CRIU dump stored the staged bytes beside the images (engine/stored.py):
            # in memory again before LOAD. A shim that stored nothing answers at once.
            if token is not None:  # FETCH_STAGED carries no token: served while none holds
                release_lease(endpoints, token)
            with report.step("fetch_staged") as moved:
                got = fetch(directory, manifest, group, where=where, options=options,
                            missing_ok=True)  # fmt: skip
                moved.append(sum(f.bytes for f in got))
            if token is not None:  # again; a stray HANDSHAKE meanwhile is waited out
                token = take_lease(endpoints, options.phase_timeout, before="the LOAD")
        if coordinate:
            from .runner import restore

            ids = tuple(p.participant or "" for p in manifest.participants)
            with report.step("coordinator_restore") as moved:
                engine_options = attrs.evolve(options, on_progress=report.emit)
                if pids and options.stop is not None and options.stop.is_set():
                    # Asked to stop once the native restore ran: the group cannot be
                    # checkpointed again, and stopping here would leave it half done. It
                    # is brought back running: the restore goes on to its end.
                    engine_options = attrs.evolve(engine_options, stop=None)
                with CopyWatcher(list(zip(endpoints, ids, strict=True)), report.emit):
                    result = restore(endpoints, directory, engine_options, gpu_pairs=pairs,
                                     lease=token)  # fmt: skip
                moved.append(bytes_moved(result.phases))
                staging = StagingSummary.from_phases(result.phases)
    except (NativeGroupError, CoordinatorError, StoreFailed, LeaseRefused) as failure:
        if token is not None and not isinstance(failure, CoordinatorError):
            release_lease(endpoints, token)  # the restore machine releases its own
        lines = list(failure.lines())
        running = isinstance(failure, CoordinatorError) and failure.rolled_back
        if running:
            lines.append("rolled back: every process runs with the bytes it had at suspend")
        else:
            lines.append(
                "the native restore ran: the group is not as it was suspended, nor running "
                "with its bytes"
            )
        lines += [f"now {line}" for line in status_lines(group, where, native)]
        what = "resume stopped on request:" if isinstance(failure, Interrupted) else (
            "resume failed:")  # fmt: skip
        raise ResumeFailed(what, lines, running=running) from failure
    marked = mark_resumed(directory, manifest, from_images=restored)
    warnings = (*(result.warnings if coordinate else ()), *marked)
    onto = _moved(manifest, group, mapped) if gpu_map else ()
    return ResumeResult(manifest, coordinate, tuple(report.timings), staging, warnings, onto)


def _parts_fetchable(directory: Path, manifest: Manifest) -> None:
    """Refuse (:class:`StoreFailed`, nothing changed) a resume whose staged parts cannot be
    fetched, as far as that is known without reading their data (every part there,
    trusted, this dump's, of its size: :func:`~.stored.check_parts`), before the native
    restore, after which the group could no longer be left as it is."""
    ids = [p.participant for p in manifest.participants if p.participant]
    problems = check_parts(directory, ids)
    dumped = manifest.images.identity if manifest.images is not None else None
    recorded = None if problems else recorded_identity(directory)
    if dumped is not None and recorded is not None and recorded != dumped:
        problems.append(
            f"the staged parts in {directory} are of dump {recorded} ({IDENTITY_FILE_NAME}), "
            f"the images and the manifest of dump {dumped}: another dump's parts"
        )
    if problems:
        raise StoreFailed(
            f"resume refused: the staged bytes in {directory} cannot be fetched:",
            [*problems, "nothing was changed: put back the parts this checkpoint stored, "
             "then resume again"],
        )  # fmt: skip


def _survivors(
    manifest: Manifest,
    directory: Path,
    group: Sequence[Process],
    lost: Sequence[Process],
    where: Where,
    native: NativeBackend,
    options: Options,
    report: Reporter,
) -> NoReturn:
    """A member died while the group was suspended: the group cannot come back as it
    was; the survivors do (native restore and unlock, then recover: rolled back to the
    bytes they had, without what the lost ones held), and ResumeFailed says so."""
    living = [p for p in group if p not in lost]
    lines = [f"{p.describe()} is gone since the suspend: left out" for p in lost]
    pids = [p.observed_pid for p in _natively_checkpointed(native, living, False, directory,
                                                           where)]  # fmt: skip
    endpoints = [where.endpoint(p) for p in living]
    try:
        with report.step("native_restore"):
            run_step(native, "restore", pids)
        with report.step("native_unlock"):
            run_step(native, "unlock", pids)
        if manifest.prepared and stored_files(directory):
            with report.step("fetch_staged") as moved:  # the rollback needs them in memory
                got = fetch(directory, manifest, living, where=where, options=options,
                            missing_ok=True)  # fmt: skip
                moved.append(sum(f.bytes for f in got))
        if manifest.prepared:
            from .recovery import recover

            with report.step("coordinator_recover"):
                engine_options = attrs.evolve(options, on_progress=report.emit)
                recovered = recover(endpoints, directory, engine_options)
            lines += list(recovered.lines())
    except (NativeGroupError, CoordinatorError, StoreFailed) as failure:
        lines += list(failure.lines())
        lines.append("the survivors are not back")
        lines += [f"now {line}" for line in status_lines(living, where, native)]
        raise ResumeFailed("resume failed:", lines, running=False) from failure
    lines += list(mark_resumed(directory, manifest, from_images=False))
    lines += [f"now {line}" for line in status_lines(living, where, native)]
    lines.append(
        "the survivors run, with the bytes they had at suspend; what the lost processes "
        "held (their memory, and the sharing of it) is lost"
    )
    raise ResumeFailed("resume: a process of the group is gone:", lines, running=True, lost=lost)


def require_same_gpus(manifest: Manifest, native: NativeBackend) -> None:
    """A resume without ``--gpu-map`` goes back onto the GPUs of its suspend: refused
    before the native restore (nothing changed) when one of them is not here, naming
    the GPUs recorded, those here, and a mapping that would fit (ordinal to the same
    ordinal where there is one). A backend that cannot list the GPUs here is not
    checked: the shims' LOAD still refuses a GPU they never used."""
    old = checkpointed(p.gpus for p in manifest.participants)
    if not old or not isinstance(native, RemappingBackend):
        return
    try:
        here = native.gpus()
    except NativeError as exc:
        raise GpuMapRefused(
            "resume refused (nothing was changed): the GPUs here cannot be listed:",
            [str(exc), "the manifest records " + ", ".join(g.describe() for g in old)],
        ) from None
    uuids = {g.uuid for g in here}
    missing = [g for g in old if g.uuid not in uuids]
    if not missing:
        return
    lines = [
        *(f"{g.describe()} (recorded at suspend) is not here" for g in missing),
        "here: " + (", ".join(g.describe() for g in here) or "no GPU"),
    ]
    proposal = GpuMap(tuple((str(g.ordinal), str(g.ordinal)) for g in old))
    try:
        resolve(proposal, old, here)
        lines.append(f"to resume onto the GPUs here: --gpu-map {proposal.describe()}")
    except GpuMapRefused:
        lines.append("name a GPU here for each one recorded: --gpu-map OLD=NEW,...")
    raise GpuMapRefused(
        "resume refused (nothing was changed): the group was suspended on other GPUs:", lines
    )


def gpu_pairs(
    manifest: Manifest, native: NativeBackend | None, gpu_map: GpuMap
) -> tuple[tuple[Gpu, Gpu], ...]:
    """``gpu_map`` resolved against the GPUs the manifest records and those ``native``
    sees here (None: a restore without the native step, whose GPUs are the manifest's
    own); refused before anything changes (gpus.resolve)."""
    old = checkpointed(p.gpus for p in manifest.participants)
    if not old:
        raise GpuMapRefused(
            f"--gpu-map {gpu_map.describe()} refused (nothing was changed):",
            [
                "the manifest records no GPUs (a native-only group, or a suspend older than "
                "the GPU records): there is nothing to check the mapping against"
            ],
        )
    if native is None:
        here = old
    elif isinstance(native, RemappingBackend):
        here = native.gpus()
    else:
        raise GpuMapRefused(
            f"--gpu-map {gpu_map.describe()} refused (nothing was changed):",
            [f"the native backend {type(native).__name__} cannot restore onto other GPUs"],
        )
    return resolve_gpus(gpu_map, old, here)


def mark_resumed(directory: Path, manifest: Manifest, *, from_images: bool) -> tuple[str, ...]:
    """Record the resume in the manifest (``from_images``: after a restore from images,
    which stay restorable), or, when it cannot be written, remove the manifest, so that
    the directory takes a new suspend either way. Never raises: the group runs already."""
    try:
        marked = attrs.evolve(manifest, resumed_at=utc_timestamp(), resumed_from_images=from_images)
        write_manifest(directory, marked)
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


def _status_words(where: Where, group: Sequence[Process]) -> str:
    """The status command that shows ``group`` where ``where`` says it lives (with a proc
    root, status takes the processes by name: each control directory is its own)."""
    import shlex

    words = ["cuinterpose", "status"]
    if where.proc_root is not None:
        words += ["--proc-root", str(where.proc_root)]
    words += ["--control-dir", str(where.control_dir)]
    for p in group:
        words += ["--process", str(p.observed_pid), str(p.namespace_pid)]
    return shlex.join(words)


def _elsewhere(manifest: Manifest) -> list[str]:
    """Why every recorded pid may name nothing here: this coordinator runs in another pid
    namespace than the one that suspended the group (inside a pod, say), whose pids the
    manifest records."""
    recorded = manifest.origin.coordinator_pid_namespace if manifest.origin else 0
    here = discovery.pid_namespace(os.getpid())
    if not recorded or not here or recorded == here:
        return []
    return [
        f"this coordinator runs in another pid namespace (pid:[{here}]) than the one that "
        f"suspended the group (pid:[{recorded}]), whose pids the manifest records: run "
        "resume from there (the host, for a pod's processes)"
    ]
