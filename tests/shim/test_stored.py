"""Staged bytes in files beside the CRIU images (shim_c/stored.c), simulated driver.

After a capture the coordinator hands the shim N open files, its parts (STORE_STAGED, the
descriptors as SCM_RIGHTS, part k the k-th): the shim writes every staged copy into them
with its threads, the bytes one stream striped across the parts, and frees the host
memory; before the restore it hands the parts again (FETCH_STAGED) and the shim reads the
copies back, after checking every part against what it stored. Here: the layout
(protocol.h's stored files) for 1, 3 and 16 parts with one allocation over several
stripes and small ones around it, every byte back through them with the native
checkpoint between; what is refused (no descriptor or too many, a second STORE, a file
not empty or handed twice, the wrong phase, LOAD and ROLLBACK before FETCH); a hostile
set of parts of each kind (out of order, one missing or too many, a part cut short or
grown, another magic, version, writer, count or offset, an entry that lies), each leaving
the shim able to FETCH the right parts; a rollback from every point after STORE.
"""

from __future__ import annotations

import array
import ctypes
import ctypes.util
import os
import socket
import struct
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
from cuinterpose.demo import Worker
from cuinterpose.engine import wire
from cuinterpose.engine.stored import Layout

from tests.shim.test_content import finish, intact, make_shared
from tests.shim.test_control import CAPTURE, RESTORE, Shim, native_checkpoint_restore
from tests.simenv import Spawn

Op, Status = wire.Op, wire.Status
H, E = wire.STORED_HEADER_STRUCT, wire.STORED_ENTRY_STRUCT
STRIPE = wire.STORED_STRIPE
# The dump these tests store as, and an earlier one.
DUMP = bytes.fromhex("0123456789abcdef" * 2)
EARLIER = bytes.fromhex("fedcba9876543210" * 2)
# Sizes in granules (2 MiB on the simulator): several chunks of the pool, a short last
# piece, small neighbours.
SIZES = [5, 1, 2, 1, 3]
# One allocation over several 8 MiB stripes, then small ones around a mid-sized one.
STRIPED = [13, 1, 1, 1, 4, 1, 1]


