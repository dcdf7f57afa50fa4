"""Staged bytes in a file beside the CRIU images (shim_c/stored.c), simulated driver.

After a capture the coordinator hands the shim an open file (STORE_STAGED, the descriptor
as SCM_RIGHTS): the shim writes every staged copy into it with its threads and frees the
host memory; before the restore it hands the file again (FETCH_STAGED) and the shim reads
the copies back, after checking every field of the file against what it stored. Here:
the file's layout (protocol.h's stored file), every byte back through it with the native
checkpoint between, what is refused (no descriptor, a second STORE, a file not empty, the
wrong phase, LOAD and ROLLBACK before FETCH) and a hostile file of each kind (cut short,
grown, another magic or version, another writer, an entry that lies), each leaving the
shim able to FETCH the right file; a rollback from every point after STORE.
"""

from __future__ import annotations

import os
import socket
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
from cuinterpose.demo import Worker
from cuinterpose.engine import wire

from tests.shim.test_content import finish, intact, make_shared
from tests.shim.test_control import CAPTURE, RESTORE, Shim, native_checkpoint_restore
from tests.simenv import Spawn

Op, Status = wire.Op, wire.Status
H, E = wire.STORED_HEADER_STRUCT, wire.STORED_ENTRY_STRUCT
# Sizes in granules: several chunks of the pool, a short last piece, small neighbours.
SIZES = [5, 1, 2, 1, 3]


