"""Private allocations staged like shared ones (issue 19), simulated driver.

A process's private VMM allocations are its own to save: SAVE_ALLOCATIONS copies them,
PREPARE_UNICAST unmaps and releases them (the device memory is free while prepared, so
the native checkpoint has nothing of them to move), LOAD_ALLOCATIONS re-creates them
with their properties (handle types, location) at their VAs with their access. The
shapes: a mapped allocation whose handle the application keeps; one whose handle it
released (only the mapping holds it, as the shim's own cudaMalloc memory will be) and
that cannot be exported; one mapped twice with different access per device; one that
the application maps read-only (copied through a temporary mapping). Then the same
with ``SNAPSHOT_SHIM_STAGE_PRIVATE=0`` (left to the native checkpoint, reported only
in INSPECT's stats), a rollback from every point a capture or restore can stop at,
and the state file and topology of a ``cuinterpose suspend``/``resume`` through the
CLI.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from cuinterpose.demo import Worker
from cuinterpose.engine import statefile, wire

from tests import simenv, snippet
from tests.shim import shimenv
from tests.shim.test_control import (
    CAPTURE,
    RESTORE,
    Shim,
    app_still_works,
    native_checkpoint_restore,
)
from tests.shim.test_rollback import POINTS, Team, interrupt
from tests.simenv import Spawn

Op, Phase, K, F = wire.Op, wire.Phase, wire.RecordKind, wire.RecordFlag

# In the worker: four private allocations, filled; P lists (name, va, size, seed) of a
# read-write mapping of each, PV what to check after the cycle.
PRIVATE = snippet.load(__file__, "private")
PRIVATE_COUNT = 4


def private_worker(
    spawn: Spawn, extra: dict[str, str] | None = None, seed: int = 500
) -> tuple[Worker, int]:
    """A worker holding the private allocations; (worker, their bytes)."""
    w = spawn(extra=extra)
    w(f"SEED = {seed}")
    return w, int(w(PRIVATE))


def observer(spawn: Spawn, namespace: str) -> Worker:
    """A process without the shim on the same simulated devices: device-wide memory use."""
    return spawn("observer", simenv.sim_env(namespace=namespace), setup=shimenv.WORKER_SETUP)


USED = snippet.load(__file__, "used")


def used(obs: Worker) -> int:
    """Device memory in use on both simulated devices, by every process."""
    return int(obs(USED))


EXPECTED_STATE = {
    "bytes": [True] * PRIVATE_COUNT,
    # Handle types and the device each was created on, as the driver reports them.
    "props": [[1, 0], [0, 0], [1, 1], [1, 0]],
    # c: read-write for both devices at vc, read-only for device 0 and none for device 1
    # at vc2; d: read-only.
    "access": [3, 3, 1, 0, 1],
}


@pytest.mark.parametrize("stage", ["staged", "left-to-native"])
def test_private_allocations_cycle(
    spawn: Spawn, control_dir: Path, sim_namespace: str, stage: str
) -> None:
    staged = stage == "staged"
    extra = {} if staged else {"SNAPSHOT_SHIM_STAGE_PRIVATE": "0"}
    w, total = private_worker(spawn, extra)
    assert w("result = state()") == EXPECTED_STATE
    obs = observer(spawn, sim_namespace)
    s = Shim(control_dir, w.pid)
    inspected = s.ok(Op.INSPECT)
    allocations = [r for r in inspected.records if r.kind is K.ALLOCATION]
    if staged:
        # Reported as topology: the creator saves them (CONTENT); b has no handle left.
        assert len(allocations) == PRIVATE_COUNT
        assert {r.flags for r in allocations} == {
            F.CREATOR | F.CONTENT | F.HANDLE_LIVE,
            F.CREATOR | F.CONTENT,
        }
        assert sorted(r.handle_types for r in allocations) == [0, 1, 1, 1]
        assert sum(r.size for r in allocations) == total
        assert len([r for r in inspected.records if r.kind is K.MAPPING]) == PRIVATE_COUNT + 1
        assert (inspected.stats.count, inspected.stats.bytes) == (0, 0)
    else:
        # Not topology: the native checkpoint keeps them; INSPECT says how much.
        assert inspected.records == ()
        assert (inspected.stats.count, inspected.stats.bytes) == (PRIVATE_COUNT, total)
    before = used(obs)
    for op in CAPTURE:
        reply = s.ok(op)
        if op == Op.SAVE_ALLOCATIONS:
            moved = (PRIVATE_COUNT, total) if staged else (0, 0)
            assert (reply.stats.count, reply.stats.bytes) == moved
    # Prepared: staged, the device memory is free (the native checkpoint moves none of
    # it); left to the native checkpoint, it is all still there.
    assert before - used(obs) == (total if staged else 0)
    assert s.ok(Op.INSPECT).records == inspected.records  # what a restore compares
    assert native_checkpoint_restore(spawn, sim_namespace, [w.pid]) == [2]
    for op in RESTORE:
        reply = s.ok(op)
        if op == Op.LOAD_ALLOCATIONS:
            moved = (PRIVATE_COUNT, total) if staged else (0, 0)
            assert (reply.stats.count, reply.stats.bytes) == moved
    assert s.ok(Op.HANDSHAKE).phase == Phase.ACTIVE
    assert used(obs) == before
    # Every byte at its VA, every allocation with its handle types, device and access.
    assert w("result = state()") == EXPECTED_STATE
    assert s.ok(Op.INSPECT).records == inspected.records
    # The application carries on: its handles and mappings are the same.
    w("fill(P[0][1], P[0][2], 7); check(cu.cuMemUnmap(P[0][1], P[0][2]))")
    w("check(cu.cuMemMap(P[0][1], P[0][2], 0, H['a'], 0)); check(access(P[0][1], P[0][2]))")
    assert w("result = digest(P[0][1], P[0][2]) == expected(7, P[0][2])")
    app_still_works(w)
    obs.close_clean()
    w.close_clean()


def private_team(spawn: Spawn, control_dir: Path) -> Team:
    """c: the private allocations and X, exported and imported by i1; i1 and i2 each a
    private allocation of their own (i2's handle released)."""
    c, _ = private_worker(spawn, seed=600)
    c(
        """
H['X'] = check(cu.cuMemCreate(2 * gran, prop(), 0))
vx = map_rw(H['X'], 2 * gran)
fill(vx, 2 * gran, 650)
P.append(('X', vx, 2 * gran, 650))
send_fd(export(H['X']))
"""
    )
    cap = c.take_fd()
    i1, i2 = spawn("i1"), spawn("i2")
    i1.give_fd(cap)
    i1(
        """
fd = recv_fd(); hx = import_fd(fd); os.close(fd)
P = [('X', map_rw(hx, 2 * gran), 2 * gran, 650)]
H['q'] = check(cu.cuMemCreate(gran, prop(), 0))
P.append(('q', map_rw(H['q'], gran), gran, 660))
"""
    )
    i2(
        """
h = check(cu.cuMemCreate(2 * gran, prop(ht=0), 0))
P = [('r', map_rw(h, 2 * gran), 2 * gran, 670)]
check(cu.cuMemRelease(h))
"""
    )
    for w in (i1, i2):
        w("fill(P[-1][1], P[-1][2], P[-1][3])")
    os.close(cap)
    return Team(control_dir, [c, i1, i2])


def intact(w: Worker) -> bool:
    return bool(
        w("result = all(digest(va, size) == expected(seed, size) for _, va, size, seed in P)")
    )


@pytest.mark.parametrize("point", POINTS)
def test_rollback_brings_private_allocations_back(
    spawn: Spawn, control_dir: Path, point: str
) -> None:
    team = private_team(spawn, control_dir)
    before = team.inspect()
    c = team.workers[0]
    interrupt(team, point)
    loaded = team.ok(Op.ROLLBACK_ALLOCATIONS)
    # What each re-creates: c its four private allocations and X, i1 q, i2 r; only
    # those that PREPARE_UNICAST had torn down.
    torn = {
        "prepared": (True, True, True),
        "split-creator": (True, False, False),
        "split-importers": (False, True, True),
    }.get(point, (False, False, False))
    want = [(PRIVATE_COUNT + 1, 1, 1)[k] if torn[k] else 0 for k in range(3)]
    assert [r.stats.count for r in loaded] == want
    assert team.ok(Op.ROLLBACK_IMPORTS) and team.phases() == [Phase.ACTIVE] * 3
    for w in team.workers:
        assert intact(w), w.name
    now = c("result = state()")
    assert now["props"][:PRIVATE_COUNT] == EXPECTED_STATE["props"]
    assert now["access"] == EXPECTED_STATE["access"]
    assert team.inspect() == before
    # Sharing is live again: the importer's write is seen by the creator.
    team.workers[1]("fill(P[0][1], P[0][2], 690)")
    assert c("result = digest(vx, 2 * gran) == expected(690, 2 * gran)")
    for w in team.workers:
        app_still_works(w)


@pytest.mark.parametrize("stage", ["staged", "left-to-native"])
def test_state_file_and_topology_with_private_allocations(
    spawn: Spawn, control_dir: Path, sim_namespace: str, tmp_path: Path, stage: str
) -> None:
    """``cuinterpose suspend`` and ``resume`` of a process holding only private memory:
    the state file records each allocation and mapping (CREATOR, CONTENT), the summary
    says what the shim staged and that nothing it tracks was left to the native
    checkpoint, and the restore verifies the same topology. Left to the native
    checkpoint: no records, nothing staged, the summary says how much it kept."""
    staged = stage == "staged"
    extra = {} if staged else {"SNAPSHOT_SHIM_STAGE_PRIVATE": "0"}
    w, total = private_worker(spawn, extra, seed=700)
    ckpt = tmp_path / "ckpt"
    # The coordinator CLI as the other tests run it (on every build, TSan's too).
    env = shimenv.coordinator_cli_env(control_dir)
    env.pop("SNAPSHOT_CONTROL_DIR", None)
    common = ["--checkpoint-dir", str(ckpt), "--control-dir", str(control_dir)]
    common += ["--process", str(w.pid), str(w.pid)]

    def run(command: str, progress: str = "json") -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            [sys.executable, "-m", "cuinterpose", command, *common, "--progress", progress],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        return done

    def events(done: subprocess.CompletedProcess[str]) -> list[dict[str, Any]]:
        return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]

    suspended = events(run("suspend"))
    state = statefile.read_state(ckpt)
    (participant,) = state.topology.participants
    allocations = [r for r in participant.records if r.kind is K.ALLOCATION]
    assert len(allocations) == (PRIVATE_COUNT if staged else 0)
    assert all(F.CREATOR in r.flags and F.CONTENT in r.flags for r in allocations)
    assert state.topology.allocation_bytes == (total if staged else 0)
    inspect = next(e for e in suspended if e.get("phase") == "INSPECT")
    assert inspect["native_kept_bytes"] == (0 if staged else total)
    summary = suspended[-1]
    assert summary["event"] == "summary"
    assert summary["staging"]["staged_bytes"] == (total if staged else 0)
    assert summary["staging"]["staged_allocations"] == (PRIVATE_COUNT if staged else 0)
    assert summary["staging"]["native_tracked_bytes"] == (0 if staged else total)
    assert summary["staging"]["native_tracked_allocations"] == (0 if staged else PRIVATE_COUNT)
    assert (summary["staging"]["gb_per_s"] > 0) is staged
    # The human summary says the same in one line.
    resumed = run("resume", "human").stdout
    assert f"staged by the shims: {PRIVATE_COUNT if staged else 0} allocations" in resumed
    assert w("result = state()") == EXPECTED_STATE
    w.close_clean()