def align(v: int) -> int:
    return -(-v // wire.STORED_ALIGN) * wire.STORED_ALIGN


def captured(spawn: Spawn, control_dir: Path, sizes: list[int] = SIZES) -> tuple[Worker, Shim, int]:
    """A creator with its allocations staged (PREPARED); (worker, shim, granularity)."""
    w = spawn(extra={"SNAPSHOT_SHIM_COPY_THREADS": "3", "SNAPSHOT_SHIM_COPY_CHUNK_MIB": "1"})
    gran = make_shared(w, sizes, seed=900)
    c = Shim(control_dir, w.pid)
    for op in CAPTURE:
        c.ok(op)
    return w, c, gran


def parts(where: Path, n: int) -> list[Path]:
    return [where / f"staged.{k}.bin" for k in range(n)]


def with_files(
    c: Shim, op: wire.Op, paths: Sequence[Path], flags: int, dump: bytes = DUMP
) -> wire.Reply:
    fds = [os.open(p, flags | os.O_CLOEXEC, 0o600) for p in paths]
    try:
        return c.call(op, fds=tuple(fds), resource_id=dump)
    finally:
        for fd in fds:
            os.close(fd)


def store(c: Shim, paths: Sequence[Path], dump: bytes = DUMP) -> wire.Reply:
    return with_files(c, Op.STORE_STAGED, paths, os.O_CREAT | os.O_EXCL | os.O_RDWR, dump)


def fetch(c: Shim, paths: Sequence[Path], dump: bytes = DUMP) -> wire.Reply:
    return with_files(c, Op.FETCH_STAGED, paths, os.O_RDONLY, dump)


def refused(reply: wire.Reply, status: wire.Status, words: str) -> None:
    assert (reply.status, reply.phase) == (status, wire.Phase.PREPARED), reply
    assert words in reply.message, reply.message


def check_layout(raws: list[bytes], sizes: list[int], participant: str) -> None:
    """Every part as protocol.h lays it out: its header, part 0's table, its stripes'
    sums (XXH64 of the stripe with the dump's seed, where libxxhash is there to say),
    each stripe of the stream in part s mod N, each part's exact size."""
    n, count, total = len(raws), len(sizes), sum(sizes)
    offsets, at = [], 0
    for size in sizes:
        offsets.append(at)
        at = align(at + size)
    stream = offsets[-1] + sizes[-1]
    layout = Layout(count, n, stream)
    stripes = -(-stream // STRIPE)
    for k, raw in enumerate(raws):
        mine = [s for s in range(stripes) if s % n == k]
        head = H.size + (count * E.size if k == 0 else 0)
        fields = H.unpack_from(raw)
        assert fields == (
            wire.STORED_MAGIC,
            wire.STORED_VERSION,
            count,
            k,
            n,
            total,
            align(head + 8 * len(mine)),
            participant.encode(),
            DUMP,
            len(mine),
        )
        end = head
        if mine:
            last = mine[-1]
            end = align(head + 8 * len(mine)) + (len(mine) - 1) * STRIPE
            end += min(STRIPE, stream - last * STRIPE)
        assert len(raw) == end == layout.size(k), (k, len(raw), end)
        sums = struct.unpack_from(f"<{len(mine)}Q", raw, head)
        for s, recorded in zip(mine, sums, strict=True):
            at = layout.stripe_at(s)
            data = raw[at : at + min(STRIPE, stream - s * STRIPE)]
            if _XXH64 is not None:  # else pinned by FETCH alone: a flipped byte refused
                assert recorded == _XXH64(data, int.from_bytes(DUMP[:8], "little") + s)
    for i, size in enumerate(sizes):
        _, got_size, got_offset = E.unpack_from(raws[0], H.size + i * E.size)
        assert (got_size, got_offset) == (size, offsets[i])


def _libxxhash() -> Callable[[bytes, int], int] | None:
    try:
        lib = ctypes.CDLL(ctypes.util.find_library("xxhash") or "libxxhash.so.0")
    except OSError:
        return None
    lib.XXH64.restype = ctypes.c_uint64
    lib.XXH64.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_uint64]
    return lambda data, seed: int(lib.XXH64(data, len(data), seed & (2**64 - 1)))


_XXH64 = _libxxhash()


@pytest.mark.parametrize("n", [1, 3, 16])
def test_staged_bytes_go_through_the_parts(
    spawn: Spawn, control_dir: Path, sim_namespace: str, tmp_path: Path, n: int
) -> None:
    """STORE writes N parts as the layout says (one allocation over several stripes, small
    ones around it; with 16 parts some hold no stripe); the staged copies are gone from
    memory (LOAD and ROLLBACK refuse, naming FETCH); after the native checkpoint and
    restore, FETCH brings them back and the restore finds every byte."""
    w, c, gran = captured(spawn, control_dir, STRIPED)
    paths = parts(tmp_path, n)
    reply = store(c, paths)
    assert reply.status == Status.OK, reply.message
    sizes = [k * gran for k in STRIPED]
    assert (reply.stats.count, reply.stats.bytes) == (len(sizes), sum(sizes))
    assert sizes[0] > 3 * STRIPE
    check_layout([p.read_bytes() for p in paths], sizes, c.participant)
    refused(c.call(Op.LOAD_ALLOCATIONS), Status.REFUSED, "in the stored file")
    refused(c.call(Op.ROLLBACK_ALLOCATIONS), Status.REFUSED, "in the stored file")
    refused(store(c, [tmp_path / "again.bin"]), Status.REFUSED, "stored already")
    assert native_checkpoint_restore(spawn, sim_namespace, [w.pid]) == [2]
    reply = fetch(c, paths)
    assert reply.status == Status.OK, reply.message
    assert (reply.stats.count, reply.stats.bytes) == (len(sizes), sum(sizes))
    for op in RESTORE:
        c.ok(op)
    assert intact(w)
    assert "warning" not in finish(w)


def send_raw(c: Shim, op: wire.Op, fds: Sequence[int]) -> wire.Reply:
    """The request's header with exactly ``fds`` (none, or more than the client allows)."""
    header = wire.Request(op=op, participant=c.participant, resource_id=DUMP, fds=(0,)).encode()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(30)
        s.connect(str(c.path))
        if fds:
            s.sendmsg([header], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
        else:
            s.sendall(header)
        data = b""
        while chunk := s.recv(1 << 16):
            data += chunk
    return wire.Reply.decode(data)


def test_what_store_and_fetch_refuse(spawn: Spawn, control_dir: Path, tmp_path: Path) -> None:
    """No descriptor or more than CUIP_STORED_MAX_PARTS (the shim's check, below the
    client's), a part that is not empty, a directory, one file handed twice, the wrong
    phase, a part the shim cannot write: refused or failed, nothing changed (the copies
    stay in memory); the capture then goes on. With nothing stored, FETCH answers OK at
    once without looking at what it was handed."""
    w = spawn()
    make_shared(w, [1], seed=5)
    c = Shim(control_dir, w.pid)
    refused_active = store(c, [tmp_path / "early.bin"])
    assert refused_active.status == Status.WRONG_PHASE, refused_active
    for op in CAPTURE:
        c.ok(op)
    # Nothing stored yet: FETCH answers at once, whatever the file (here not one at all).
    nothing = with_files(c, Op.FETCH_STAGED, [tmp_path], os.O_RDONLY)
    assert (nothing.status, nothing.stats.count) == (Status.OK, 0), nothing
    bare = send_raw(c, Op.STORE_STAGED, [])
    assert bare.status == Status.BAD_REQUEST and "it carried none" in bare.message, bare
    null = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    try:
        most = send_raw(c, Op.FETCH_STAGED, [null] * wire.STORED_MAX_PARTS)  # nothing stored
        many = send_raw(c, Op.FETCH_STAGED, [null] * (wire.STORED_MAX_PARTS + 1))
    finally:
        os.close(null)
    assert (most.status, most.stats.count) == (Status.OK, 0), most
    assert many.status == Status.BAD_REQUEST and "it carried more" in many.message, many
    assert "1 to 64 file descriptors" in many.message, many
    full = tmp_path / "full.bin"
    full.write_bytes(b"x")
    fresh = parts(tmp_path, 2)
    for p in fresh:
        p.touch()
    refused(with_files(c, Op.STORE_STAGED, [*fresh, full], os.O_RDWR), Status.REFUSED,
            "part 2: the descriptor handed is not an empty regular file")  # fmt: skip
    refused(with_files(c, Op.STORE_STAGED, [fresh[0], tmp_path], os.O_RDONLY), Status.REFUSED,
            "part 1: the descriptor handed is not an empty regular file")  # fmt: skip
    refused(with_files(c, Op.STORE_STAGED, [*fresh, fresh[0]], os.O_RDWR), Status.REFUSED,
            "part 2 is the same file as part 0")  # fmt: skip
    # A part the shim cannot write: the write fails, naming the part and the call.
    failed = with_files(c, Op.STORE_STAGED, [fresh[0], fresh[1]], os.O_RDONLY)
    refused(failed, Status.INTERNAL, "part 0: writing its header")
    assert "Bad file descriptor" in failed.message, failed.message
    assert failed.message.endswith("the staged bytes stay in memory"), failed.message
    assert store(c, [tmp_path / "ok.bin"]).status == Status.OK
    refused(with_files(c, Op.FETCH_STAGED, [tmp_path], os.O_RDONLY), Status.REFUSED,
            "part 0: the descriptor handed is not a regular file")  # fmt: skip
    assert fetch(c, [tmp_path / "ok.bin"]).status == Status.OK
    for op in RESTORE:
        c.ok(op)
    assert intact(w)
    finish(w)


def patch(
    part: int, offset: int, fmt: str, value: int | bytes
) -> Callable[[list[bytes]], list[bytes]]:
    def apply(raws: list[bytes]) -> list[bytes]:
        raw = bytearray(raws[part])
        struct.pack_into(fmt, raw, offset, value)
        return [*raws[:part], bytes(raw), *raws[part + 1 :]]

    return apply


def edit(part: int, change: Callable[[bytes], bytes]) -> Callable[[list[bytes]], list[bytes]]:
    return lambda raws: [change(r) if k == part else r for k, r in enumerate(raws)]


# Each hostile set of parts (of the 3 stored) and the words FETCH answers it with.
HOSTILE: dict[str, tuple[Callable[[list[bytes]], list[bytes]], str]] = {
    "out-of-order": (lambda r: [r[1], r[0], r[2]], "part 0: its part index"),
    "part-missing": (lambda r: r[:2], "part 0: its part count (the files handed) is 3, expected 2"),
    "part-too-many": (
        lambda r: [*r, r[2]],
        "part 0: its part count (the files handed) is 3, expected 4",
    ),
    "empty-part": (edit(2, lambda raw: b""), "part 2: the file is shorter than its header"),
    "cut-in-a-header": (
        edit(1, lambda raw: raw[:40]),
        "part 1: the file is shorter than its header",
    ),
    "cut-in-the-table": (
        edit(0, lambda raw: raw[: H.size + 40]),
        "part 0: the file's table is cut short",
    ),
    "part-cut-short": (edit(1, lambda raw: raw[:-1]), "part 1: the file has"),
    "part-grown": (edit(2, lambda raw: raw + b"\0"), "part 2: the file has"),
    "magic": (patch(1, 0, "<I", 0x12345678), "part 1: not a stored file (magic 0x12345678)"),
    "version": (patch(2, 4, "<I", 2), "part 2: stored format version 2, this shim reads version 3"),
    "identity": (
        patch(1, 64, "<16s", EARLIER),
        f"part 1: the file is of dump {EARLIER.hex()}, not of dump {DUMP.hex()}",
    ),
    "stripes": (patch(2, 80, "<Q", 7), "part 2: its stripe count is 7, expected 1"),
    "sum": (
        patch(0, H.size + len(SIZES) * E.size, "<Q", 1),
        "part 0: stripe 0 (file offset 4096, 8388608 bytes): its bytes sum to",
    ),
    "part-index": (
        patch(2, 12, "<H", 1),
        "part 2: its part index (the parts are handed in order) is 1, expected 2",
    ),
    "part-count": (
        patch(1, 14, "<H", 4),
        "part 1: its part count (the files handed) is 4, expected 3",
    ),
    "writer": (patch(1, 32, "<32s", b"f" * 32), "part 1: the file was written by participant"),
    "count": (patch(2, 8, "<I", 4), "part 2: its allocation count (this process stored) is 4"),
    "bytes": (patch(1, 16, "<Q", 1), "part 1: its byte count (this process stored) is 1"),
    "data-offset": (patch(1, 24, "<Q", 8192), "part 1: its data offset is 8192, expected 4096"),
    "entry-id": (patch(0, H.size + E.size, "<16s", b"\1" * 16), "part 0: entry 1 of the table"),
    "entry-size": (patch(0, H.size + 16, "<Q", 1 << 40), "part 0: entry 0 of the table"),
    "entry-offset": (patch(0, H.size + 2 * E.size + 24, "<Q", 0), "part 0: entry 2 of the table"),
}


def test_hostile_parts_are_refused_before_a_byte_is_read(
    spawn: Spawn, control_dir: Path, tmp_path: Path
) -> None:
    """Each corruption of the 3 parts answers REFUSED naming the part, the field and both
    values, and maps nothing (LOAD still refuses, naming FETCH); the true parts then
    FETCH and every byte comes back."""
    w, c, _ = captured(spawn, control_dir)
    good = parts(tmp_path, 3)
    assert store(c, good).status == Status.OK
    raws = [p.read_bytes() for p in good]
    assert all(len(r) > wire.STORED_ALIGN for r in raws)  # every part holds a stripe
    for name, (corrupt, words) in HOSTILE.items():
        bad: list[Path] = []
        for k, raw in enumerate(corrupt(raws)):
            if k < len(good) and raw == raws[k]:
                bad.append(good[k])  # unchanged: the true part
            else:
                bad.append(tmp_path / f"{name}.{k}.bin")
                bad[-1].write_bytes(raw)
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
    """Stopped after STORE (the bytes only in the parts: FETCH first), after FETCH, or
    after the LOAD that followed it: ROLLBACK_ALLOCATIONS and ROLLBACK_IMPORTS bring the
    process back to ACTIVE with every byte."""
    w, c, _ = captured(spawn, control_dir)
    paths = parts(tmp_path, 2)
    assert store(c, paths).status == Status.OK
    if stop != "STORE_STAGED":
        assert fetch(c, paths).status == Status.OK
    if stop == "LOAD_ALLOCATIONS":
        c.ok(Op.LOAD_ALLOCATIONS)
    if stop == "STORE_STAGED":
        refused(c.call(Op.ROLLBACK_ALLOCATIONS), Status.REFUSED, "FETCH_STAGED first")
        assert fetch(c, paths).status == Status.OK
    c.ok(Op.ROLLBACK_ALLOCATIONS)
    reply = c.ok(Op.ROLLBACK_IMPORTS)
    assert reply.phase == wire.Phase.ACTIVE
    assert intact(w)
    finish(w)


def test_a_flipped_byte_is_refused_naming_the_part_stripe_and_offset(
    spawn: Spawn, control_dir: Path, tmp_path: Path
) -> None:
    """One data byte flipped in one part (size and header intact): FETCH reads, sums and
    refuses it, naming the part, the stripe, its file offset and both sums; nothing is
    mapped (LOAD still names FETCH); the true byte put back, every byte comes back."""
    w, c, gran = captured(spawn, control_dir, STRIPED)
    good = parts(tmp_path, 3)
    assert store(c, good).status == Status.OK
    layout = Layout(len(STRIPED), 3, sum(STRIPED) * gran)  # granules: no alignment gap
    assert layout.stripes == 6  # part 1 holds stripes 1 and 4
    raw = bytearray(good[1].read_bytes())
    at = layout.stripe_at(4) + 12345
    raw[at] ^= 0x20
    good[1].write_bytes(bytes(raw))
    reply = fetch(c, good)
    words = f"part 1: stripe 4 (file offset {layout.stripe_at(4)}, {STRIPE} bytes): its bytes"
    refused(reply, Status.REFUSED, words)
    assert "they changed since they were stored" in reply.message
    refused(c.call(Op.LOAD_ALLOCATIONS), Status.REFUSED, "FETCH_STAGED first")
    raw[at] ^= 0x20
    good[1].write_bytes(bytes(raw))
    assert fetch(c, good).status == Status.OK
    for op in RESTORE:
        c.ok(op)
    assert intact(w)
    finish(w)


@pytest.mark.skipif(os.geteuid() != 0, reason="a part of uid 65534 needs root to make")
def test_an_untrusted_part_is_refused_before_a_byte_is_read(
    spawn: Spawn, control_dir: Path, tmp_path: Path
) -> None:
    """A part others may write (0666, 0620) or owned by uid 65534 is refused by its
    descriptor's owner and mode before anything of it is read: its header is garbage
    too, and the answer is the trust, not the header. The dump named must be the one
    stored (and some dump must be named)."""
    w, c, _ = captured(spawn, control_dir)
    good = parts(tmp_path, 2)
    assert store(c, good).status == Status.OK
    bad = tmp_path / "bad.1.bin"
    bad.write_bytes(b"\xff" * 64)
    for mode, owner, words in [
        (0o666, 0, "part 1: the file is writable by group or others (uid 0, mode 0666)"),
        (0o620, 0, "part 1: the file is writable by group or others (uid 0, mode 0620)"),
        (0o600, 65534, "part 1: the file is owned by another user than root or this "
         "process's (uid 65534, mode 0600)"),
    ]:  # fmt: skip
        os.chmod(bad, mode)
        os.chown(bad, owner, owner)
        reply = fetch(c, [good[0], bad])
        refused(reply, Status.REFUSED, words)
        assert reply.message.endswith("not trusted, nothing of it was read"), reply.message
    refused(fetch(c, good, EARLIER), Status.REFUSED,
            f"the coordinator asks for the parts of dump {EARLIER.hex()}; this process "
            f"stored dump {DUMP.hex()}")  # fmt: skip
    nameless = fetch(c, good, wire.ZERO_ID)
    assert nameless.status == Status.BAD_REQUEST, nameless
    assert "must name the dump" in nameless.message, nameless
    assert fetch(c, good).status == Status.OK
    for op in RESTORE:
        c.ok(op)
    assert intact(w)
    finish(w)


def test_an_earlier_stores_parts_are_refused_naming_both(
    spawn: Spawn, control_dir: Path, tmp_path: Path
) -> None:
    """Stored as one dump, fetched, stored again as another: the first store's parts (the
    same process, the same layout) are refused by the dump they carry, naming both."""
    w, c, _ = captured(spawn, control_dir)
    earlier, newer = parts(tmp_path / "a", 2), parts(tmp_path / "b", 2)
    earlier[0].parent.mkdir()
    newer[0].parent.mkdir()
    assert store(c, earlier, EARLIER).status == Status.OK
    assert fetch(c, earlier, EARLIER).status == Status.OK
    assert store(c, newer).status == Status.OK
    refused(fetch(c, earlier), Status.REFUSED,
            f"part 0: the file is of dump {EARLIER.hex()}, not of dump {DUMP.hex()}")  # fmt: skip
    mixed = [newer[0], earlier[1]]
    refused(fetch(c, mixed), Status.REFUSED, f"part 1: the file is of dump {EARLIER.hex()}")
    assert fetch(c, newer).status == Status.OK
    for op in RESTORE:
        c.ok(op)
    assert intact(w)
    finish(w)


CASES = [(0, 0, 1), (1, 5, 1), (31, 0, 7), (32, 1, 32), (33, 2, 5), (100, 2**63 + 9, 64),
         (4096 + 17, 3, 1000), ((1 << 20) + 3, 2**64 - 1, 1 << 20), (3000, 4, 0)]  # fmt: skip


@pytest.mark.skipif(_XXH64 is None, reason="libxxhash.so.0 is not installed")
def test_the_sums_are_xxh64_whatever_the_pieces() -> None:
    """shim_c/xxh64.h against the reference library (libxxhash): short inputs and tails,
    every seed width, fed in pieces of any size across its 32-byte blocks, and zeros fed
    as xxh64_zeros feeds an alignment gap."""
    from tests.shim import shimenv

    args = [f"{n}:{seed}:{split}" for n, seed, split in CASES]
    out = subprocess.run([str(shimenv.test_program("xxh64_prog")), *args], capture_output=True,
                         text=True, timeout=30, check=True).stdout.split()  # fmt: skip
    assert _XXH64 is not None
    for (n, seed, split), got in zip(CASES, out, strict=True):
        data = bytes((i * 131 + 7) & 0xFF for i in range(n)) if split else bytes(n)
        assert int(got, 16) == _XXH64(data, seed), (n, seed, split)
