"""Rollback: back to ACTIVE from any phase short of the native checkpoint (simulated
driver, real shim processes, the wire ops sent directly).

A team of three shims: a creator ``c`` whose allocation ``X`` two importers map, and one
of those importers (``i1``) creating ``Y`` that the creator imports, so that one process
is both. The capture is interrupted at every point the coordinator can stop at (after
PREPARE_MULTICAST, SAVE_ALLOCATIONS, PREPARE_UNICAST, with the team split between
PREPARED and ALLOCATIONS_SAVED, after LOAD_ALLOCATIONS, RESTORE_UNICAST and the
multicast restore ops); ROLLBACK_ALLOCATIONS then ROLLBACK_IMPORTS to every shim must
bring every one back to ACTIVE with every byte at its VA in every process, the
topology as INSPECT reported it before, sharing live (a write through one process is
seen by the others) and the application's calls working. Also: a repeated
ROLLBACK_ALLOCATIONS is harmless, ROLLBACK_IMPORTS outside ROLLBACK_LOADED is
WRONG_PHASE, a transient out-of-memory at LOAD_ALLOCATIONS answers RETRY and leaves
the shim PREPARED (a retry then finishes the restore, or a rollback undoes it), a
failed LOAD (FAILED) rolls back, and the application cannot free or re-map a
reservation the shim keeps while not ACTIVE.

Every wait is on an observable state (the replies' phases, the workers' answers).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path

import pytest
from cuinterpose.demo import Worker
from cuinterpose.engine import client, wire

from tests import simenv, snippet
from tests.shim import shimenv
from tests.shim.test_content import FILL_REGISTRATIONS, UNREGISTER_ALL
from tests.shim.test_control import CAPTURE, RESTORE, app_still_works
from tests.simenv import Spawn

Op, Status, Phase = wire.Op, wire.Status, wire.Phase
ROLLBACK = [Op.ROLLBACK_ALLOCATIONS, Op.ROLLBACK_IMPORTS]
TIMEOUT_S = 60.0  # the exchange's deadline (a hang fails), not a bound on speed


class Team:
    """Workers with the shim and their endpoints; ops go to all (or some) at once."""

    def __init__(self, control_dir: Path, workers: Sequence[Worker]) -> None:
        self.workers = list(workers)
        self.endpoints = []
        self.ids = []
        for w in self.workers:
            path = shimenv.wait_socket(control_dir, w.pid)
            self.endpoints.append(client.Endpoint(w.pid, w.pid, path))
            self.ids.append(shimenv.handshake(path).participant)

    def send(self, op: Op, which: Sequence[int] | None = None) -> list[wire.Reply]:
        picked = range(len(self.workers)) if which is None else which
        calls = [
            (
                self.endpoints[k],
                wire.Request(op=op, participant="" if op == Op.HANDSHAKE else self.ids[k]),
                self.ids[k],
            )
            for k in picked
        ]
        replies = client.call_all(calls, timeout=TIMEOUT_S)
        for reply in replies:
            assert isinstance(reply, wire.Reply), reply
        return replies  # type: ignore[return-value]

    def ok(self, op: Op, which: Sequence[int] | None = None) -> list[wire.Reply]:
        replies = self.send(op, which)
        for reply in replies:
            assert reply.status == Status.OK, (op.name, reply.status, reply.message)
        return replies

    def phases(self) -> list[Phase]:
        return [Phase(r.phase) for r in self.send(Op.HANDSHAKE)]

    def inspect(self) -> list[tuple[wire.Record, ...]]:
        return [r.records for r in self.ok(Op.INSPECT)]


SEED_X, SEED_Y = 101, 202


def build_team(spawn: Spawn, control_dir: Path, extra: dict[str, str] | None = None) -> Team:
    """c creates X (3 granules) mapped by i1 and i2; i1 creates Y (2 granules) that c
    maps. Each process records its mappings as (name, va, size) in M."""
    c, i1, i2 = (spawn(name, extra=extra) for name in ("c", "i1", "i2"))
    c(
        f"""