def align(v: int) -> int:
    return -(-v // wire.STORED_ALIGN) * wire.STORED_ALIGN


def captured(spawn: Spawn, control_dir: Path) -> tuple[Worker, Shim, int]:
    """A creator with its allocations staged (PREPARED); (worker, shim, granularity)."""
    w = spawn(extra={"SNAPSHOT_SHIM_COPY_THREADS": "3", "SNAPSHOT_SHIM_COPY_CHUNK_MIB": "1"})
    gran = make_shared(w, SIZES, seed=900)
    c = Shim(control_dir, w.pid)
    for op in CAPTURE:
        c.ok(op)
    return w, c, gran


def with_file(c: Shim, op: wire.Op, path: Path, flags: int) -> wire.Reply:
    fd = os.open(path, flags | os.O_CLOEXEC, 0o600)
    try:
        return c.call(op, fd=fd)
    finally:
        os.close(fd)


def store(c: Shim, path: Path) -> wire.Reply:
    return with_file(c, Op.STORE_STAGED, path, os.O_CREAT | os.O_EXCL | os.O_RDWR)


def fetch(c: Shim, path: Path) -> wire.Reply:
    return with_file(c, Op.FETCH_STAGED, path, os.O_RDONLY)


def refused(reply: wire.Reply, status: wire.Status, words: str) -> None:
    assert (reply.status, reply.phase) == (status, wire.Phase.PREPARED), reply
    assert words in reply.message, reply.message


def test_staged_bytes_go_through_the_file(
    spawn: Spawn, control_dir: Path, sim_namespace: str, tmp_path: Path
) -> None:
    """STORE writes the header, one entry per allocation in table order and each
    allocation's bytes at its aligned offset; the staged copies are gone from memory
    (LOAD and ROLLBACK refuse, naming FETCH); after the native checkpoint and restore, FETCH brings
    them back and the restore finds every byte."""
    w, c, gran = captured(spawn, control_dir)
    path = tmp_path / "staged.bin"
    reply = store(c, path)
    assert reply.status == Status.OK, reply.message
    total = sum(SIZES) * gran
    assert (reply.stats.count, reply.stats.bytes) == (len(SIZES), total)
    raw = path.read_bytes()
    magic, version, count, reserved, nbytes, data_offset, writer = H.unpack_from(raw)
    assert (magic, version, count, reserved, nbytes) == (
        wire.STORED_MAGIC,
        wire.STORED_VERSION,
        len(SIZES),
        0,
        total,
    )
    assert writer.decode() == c.participant
    assert data_offset == align(H.size + count * E.size)
    at = data_offset
    for k, n in enumerate(SIZES):
        _, size, offset = E.unpack_from(raw, H.size + k * E.size)
        assert (size, offset) == (n * gran, at)
        at = align(at + size)
    assert len(raw) == offset + size
    # The host copies are gone: nothing to load or roll back to until FETCH.
    refused(c.call(Op.LOAD_ALLOCATIONS), Status.REFUSED, "in the stored file")
    refused(c.call(Op.ROLLBACK_ALLOCATIONS), Status.REFUSED, "in the stored file")
    refused(store(c, tmp_path / "again.bin"), Status.REFUSED, "stored already")
    assert native_checkpoint_restore(spawn, sim_namespace, [w.pid]) == [2]
    reply = fetch(c, path)
    assert reply.status == Status.OK, reply.message
    assert (reply.stats.count, reply.stats.bytes) == (len(SIZES), total)
    for op in RESTORE:
        c.ok(op)
    assert intact(w)
    assert "warning" not in finish(w)


def test_what_store_and_fetch_refuse(spawn: Spawn, control_dir: Path, tmp_path: Path) -> None:
    """No descriptor (the shim's check, below the client's), a file that is not empty, a
    directory, the wrong phase, a file the shim cannot write: refused or failed, nothing
    changed (the copies stay in memory); the capture then goes on. With
    nothing stored, FETCH answers OK at once without looking at what it was handed."""
    w = spawn()
    make_shared(w, [1], seed=5)
    c = Shim(control_dir, w.pid)
    refused_active = store(c, tmp_path / "early.bin")
    assert refused_active.status == Status.WRONG_PHASE, refused_active
    for op in CAPTURE:
        c.ok(op)
    # Nothing stored yet: FETCH answers at once, whatever the file (here not one at all).
    nothing = with_file(c, Op.FETCH_STAGED, tmp_path, os.O_RDONLY)
    assert (nothing.status, nothing.stats.count) == (Status.OK, 0), nothing
    header = wire.Request(op=Op.STORE_STAGED, participant=c.participant, fd=0).encode()
    # The descriptor left out: sent as bare bytes, as a client that lost it would.
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(30)
        s.connect(str(c.path))
        s.sendall(header)
        data = b""
        while chunk := s.recv(1 << 16):
            data += chunk
    bare = wire.Reply.decode(data)
    assert bare.status == Status.BAD_REQUEST and "must carry a file descriptor" in bare.message
    full = tmp_path / "full.bin"
    full.write_bytes(b"x")
    refused(with_file(c, Op.STORE_STAGED, full, os.O_RDWR), Status.REFUSED, "empty regular file")
    refused(with_file(c, Op.STORE_STAGED, tmp_path, os.O_RDONLY), Status.REFUSED, "regular")
    # A file the shim cannot write: the write fails, naming the call; the copies stay.
    (tmp_path / "ro.bin").touch()
    failed = with_file(c, Op.STORE_STAGED, tmp_path / "ro.bin", os.O_RDONLY)
    refused(failed, Status.INTERNAL, "Bad file descriptor")
    assert failed.message.endswith("the staged bytes stay in memory"), failed.message
    assert store(c, tmp_path / "ok.bin").status == Status.OK
    refused(with_file(c, Op.FETCH_STAGED, tmp_path, os.O_RDONLY), Status.REFUSED, "regular")
    assert fetch(c, tmp_path / "ok.bin").status == Status.OK
    for op in RESTORE:
        c.ok(op)
    assert intact(w)
    finish(w)


def patch(offset: int, fmt: str, value: int | bytes) -> Callable[[bytearray], bytearray]:
    def apply(raw: bytearray) -> bytearray:
        struct.pack_into(fmt, raw, offset, value)
        return raw

    return apply


# Each hostile file and the words FETCH answers it with.
HOSTILE: dict[str, tuple[Callable[[bytearray], bytearray], str]] = {
    "empty": (lambda raw: bytearray(), "shorter than its header"),
    "cut-in-the-header": (lambda raw: raw[:40], "shorter than its header"),
    "cut-in-the-data": (lambda raw: raw[:-1], "the file has"),
    "grown": (lambda raw: raw + b"\0", "the file has"),
    "magic": (patch(0, "<I", 0x12345678), "not a stored file"),
    "version": (patch(4, "<I", 2), "not a stored file"),
    "reserved": (patch(12, "<I", 1), "not a stored file"),
    "writer": (patch(32, "<32s", b"f" * 32), "written by participant"),
    "count": (patch(8, "<I", 4), "the file holds"),
    "bytes": (patch(16, "<Q", 1), "the file holds"),
    "data-offset": (patch(24, "<Q", 8192), "the file holds"),
    "entry-id": (patch(H.size + E.size, "<16s", b"\1" * 16), "entry 1 of the file"),
    "entry-size": (patch(H.size + 16, "<Q", 1 << 40), "entry 0 of the file"),
    "entry-offset": (patch(H.size + 2 * E.size + 24, "<Q", 0), "entry 2 of the file"),
}


def test_a_hostile_file_is_refused_before_a_byte_is_read(
    spawn: Spawn, control_dir: Path, tmp_path: Path
) -> None:
    """Each corruption of the stored file answers REFUSED naming what is wrong, and maps
    nothing (LOAD still refuses, naming FETCH); the true file then FETCHes and every
    byte comes back."""
    w, c, _ = captured(spawn, control_dir)
    good = tmp_path / "staged.bin"
    assert store(c, good).status == Status.OK
    raw = good.read_bytes()
    for name, (corrupt, words) in HOSTILE.items():
        bad = tmp_path / f"{name}.bin"
        bad.write_bytes(bytes(corrupt(bytearray(raw))))
        refused(fetch(c, bad), Status.REFUSED, words)
        refused(c.call(Op.LOAD_ALLOCATIONS), Status.REFUSED, "FETCH_STAGED first")
    assert fetch(c, good).status == Status.OK
    for op in RESTORE:
        c.ok(op)
    assert intact(w)
    finish(w)


@pytest.mark.parametrize("stop", ["STORE_STAGED", "FETCH_STAGED", "LOAD_ALLOCATIONS"])
def test_a_rollback_after_the_file(
    spawn: Spawn, control_dir: Path, tmp_path: Path, stop: str
) -> None:
    """Stopped after STORE (the bytes only in the file: FETCH first), after FETCH, or
    after the LOAD that followed it: ROLLBACK_ALLOCATIONS and ROLLBACK_IMPORTS bring the
    process back to ACTIVE with every byte."""
    w, c, _ = captured(spawn, control_dir)
    path = tmp_path / "staged.bin"
    assert store(c, path).status == Status.OK
    if stop != "STORE_STAGED":
        assert fetch(c, path).status == Status.OK
    if stop == "LOAD_ALLOCATIONS":
        c.ok(Op.LOAD_ALLOCATIONS)
    if stop == "STORE_STAGED":
        refused(c.call(Op.ROLLBACK_ALLOCATIONS), Status.REFUSED, "FETCH_STAGED first")
        assert fetch(c, path).status == Status.OK
    c.ok(Op.ROLLBACK_ALLOCATIONS)
    reply = c.ok(Op.ROLLBACK_IMPORTS)
    assert reply.phase == wire.Phase.ACTIVE
    assert intact(w)
    finish(w)
