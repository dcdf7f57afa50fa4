"""LOAD_ALLOCATIONS re-creating its allocations on creator threads (shim_c/creators.c,
shim_c/content.c), simulated driver with real shims.

SNAPSHOT_SHIM_LOAD_CREATE_THREADS threads re-create the allocations in order
(cuMemCreate, cuMemMap, cuMemSetAccess at every recorded VA) while the control thread
queues each one's copy as soon as it exists. Each VMM call takes a few hundred
microseconds in the simulated driver here (CUINTERPOSE_SIM_VMM_US, outside its lock), so
that creations really overlap. Here: hundreds of allocations re-created in parallel, every
byte at its own VA, the timing line naming the threads; with 0 threads the control thread
creates them, as before; a failure injected into one cuMemSetAccess in the middle of the
parallel re-creation fails the op naming the call, the allocation and its device, leaves
nothing of the failed allocation behind (device memory in use is exactly what was
loaded), and the rollback then loads the rest with every byte right.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from cuinterpose.engine import wire

from tests.shim.test_content import finish
from tests.shim.test_control import CAPTURE, RESTORE, Shim, native_checkpoint_restore
from tests.simenv import Spawn

Op, Status, Phase, Kind = wire.Op, wire.Status, wire.Phase, wire.RecordKind

# COUNT allocations of one granule, each filled with a 32-bit value of its own (a
# cuMemsetD32: fast), exported so that the shim shares and saves them. WRONG() reads
# every one back at its VA: the indexes whose bytes are not its value.
MANY = r"""
import struct
def value(k):
    return (0x9E3779B1 * (k + 1)) & 0xFFFFFFFF