H['X'] = check(cu.cuMemCreate(3 * gran, prop(), 0))
M = [('X', map_rw(H['X'], 3 * gran), 3 * gran)]
fill(M[0][1], 3 * gran, {SEED_X})
send_fd(export(H['X']))
"""
    )
    cap_x = c.take_fd()
    i1(
        f"""
H['Y'] = check(cu.cuMemCreate(2 * gran, prop(), 0))
M = [('Y', map_rw(H['Y'], 2 * gran), 2 * gran)]
fill(M[0][1], 2 * gran, {SEED_Y})
send_fd(export(H['Y']))
"""
    )
    cap_y = i1.take_fd()
    for w in (i1, i2):
        w.give_fd(cap_x)
        w(
            """
fd = recv_fd(); H['x'] = import_fd(fd); os.close(fd)
M = globals().get('M', []) + [('X', map_rw(H['x'], 3 * gran), 3 * gran)]
"""
        )
    c.give_fd(cap_y)
    c("fd = recv_fd(); H['y'] = import_fd(fd); os.close(fd)")
    c("M.append(('Y', map_rw(H['y'], 2 * gran), 2 * gran))")
    os.close(cap_x)
    os.close(cap_y)
    return Team(control_dir, [c, i1, i2])


def assert_intact(team: Team, seeds: dict[str, int]) -> None:
    """Every mapping of every process holds its allocation's bytes (``seeds``: by
    allocation name, the seed its bytes were filled from; others are not looked at)."""
    for w in team.workers:
        got = w(
            f"""
SEEDS = {seeds!r}
result = [[name, digest(va, size) == expected(SEEDS[name], size)]
          for name, va, size in M if name in SEEDS]
"""
        )
        assert got and all(ok for _, ok in got), (w.name, got)


def assert_shared(team: Team, seed: int) -> None:
    """A write through each process's mapping of X and Y is seen by every other."""
    c, _, i2 = team.workers
    i2(f"name, va, size = M[0]; fill(va, size, {seed})")  # i2 writes X
    c(f"name, va, size = M[1]; fill(va, size, {seed + 1})")  # c writes Y (an import)
    assert_intact(team, {"X": seed, "Y": seed + 1})
    c(f"name, va, size = M[0]; fill(va, size, {seed + 2})")  # the creator writes X
    assert_intact(team, {"X": seed + 2, "Y": seed + 1})


def interrupt(team: Team, point: str) -> None:
    """Run the capture (and the restore) to ``point`` on the whole team, or split."""
    if point == "active":
        return
    steps = {
        "detached": CAPTURE[:2],
        "saved": CAPTURE[:3],
        "prepared": CAPTURE,
        "loaded": CAPTURE + RESTORE[:1],
        "restored": CAPTURE + RESTORE[:2],
        "multicast-joined": CAPTURE + RESTORE[:-1],
    }
    if point.startswith("split"):
        for op in CAPTURE[:3]:
            team.ok(op)
        # The coordinator stopped while PREPARE_UNICAST reached some shims only.
        subset = [0] if point == "split-creator" else [1, 2]
        team.ok(Op.PREPARE_UNICAST, subset)
        want = [Phase.PREPARED if k in subset else Phase.ALLOCATIONS_SAVED for k in range(3)]
        assert team.phases() == want
        return
    for op in steps[point]:
        team.ok(op)


def roll_back(team: Team) -> list[wire.Reply]:
    """Both rollback ops to every shim; every shim ACTIVE afterwards. The replies to
    ROLLBACK_ALLOCATIONS."""
    loaded = team.ok(Op.ROLLBACK_ALLOCATIONS)
    assert {r.phase for r in loaded} == {Phase.ROLLBACK_LOADED}
    done = team.ok(Op.ROLLBACK_IMPORTS)
    assert {r.phase for r in done} == {Phase.ACTIVE}
    assert team.phases() == [Phase.ACTIVE] * 3
    return loaded


POINTS = [
    "active",
    "detached",
    "saved",
    "prepared",
    "split-creator",
    "split-importers",
    "loaded",
    "restored",
    "multicast-joined",
]


