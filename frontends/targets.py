"""Which processes a command acts on, and what is wrong with them before it starts.

The command line names them with ``--pid P`` (the same pid here and in its pid
namespace) or ``--process OBSERVED NS``; ``resume``, ``restore`` and ``recover`` take
them from the checkpoint directory when none is named (the manifest, else an
interrupted capture's intent, else the state file), and ``status`` lists every
shim of the control directory. What is at each process's socket (a pid that names no
process, a process without a shim) the engine's detection says, once
(``engine/detection.py`` ``look``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from .engine import discovery

# The manifest and the state file are read where a group is taken from them: a verb
# that names its processes, or status listing the control directory, loads neither
# (tests/engine/test_import_cost.py).
if TYPE_CHECKING:
    from .engine.statefile import CheckpointState

Pair = tuple[int, int]


class TargetError(Exception):
    """The processes could not be worked out: one line per fact."""

    def __init__(self, lines: Sequence[str], *, usage: bool = False) -> None:
        super().__init__(*lines)
        self.lines = tuple(lines)
        self.usage = usage


def named(pids: Sequence[int] | None, processes: Sequence[Sequence[int]] | None) -> list[Pair]:
    """The processes named on the command line, in order; a repeat is a usage error."""
    pairs: list[Pair] = [(p, p) for p in pids or ()]
    pairs += [(int(o), int(n)) for o, n in processes or ()]
    seen: set[Pair] = set()
    for pair in pairs:
        if pair in seen:
            text = f"--pid {pair[0]}" if pair[0] == pair[1] else f"--process {pair[0]} {pair[1]}"
            raise TargetError([f"{text} is given twice"], usage=True)
        seen.add(pair)
    return pairs


def from_checkpoint_dir(directory: Path) -> tuple[list[Pair], str] | None:
    """The group a checkpoint directory records and where it says so; None when it
    records none. The manifest, the intent and the state file name both pids (a
    version 1 state file or intent only the namespace pid: taken as the pid here too,
    unless the processes live in another pid namespace)."""
    from .engine.manifest import MANIFEST_FILE_NAME, read_manifest

    directory = Path(directory)
    if (directory / MANIFEST_FILE_NAME).exists():
        manifest = read_manifest(directory)
        return [(p.observed_pid, p.namespace_pid) for p in manifest.participants], str(
            directory / MANIFEST_FILE_NAME
        )
    from .engine.directory import read_intent
    from .engine.statefile import STATE_FILE_NAME, StateFileError, read_state

    state: CheckpointState | None = None
    source = ""
    try:
        state = read_intent(directory)
        source = "the interrupted capture's intent"
        if state is None and (directory / STATE_FILE_NAME).exists():
            state = read_state(directory)
            source = str(directory / STATE_FILE_NAME)
    except StateFileError as exc:
        raise TargetError([f"the group's record in {directory} is unreadable: {exc}"]) from None
    if state is None:
        return None
    return [p.pair() for p in state.participants], source


def resolve(
    given: list[Pair],
    checkpoint_dir: Path | None,
    *,
    proc_root: Path | None,
    control_dir: Path | None = None,
) -> list[Pair]:
    """``given``, else the checkpoint directory's group; a mismatch with the recorded
    group is refused, naming both. With ``control_dir``, a recorded process that runs
    but has no shim there is named as no participant of the group: one the record
    names extra."""
    try:
        recorded = from_checkpoint_dir(checkpoint_dir) if checkpoint_dir is not None else None
    except TargetError:
        if not given:
            raise
        # Named processes need no record: the run itself says what is wrong with it
        # (restore refuses the file by name; recover rolls the group back without it).
        recorded = None
    if given:
        # The survivors alone may be named once the others are gone (recover brings
        # them back: specs/recovery.md); anything else that differs is refused. A
        # recorded pid that names a process started since is gone.
        starts = recorded_starts(checkpoint_dir) if recorded is not None else {}

        def runs(pair: Pair) -> bool:
            return discovery.same_process(pair[0], starts.get(pair, 0), proc_root)

        survivors = (
            recorded is not None
            and set(given) < set(recorded[0])
            and all(discovery.is_running(observed, proc_root) for observed, _ in given)
            and not any(runs(pair) for pair in set(recorded[0]) - set(given))
        )
        if recorded is not None and set(given) != set(recorded[0]) and not survivors:
            raise TargetError(
                _not_the_group(given, recorded[0], recorded[1], runs, proc_root, control_dir)
            )
        return given
    if recorded is None:
        if checkpoint_dir is None:
            raise TargetError(["no process named: give --pid PID (or --process OBSERVED NS)"],
                              usage=True)  # fmt: skip
        raise TargetError(
            [f"{checkpoint_dir} records no group (no manifest, interrupted capture or state "
             "file: nothing was suspended or prepared into it); name the processes with "
             "--pid PID"])  # fmt: skip
    from .engine.statefile import STATE_FILE_NAME

    if (
        proc_root is not None
        and recorded[1].endswith(STATE_FILE_NAME)
        and _unpaired(checkpoint_dir)
    ):
        raise TargetError(
            ["the state file (version 1) holds namespace pids only: with --proc-root, name each "
             "process "
             "(--process OBSERVED NS)"], usage=True)  # fmt: skip
    return recorded[0]


def recorded_starts(directory: Path | None) -> dict[Pair, int]:
    """Each recorded process's start time (clock ticks; 0 or absent: not recorded), by
    pair: a recorded pid that names a process started at another time names another
    process now."""
    from .engine.manifest import MANIFEST_FILE_NAME, ManifestError, read_manifest

    if directory is None:
        return {}
    try:
        if (Path(directory) / MANIFEST_FILE_NAME).exists():
            manifest = read_manifest(directory)
            started = manifest.origin.started if manifest.origin is not None else ()
            pairs = [(p.observed_pid, p.namespace_pid) for p in manifest.participants]
            return dict(zip(pairs, started, strict=False))
        from .engine.directory import read_intent
        from .engine.statefile import STATE_FILE_NAME, read_state

        state = read_intent(directory)
        if state is None and (Path(directory) / STATE_FILE_NAME).exists():
            state = read_state(directory)
    except (ManifestError, OSError, ValueError):
        return {}
    return {} if state is None else {p.pair(): p.started for p in state.participants}


def _unpaired(checkpoint_dir: Path | None) -> bool:
    """Whether the state file records a participant by its namespace pid alone."""
    from .engine.statefile import StateFileError, read_state

    if checkpoint_dir is None:
        return False
    try:
        return any(not p.observed_pid for p in read_state(checkpoint_dir).participants)
    except StateFileError:
        return True


def _not_the_group(
    given: list[Pair],
    recorded: list[Pair],
    source: str,
    same: Callable[[Pair], bool],
    proc_root: Path | None,
    control_dir: Path | None = None,
) -> list[str]:
    """Why ``given`` is not the group ``source`` records: each recorded process not
    given (and whether it runs, or runs without a shim: extra), each given one not
    recorded, and what to name. ``same``: whether a recorded pair still names the
    process recorded."""
    runs = {pair: same(pair) for pair in recorded}
    extra = [
        pair
        for pair in recorded
        if pair not in given and runs[pair] and not _has_shim(pair, control_dir, proc_root)
    ]
    lines = [
        f"the processes given are not the group recorded in {source}:",
        f"given {describe(given)}",
        f"recorded {describe(recorded)}",
    ]
    lines += [
        f"recorded {describe([pair])} is not given: "
        + _whether_it_runs(pair, runs[pair], proc_root)
        + (f", with no shim in {control_dir}: no participant of the group, the record names "
           "it extra" if pair in extra else "")
        for pair in recorded
        if pair not in given
    ]  # fmt: skip
    lines += [f"{describe([pair])} is given but not recorded there" for pair in given
              if pair not in recorded]  # fmt: skip
    alive = [pair for pair in recorded if runs[pair]]
    hint = "name the recorded ones, or none (they are taken from there)"
    if extra:
        members = [pair for pair in recorded if pair not in extra]
        hint = (
            f"{source} names {describe(extra)} extra (no shim: not a process of the group, "
            f"the record edited or another group's): the group's processes in it are "
            f"{describe(members) or 'none'}; a capture to restore must be of the group, "
            "prepare it again"
        )
    elif alive and len(alive) < len(recorded):
        hint += f"; or only the survivors, {describe(alive)}, to leave the gone ones out"
    return [*lines, hint]


def _has_shim(pair: Pair, control_dir: Path | None, proc_root: Path | None) -> bool:
    """Whether a shim serves ``pair``'s socket (True when no control directory is known:
    nothing to tell)."""
    if control_dir is None:
        return True
    from .engine.client import endpoint_for

    path = endpoint_for(pair[0], pair[1], control_dir=control_dir, proc_root=proc_root).path
    return discovery.is_socket(path) and discovery.serves(path)


def _whether_it_runs(pair: Pair, same: bool, proc_root: Path | None) -> str:
    pid = pair[0]
    if same:
        return "it runs"
    if discovery.is_running(pid, proc_root):
        return "its pid names another process now, started since (it is gone)"
    if discovery.pid_exists(pid, proc_root):
        return "it exited (a zombie its parent has not reaped: it is gone)"
    return "no process has that pid (it is gone)"


def describe(pairs: Sequence[Pair]) -> str:
    return ", ".join(f"pid {o}" if o == n else f"pid {o} (ns pid {n})" for o, n in pairs)


def shims(control_dir: Path, proc_root: Path | None = None) -> list[Pair]:
    """Every shim of the control directory, as (pid, pid)."""
    if proc_root is not None:
        raise TargetError(
            ["with --proc-root, name the processes (--process OBSERVED NS): "
             "the control directories are each process's own"], usage=True)  # fmt: skip
    return [(p, p) for p in discovery.shims_in(control_dir)]
