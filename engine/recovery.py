"""``recover``: bring a group back to running from wherever a capture or restore left it.

Every process is asked its phase (HANDSHAKE changes nothing). Then:

- all ACTIVE and no interrupted capture recorded: nothing to do;
- all PREPARED with a completed capture's state file and no interrupted capture:
  roll forward, a restore (the native checkpoint was undone already, or never
  happened), when every participant of the state file answers; when one does not
  (it died between prepare and restore), roll the survivors back, naming it;
- anything else: roll back to ACTIVE with the staged bytes.

Before either, the staged bytes of every PREPARED process that stored them beside the
images (STORE_STAGED, engine/stored.py) and holds none in memory are fetched back from
the checkpoint directory (FETCH_STAGED: a shim that holds them answers at once): a
coordinator killed during or after the store, with or without a manifest, leaves them
there, and neither a restore nor a rollback runs without them.

Processes that are gone are left out and reported; the survivors are brought back.
"""

from __future__ import annotations

import shlex
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import attrs

from .client import Endpoint, ParticipantError
from .directory import INTENT_FILE_NAME, clear_intent
from .errors import CoordinatorError, Problem
from .manifest import Process
from .native_checkpoint import NativeBackend, ProcessState, state_names, undo_suspend
from .options import Options
from .runner import RestoreResult, RollbackResult, restore, rollback
from .statefile import STATE_FILE_NAME, StateFileError, read_state
from .steps import check_endpoints
from .wire import InFlight, Op, Phase, Reply, Request

Action = Literal["nothing", "restored", "rolled back"]
# How often a recover asks whether a store a dead coordinator sent is still running.
_BUSY_POLL_S = 0.05


@attrs.frozen
class ProcessBefore:
    """One process as recover found it: its phase, or why it did not answer."""

    endpoint: Endpoint
    participant: str | None
    phase: Phase | None
    problem: str | None

    def describe(self) -> str:
        who = self.endpoint.describe()
        if self.phase is None:
            return f"{who}: did not answer ({self.problem})"
        return f"{who}: participant {self.participant}, phase {self.phase.name}"


@attrs.frozen
class RecoveryReport:
    action: Action
    before: tuple[ProcessBefore, ...]
    result: RestoreResult | RollbackResult | None
    left_out: tuple[str, ...] = ()  # the capture's participants not brought back

    def lines(self) -> tuple[str, ...]:
        lines = [f"found {p.describe()}" for p in self.before]
        lines.append(f"recover: {self.action}")
        if isinstance(self.result, RollbackResult):
            lines += [f"left out (gone) {g}" for g in self.result.gone]
            lines += [f"lost {line}" for line in self.result.lost]
        lines += list(self.left_out)
        return tuple(lines)


def native_check_refusal(command: str, why: object) -> tuple[str, ...]:
    """Why ``command`` refuses when no driver can tell it every process's native state:
    a process still natively checkpointed would be wedged by it (fail closed)."""
    return (
        f"{command} refused: the native state of the processes cannot be checked: {why}",
        "a process natively LOCKED or CHECKPOINTED would be left unreachable by this run; "
        "nothing was changed",
        "load the driver the processes run on (LD_LIBRARY_PATH), or pass --skip-native-check "
        "if you know every process is natively RUNNING",
    )


class NativeStuck(Exception):
    """``recover``'s native restore and unlock left a process natively held: one line
    per fact (what ran, what each process is now)."""

    def __init__(self, lines: Sequence[str]) -> None:
        super().__init__(*lines)
        self.lines = tuple(lines)


def native_back(native: NativeBackend, endpoints: Sequence[Endpoint]) -> tuple[str, ...]:
    """Bring every process natively RUNNING from any mix of RUNNING, LOCKED and
    CHECKPOINTED (a suspend or resume stopped between its native steps): the native
    restore of the CHECKPOINTED ones, then the unlock of the LOCKED ones, each process
    on its own. The lines say what ran (none: nothing was held); :class:`NativeStuck`
    when a process is still held after it. Gone or unknown ones are left to the survey."""
    held = [e.observed_pid for e in _natively_held(native, endpoints)]
    if not held:
        return ()
    done = undo_suspend(native, held)
    lines = tuple(f"native: {line}" for line in done)
    still = _natively_held(native, endpoints)
    if still:
        states = state_names(native, [e.observed_pid for e in still])
        raise NativeStuck(
            [
                *lines,
                *(f"{e.describe()} is still natively {states[e.observed_pid]}" for e in still),
            ]
        )
    return lines


def _natively_held(native: NativeBackend, endpoints: Sequence[Endpoint]) -> list[Endpoint]:
    states = state_names(native, [e.observed_pid for e in endpoints])
    held = (ProcessState.LOCKED.name, ProcessState.CHECKPOINTED.name)
    return [e for e in endpoints if states[e.observed_pid] in held]


def survey(endpoints: Sequence[Endpoint], options: Options) -> tuple[ProcessBefore, ...]:
    """Every process's phase, from a HANDSHAKE; one that does not answer says why."""
    results = options.transport(
        [(e, Request(Op.HANDSHAKE), None) for e in endpoints], timeout=options.phase_timeout
    )
    found: list[ProcessBefore] = []
    for endpoint, result in zip(endpoints, results, strict=True):
        if isinstance(result, ParticipantError):
            found.append(ProcessBefore(endpoint, None, None, result.reason))
        else:
            assert isinstance(result, Reply)
            found.append(ProcessBefore(endpoint, result.participant, result.phase, None))
    return tuple(found)