@pytest.mark.parametrize("point", POINTS)
def test_rollback_from(spawn: Spawn, control_dir: Path, point: str) -> None:
    team = build_team(spawn, control_dir)
    c = team.workers[0]
    before = team.inspect()
    gran = int(c("result = gran"))
    interrupt(team, point)
    if point != "active":
        # Not ACTIVE: the application's calls wait at the closed gate.
        shimenv.send_held(c, "result = err(cu.cuCtxSynchronize())")
    loaded = team.ok(Op.ROLLBACK_ALLOCATIONS)
    assert {r.phase for r in loaded} == {Phase.ROLLBACK_LOADED}
    # The creators re-create exactly what was torn down (X by c, Y by i1).
    torn = {
        "prepared": (1, 1),
        "split-creator": (1, 0),
        "split-importers": (0, 1),
    }.get(point, (0, 0))
    assert [r.stats.count for r in loaded] == [torn[0], torn[1], 0]
    assert [r.stats.bytes for r in loaded] == [3 * gran * torn[0], 2 * gran * torn[1], 0]
    # Repeated (the coordinator was interrupted during the rollback): harmless.
    again = team.ok(Op.ROLLBACK_ALLOCATIONS)
    assert [(r.phase, r.stats.count) for r in again] == [(Phase.ROLLBACK_LOADED, 0)] * 3
    # ROLLBACK_LOADED is not ACTIVE: the application still waits (never quiesced:
    # its tracked calls answer NOT_READY).
    if point != "active":
        assert not c.answered(0.3)
    else:
        assert c("result = err(cu.cuMemCreate(gran, prop(), 0))") == "CUDA_ERROR_NOT_READY"
    done = team.ok(Op.ROLLBACK_IMPORTS)
    assert {r.phase for r in done} == {Phase.ACTIVE}
    if point != "active":
        assert c.reply() == "CUDA_SUCCESS"  # let go once ACTIVE
    assert team.phases() == [Phase.ACTIVE] * 3
    assert_intact(team, {"X": SEED_X, "Y": SEED_Y})
    assert team.inspect() == before
    assert_shared(team, 300)
    for w in team.workers:
        app_still_works(w)


def test_capture_and_restore_after_a_rollback(spawn: Spawn, control_dir: Path) -> None:
    """After a rollback the staged bytes are gone and the team captures and restores
    again as if nothing had happened."""
    team = build_team(spawn, control_dir)
    interrupt(team, "prepared")
    roll_back(team)
    assert_shared(team, 400)
    for op in CAPTURE + RESTORE:
        team.ok(op)
    assert team.phases() == [Phase.ACTIVE] * 3
    assert_intact(team, {"X": 402, "Y": 401})
    assert_shared(team, 500)


def test_rollback_imports_only_in_rollback_loaded(spawn: Spawn, control_dir: Path) -> None:
    team = build_team(spawn, control_dir)
    phases = [Phase.ACTIVE, Phase.MULTICAST_DETACHED, Phase.ALLOCATIONS_SAVED, Phase.PREPARED]
    team.ok(Op.QUIESCE)
    phases[0] = Phase.QUIESCED
    for k, phase in enumerate(phases):
        if k:
            team.ok(CAPTURE[k])
        refused = team.send(Op.ROLLBACK_IMPORTS)
        assert [(r.status, r.phase) for r in refused] == [(Status.WRONG_PHASE, phase)] * 3
        assert all("ROLLBACK_IMPORTS" in r.message for r in refused)
    roll_back(team)
    assert_intact(team, {"X": SEED_X, "Y": SEED_Y})
    # ACTIVE again: not served there either.
    refused = team.send(Op.ROLLBACK_IMPORTS)
    assert [(r.status, r.phase) for r in refused] == [(Status.WRONG_PHASE, Phase.ACTIVE)] * 3


