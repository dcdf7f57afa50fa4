"""Multicast teams through the shim and the coordinator (simulated driver only).

Teams of two and four processes, one device each: the creator exports the object
through a capability and the others import it; each binds a private member
allocation filled with its own bytes (BIND_MEM and BIND_ADDR, the 12.1 and the
device-explicit forms) and maps the object with access set. Capture, native
checkpoint and restore, restore: the topology is the captured one, every member's
bytes are intact, access on each old multicast VA is read-write, a write through any
process's old multicast VA reaches every member, and the old handles unbind, rebind
and export again. Also: an object whose creator released its handle but kept its
mapping; native content mode; refusals before any destructive op (a participant
left out, a device without a binding, a bound member gone), every multicast
predicate tripped by one changed field of real records; an application bind
waiting for its team refusing PREPARE_MULTICAST; rollback rebuilding the teams from
every stop of the capture and of the restore's multicast steps, and from FAILED;
and a participant that dies before RESTORE_MULTICAST_BINDINGS.

Never on a real GPU: cuMulticastCreate can take a shared host's GPUs out of
service, so every test here needs the simulated driver.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import attrs
import pytest
from cuinterpose import native_calls
from cuinterpose.demo import Worker
from cuinterpose.engine import (
    Endpoint,
    OpEvent,
    Options,
    Refused,
    StepFailed,
    Topology,
    capture,
    endpoint_for,
    inspect,
    restore,
    wire,
)
from cuinterpose.engine.validate import validate

from tests import simenv, snippet
from tests.shim import shimenv
from tests.shim.test_rollback import Team as RollbackTeam
from tests.simenv import Spawn
from tests.waiting import wait_until

pytestmark = pytest.mark.skipif(
    not simenv.is_simulated(), reason="multicast runs on the simulated driver only"
)

Op, Status, Phase, Kind = wire.Op, wire.Status, wire.Phase, wire.RecordKind
TIMEOUT_S = 60.0  # a phase's deadline (a hang fails), not a bound on speed
RW = 3  # CU_MEM_ACCESS_FLAGS_PROT_READWRITE

# After shimenv.WORKER_SETUP: this worker's own device DEV becomes current.
MC_SETUP = snippet.load(__file__, "mc_setup")


@attrs.define
class McTeam:
    """n processes, device k in process k; process 0 created the object."""

    workers: list[Worker]
    gran: int
    control_dir: Path

    @property
    def pids(self) -> list[int]:
        return [w.pid for w in self.workers]

    def endpoints(self) -> list[Endpoint]:
        return [endpoint_for(p, p, control_dir=self.control_dir) for p in self.pids]

    def members_hold(
        self, seed_of: Callable[[int], int], which: list[int] | None = None
    ) -> list[bool]:
        """Does each member (of the processes ``which``, default all) hold the 2
        granules of its seed?"""
        picked = range(len(self.workers)) if which is None else which
        return [
            bool(
                self.workers[k](
                    f"result = digest(H['mva'], 2 * gran) == expected({seed_of(k)}, 2 * gran)"
                )
            )
            for k in picked
        ]

    def write_through(self, k: int, seed: int) -> None:
        """Process k writes 2 granules of `seed` through its multicast mapping."""
        self.workers[k](f"fill(H['cva'], 2 * gran, {seed})")


def devices_env(n: int, **more: str) -> dict[str, str]:
    return {"CUINTERPOSE_SIM_DEVICES": str(max(n, 2)), **more}


def build_team(
    spawn: Spawn,
    control_dir: Path,
    n: int,
    *,
    bind: bool = True,
    extra: dict[str, str] | None = None,
) -> McTeam:
    """Every process adds its device, creates a 2-granule member on it filled with seed
    100 + k, binds granule 0 of the object with BIND_MEM and granule 1 with BIND_ADDR
    (the 12.1 forms in even processes for BIND_MEM, in odd ones for BIND_ADDR), and
    maps the whole object read-write. ``bind=False`` stops after adding the devices."""
    env = devices_env(n, **(extra or {}))
    workers = [spawn(f"p{k}", extra=env, device=k) for k in range(n)]
    for w in workers:
        w(MC_SETUP)
    gran = int(workers[0]("result = gran"))
    workers[0](f"H['mc'] = check(cu.cuMulticastCreate(mcprop({n}, 2 * gran)))")
    workers[0]("send_fd(export(H['mc']))")
    cap = workers[0].take_fd()
    for w in workers[1:]:
        w.give_fd(cap)
        w("fd = recv_fd(); H['mc'] = import_fd(fd); os.close(fd)")
    os.close(cap)
    for k, w in enumerate(workers):
        w(
            f"""
