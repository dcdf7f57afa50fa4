"""The shim's control server under protocol use and abuse (simulated driver).

Hostile input (random and truncated requests, wrong participant, bad authorization,
unknown op, non-zero reserved fields, peers that hang up or stall, floods of
connections) must get an error reply or a dropped connection, never a crash, and
the application must keep working. Also the phase machine: a whole unicast cycle
(without the native checkpoint, which tests/shim/test_e2e.py adds), WRONG_PHASE,
NOT_READY for the application outside ACTIVE, FAILED with its reason.
"""

from __future__ import annotations

import os
import random
import re
import socket
import stat
import struct
import threading
import time
from pathlib import Path

import pytest
from cuinterpose.demo import Worker
from cuinterpose.engine import wire

from tests import simenv, snippet
from tests.shim import shimenv
from tests.simenv import Spawn

Op, Status, Phase = wire.Op, wire.Status, wire.Phase


class Shim:
    """One application's control endpoint."""

    def __init__(self, control_dir: Path, pid: int) -> None:
        self.path = shimenv.wait_socket(control_dir, pid)
        self.participant = shimenv.handshake(self.path).participant

    def call(self, op: Op, **kw: object) -> wire.Reply:
        who = "" if op == Op.HANDSHAKE else self.participant
        reply, fds = shimenv.request(self.path, wire.Request(op=op, participant=who, **kw))  # type: ignore[arg-type]
        for fd in fds:
            os.close(fd)
        assert reply.op == op and reply.participant == self.participant
        return reply

    def ok(self, op: Op, **kw: object) -> wire.Reply:
        reply = self.call(op, **kw)
        assert reply.status == Status.OK, (op, reply.status, reply.message)
        return reply


def header(op: int = 1, participant: bytes = b"\0" * 32, **fields: int) -> bytearray:
    raw = bytearray(wire.Header(op=op).encode())
    raw[16:48] = participant
    for name, (off, fmt) in {
        "status": (8, "<i"),
        "count": (12, "<I"),
        "resource_kind": (80, "<I"),
        "message_length": (84, "<I"),
        "pid": (88, "<I"),
        "phase": (92, "<H"),
        "flags": (94, "<H"),
        "stat_count": (96, "<Q"),
        "stat_copy_ns": (120, "<Q"),
    }.items():
        if name in fields:
            struct.pack_into(fmt, raw, off, fields[name])
    return raw


def reply_of(raw: bytes) -> wire.Reply:
    return wire.Reply.decode(raw)


def app_still_works(w: Worker, seed: int = 5) -> None:
    got = w(
        f"""
h = check(cu.cuMemCreate(gran, prop(), 0))
va = map_rw(h, gran)
fill(va, gran, {seed})
result = digest(va, gran) == expected({seed}, gran)
check(cu.cuMemUnmap(va, gran)); check(cu.cuMemRelease(h)); check(cu.cuMemAddressFree(va, gran))
"""
    )
    assert got is True


# ---------------------------------------------------------------- transport
@pytest.mark.threads  # make tsan
def test_socket_mode_and_handshake(spawn: Spawn, control_dir: Path) -> None:
    w = spawn()
    shim = Shim(control_dir, w.pid)
    assert stat.S_IMODE(shim.path.stat().st_mode) == 0o600
    reply = shimenv.handshake(shim.path)
    assert reply.status == Status.OK and reply.pid == w.pid and reply.phase == Phase.ACTIVE
    assert wire.is_participant_id(reply.participant)
    assert not [p for p in control_dir.iterdir() if p.name.endswith(".tmp")]