def test_kept_reservations_are_gated(spawn: Spawn, control_dir: Path) -> None:
    """While not ACTIVE the application cannot free, unmap or map over a reservation
    the shim keeps (nor release a torn-down handle); the reservation survives and the
    bytes come back there."""
    team = build_team(spawn, control_dir)
    c, i1, _ = team.workers
    interrupt(team, "prepared")
    # Quiesced, the application waits at the gate: it cannot free a kept reservation.
    shimenv.send_held(i1, "_, vx, sx = M[1]; result = err(cu.cuMemAddressFree(vx + gran, 0))")
    roll_back(team)
    assert i1.reply() == "CUDA_ERROR_INVALID_VALUE"  # size 0: run once ACTIVE, harmless
    assert_intact(team, {"X": SEED_X, "Y": SEED_Y})
    assert_shared(team, 600)
    # ACTIVE again: the application unmaps, frees and releases as it likes.
    c(
        """
name, va, size = M.pop(1)
check(cu.cuMemUnmap(va, size)); check(cu.cuMemAddressFree(va, size))
check(cu.cuMemRelease(H['y']))
"""
    )


# ---------------------------------------------------------------- transient failures
SMALL = {"CUINTERPOSE_SIM_MEM_MIB": "64"}

# Fill the device until cuMemCreate answers OUT_OF_MEMORY (the hog runs without the
# shim, in the team's simulated node).
HOG = snippet.load(__file__, "hog")


def hog_release(n: int | None = None) -> str:
    """Release the hog's first ``n`` granules (all of them by default)."""
    count = "len(HOG)" if n is None else str(n)
    return f"""
for h in HOG[:{count}]:
    check(cu.cuMemRelease(h))
del HOG[:{count}]
"""


@pytest.mark.parametrize("then", ["retry", "rollback"])
def test_out_of_memory_at_load_answers_retry(
    spawn: Spawn, control_dir: Path, sim_namespace: str, then: str
) -> None:
    """The creator's two allocations are torn down; the others load theirs, then the
    device is filled but for room for one. LOAD re-creates the first, answers RETRY
    for the second (naming the call and the allocation) and stays PREPARED; once
    memory is free, a retried LOAD loads only the second and the restore finishes, or
    a rollback brings everything back."""
    team = build_team(spawn, control_dir, extra=SMALL)
    c = team.workers[0]
    c(
        """
H['Z'] = check(cu.cuMemCreate(3 * gran, prop(), 0))
M.append(('Z', map_rw(H['Z'], 3 * gran), 3 * gran))
fill(M[-1][1], 3 * gran, 303)
os.close(export(H['Z']))
"""
    )
    seeds = {"X": SEED_X, "Y": SEED_Y, "Z": 303}
    gran = int(c("result = gran"))
    hog = spawn(
        "hog",
        simenv.sim_env(namespace=sim_namespace, extra=SMALL),
        setup=shimenv.WORKER_SETUP,
    )
    try:
        interrupt(team, "prepared")
        team.ok(Op.LOAD_ALLOCATIONS, [1, 2])  # i1's Y first: c alone meets the shortage
        count, why = hog(HOG)
        assert why == "CUDA_ERROR_OUT_OF_MEMORY" and count > 0
        hog(hog_release(3))  # room for X (3 granules), not for Z as well
        op = Op.LOAD_ALLOCATIONS if then == "retry" else Op.ROLLBACK_ALLOCATIONS
        replies = team.send(op, [0])
        assert replies[0].status == Status.RETRY, replies[0].message
        assert replies[0].phase == Phase.PREPARED
        assert re.fullmatch(
            op.name + r": cuMemCreate failed: CUDA_ERROR_OUT_OF_MEMORY \(2\) "
            r"\(allocation [0-9a-f]{32}, \d+ bytes\)",
            replies[0].message,
        ), replies[0].message
        assert replies[0].stats.count == 1  # X was loaded and stays
        assert team.phases()[0] == Phase.PREPARED
        # Still waiting, not failed: the application's calls wait at the gate.
        shimenv.send_held(c, "result = err(cu.cuCtxSynchronize())")
        # Sent again while still out of memory: RETRY again, nothing lost.
        again = team.send(op, [0])[0]
        assert (again.status, again.phase, again.stats.count) == (
            Status.RETRY,
            Phase.PREPARED,
            0,
        )
        hog(hog_release())
        loaded = team.send(op, [0])[0]
        assert loaded.status == Status.OK, loaded.message
        assert (loaded.stats.count, loaded.stats.bytes) == (1, 3 * gran)  # Z only
        if then == "retry":
            for step in RESTORE[1:]:
                team.ok(step)
            assert team.phases() == [Phase.ACTIVE] * 3
        else:
            team.ok(Op.ROLLBACK_ALLOCATIONS, [1, 2])
            team.ok(Op.ROLLBACK_IMPORTS)
            assert team.phases() == [Phase.ACTIVE] * 3
        assert_intact(team, seeds)
        assert_shared(team, 700)
    finally:
        hog.close_clean()
    for w in team.workers:
        app_still_works(w)