K = {k}
check(cu.cuMulticastAddDevice(H['mc'], DEV))
H['m'] = check(cu.cuMemCreate(2 * gran, prop(device=DEV), 0))
H['mva'] = reserve(2 * gran)
check(cu.cuMemMap(H['mva'], 2 * gran, 0, H['m'], 0))
check(access(H['mva'], 2 * gran, device=DEV))
fill(H['mva'], 2 * gran, 100 + K)
"""
        )
    team = McTeam(workers, gran, control_dir)
    if bind:
        for w in workers:
            bind_and_map(w)
    return team


def bind_and_map(w: Worker) -> None:
    w(
        """
if K % 2 == 0:
    check(cu.cuMulticastBindMem(H['mc'], 0, H['m'], 0, gran, 0))
    check(cu.cuMulticastBindAddr_v2(H['mc'], DEV, gran, int(H['mva']) + gran, gran, 0))
else:
    check(cu.cuMulticastBindMem_v2(H['mc'], DEV, 0, H['m'], 0, gran, 0))
    check(cu.cuMulticastBindAddr(H['mc'], gran, int(H['mva']) + gran, gran, 0))
H['cva'] = mc_map(H['mc'], 2 * gran)
"""
    )


def native_cycle(team: McTeam, namespace: str) -> None:
    env = simenv.sim_env(namespace=namespace, devices=max(len(team.workers), 2))
    ck = native_calls.run_in_subprocess("checkpoint-all", team.pids, env=env)
    assert set(ck["states"].values()) == {"CHECKPOINTED"}, ck
    rs = native_calls.run_in_subprocess("restore-all", team.pids, env=env)
    assert set(rs["states"].values()) == {"RUNNING"}, rs


def records_of(topology: Topology, kind: wire.RecordKind) -> list[tuple[str, wire.Record]]:
    return list(topology.of_kind(kind))


@pytest.mark.parametrize("n,mode", [(2, "host"), (4, "host"), (2, "native")])
def test_team_checkpoint_and_restore(
    spawn: Spawn,
    control_dir: Path,
    sim_namespace: str,
    tmp_path: Path,
    n: int,
    mode: Literal["host", "native"],
) -> None:
    """``native``: SNAPSHOT_CONTENT_MODE=native, the members' creators keep them through
    the native checkpoint (which moves their bytes); the teams are rebuilt the same."""
    team = build_team(spawn, control_dir, n, extra={"SNAPSHOT_CONTENT_MODE": mode})
    # The data path before anything: a write through one process reaches every member.
    team.write_through(n - 1, 7)
    assert team.members_hold(lambda k: 7) == [True] * n
    for k, w in enumerate(team.workers):
        w(f"fill(H['mva'], 2 * gran, {100 + k})")
    if n == 2:
        # The creator lets go of its handle; its mapping keeps the object.
        team.workers[0]("check(cu.cuMemRelease(H['mc']))")

    _, before = inspect(team.endpoints(), timeout=TIMEOUT_S)
    assert validate(before) == ()
    objects = records_of(before, Kind.MC_OBJECT)
    assert len(objects) == n and len({r.id for _, r in objects}) == 1
    creators = [p for p, r in objects if wire.RecordFlag.CREATOR in r.flags]
    assert len(creators) == 1
    live = [wire.RecordFlag.HANDLE_LIVE in r.flags for _, r in objects]
    assert live.count(False) == (1 if n == 2 else 0)
    bindings = records_of(before, Kind.MC_BINDING)
    assert len(bindings) == 2 * n
    assert {(r.binding_kind, r.api_version) for _, r in bindings} >= {
        (wire.BindingKind.BIND_MEM, 1),
        (wire.BindingKind.BIND_ADDR, 2),
        (wire.BindingKind.BIND_MEM, 2),
        (wire.BindingKind.BIND_ADDR, 1),
    }
    # A bound member counts as shared, though never exported.
    assert len(records_of(before, Kind.ALLOCATION)) == n
    for _, r in records_of(before, Kind.MC_MAPPING):
        assert [(a.location_type, a.flags) for a in r.access] == [(1, RW)]

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    capture(team.endpoints(), ckpt, Options(TIMEOUT_S, content_mode=mode))
    # The application waits at the closed gate until the restore is done.
    shimenv.send_held(team.workers[-1], "result = err(cu.cuCtxSynchronize())")
    native_cycle(team, sim_namespace)
    result = restore(team.endpoints(), ckpt, Options(TIMEOUT_S, content_mode=mode))
    assert team.workers[-1].reply() == "CUDA_SUCCESS"
    assert list(result.topology.records()) == list(before.records())

    assert team.members_hold(lambda k: 100 + k) == [True] * n
    assert [w("result = get_access(H['cva'])") for w in team.workers] == [RW] * n
    for k in range(n):
        team.write_through(k, 300 + k)
        assert team.members_hold(lambda _, s=300 + k: s) == [True] * n, f"written through {k}"
    # The old handles: unbind and bind again, map again, export again.
    for k, w in enumerate(team.workers):
        if n == 2 and k == 0:
            continue  # released before the capture
        w(
            """