A = []
for k in range(COUNT):
    h = check(cu.cuMemCreate(gran, prop(), 0))
    va = map_rw(h, gran)
    check(cu.cuMemsetD32(va, value(k), gran // 4))
    os.close(export(h))
    A.append((h, va))
check(cu.cuCtxSynchronize())
def WRONG():
    buf = (ctypes.c_char * gran)()
    bad = []
    for k, (h, va) in enumerate(A):
        check(cu.cuMemcpyDtoH(ctypes.addressof(buf), va, gran))
        if bytes(buf) != struct.pack("<I", value(k)) * (gran // 4):
            bad.append(k)
    return bad
result = [va for _, va in A]
"""


def make_many(w: object, count: int) -> list[int]:
    """MANY in worker ``w``: the VAs of its ``count`` allocations."""
    return list(w(f"COUNT = {count}\n" + MANY))  # type: ignore[operator]


def timing(log: str, op: str) -> dict[str, object]:
    lines = [x for x in log.splitlines() if x.startswith("cuinterpose-timing ")]
    found = [json.loads(x.split(" ", 1)[1]) for x in lines]
    ours = [t for t in found if t["op"] == op]
    assert len(ours) == 1, log
    return ours[0]  # type: ignore[no-any-return]


@pytest.mark.parametrize(("threads", "count"), [(8, 512), (0, 48)], ids=["8-threads", "control"])
@pytest.mark.threads  # make tsan
@pytest.mark.timeout(120)
def test_many_allocations_recreated_in_parallel(
    spawn: Spawn, control_dir: Path, sim_namespace: str, threads: int, count: int
) -> None:
    """``count`` allocations of 2 MiB through a capture, the native checkpoint and a
    restore: every one back at its VA with its own bytes, loaded by ``threads`` creator
    threads (0: the control thread), as the timing line says."""
    creator = spawn(
        extra={
            "SNAPSHOT_SHIM_LOAD_CREATE_THREADS": str(threads),
            "SNAPSHOT_SHIM_COPY_THREADS": "4",
            "SNAPSHOT_SHIM_TIMING": "1",
            "CUINTERPOSE_SIM_VMM_US": "100",
        }
    )
    vas = make_many(creator, count)
    assert len(set(vas)) == count
    gran = int(creator("result = gran"))
    c = Shim(control_dir, creator.pid)
    for op in CAPTURE:
        c.ok(op)
    assert native_checkpoint_restore(spawn, sim_namespace, [creator.pid]) == [2]
    loaded = c.ok(Op.LOAD_ALLOCATIONS)
    assert (loaded.stats.count, loaded.stats.bytes) == (count, count * gran)
    for op in RESTORE[1:]:
        c.ok(op)
    assert creator("result = WRONG()") == []
    assert creator("result = [va for _, va in A]") == vas
    log = finish(creator)
    t = timing(log, "LOAD_ALLOCATIONS")
    assert t["create_threads"] == threads and t["allocations"] == count
    per_thread = t["thread_s"]
    assert isinstance(per_thread, dict)
    # Every creation's three VMM calls took at least 3 x 100 us, on whichever thread.
    assert float(per_thread["create"]) >= count * 300e-6
    assert "warning" not in log


USED_CODE = """
free, total = check(cu.cuMemGetInfo())
result = int(total) - int(free)
"""


def test_a_failure_in_the_middle_of_parallel_recreation_undoes_it_and_rolls_back(
    spawn: Spawn, control_dir: Path
) -> None:
    """64 allocations, 4 creator threads; the 21st cuMemSetAccess of the LOAD fails
    (injected in the simulated driver) while others are being created. The op fails
    (FAILED), naming the call, its result, the allocation and its device; the claiming
    of more stops, those already created are loaded and the failed one is gone
    entirely: device memory in use is exactly the loaded ones'. The rollback loads
    the others (the failed one among them) and every allocation has its bytes at its VA,
    the topology as INSPECT reported it before."""
    count = 64
    creator = spawn(
        extra={
            "SNAPSHOT_SHIM_LOAD_CREATE_THREADS": "4",
            "SNAPSHOT_SHIM_COPY_THREADS": "2",
            "CUINTERPOSE_SIM_VMM_US": "300",
        }
    )
    vas = make_many(creator, count)
    gran = int(creator("result = gran"))
    before_used = int(creator(USED_CODE))
    c = Shim(control_dir, creator.pid)
    before = c.ok(Op.INSPECT).records
    va_of = {r.id: r.address for r in before if r.kind == Kind.MAPPING}
    for op in CAPTURE:
        c.ok(op)
    assert int(creator(USED_CODE)) == before_used - count * gran  # all torn down
    armed = "ctypes.CDLL('libcuda.so.1').cuinterposeSimFail(b'cuMemSetAccess', 20, 999)"
    assert creator(f"import ctypes; result = {armed}") == 0
    failed = c.call(Op.LOAD_ALLOCATIONS)
    assert (failed.status, failed.phase) == (Status.CUDA_FAILED, Phase.FAILED), failed.message
    m = re.fullmatch(
        r"LOAD_ALLOCATIONS: cuMemSetAccess failed: CUDA_ERROR_UNKNOWN \(999\) "
        r"\(allocation ([0-9a-f]{32}), (\d+) bytes, device 0\)",
        failed.message,
    )
    assert m, failed.message
    assert int(m[2]) == gran
    named = bytes.fromhex(m[1])
    assert va_of[named] in vas  # one of ours, by its VA
    # 20 creations got through before the failure; how many more the other threads
    # finished beside it (and claimed before they saw it) is the scheduler's. What is
    # not: each allocation is loaded whole or not at all.
    loaded_bytes = int(creator(USED_CODE)) - (before_used - count * gran)
    assert loaded_bytes % gran == 0
    assert 20 <= loaded_bytes // gran < count
    rolled = c.ok(Op.ROLLBACK_ALLOCATIONS)
    assert rolled.stats.count == count - loaded_bytes // gran
    c.ok(Op.ROLLBACK_IMPORTS)
    assert c.ok(Op.HANDSHAKE).phase == Phase.ACTIVE
    assert int(creator(USED_CODE)) == before_used  # nothing leaked, nothing twice
    assert creator("result = WRONG()") == []
    assert c.ok(Op.INSPECT).records == before
    assert "AddressSanitizer" not in finish(creator)


# MANY, but every allocation mapped into one reservation, back to back (as torch's
# expandable segments map theirs), each with its own cuMemSetAccess.
SIDE_BY_SIDE = MANY.replace(
    "    va = map_rw(h, gran)\n",
    "    va = BASE + k * gran\n"
    "    check(cu.cuMemMap(va, gran, 0, h, 0))\n"
    "    check(access(va, gran))\n",
).replace("A = []\n", "A = []\nBASE = reserve(COUNT * gran)\n")

RUNS = {
    "SNAPSHOT_SHIM_LOAD_ACCESS_RUNS": "1",
    "SNAPSHOT_SHIM_LOAD_CREATE_THREADS": "4",
    "SNAPSHOT_SHIM_COPY_CHUNK_MIB": "16",  # a run spans at most a chunk: 8 allocations
    "SNAPSHOT_SHIM_COPY_THREADS": "2",
    "SNAPSHOT_SHIM_TIMING": "1",
    "CUINTERPOSE_SIM_VMM_US": "200",
}


@pytest.mark.threads  # make tsan
def test_access_runs_set_side_by_side_mappings_in_one_call_each(
    spawn: Spawn, control_dir: Path
) -> None:
    """SNAPSHOT_SHIM_LOAD_ACCESS_RUNS=1: 40 allocations mapped back to back are mapped
    without access by 4 creator threads and given it in 5 calls (runs of at most a 16 MiB
    chunk); every byte back at its VA, readable and writable."""
    count = 40
    creator = spawn(extra=RUNS)
    assert creator(f"COUNT = {count}\n" + SIDE_BY_SIDE) == [
        int(creator("result = BASE")) + k * int(creator("result = gran")) for k in range(count)
    ]
    c = Shim(control_dir, creator.pid)
    for op in CAPTURE + RESTORE:
        c.ok(op)
    assert creator("result = WRONG()") == []
    creator("check(cu.cuMemsetD32(A[7][1], 5, gran // 4)); check(cu.cuCtxSynchronize())")
    assert creator("result = WRONG()") == [7]  # written through the restored mapping
    t = timing(finish(creator), "LOAD_ALLOCATIONS")
    assert (t["allocations"], t["access_runs"], t["create_threads"]) == (count, 5, 4)


def test_a_failed_access_run_undoes_its_allocations_and_rolls_back(
    spawn: Spawn, control_dir: Path
) -> None:
    """The second run's cuMemSetAccess fails (injected): the op fails naming the call,
    the run and its first allocation; the run's 8 allocations are gone entirely (device
    memory in use is exactly the loaded ones'), and the rollback brings every one back
    with its bytes."""
    count = 40
    creator = spawn(extra=RUNS)
    creator(f"COUNT = {count}\n" + SIDE_BY_SIDE)
    gran = int(creator("result = gran"))
    before_used = int(creator(USED_CODE))
    c = Shim(control_dir, creator.pid)
    before = c.ok(Op.INSPECT).records
    for op in CAPTURE:
        c.ok(op)
    armed = "ctypes.CDLL('libcuda.so.1').cuinterposeSimFail(b'cuMemSetAccess', 1, 999)"
    assert creator(f"import ctypes; result = {armed}") == 0
    failed = c.call(Op.LOAD_ALLOCATIONS)
    assert (failed.status, failed.phase) == (Status.CUDA_FAILED, Phase.FAILED), failed.message
    base = int(creator("result = BASE"))
    assert re.fullmatch(
        r"LOAD_ALLOCATIONS: cuMemSetAccess failed: CUDA_ERROR_UNKNOWN \(999\) for 8 mappings "
        rf"side by side at {hex(base + 8 * gran)} \(16777216 bytes\), the first \(allocation "
        r"[0-9a-f]{32}, 2097152 bytes, device 0\); 8 allocations failed to load",
        failed.message,
    ), failed.message
    loaded = (int(creator(USED_CODE)) - (before_used - count * gran)) // gran
    assert 8 <= loaded <= count - 8  # the first run, maybe more; never the failed one
    rolled = c.ok(Op.ROLLBACK_ALLOCATIONS)
    assert rolled.stats.count == count - loaded
    c.ok(Op.ROLLBACK_IMPORTS)
    assert int(creator(USED_CODE)) == before_used
    assert creator("result = WRONG()") == []
    assert c.ok(Op.INSPECT).records == before
    assert "AddressSanitizer" not in finish(creator)