def recover(
    endpoints: Sequence[Endpoint],
    checkpoint_dir: Path,
    options: Options | None = None,
    *,
    gpu_pairs: Sequence[tuple[str, str]] = (),
) -> RecoveryReport:
    """Bring the group back to running; raises as :func:`~.runner.rollback` does.
    ``gpu_pairs``: the GPUs a native restore put the processes on, for a restore
    forward (:func:`~.runner.restore`); a rollback never left its GPUs."""
    check_endpoints(endpoints)
    options = options or Options()
    directory = Path(checkpoint_dir)
    before = survey(endpoints, options)
    phases = _phases(before)
    interrupted = (directory / INTENT_FILE_NAME).exists()
    if phases == {Phase.ACTIVE}:
        if interrupted:
            clear_intent(directory)
        return RecoveryReport("nothing", before, None)
    try:
        _fetch_stored(endpoints, directory, options, before)
        return _bring_back(endpoints, directory, options, before, interrupted, gpu_pairs)
    except CoordinatorError as error:
        if not error.destroyed and interrupted:
            error.problems = (*error.problems, _intent_stays(directory))
        raise


def _bring_back(
    endpoints: Sequence[Endpoint],
    directory: Path,
    options: Options,
    before: Sequence[ProcessBefore],
    interrupted: bool,
    gpu_pairs: Sequence[tuple[str, str]],
) -> RecoveryReport:
    if (
        _phases(before) == {Phase.PREPARED}
        and not interrupted
        and (directory / STATE_FILE_NAME).exists()
    ):
        missing = _not_answering(directory, before)
        if not missing:
            restored = restore(endpoints, directory, options, gpu_pairs=gpu_pairs)
            return RecoveryReport("restored", tuple(before), restored)
        # A participant of the capture died (or is not given): the group cannot be
        # restored as captured, and the survivors go back to ACTIVE with their bytes.
        result = rollback(endpoints, directory, options)
        return RecoveryReport("rolled back", tuple(before), result, missing)
    return RecoveryReport("rolled back", tuple(before), rollback(endpoints, directory, options))


def _fetch_stored(
    endpoints: Sequence[Endpoint],
    directory: Path,
    options: Options,
    before: Sequence[ProcessBefore],
) -> None:
    """FETCH_STAGED to every PREPARED process whose parts the directory holds (the shim
    checks them all, and every stripe's sum as it reads); CoordinatorError (step
    FETCH_STAGED, nothing changed: the bytes stay in the files) when one cannot be."""
    from .stored import StoreFailed, fetch_pairs, parts_of

    reach = {Process(e.observed_pid, e.namespace_pid): e for e in endpoints}
    pairs: list[tuple[Process, str]] = []
    try:
        for b in before:
            if b.phase is Phase.PREPARED and b.participant and parts_of(directory, b.participant):
                pairs.append((Process(b.endpoint.observed_pid, b.endpoint.namespace_pid),
                              b.participant))  # fmt: skip
        if pairs:
            _stores_done([reach[p] for p, _ in pairs], [i for _, i in pairs], options)
            # No precheck: a shim the dead coordinator never sent its STORE still holds
            # its bytes (its parts empty) and reads nothing; one that stored checks all.
            fetch_pairs(directory, pairs, where=reach.__getitem__, options=options, precheck=False)
    except StoreFailed as failed:
        raise CoordinatorError(
            "recover", "FETCH_STAGED", [Problem(line) for line in failed.lines()]
        ) from None


_FILE_OPS = frozenset({Op.STORE_STAGED, Op.FETCH_STAGED})


def _stores_done(endpoints: Sequence[Endpoint], ids: Sequence[str], options: Options) -> None:
    """Wait, for at most the phase timeout, until no shim runs a STORE_STAGED or
    FETCH_STAGED (one a dead coordinator sent runs to its end in the shim: its files are
    complete only then). Past the timeout, the FETCH that follows says which is busy."""
    deadline = time.monotonic() + options.phase_timeout
    calls = [(e, Request(Op.STATUS, participant=i), i) for e, i in zip(endpoints, ids, strict=True)]
    while time.monotonic() < deadline:
        replies = options.transport(calls, timeout=options.phase_timeout)
        busy = [
            r for r in replies
            if isinstance(r, Reply) and InFlight.from_stats(r.stats).op in _FILE_OPS
        ]  # fmt: skip
        if not busy:
            return
        threading.Event().wait(_BUSY_POLL_S)


def _phases(before: Sequence[ProcessBefore]) -> set[Phase | None]:
    return {p.phase for p in before}


def _intent_stays(directory: Path) -> Problem:
    """What a recover refused (nothing changed) says of the interrupted capture's intent
    it leaves as it found it: another coordinator (another directory's recover) may be
    bringing the group back meanwhile, and the intent is then stale."""
    return Problem(
        f"{directory / INTENT_FILE_NAME} (the interrupted capture) is left as it was: once "
        f"the other coordinator is done, run `cuinterpose recover --checkpoint-dir "
        f"{shlex.quote(str(directory))}` again (with the same processes): it removes the "
        "intent if the group runs, or brings the group back"
    )


def _not_answering(directory: Path, before: Sequence[ProcessBefore]) -> tuple[str, ...]:
    """Why the state file cannot be restored as captured: its participants that no
    process answered as, or its own problem; one line each (none: restore it)."""
    try:
        state = read_state(directory)
    except StateFileError as exc:
        return (f"the state file cannot be restored from ({exc}): rolled back instead",)
    answered = {p.participant for p in before if p.participant}
    return tuple(
        f"participant {p.participant} (pid {p.pid} at capture): in the state file, and no "
        "given process answers as it (gone, or not given): left out"
        for p in state.participants
        if p.participant not in answered
    )