check(cu.cuMulticastUnbind(H['mc'], DEV, 0, gran))
check(cu.cuMulticastBindMem_v2(H['mc'], DEV, 0, H['m'], 0, gran, 0))
check(cu.cuMemUnmap(H['cva'], 2 * gran))
check(cu.cuMemMap(H['cva'], 2 * gran, 0, H['mc'], 0))
check(access(H['cva'], 2 * gran, device=DEV))
"""
        )
    team.write_through(0, 400)
    assert team.members_hold(lambda _: 400) == [True] * n
    # A retain through the old multicast VA answers the same logical handle.
    retained = team.workers[-1](
        """
h = check(cu.cuMemRetainAllocationHandle(H['cva']))
result = [int(h) == int(H['mc']), int(h) >> 48 == 0xC1F0]
check(cu.cuMemRelease(h))
"""
    )
    assert retained == [True, True]
    if n != 2:
        team.workers[0]("os.close(export(H['mc']))")
    _, after = inspect(team.endpoints(), timeout=TIMEOUT_S)
    assert validate(after) == ()
    for w in team.workers:
        w.close_clean()


def test_one_process_team_and_an_unsupported_object(spawn: Spawn, control_dir: Path) -> None:
    """A one-device team in one process is captured like any other; an object also
    exportable as a fabric handle is reported UNSUPPORTED_EXPORTABLE and refuses
    PREPARE_MULTICAST with nothing torn down."""
    w = spawn("solo")
    w(MC_SETUP)
    team = McTeam([w], int(w("result = gran")), control_dir)
    w(
        """
K = 0
H['mc'] = check(cu.cuMulticastCreate(mcprop(1, 2 * gran)))
check(cu.cuMulticastAddDevice(H['mc'], DEV))
H['m'] = check(cu.cuMemCreate(2 * gran, prop(device=DEV), 0))
H['mva'] = reserve(2 * gran)
check(cu.cuMemMap(H['mva'], 2 * gran, 0, H['m'], 0)); check(access(H['mva'], 2 * gran))
result = int(H['mc']) >> 48
"""
    )
    bind_and_map(w)
    _, topology = inspect(team.endpoints(), timeout=TIMEOUT_S)
    assert validate(topology) == ()
    kinds = sorted(r.kind for _, r in topology.records())
    assert kinds == sorted(
        [Kind.ALLOCATION, Kind.MAPPING, Kind.MC_OBJECT, Kind.MC_DEVICE]
        + [Kind.MC_BINDING] * 2
        + [Kind.MC_MAPPING]
    )
    w(
        """