def test_hostile_requests_get_errors(spawn: Spawn, control_dir: Path) -> None:
    w = spawn()
    shim = Shim(control_dir, w.pid)
    me = shim.participant.encode()
    other = ("0" * 31 + "1").encode() if me != b"0" * 31 + b"1" else b"f" * 32
    cases: list[tuple[bytes, Status]] = [
        (bytes(header(op=max(Op) + 1, participant=me)), Status.BAD_REQUEST),  # unknown op
        (bytes(header(op=0, participant=me)), Status.BAD_REQUEST),
        (bytes(header(op=0xFFFF, participant=me)), Status.BAD_REQUEST),
        (bytes(header(op=Op.INSPECT, participant=other)), Status.WRONG_PARTICIPANT),
        (bytes(header(op=Op.INSPECT, participant=b"G" * 32)), Status.BAD_REQUEST),
        (bytes(header(op=Op.INSPECT, participant=b"\0" * 32)), Status.BAD_REQUEST),
        (bytes(header(op=Op.HANDSHAKE, participant=me)), Status.BAD_REQUEST),
        (bytes(header(op=Op.INSPECT, participant=me, flags=1)), Status.BAD_REQUEST),
        (bytes(header(op=Op.INSPECT, participant=me, status=3)), Status.BAD_REQUEST),
        (bytes(header(op=Op.INSPECT, participant=me, count=1)), Status.BAD_REQUEST),
        (bytes(header(op=Op.INSPECT, participant=me, pid=7)), Status.BAD_REQUEST),
        (bytes(header(op=Op.INSPECT, participant=me, phase=1)), Status.BAD_REQUEST),
        (bytes(header(op=Op.INSPECT, participant=me, message_length=4)), Status.BAD_REQUEST),
        (bytes(header(op=Op.INSPECT, participant=me, stat_count=1)), Status.BAD_REQUEST),
        (bytes(header(op=Op.INSPECT, participant=me, stat_copy_ns=1)), Status.BAD_REQUEST),
        (bytes(header(op=Op.INSPECT, participant=me, resource_kind=1)), Status.BAD_REQUEST),
        (bytes(header(op=Op.EXPORT, participant=me)), Status.BAD_REQUEST),  # no kind, no id
        (bytes(header(op=Op.SAVE_ALLOCATIONS, participant=me)), Status.WRONG_PHASE),
        (bytes(header(op=Op.RESTORE_UNICAST, participant=me)), Status.WRONG_PHASE),
    ]
    bad_magic = header(op=Op.HANDSHAKE)
    bad_magic[0] ^= 0xFF
    bad_version = header(op=Op.HANDSHAKE)
    bad_version[4] = 9
    for raw in (bad_magic, bad_version):
        got = shimenv.raw_exchange(shim.path, bytes(raw))
        assert struct.unpack_from("<i", got, 8)[0] == Status.BAD_REQUEST
    for raw, status in cases:
        got = shimenv.raw_exchange(shim.path, raw)
        assert len(got) >= 128, raw[:8]
        assert struct.unpack_from("<i", got, 8)[0] == status, (raw[4:8], got[128:])
        assert struct.unpack_from("<H", got, 92)[0] == Phase.ACTIVE
    # A valid request followed by trailing garbage is still one request.
    got = shimenv.raw_exchange(shim.path, wire.Request(op=Op.HANDSHAKE).encode() + b"junk")
    assert reply_of(got).status == Status.OK
    app_still_works(w)


def test_a_request_of_another_version_is_answered_in_the_shims_and_changes_nothing(
    spawn: Spawn, control_dir: Path
) -> None:
    # What a coordinator of another version meets: BAD_REQUEST in this shim's version,
    # naming both, before the lease or anything else is taken (specs/protocol.md).
    w = spawn()
    shim = Shim(control_dir, w.pid)
    for version in (1, wire.VERSION + 1):
        raw = bytearray(wire.Request(Op.HANDSHAKE, authorization=b"\1" * 16).encode())
        struct.pack_into("<H", raw, 4, version)
        got = shimenv.raw_exchange(shim.path, bytes(raw))
        assert struct.unpack_from("<HH", got, 4) == (wire.VERSION, Op.HANDSHAKE)
        reply = reply_of(got)
        assert (reply.status, reply.phase) == (Status.BAD_REQUEST, Phase.ACTIVE)
        assert reply.message == (
            f"this shim speaks protocol version {wire.VERSION}, the request version "
            f"{version}: nothing was done"
        )
    # No lease was taken: another coordinator's token is served.
    taken = shimenv.request(shim.path, wire.Request(Op.HANDSHAKE, authorization=b"\2" * 16))[0]
    assert taken.status == Status.OK, taken.message
    released = shimenv.request(shim.path, wire.Request(Op.RELEASE, authorization=b"\2" * 16))
    assert released[0].status == Status.OK
    app_still_works(w)


