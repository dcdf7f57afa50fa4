"""Fault injection on real shims over the simulated driver (specs/recovery.md).

Every case ends with the group running again with every byte at its address and
the sharing live (where a participant was killed: the survivor running with its
bytes), and with a report that says what happened. The team is the smallest one
that shares: a creator and an importer of one allocation.

- The coordinator is killed (SIGKILL, nothing cleaned up) right after each phase
  of capture and of restore; ``cuinterpose recover`` then brings the group back.
- A participant is killed right after each phase: the coordinator's next op
  finds it gone, and the run rolls the survivor back by itself.
- The state file cannot be written (no space at the rename) after the last
  teardown: the capture rolls back. A FIFO or a directory under the state file's
  or the intent's name is refused before anything changes, never waited on.

SIGINT in the middle of a phase is tested with fake participants
(tests/engine/test_cli.py): the signal has to land while an op is in flight.

Every wait is on an observable state: the coordinator's progress events and the
workers' own exits; no sleeps.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from cuinterpose.demo import Worker, coordinator_env, pattern_digest
from cuinterpose.engine import (
    OpEvent,
    Options,
    StepFailed,
    capture,
    endpoint_for,
    restore,
)
from cuinterpose.engine import directory as checkpoint_directory
from cuinterpose.engine.progress import Event

from tests.shim import shimenv
from tests.shim.pair import Pair, running_as_before, share
from tests.shim.workers.cycle import assert_still_active, cli
from tests.simenv import Spawn

SEED = 83
KILLED_COORDINATOR = Path(__file__).parent / "workers" / "killed_coordinator.py"

CAPTURE_BOUNDARIES = [
    ("capture", phase, 1)
    for phase in (
        "HANDSHAKE",
        "INSPECT",
        "QUIESCE",
        "PREPARE_MULTICAST",
        "SAVE_ALLOCATIONS",
        "PREPARE_UNICAST",
    )
]
RESTORE_BOUNDARIES = [
    ("restore", "HANDSHAKE", 1),
    ("restore", "INSPECT", 1),
    ("restore", "LOAD_ALLOCATIONS", 1),
    ("restore", "RESTORE_UNICAST", 1),
    ("restore", "RESTORE_MULTICAST_CREATORS", 1),
    ("restore", "RESTORE_MULTICAST_IMPORTERS", 1),
    ("restore", "RESTORE_MULTICAST_DEVICES", 1),
    ("restore", "RESTORE_MULTICAST_BINDINGS", 1),
    ("restore", "INSPECT", 2),
]


def _ckpt(tmp_path: Path) -> Path:
    path = tmp_path / "checkpoint"  # where workers.cycle.cli puts it
    path.mkdir(exist_ok=True)
    return path


def _endpoints(control_dir: Path, workers: list[Worker]) -> list:  # type: ignore[type-arg]
    return [endpoint_for(w.pid, w.pid, control_dir=control_dir) for w in workers]


def _recover(pair: Pair, control_dir: Path, tmp_path: Path) -> str:
    """``cuinterpose recover`` for the pair; its report (stdout) once it succeeded."""
    argv = [sys.executable, "-m", "cuinterpose", "recover", "--checkpoint-dir"]
    argv += [str(_ckpt(tmp_path)), "--control-dir", str(control_dir), "--progress", "none"]
    for pid in pair.pids:
        argv += ["--process", str(pid), str(pid)]
    env = shimenv.coordinator_cli_env(control_dir)  # recover checks the native states
    run = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout


def _kill_after(machine: str, phase: str, victim: Worker) -> Options:
    """Options whose progress callback kills ``victim`` once ``phase`` completed."""

    def on_progress(event: Event) -> None:
        ours = isinstance(event, OpEvent) and (event.machine, event.phase) == (machine, phase)
        if ours and not victim.closed:
            victim.kill()  # returns once the process is reaped

    return Options(60.0, on_progress=on_progress)


# -- the coordinator killed at every boundary, then recover --------------------------------


@pytest.mark.parametrize(
    ("machine", "phase", "occurrence"),
    CAPTURE_BOUNDARIES + RESTORE_BOUNDARIES,
    ids=[f"{m}-{p}-{n}" for m, p, n in CAPTURE_BOUNDARIES + RESTORE_BOUNDARIES],
)
def test_a_killed_coordinator_is_recovered(
    spawn: Spawn,
    shim_env: dict[str, str],
    control_dir: Path,
    tmp_path: Path,
    machine: str,
    phase: str,
    occurrence: int,
) -> None:
    pair = share(spawn, shim_env, SEED)
    if machine == "restore":
        prepared = cli("prepare", pair.pids, control_dir, tmp_path)
        assert prepared.returncode == 0, prepared.stderr
    argv = [sys.executable, str(KILLED_COORDINATOR), machine, phase, str(occurrence)]
    argv += [str(_ckpt(tmp_path)), str(control_dir), *map(str, pair.pids)]
    killed = subprocess.run(
        argv, env=coordinator_env(), capture_output=True, text=True, timeout=120, check=False
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr

    report = _recover(pair, control_dir, tmp_path)
    # The report names every process as found, and what was done.
    for pid in pair.pids:
        assert f"found pid {pid}" in report, report
    expected = {"nothing", "restored", "rolled back"}
    assert any(f"recover: {action}" in report for action in expected), report
    running_as_before(pair, write_seed=SEED + 7)


# -- a participant killed after each phase ------------------------------------------------


@pytest.mark.parametrize("phase", ["HANDSHAKE", "INSPECT", "PREPARE_MULTICAST", "SAVE_ALLOCATIONS"])
def test_an_importer_killed_during_capture_leaves_the_creator_running(
    spawn: Spawn, shim_env: dict[str, str], control_dir: Path, tmp_path: Path, phase: str
) -> None:
    pair = share(spawn, shim_env, SEED)
    endpoints = _endpoints(control_dir, [pair.creator, pair.importer])
    with pytest.raises(StepFailed) as caught:
        capture(endpoints, _ckpt(tmp_path), _kill_after("capture", phase, pair.importer))
    error = caught.value
    assert str(pair.importer.pid) in str(error)
    if error.destroyed:  # past the first destructive op: rolled back without the dead one
        assert error.rolled_back, error.rollback_error
    assert_still_active(pair.creator, pair.handle, pair.va, pair.size, SEED)
    pair.creator.close_clean()


@pytest.mark.parametrize("phase", ["HANDSHAKE", "INSPECT", "LOAD_ALLOCATIONS", "RESTORE_UNICAST"])
def test_an_importer_killed_during_restore_leaves_the_creator_running(
    spawn: Spawn, shim_env: dict[str, str], control_dir: Path, tmp_path: Path, phase: str
) -> None:
    pair = share(spawn, shim_env, SEED)
    endpoints = _endpoints(control_dir, [pair.creator, pair.importer])
    capture(endpoints, _ckpt(tmp_path), Options(60.0))
    with pytest.raises(StepFailed) as caught:
        restore(endpoints, _ckpt(tmp_path), _kill_after("restore", phase, pair.importer))
    assert str(pair.importer.pid) in str(caught.value)
    if not caught.value.rolled_back:  # failed before anything changed: recover brings it back
        report = _recover(pair, control_dir, tmp_path)
        assert "recover: rolled back" in report and "left out (gone)" in report, report
    assert_still_active(pair.creator, pair.handle, pair.va, pair.size, SEED)
    pair.creator.close_clean()


@pytest.mark.parametrize("phase", ["HANDSHAKE", "INSPECT", "PREPARE_MULTICAST"])
def test_a_creator_killed_before_its_bytes_are_saved_leaves_the_importer_running(
    spawn: Spawn, shim_env: dict[str, str], control_dir: Path, tmp_path: Path, phase: str
) -> None:
    """The importer never tore its import down: its mapping keeps the memory alive."""
    pair = share(spawn, shim_env, SEED)
    endpoints = _endpoints(control_dir, [pair.creator, pair.importer])
    with pytest.raises(StepFailed) as caught:
        capture(endpoints, _ckpt(tmp_path), _kill_after("capture", phase, pair.creator))
    assert str(pair.creator.pid) in str(caught.value)
    if caught.value.destroyed:
        assert caught.value.rolled_back, caught.value.rollback_error
    importer = pair.importer
    assert importer.digest(pair.importer_va, pair.size) == pattern_digest(SEED, pair.size)
    importer.close_clean()


# -- the state file cannot be written ------------------------------------------------------


def test_no_space_for_the_state_file_rolls_the_capture_back(
    spawn: Spawn,
    shim_env: dict[str, str],
    control_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pair = share(spawn, shim_env, SEED)
    real_rename = os.rename

    def full(src: object, dst: object, *args: object, **kwargs: object) -> None:
        if str(dst).endswith("cuinterpose.state"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_rename(src, dst, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(checkpoint_directory.os, "rename", full)
    endpoints = _endpoints(control_dir, [pair.creator, pair.importer])
    with pytest.raises(StepFailed) as caught:
        capture(endpoints, _ckpt(tmp_path), Options(60.0))
    assert caught.value.step == "WRITE_STATE"
    assert "No space left on device" in str(caught.value)
    assert caught.value.rolled_back, caught.value.rollback_error
    assert not (_ckpt(tmp_path) / "cuinterpose.intent").exists()
    running_as_before(pair, write_seed=SEED + 7)


@pytest.mark.parametrize("name", ["cuinterpose.state", "cuinterpose.intent"])
@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_blocking_path_at_the_state_file_is_refused_before_anything_changes(
    spawn: Spawn, shim_env: dict[str, str], control_dir: Path, tmp_path: Path, name: str, kind: str
) -> None:
    pair = share(spawn, shim_env, SEED)
    planted = _ckpt(tmp_path) / name
    if kind == "fifo":
        os.mkfifo(planted)
    else:
        planted.mkdir()
    run = cli("prepare", pair.pids, control_dir, tmp_path, timeout_s=60)
    assert run.returncode == 1, run.stderr
    assert "is not a regular file" in run.stderr, run.stderr
    sent = {e.get("phase") for e in run.events if e.get("event") == "phase"}
    assert sent <= {"HANDSHAKE", "QUIESCE", "INSPECT"}, sent  # the gate reopened at the end
    running_as_before(pair, write_seed=SEED + 7)