p = mcprop(1, 2 * gran)
p.handleTypes = int(POSIX) | int(cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_FABRIC)
H['fab'] = check(cu.cuMulticastCreate(p))
"""
    )
    path = shimenv.wait_socket(control_dir, w.pid)
    participant = shimenv.handshake(path).participant
    reply, _ = shimenv.request(path, wire.Request(op=Op.INSPECT, participant=participant))
    assert [r.kind for r in reply.records].count(Kind.UNSUPPORTED_EXPORTABLE) == 1
    assert "multicast" in reply.message
    quiet, _ = shimenv.request(path, wire.Request(op=Op.QUIESCE, participant=participant))
    assert (quiet.status, quiet.phase) == (Status.OK, Phase.QUIESCED), quiet
    refused, _ = shimenv.request(
        path, wire.Request(op=Op.PREPARE_MULTICAST, participant=participant)
    )
    assert (refused.status, refused.phase) == (Status.REFUSED, Phase.QUIESCED)
    assert "handle type" in refused.message
    # No coordinator holds a lease: the first call held at the gate reopens it.
    w("fill(H['cva'], 2 * gran, 9)")
    assert team.members_hold(lambda _: 9) == [True]
    w("check(cu.cuMemRelease(H['fab']))")
    w.close_clean()


def refusal(team: McTeam, tmp_path: Path, endpoints: list[Endpoint] | None = None) -> str:
    """The capture refuses before any destructive op; its message and details (the rules)."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir(exist_ok=True)
    events: list[str] = []

    def seen(event: object) -> None:
        if isinstance(event, OpEvent):
            events.append(event.phase)

    with pytest.raises(Refused) as caught:
        capture(endpoints or team.endpoints(), ckpt, Options(TIMEOUT_S, on_progress=seen))
    assert not {"PREPARE_MULTICAST", "SAVE_ALLOCATIONS", "PREPARE_UNICAST"} & set(events)
    return "\n".join((str(caught.value), *caught.value.details()))


def assert_untouched(team: McTeam, bound: list[int]) -> None:
    """Still ACTIVE and still one team: a write reaches every bound member."""
    for w in team.workers:
        assert w("result = err(cu.cuMemGetAllocationGranularity(prop(), 0)[0])") == ("CUDA_SUCCESS")
    team.write_through(bound[0], 77)
    assert team.members_hold(lambda _: 77, bound) == [True] * len(bound)


def hex_id(topology: Topology) -> str:
    (_, record), *_ = topology.of_kind(Kind.MC_OBJECT)
    return record.id.hex()


def test_refused_when_a_participant_is_left_out(
    spawn: Spawn, control_dir: Path, tmp_path: Path
) -> None:
    team = build_team(spawn, control_dir, 2)
    _, topology = inspect(team.endpoints(), timeout=TIMEOUT_S)
    message = refusal(team, tmp_path, team.endpoints()[:1])
    assert hex_id(topology) in message
    assert "1 distinct devices added ([0]), the object was created for 2" in message
    assert "rules: multicast.devices" in message
    assert_untouched(team, [0, 1])


def test_refused_when_a_device_has_no_binding(
    spawn: Spawn, control_dir: Path, tmp_path: Path
) -> None:
    team = build_team(spawn, control_dir, 2, bind=False)
    bind_and_map(team.workers[0])  # device 1 joined the team but binds nothing
    _, topology = inspect(team.endpoints(), timeout=TIMEOUT_S)
    message = refusal(team, tmp_path)
    assert hex_id(topology) in message
    assert "device 1 has no binding" in message and "multicast.device_binding" in message
    assert_untouched(team, [0])