def test_random_truncated_and_hung_up(spawn: Spawn, control_dir: Path) -> None:
    w = spawn(extra={"SNAPSHOT_SHIM_IO_TIMEOUT_S": "0.3"})
    shim = Shim(control_dir, w.pid)
    rng = random.Random(1234)
    valid = wire.Request(op=Op.INSPECT, participant=shim.participant).encode()
    for i in range(150):
        kind = i % 3
        if kind == 0:
            payload = rng.randbytes(rng.randrange(0, 300))
        elif kind == 1:
            payload = valid[: rng.randrange(0, 128)]
        else:  # a valid request with one byte flipped
            b = bytearray(valid)
            pos = rng.randrange(0, 128)
            b[pos] ^= 1 << rng.randrange(8)
            payload = bytes(b)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(5)
            s.connect(str(shim.path))
            s.sendall(payload)
            if len(payload) < 128:
                s.shutdown(socket.SHUT_WR)  # hang up mid-request
            try:
                got = s.recv(1 << 20)
            except (ConnectionResetError, TimeoutError):
                got = b""
        if got:
            assert len(got) >= 128
    # A client that stalls mid-request is dropped after the I/O timeout (0.3 s): the
    # shim hangs up (recv sees the end) rather than the client's own deadline passing.
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(60)
        t0 = time.monotonic()
        s.connect(str(shim.path))
        s.sendall(valid[:40])
        assert s.recv(10) == b""
        assert time.monotonic() - t0 >= 0.3
    # A client that sends a full request and hangs up before the reply (SIGPIPE).
    for _ in range(20):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(str(shim.path))
            s.sendall(valid)
    assert shim.ok(Op.INSPECT).phase == Phase.ACTIVE
    app_still_works(w)