def test_failed_load_rolls_back(spawn: Spawn, control_dir: Path) -> None:
    """A LOAD that fails for good (the copy's host registration: not transient) leaves
    the shim FAILED with its staged bytes; a rollback from FAILED brings it back."""
    team = build_team(
        spawn,
        control_dir,
        extra={"SNAPSHOT_SHIM_COPY_CHUNK_MIB": "1", "SNAPSHOT_SHIM_STAGING_BOUNCE_MIB": "0"},
    )
    c = team.workers[0]
    interrupt(team, "prepared")
    count, why = c(FILL_REGISTRATIONS)
    assert why == "CUDA_ERROR_OUT_OF_MEMORY" and count > 0
    failed = team.send(Op.LOAD_ALLOCATIONS, [0])[0]
    assert (failed.status, failed.phase) == (Status.CUDA_FAILED, Phase.FAILED)
    assert "cuMemHostRegister" in failed.message
    assert team.send(Op.ROLLBACK_IMPORTS, [0])[0].status == Status.WRONG_PHASE
    # Still failing: the rollback fails the same way and the shim stays FAILED.
    refailed = team.send(Op.ROLLBACK_ALLOCATIONS, [0])[0]
    assert (refailed.status, refailed.phase) == (Status.CUDA_FAILED, Phase.FAILED)
    c(UNREGISTER_ALL)
    roll_back(team)
    assert not team.send(Op.HANDSHAKE, [0])[0].message  # the old reason is gone
    assert_intact(team, {"X": SEED_X, "Y": SEED_Y})
    assert_shared(team, 800)


def test_a_failed_unmap_in_prepare_unicast_leaves_the_allocation_whole(
    spawn: Spawn, control_dir: Path
) -> None:
    """c maps X twice; its second unmap fails (injected in the simulated driver).

    PREPARE_UNICAST fails on c, which maps the first mapping again, so X stays live and
    whole instead of half torn down; the rollback then brings every shim back."""
    team = build_team(spawn, control_dir)
    c = team.workers[0]
    c("M.append(('X', map_rw(H['X'], 3 * gran), 3 * gran))")
    before = team.inspect()
    c("import ctypes; ctypes.CDLL('libcuda.so.1').cuinterposeSimFailUnmap(1, 999)")
    for op in CAPTURE[:3]:
        team.ok(op)
    replies = team.send(Op.PREPARE_UNICAST)
    assert replies[0].status == Status.CUDA_FAILED, replies[0].message
    assert "cuMemUnmap" in replies[0].message and "CUDA_ERROR_UNKNOWN" in replies[0].message
    assert [r.phase for r in replies] == [Phase.FAILED, Phase.PREPARED, Phase.PREPARED]
    loaded = roll_back(team)
    # X was never torn down on c: nothing to re-create there; i1 re-creates Y.
    assert [r.stats.count for r in loaded] == [0, 1, 0]
    assert_intact(team, {"X": SEED_X, "Y": SEED_Y})
    assert team.inspect() == before
    assert_shared(team, 400)
    for w in team.workers:
        app_still_works(w)