def test_refused_when_a_bound_member_is_gone(
    spawn: Spawn, control_dir: Path, tmp_path: Path
) -> None:
    """A member the application released while still bound is not reported: the
    binding cannot be replayed."""
    team = build_team(spawn, control_dir, 2)
    team.workers[1]("check(cu.cuMemUnmap(H['mva'], 2 * gran)); check(cu.cuMemRelease(H['m']))")
    message = refusal(team, tmp_path)
    assert "MC_BINDING" in message and "rules: multicast.bind_mem_member" in message
    assert "is not an allocation the participant reported" in message
    assert_untouched(team, [0])


Mutation = Callable[[wire.Record], wire.Record | None]


def _evolve(kind: wire.RecordKind, **changes: object) -> Mutation:
    def mutate(r: wire.Record) -> wire.Record | None:
        return attrs.evolve(r, **changes) if r.kind == kind else r

    return mutate


def _bind_mem(**changes: object) -> Mutation:
    def mutate(r: wire.Record) -> wire.Record | None:
        if r.kind == Kind.MC_BINDING and r.binding_kind == wire.BindingKind.BIND_MEM:
            return attrs.evolve(r, **changes)
        return r

    return mutate


def _drop(kind: wire.RecordKind) -> Mutation:
    return lambda r: None if r.kind == kind else r


# One record change per multicast predicate, applied to one participant's real records.
MUTATIONS: dict[str, Mutation] = {
    "multicast.properties": _evolve(Kind.MC_OBJECT, num_devices=3),
    "multicast.single_creator": _evolve(Kind.MC_OBJECT, flags=wire.RecordFlag.CREATOR),
    "multicast.unknown_object": _drop(Kind.MC_OBJECT),
    "multicast.devices": _evolve(Kind.MC_DEVICE, device=0),
    "multicast.device_binding": _drop(Kind.MC_BINDING),
    "multicast.binding_bounds": _evolve(Kind.MC_BINDING, offset=1 << 40),
    "multicast.mapping_bounds": _evolve(Kind.MC_MAPPING, offset=1 << 40),
    "multicast.binding_kind": _evolve(Kind.MC_BINDING, api_version=3),
    "multicast.bind_mem_member": _bind_mem(member_offset=1 << 40),
    "multicast.bind_addr": _evolve(Kind.MC_BINDING, binding_kind=wire.BindingKind.BIND_ADDR),
}


def test_every_multicast_predicate_on_real_records(spawn: Spawn, control_dir: Path) -> None:
    """The records the shims report for a real team pass every predicate; changing one
    field of one participant's records trips the predicate that guards it, and the
    message names the object. A BIND_MEM member bound beyond its bounds, or a device
    added twice, cannot be made through a driver that checks its arguments: these
    come from the changed records only."""
    team = build_team(spawn, control_dir, 2)
    _, topology = inspect(team.endpoints(), timeout=TIMEOUT_S)
    assert validate(topology) == ()
    mc_id = hex_id(topology)
    importer = next(
        p for p, r in topology.of_kind(Kind.MC_OBJECT) if wire.RecordFlag.CREATOR not in r.flags
    )
    for rule, mutate in MUTATIONS.items():
        changed = Topology.from_inspect(
            (
                p.participant,
                p.pid,
                [
                    m
                    for r in p.records
                    if (m := mutate(r) if p.participant == importer else r) is not None
                ],
            )
            for p in topology.participants
        )
        found = [v for v in validate(changed) if v.rule == rule]
        assert found, rule
        assert any(mc_id == v.resource or mc_id in v.reason for v in found), (rule, found)
    for w in team.workers:
        w.close_clean()


CAPTURE = [Op.QUIESCE, Op.PREPARE_MULTICAST, Op.SAVE_ALLOCATIONS, Op.PREPARE_UNICAST]
RESTORE = [
    Op.LOAD_ALLOCATIONS,
    Op.RESTORE_UNICAST,
    Op.RESTORE_MULTICAST_CREATORS,
    Op.RESTORE_MULTICAST_IMPORTERS,
    Op.RESTORE_MULTICAST_DEVICES,
]
STOPS = {
    "active": [],
    "multicast-detached": CAPTURE[:2],
    "allocations-saved": CAPTURE[:3],
    "prepared": CAPTURE,
    "unicast-restored": CAPTURE + RESTORE[:2],
    "multicast-created": CAPTURE + RESTORE[:3],
    "multicast-joined": CAPTURE + RESTORE,
    "importer-failed": CAPTURE + RESTORE[:2],  # then the importer fails (below)
}