def test_many_concurrent_connections(spawn: Spawn, control_dir: Path) -> None:
    w = spawn()
    shim = Shim(control_dir, w.pid)
    answers: list[int] = []
    lock = threading.Lock()

    def hammer() -> None:
        for _ in range(5):
            try:
                reply = shimenv.handshake(shim.path)
                with lock:
                    answers.append(int(reply.status))
            except (OSError, wire.WireError):
                pass  # dropped under load: allowed

    # Idle connections that never send anything hold threads until the timeout.
    idle = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(30)]
    for s in idle:
        s.connect(str(shim.path))
    threads = [threading.Thread(target=hammer) for _ in range(40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for s in idle:
        s.close()
    assert answers and set(answers) == {Status.OK}
    assert shimenv.handshake(shim.path).status == Status.OK
    app_still_works(w)


# ---------------------------------------------------------------- EXPORT
def read_capability(fd: int) -> dict[str, object]:
    raw = os.pread(fd, 128, 0)
    magic, version, kind = struct.unpack_from("<IHH", raw, 0)
    return {
        "magic": magic,
        "version": version,
        "kind": kind,
        "creator": raw[8:40].decode(),
        "id": raw[40:56],
        "auth": raw[56:72],
        "endpoint": raw[72:112].rstrip(b"\0").decode(),
        "size": struct.unpack_from("<Q", raw, 112)[0],
    }


def test_export_authorization(spawn: Spawn, control_dir: Path) -> None:
    w = spawn()
    shim = Shim(control_dir, w.pid)
    w("H['a'] = check(cu.cuMemCreate(2 * gran, prop(), 0)); send_fd(export(H['a']))")
    fd = w.take_fd()
    cap = read_capability(fd)
    os.close(fd)
    assert cap["magic"] == 0x43495543 and cap["creator"] == shim.participant
    assert cap["endpoint"] == shim.path.name and cap["size"] == 2 * int(w("result = gran"))

    def export(
        rid: bytes,
        auth: bytes,
        kind: wire.ResourceKind = wire.ResourceKind.UNICAST,
        size: int = int(cap["size"]),  # type: ignore[call-overload]
    ) -> tuple[wire.Reply, list[int]]:
        return shimenv.request(
            shim.path,
            wire.Request(
                op=Op.EXPORT,
                participant=shim.participant,
                resource_id=rid,
                authorization=auth,
                resource_kind=kind,
                fetcher=fetcher,
                export_size=size,
            ),
        )

    fetcher = "fe" * 16
    raw = wire.Request(
        op=Op.EXPORT, participant=shim.participant, resource_id=cap["id"],  # type: ignore[arg-type]
        authorization=cap["auth"], resource_kind=wire.ResourceKind.UNICAST,  # type: ignore[arg-type]
    ).encode()  # fmt: skip
    refused = wire.Reply.decode(shimenv.raw_exchange(shim.path, raw))  # the fetcher all zero
    assert refused.status == Status.BAD_REQUEST and "requesting participant" in refused.message
    reply, fds = export(cap["id"], bytes(16))  # type: ignore[arg-type]
    assert reply.status == Status.UNAUTHORIZED and not fds
    wrong = bytes(b ^ 1 for b in cap["auth"])  # type: ignore[union-attr]
    reply, fds = export(cap["id"], wrong)  # type: ignore[arg-type]
    assert reply.status == Status.UNAUTHORIZED and not fds
    reply, fds = export(os.urandom(16), cap["auth"])  # type: ignore[arg-type]
    assert reply.status == Status.NOT_FOUND and not fds
    reply, fds = export(cap["id"], cap["auth"], wire.ResourceKind.MULTICAST)  # type: ignore[arg-type]
    assert reply.status == Status.NOT_FOUND and not fds
    # A size other than the one handed out names nothing the creator gave.
    reply, fds = export(cap["id"], cap["auth"], size=2 * int(cap["size"]))  # type: ignore[arg-type, call-overload]
    assert reply.status == Status.UNAUTHORIZED and "handed out" in reply.message and not fds
    reply, fds = export(cap["id"], cap["auth"])  # type: ignore[arg-type]
    assert reply.status == Status.OK and len(fds) == 1
    for fd in fds:
        os.close(fd)
    # The creator noted who fetched (this test's process, alive): a FETCH record,
    # apart from the topology, naming the fetcher and its pid.
    (fetch,) = [r for r in shim.ok(Op.INSPECT).records if r.kind is wire.RecordKind.FETCH]
    assert (fetch.id, fetch.fetcher, fetch.pid) == (cap["id"], fetcher, os.getpid())
    assert fetch.creator == shim.participant
    # An open that failed after its fetch withdraws it: no FD, no record left.
    withdrawn, fds = shimenv.request(
        shim.path,
        wire.Request(
            op=Op.EXPORT,
            participant=shim.participant,
            resource_id=cap["id"],  # type: ignore[arg-type]
            authorization=cap["auth"],  # type: ignore[arg-type]
            resource_kind=wire.ResourceKind.UNICAST,
            fetcher=fetcher,
            export_size=int(cap["size"]),  # type: ignore[call-overload]
            withdraw=True,
        ),
    )
    assert withdrawn.status == Status.OK and not fds
    assert not [r for r in shim.ok(Op.INSPECT).records if r.kind is wire.RecordKind.FETCH]
    app_still_works(w)


# ---------------------------------------------------------------- INSPECT
def test_inspect_records(spawn: Spawn, control_dir: Path) -> None:
    creator, importer = spawn(), spawn()
    c, i = Shim(control_dir, creator.pid), Shim(control_dir, importer.pid)
    assert c.ok(Op.INSPECT).records == ()  # nothing shared yet
    creator(
        """
H['x'] = check(cu.cuMemCreate(2 * gran, prop(), 0))
H['va'] = map_rw(H['x'], 2 * gran)
H['p'] = check(cu.cuMemCreate(gran, prop(), 0))      # private: reported, staged too
H['pva'] = map_rw(H['p'], gran)
send_fd(export(H['x']))
"""
    )
    importer.give_fd(creator.take_fd())
    # Drivers map only whole allocations (the simulator as the H200); the H200
    # has one device, so there the second location is the device again.
    off, sz2, other = (0, 2, 1) if simenv.is_simulated() else (0, 2, 0)
    importer(f"OFF = {off} * gran; SZ2 = {sz2} * gran; OTHER = {other}")
    importer(
        """
fd = recv_fd()
H['y'] = import_fd(fd); os.close(fd)
H['va1'] = map_rw(H['y'], 2 * gran)
H['va2'] = reserve(SZ2)
check(cu.cuMemMap(H['va2'], SZ2, OFF, H['y'], 0))
check(access(H['va2'], SZ2, 0))
check(access(H['va2'], SZ2, OTHER, cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READ))
H['r'] = check(cu.cuMemRetainAllocationHandle(H['va1']))
result = [int(H['r']) == int(H['y'])]
"""
    )
    gran = int(creator("result = gran"))
    cr = c.ok(Op.INSPECT).records
    ir = i.ok(Op.INSPECT).records
    K = wire.RecordKind
    # The private allocation is the creator's to stage as well (SNAPSHOT_SHIM_STAGE_PRIVATE,
    # on by default): two allocations by id, each followed by its mapping, then the FETCH.
    assert [r.kind for r in cr] == [K.ALLOCATION, K.MAPPING] * 2 + [K.FETCH]
    fetch = cr[4]  # the importer fetched the export: its id and pid, as the creator saw them
    (alloc,) = [r for r in cr[::2] if r.kind is K.ALLOCATION and r.id == fetch.id]
    (private,) = [r for r in cr[::2] if r.kind is K.ALLOCATION and r.id != fetch.id]
    assert (fetch.id, fetch.fetcher, fetch.pid) == (alloc.id, i.participant, importer.pid)
    assert fetch.creator == c.participant and not fetch.flags and not fetch.access
    assert private.flags == alloc.flags and private.size == gran
    F = wire.RecordFlag
    assert alloc.flags == F.CREATOR | F.HANDLE_LIVE | F.CONTENT
    assert alloc.creator == c.participant and alloc.handle_count == 1
    assert alloc.handle_types == 1 and alloc.size == 2 * int(creator("result = gran"))
    assert [r.kind for r in ir] == [wire.RecordKind.ALLOCATION] + [wire.RecordKind.MAPPING] * 2
    assert ir[0].id == alloc.id and ir[0].creator == c.participant
    assert ir[0].flags == wire.RecordFlag.HANDLE_LIVE and ir[0].handle_count == 2  # import+retain
    assert ir[1].address < ir[2].address  # mappings sorted by address
    whole, second = sorted(ir[1:], key=lambda r: len(r.access))
    assert (whole.offset, second.offset, second.size) == (0, off * gran, sz2 * gran)
    # Access merged per location, not last-call-wins, sorted by location.
    if other:
        assert len(second.access) == 2
        assert second.access == (wire.Access(1, 0, 3), wire.Access(1, 1, 1))
        assert whole.access == (wire.Access(1, 0, 3),)
    else:  # the same location twice: the later call wins for it
        assert {second.access, whole.access} == {(wire.Access(1, 0, 1),), (wire.Access(1, 0, 3),)}
    # Records are deterministic: asking twice gives the same bytes.
    assert i.ok(Op.INSPECT).records == ir


def test_raw_import_and_unsupported_exportable_reported(
    spawn: Spawn, control_dir: Path, sim_namespace: str
) -> None:
    app = spawn()
    shim = Shim(control_dir, app.pid)
    plain = spawn("plain", simenv.sim_env(namespace=sim_namespace), setup=shimenv.WORKER_SETUP)
    try:
        plain("H['x'] = check(cu.cuMemCreate(gran, prop(), 0)); send_fd(export(H['x']))")
        app.give_fd(plain.take_fd())
        app("fd = recv_fd(); H['raw'] = import_fd(fd); os.close(fd)")
        app("H['rva'] = map_rw(H['raw'], gran)")
        fabric = "cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_FABRIC"
        # POSIX | FABRIC: exportable through a handle type the shim does not capture.
        made = app(f"e, H['u'] = cu.cuMemCreate(gran, prop(POSIX | {fabric}), 0); result = err(e)")
        if made != "CUDA_SUCCESS":  # a real GPU without fabric support
            assert not simenv.is_simulated()
            app("H['u'] = check(cu.cuMemCreate(gran, prop(), 0))")
        app("H['uva'] = map_rw(H['u'], gran)")
        reply = shim.ok(Op.INSPECT)
        kinds = sorted(r.kind for r in reply.records)
        expect = [wire.RecordKind.RAW_IMPORT]
        if made == "CUDA_SUCCESS":
            expect.append(wire.RecordKind.UNSUPPORTED_EXPORTABLE)
        assert kinds == expect
        assert "raw import" in reply.message
        # The application keeps using both.
        app("fill(H['rva'], gran, 3); fill(H['uva'], gran, 4)")
        assert app("result = digest(H['uva'], gran) == expected(4, gran)")
        # Released and unmapped: nothing left to refuse.
        app("""
for k, v in (('raw', 'rva'), ('u', 'uva')):
    check(cu.cuMemUnmap(H[v], gran)); check(cu.cuMemRelease(H[k]))
""")
        assert shim.ok(Op.INSPECT).records == ()
    finally:
        plain.close_clean()


# ---------------------------------------------------------------- the phase machine
NATIVE = snippet.load(__file__, "native")


def native_checkpoint_restore(spawn: Spawn, namespace: str, pids: list[int]) -> list[int]:
    """Native lock, checkpoint, restore, unlock of ``pids`` (processes of the simulated
    driver's ``namespace``) from a process without the shim; their states once
    checkpointed."""
    controller = spawn("controller", simenv.sim_env(namespace=namespace), setup="")
    try:
        controller(f"PIDS = {pids!r}")
        return list(controller(NATIVE))
    finally:
        controller.close_clean()


CAPTURE = [Op.QUIESCE, Op.PREPARE_MULTICAST, Op.SAVE_ALLOCATIONS, Op.PREPARE_UNICAST]
RESTORE = [
    Op.LOAD_ALLOCATIONS,
    Op.RESTORE_UNICAST,
    Op.RESTORE_MULTICAST_CREATORS,
    Op.RESTORE_MULTICAST_IMPORTERS,
    Op.RESTORE_MULTICAST_DEVICES,
    Op.RESTORE_MULTICAST_BINDINGS,
]


@pytest.mark.threads  # make tsan
@pytest.mark.parametrize("mode", ["host", "private-native", "native"])
def test_unicast_cycle(spawn: Spawn, control_dir: Path, sim_namespace: str, mode: str) -> None:
    """The whole unicast cycle; ``host``: the creator stages its shared and its private
    allocation; ``private-native``: only the shared one (SNAPSHOT_SHIM_STAGE_PRIVATE=0),
    the private one stays with the native checkpoint; ``native``: the creator keeps both
    (SNAPSHOT_CONTENT_MODE=native) and copies nothing, the importer still tears down."""
    extra = {"SNAPSHOT_CONTENT_MODE": "native" if mode == "native" else "host"}
    if mode == "private-native":
        extra["SNAPSHOT_SHIM_STAGE_PRIVATE"] = "0"
    creator, importer = spawn(extra=extra), spawn()
    c, i = Shim(control_dir, creator.pid), Shim(control_dir, importer.pid)
    creator(
        """
H['x'] = check(cu.cuMemCreate(2 * gran, prop(), 0))
H['va'] = map_rw(H['x'], 2 * gran)
fill(H['va'], 2 * gran, 11)
H['p'] = check(cu.cuMemCreate(gran, prop(), 0))
H['pva'] = map_rw(H['p'], gran)
fill(H['pva'], gran, 12)
send_fd(export(H['x']))
"""
    )
    cap = creator.take_fd()
    importer.give_fd(cap)
    # Drivers map whole allocations only (the simulator as the H200).
    off, sz2 = 0, 2
    importer(f"OFF = {off} * gran; SZ2 = {sz2} * gran")
    importer(
        """
fd = recv_fd()
H['y'] = import_fd(fd); os.close(fd)
H['va1'] = map_rw(H['y'], 2 * gran)
H['va2'] = map_rw(H['y'], SZ2, offset=OFF)
"""
    )
    gran = int(creator("result = gran"))
    inspected = c.ok(Op.INSPECT)
    captured = {c.participant: inspected.records, i.participant: i.ok(Op.INSPECT).records}
    # What the creator stages, and what it leaves to the native checkpoint (INSPECT's
    # stats): allocations and bytes.
    moved, left = {
        "host": ((2, 3 * gran), (0, 0)),
        "private-native": ((1, 2 * gran), (1, gran)),
        "native": ((0, 0), (2, 3 * gran)),
    }[mode]
    assert (inspected.stats.count, inspected.stats.bytes) == left
    allocations = [r for r in inspected.records if r.kind is wire.RecordKind.ALLOCATION]
    assert len(allocations) == (1 if mode == "private-native" else 2)
    for op in CAPTURE:
        replies = [p.ok(op) for p in (c, i)]
        if op == Op.SAVE_ALLOCATIONS:
            assert (replies[0].stats.count, replies[0].stats.bytes) == moved
            assert replies[1].stats.count == 0
    assert {p.ok(Op.HANDSHAKE).phase for p in (c, i)} == {Phase.PREPARED}
    # Outside ACTIVE the application's calls wait at the closed gate (quiesce.md).
    shimenv.send_held(importer, "result = err(cu.cuCtxSynchronize())")
    # While PREPARED, INSPECT reports what was captured: a restore compares it with
    # its state file before it changes anything.
    assert {p.participant: p.ok(Op.INSPECT).records for p in (c, i)} == captured
    # The native checkpoint and restore of both, from a controller without the shim.
    states = native_checkpoint_restore(spawn, sim_namespace, [creator.pid, importer.pid])
    assert states == [2, 2]  # CHECKPOINTED
    for op in RESTORE:
        for p in (c, i):
            p.ok(op)
    assert importer.reply() == "CUDA_SUCCESS"  # let go once ACTIVE
    assert {p.ok(Op.HANDSHAKE).phase for p in (c, i)} == {Phase.ACTIVE}
    assert {p.participant: p.ok(Op.INSPECT).records for p in (c, i)} == captured
    # Same bytes at the same VAs, sharing is live again, old handles work.
    assert creator("result = digest(H['va'], 2 * gran) == expected(11, 2 * gran)")
    assert creator("result = digest(H['pva'], gran) == expected(12, gran)")
    importer("fill(H['va2'], gran, 13)")
    assert creator(f"result = digest(H['va'] + {off} * gran, gran) == expected(13, gran)")
    importer("""
check(cu.cuMemUnmap(H['va2'], SZ2))
check(cu.cuMemMap(H['va2'], SZ2, OFF, H['y'], 0))
check(access(H['va2'], SZ2))
result = digest(H['va2'], gran)
""")
    # A capability exported before the cycle still imports afterwards.
    late = spawn()
    late.give_fd(cap)
    now = creator("result = digest(H['va'], 2 * gran)")
    late("fd = recv_fd(); h = import_fd(fd); os.close(fd); va = map_rw(h, 2 * gran)")
    assert late("result = digest(va, 2 * gran)") == now
    importer("""
for va, size in ((H['va1'], 2 * gran), (H['va2'], SZ2)):
    check(cu.cuMemUnmap(va, size))
check(cu.cuMemRelease(H['y']))
result = err(cu.cuMemRelease(H['y']))
""")
    os.close(cap)


def test_failed_is_sticky_and_reported(spawn: Spawn, control_dir: Path) -> None:
    creator, importer = spawn(), spawn()
    c, i = Shim(control_dir, creator.pid), Shim(control_dir, importer.pid)
    creator("H['x'] = check(cu.cuMemCreate(gran, prop(), 0)); H['va'] = map_rw(H['x'], gran)")
    creator("send_fd(export(H['x']))")
    importer.give_fd(creator.take_fd())
    importer("fd = recv_fd(); H['y'] = import_fd(fd); os.close(fd); H['va'] = map_rw(H['y'], gran)")
    for op in CAPTURE:
        for p in (c, i):
            p.ok(op)
    creator.kill()  # the creator is gone: the importer cannot re-import
    i.ok(Op.LOAD_ALLOCATIONS)
    reply = i.call(Op.RESTORE_UNICAST)
    assert reply.status == Status.CUDA_FAILED and reply.phase == Phase.FAILED
    assert "RESTORE_UNICAST" in reply.message
    hs = i.ok(Op.HANDSHAKE)
    assert hs.phase == Phase.FAILED and hs.message == reply.message
    assert i.call(Op.INSPECT).status == Status.WRONG_PHASE
    assert i.call(Op.RESTORE_UNICAST).status == Status.WRONG_PHASE
    shimenv.send_held(importer, "result = err(cu.cuMemUnmap(H['va'], gran))")
    importer.kill()  # held until a rollback, which cannot re-import from a dead creator


def test_status_names_the_driver_the_shim_loaded(spawn: Spawn, control_dir: Path) -> None:
    """STATUS with ask_driver (protocol.h, CUIP_ASK_DRIVER): the path of the libcuda.so.1
    the process runs on, for the coordinator's native calls; a plain STATUS is as before,
    and a STATUS asking anything beyond the two asks' bits is refused."""
    w = spawn()
    shim = Shim(control_dir, w.pid)
    reply, _ = shimenv.request(shim.path, wire.Request(Op.STATUS, ask_driver=True))
    assert reply.status is Status.OK and reply.phase is Phase.ACTIVE, reply
    if simenv.is_simulated():
        expected = simenv.sim_dir() / "libcuda.so.1"
        assert Path(reply.message).resolve() == expected.resolve(), reply.message
    else:  # the machine's own, wherever the loader found it
        assert Path(reply.message).name.startswith("libcuda.so"), reply.message
    plain, _ = shimenv.request(shim.path, wire.Request(Op.STATUS))
    assert (plain.status, plain.message) == (Status.OK, "")
    me = shim.participant.encode()
    got = shimenv.raw_exchange(shim.path, bytes(header(op=Op.STATUS, participant=me,
                                                       stat_count=4)))  # fmt: skip
    assert struct.unpack_from("<i", got, 8)[0] == Status.BAD_REQUEST
    app_still_works(w)


def test_status_names_the_gpus_the_process_uses(spawn: Spawn, control_dir: Path) -> None:
    """STATUS asking the devices: one line a GPU in use (its primary context is active,
    memory is there), ordinal, UUID, bytes created, name."""
    w = spawn()
    w.check("alloc", size=2 << 20)  # a granularity: owned (a smaller one is the driver's)
    shim = Shim(control_dir, w.pid)
    reply, _ = shimenv.request(shim.path, wire.Request(Op.STATUS, ask_devices=True))
    assert reply.status is Status.OK, reply
    (line,) = reply.message.splitlines()
    ordinal, uuid, created, name = line.split("\t")
    assert ordinal == "0" and re.fullmatch(r"GPU-[0-9a-f-]{36}", uuid), line
    assert int(created) >= 2 << 20 and name, line
    # Both asked (CUIP_ASK_ALL): the driver's line, then the same report, in one reply.
    both, _ = shimenv.request(shim.path, wire.Request(Op.STATUS, ask_driver=True, ask_devices=True))
    driver, _ = shimenv.request(shim.path, wire.Request(Op.STATUS, ask_driver=True))
    assert both.status is Status.OK, both
    assert both.message == f"{driver.message}\n{reply.message}", both.message
    app_still_works(w)