@pytest.mark.parametrize("stop", list(STOPS))
def test_rollback_rebuilds_the_team(spawn: Spawn, control_dir: Path, stop: str) -> None:
    """Stopped anywhere short of the native checkpoint (or in the restore's multicast
    steps, or with the importer FAILED), both rollback ops to everyone bring the team
    back: same records, every member's bytes, a write through any process reaching
    every member, old handles; and the team captures and restores again."""
    team = build_team(spawn, control_dir, 2)
    ops = RollbackTeam(control_dir, team.workers)
    before = ops.inspect()
    for op in STOPS[stop]:
        ops.ok(op)
    if stop == "importer-failed":
        # The importer runs ahead: the creator has not created the object again, so
        # its import fails and the importer is FAILED, naming the object.
        ops.ok(Op.RESTORE_MULTICAST_CREATORS, [1])
        (failed,) = ops.send(Op.RESTORE_MULTICAST_IMPORTERS, [1])
        assert (failed.status, failed.phase) == (Status.CUDA_FAILED, Phase.FAILED), failed
        mc_id = next(r.id for r in before[1] if r.kind == Kind.MC_OBJECT).hex()
        assert f"multicast object {mc_id}" in failed.message, failed.message
        assert ops.phases() == [Phase.UNICAST_RESTORED, Phase.FAILED]
    loaded = ops.ok(Op.ROLLBACK_ALLOCATIONS)
    assert {r.phase for r in loaded} == {Phase.ROLLBACK_LOADED}
    again = ops.ok(Op.ROLLBACK_ALLOCATIONS)  # an interrupted rollback, sent again
    assert {r.phase for r in again} == {Phase.ROLLBACK_LOADED}
    done = ops.ok(Op.ROLLBACK_IMPORTS)
    assert {r.phase for r in done} == {Phase.ACTIVE}
    assert ops.inspect() == before
    assert team.members_hold(lambda k: 100 + k) == [True, True]
    for k in (0, 1):
        team.write_through(k, 500 + k)
        assert team.members_hold(lambda _, s=500 + k: s) == [True, True]
    team.workers[1](
        """
check(cu.cuMulticastUnbind(H['mc'], DEV, gran, gran))
check(cu.cuMulticastBindAddr(H['mc'], gran, int(H['mva']) + gran, gran, 0))
"""
    )
    # And a full cycle afterwards (no native checkpoint: the shims only).
    for op in [*CAPTURE, *RESTORE, Op.RESTORE_MULTICAST_BINDINGS]:
        ops.ok(op)
    assert ops.inspect() == before
    team.write_through(1, 600)
    assert team.members_hold(lambda _: 600) == [True, True]
    for w in team.workers:
        w.close_clean()


def test_a_participant_gone_before_the_bindings_fails_the_restore(
    spawn: Spawn, control_dir: Path, sim_namespace: str, tmp_path: Path
) -> None:
    """A participant dies after RESTORE_MULTICAST_DEVICES. The restore fails at
    RESTORE_MULTICAST_BINDINGS naming it; the coordinator's rollback rebuilds the
    survivor's team, whose bind then waits for a device nobody will add: the shim
    gives up after its peer timeout (the simulated driver's own cap is set far
    beyond), so the survivor answers, FAILED with the reason, instead of hanging."""
    waits = {"SNAPSHOT_PEER_TIMEOUT_S": "2", "CUINTERPOSE_SIM_MC_WAIT_MS": "3600000"}
    team = build_team(spawn, control_dir, 2, extra=waits)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    capture(team.endpoints(), ckpt, Options(TIMEOUT_S))
    native_cycle(team, sim_namespace)
    doomed = team.workers[1]

    def on_progress(event: object) -> None:
        if isinstance(event, OpEvent) and event.phase == "RESTORE_MULTICAST_DEVICES":
            doomed.kill()
            doomed.proc.wait()

    with pytest.raises(StepFailed) as caught:
        restore(team.endpoints(), ckpt, Options(TIMEOUT_S, on_progress=on_progress))
    failed = caught.value
    assert "RESTORE_MULTICAST_BINDINGS" in str(failed), str(failed)
    assert str(doomed.pid) in str(failed), str(failed)
    survivor = shimenv.handshake(shimenv.socket_path(control_dir, team.workers[0].pid))
    # The survivor was rolled back (its team torn down, then rebuilt): its bind gave up.
    assert survivor.phase == Phase.FAILED, survivor
    assert "ROLLBACK_IMPORTS" in survivor.message, survivor.message
    assert "still waits for the team" in survivor.message, survivor.message


def test_a_bind_waiting_for_its_team_refuses_the_capture(spawn: Spawn, control_dir: Path) -> None:
    """An application bind blocks in the driver until the team is complete, without
    the shim's lock; while it waits, PREPARE_MULTICAST and ROLLBACK_ALLOCATIONS are
    refused (it would complete into a torn-down team) and the shim stays ACTIVE. The
    bind pins the object: its MC_OBJECT shows one more handle while in flight, which is
    what the test waits for."""
    a, b = (spawn(f"p{k}", extra=devices_env(2), device=k) for k in range(2))
    for w in (a, b):
        w(MC_SETUP)
    a("H['mc'] = check(cu.cuMulticastCreate(mcprop(2, 2 * gran))); send_fd(export(H['mc']))")
    cap = a.take_fd()
    b.give_fd(cap)
    os.close(cap)
    b("fd = recv_fd(); H['mc'] = import_fd(fd); os.close(fd)")
    a("check(cu.cuMulticastAddDevice(H['mc'], DEV))")
    a("H['m'] = check(cu.cuMemCreate(gran, prop(), 0))")
    a.send("result = err(cu.cuMulticastBindMem(H['mc'], 0, H['m'], 0, gran, 0))")
    path = shimenv.wait_socket(control_dir, a.pid)
    who = shimenv.handshake(path).participant

    def handles() -> int:
        reply, _ = shimenv.request(path, wire.Request(op=Op.INSPECT, participant=who))
        return sum(r.handle_count for r in reply.records if r.kind == Kind.MC_OBJECT)

    wait_until(lambda: handles() == 2, "the bind in flight")
    lease = os.urandom(16)

    def ask(op: Op) -> wire.Reply:
        who_ = "" if op in (Op.HANDSHAKE, Op.RELEASE) else who
        return shimenv.request(path, wire.Request(op=op, participant=who_, authorization=lease))[0]

    assert ask(Op.HANDSHAKE).status == Status.OK
    quiet = ask(Op.QUIESCE)  # the bind left the gate: it waits in the driver
    assert (quiet.status, quiet.phase) == (Status.OK, Phase.QUIESCED), quiet
    refused = ask(Op.PREPARE_MULTICAST)
    assert (refused.status, refused.phase) == (Status.REFUSED, Phase.QUIESCED), refused
    assert "waiting for their team" in refused.message
    # So is a rollback (which would tear the team down as well).
    refused = ask(Op.ROLLBACK_ALLOCATIONS)
    assert (refused.status, refused.phase) == (Status.REFUSED, Phase.QUIESCED), refused
    assert "waiting for their team" in refused.message
    b("check(cu.cuMulticastAddDevice(H['mc'], DEV))")
    assert a.reply() == "CUDA_SUCCESS"
    # The run's end (RELEASE) sends the QUIESCED shim back to ACTIVE: nothing torn down.
    assert ask(Op.RELEASE).phase == Phase.ACTIVE
    assert handles() == 1
    _, topology = inspect([endpoint_for(a.pid, a.pid, control_dir=control_dir)], timeout=TIMEOUT_S)
    assert [r.device for _, r in topology.of_kind(Kind.MC_BINDING)] == [0]
