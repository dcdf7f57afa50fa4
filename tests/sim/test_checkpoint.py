"""Checkpoint API across processes: a controller worker drives a target
worker's state machine through cuCheckpointProcess*(pid), as the agent does.
Expected codes are the real driver's (specs/records)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests import simenv, snippet
from tests.sim.simtest import MiB, hand_over, needs_multicast, psha, sim_only

CTL = snippet.load(__file__, "ctl")


def controller(spawn):
    c = spawn()
    c(CTL)
    return c


def share(creator, importer, seed: int, size: int) -> None:
    """``creator`` fills ``size`` bytes with ``pattern(seed)`` and exports them; ``importer``
    maps them. Both hold ``h`` and ``va``."""
    creator(f"""
h, va = alloc({size}); write(va, pattern({seed}, {size}))
fd = check(cu.cuMemExportToShareableHandle(h, POSIX, 0)); send_fd(fd); os.close(fd)
""")
    hand_over(creator, importer)
    importer(f"h, va = import_map(recv_fd(), {size})")


def maps_of(pid: int, va: int) -> str:
    """The /proc/<pid>/maps line covering va."""
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
        if lo <= va < hi:
            return line
    return ""


def test_state_machine_and_wrong_state_calls(spawn):
    t, c = spawn(), controller(spawn)
    t("d = check(cu.cuMemAlloc(64 * MiB))")
    pid = t.pid
    r = c(f"""
pid = {pid}
seq = [("state", state(pid)), ("ckpt_running", ckpt(pid)), ("restore_running", restore(pid)),
       ("unlock_running", unlock(pid)), ("lock", lock(pid)), ("state", state(pid)),
       ("lock_twice", lock(pid)), ("restore_locked", restore(pid)),
       ("tid", err(cu.cuCheckpointProcessGetRestoreThreadId(pid))),
       ("ckpt", ckpt(pid)), ("state", state(pid)), ("ckpt_twice", ckpt(pid)),
       ("lock_ckpted", lock(pid)), ("unlock_ckpted", unlock(pid)), ("restore", restore(pid)),
       ("state", state(pid)), ("unlock", unlock(pid)), ("state", state(pid)),
       ("state_self", state(os.getpid()))]
result = seq
""")
    ok, ill = "CUDA_SUCCESS", "CUDA_ERROR_ILLEGAL_STATE"
    assert r == [
        ["state", "RUNNING"],
        ["ckpt_running", ill],
        ["restore_running", ill],
        ["unlock_running", ill],
        ["lock", ok],
        ["state", "LOCKED"],
        ["lock_twice", ill],
        ["restore_locked", ill],
        ["tid", ok],
        ["ckpt", ok],
        ["state", "CHECKPOINTED"],
        ["ckpt_twice", ill],
        ["lock_ckpted", ill],
        ["unlock_ckpted", ill],
        ["restore", ok],
        ["state", "LOCKED"],
        ["unlock", ok],
        ["state", "RUNNING"],
        ["state_self", "RUNNING"],
    ]
    # The target runs normally afterwards.
    assert t("result = err(cu.cuMemsetD8(d, 7, 16))") == ok


def test_pids_without_cuda(spawn):
    c = controller(spawn)
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    dead_pid = int(gone.stdout)
    r = c(f"result = [state({simenv.os.getpid()}), lock({simenv.os.getpid()}), state({dead_pid})]")
    assert r == [
        "CUDA_ERROR_NOT_INITIALIZED",
        "CUDA_ERROR_NOT_INITIALIZED",
        "CUDA_ERROR_OPERATING_SYSTEM",
    ]


def test_checkpoint_frees_memory_and_restore_preserves_vas_and_handles(spawn):
    t, c = spawn(), controller(spawn)
    size = 8 * MiB
    info = t(f"""
h, va = alloc({size})
write(va, pattern(5, {size}))
os.close(check(cu.cuMemExportToShareableHandle(h, POSIX, 0)))  # exported, FD closed
hn, van = alloc(2 * MiB, NONE_H)
write(van, pattern(6, 2 * MiB))
d = check(cu.cuMemAlloc(4 * MiB))
check(cu.cuMemsetD8(d, 0x5A, 4 * MiB))
result = [int(h), int(va), int(hn), int(van), int(d)]
""")
    h, va, _hn, van, d = info
    pid = t.pid
    free0 = c("result = free_mem()")
    if simenv.is_simulated():
        assert "cuinterpose-sim-alloc" in maps_of(pid, va)
    assert c(f"result = [lock({pid}), ckpt({pid}), state({pid})]") == [
        "CUDA_SUCCESS",
        "CUDA_SUCCESS",
        "CHECKPOINTED",
    ]
    free_ckpt = c("result = free_mem()")
    owned = size + 2 * MiB + 4 * MiB
    if simenv.is_simulated():
        assert free_ckpt - free0 == owned  # all of it handed back
    else:  # the real driver also frees the context's own memory
        assert free_ckpt - free0 >= owned
    if simenv.is_simulated():
        line = maps_of(pid, va)
        assert "memfd" not in line and "---p" in line, line  # VA kept, pages gone
    assert c(f"result = [restore({pid}), state({pid})]") == ["CUDA_SUCCESS", "LOCKED"]
    if simenv.is_simulated():
        assert c("result = free_mem()") == free0
    assert c(f"result = [unlock({pid}), state({pid})]") == ["CUDA_SUCCESS", "RUNNING"]
    r = t(f"""
p = check(cu.cuMemGetAllocationPropertiesFromHandle({h}))
result = [sha({va}, {size}), sha({van}, 2 * MiB), read({d}, 16),
          int(check(cu.cuMemRetainAllocationHandle({va}))) == {h}, int(p.requestedHandleTypes)]
check(cu.cuMemRelease({h}))
""")
    assert r[0] == psha(5, size) and r[1] == psha(6, 2 * MiB)
    assert r[2] == "5a" * 16 and r[3] is True and r[4] == 1


def test_fd_exported_before_checkpoint_names_the_old_memory(spawn):
    """Measured on an H200: an open exported FD keeps the allocation's memory
    through the checkpoint; restore gives the process a copy, and the old FD
    still imports the checkpoint-time bytes, no longer shared with the process."""
    t, c, other = spawn(), controller(spawn), spawn()
    size = 4 * MiB
    t(f"""
h, va = alloc({size}); write(va, pattern(5, {size}))
kept_fd = check(cu.cuMemExportToShareableHandle(h, POSIX, 0))
""")
    pid = t.pid
    r = c(f"result = [f({pid}) for f in (lock, ckpt, restore, unlock)]")
    assert r == ["CUDA_SUCCESS"] * 4
    assert t(f"result = sha(va, {size})") == psha(5, size)
    t("send_fd(kept_fd); write(va, b'written after restore')")
    hand_over(t, other)
    got = other(f"hi, v = import_map(recv_fd(), {size}); result = sha(v, {size})")
    assert got == psha(5, size)  # the old memory, without the write
    # A new export shares the restored allocation again.
    t("send_fd(check(cu.cuMemExportToShareableHandle(h, POSIX, 0)))")
    hand_over(t, other)
    assert other(f"h2, v2 = import_map(recv_fd(), {size}); result = read(v2, 21)") == (
        b"written after restore".hex()
    )


def test_lock_blocks_driver_calls_until_unlock(spawn):
    t, c = spawn(), controller(spawn)
    t("h, va = alloc(2 * MiB)")
    assert c(f"result = lock({t.pid})") == "CUDA_SUCCESS"
    t.send("result = write(va, b'after unlock')")
    assert not t.answered(0.7), "a driver call ran while the process was locked"
    assert c(f"result = unlock({t.pid})") == "CUDA_SUCCESS"
    assert t.answered(10)
    assert t.reply() == "CUDA_SUCCESS"
    assert bytes.fromhex(t("result = read(va, 12)")) == b"after unlock"


@pytest.mark.slow
@needs_multicast
def test_lock_times_out_on_a_call_in_flight(spawn):
    """A multicast bind waiting for its team is a call in flight: lock gives up
    after its timeout with NOT_READY and leaves the process RUNNING."""
    t = spawn(extra={"CUINTERPOSE_SIM_MC_WAIT_MS": "2000"})
    c = controller(spawn)
    t("""
mp = cu.CUmulticastObjectProp()
mp.numDevices = 2; mp.size = 2 * MiB; mp.handleTypes = 0; mp.flags = 0
mc = check(cu.cuMulticastCreate(mp))
check(cu.cuMulticastAddDevice(mc, 0))
hm = check(cu.cuMemCreate(2 * MiB, prop(NONE_H), 0))
""")
    t.send("result = err(cu.cuMulticastBindMem(mc, 0, hm, 0, 2 * MiB, 0))")
    assert not t.answered(0.3)
    for _ in range(5):
        r = c(f"result = [lock({t.pid}, 300), state({t.pid})]")
        if r[0] != "CUDA_SUCCESS":
            break
        # A loaded machine had not started the bind yet: the lock held it
        # back at the gate; let it in and try again.
        c(f"unlock({t.pid})")
    assert r == ["CUDA_ERROR_NOT_READY", "RUNNING"]
    assert t.answered(10)
    assert t.reply() == "CUDA_ERROR_TIMEOUT"  # the simulator's cap on a team that never completes
    assert c(f"result = [lock({t.pid}, 300), unlock({t.pid})]") == ["CUDA_SUCCESS"] * 2


def test_importer_restore_not_supported_creator_restores(spawn):
    creator, importer, c = spawn(), spawn(), controller(spawn)
    size = 4 * MiB
    share(creator, importer, 9, size)
    pids = [creator.pid, importer.pid]
    free0 = c("result = free_mem()")
    r = c(f"""
pids = {pids}
out = [lock(p) for p in pids] + [ckpt(p) for p in pids] + [state(p) for p in pids]
out += [free_mem()]
out += [restore(pids[0]), restore(pids[1]), state(pids[0]), state(pids[1])]
out += [unlock(pids[0]), state(pids[0]), unlock(pids[1]), restore(pids[1]), state(pids[1])]
result = out
""")
    ok = "CUDA_SUCCESS"
    assert r[:6] == [ok, ok, ok, ok, "CHECKPOINTED", "CHECKPOINTED"]
    if simenv.is_simulated():
        assert r[6] - free0 == size  # both let go, no FD open: freed
    assert r[7:] == [
        ok,
        "CUDA_ERROR_NOT_SUPPORTED",
        "LOCKED",
        "CHECKPOINTED",
        ok,
        "RUNNING",
        "CUDA_ERROR_ILLEGAL_STATE",
        "CUDA_ERROR_OPERATING_SYSTEM",  # every restore after the first refusal
        "CHECKPOINTED",
    ]
    assert creator(f"result = sha(va, {size})") == psha(9, size)
    importer.kill()  # stuck CHECKPOINTED, as on the real driver


@sim_only
def test_importer_that_released_restores(spawn):
    """The teardown the shim automates: importer unmaps and releases, keeps its VA."""
    creator, importer, c = spawn(), spawn(), controller(spawn)
    creator("""
h, va = alloc(2 * MiB); write(va, pattern(4, 2 * MiB))
send_fd(check(cu.cuMemExportToShareableHandle(h, POSIX, 0)))
""")
    hand_over(creator, importer)
    importer("""
h, va = import_map(recv_fd(), 2 * MiB)
check(cu.cuMemUnmap(va, 2 * MiB)); check(cu.cuMemRelease(h))
""")
    pids = [creator.pid, importer.pid]
    r = c(f"result = [f(p) for f in (lock, ckpt, restore, unlock) for p in {pids}]")
    assert r == ["CUDA_SUCCESS"] * 8
    assert creator("result = sha(va, 2 * MiB)") == psha(4, 2 * MiB)


REMAP = """
def remap_restore(pid, pairs):
    a = cu.CUcheckpointRestoreArgs()
    ps = []
    for old, new in pairs:
        p = cu.CUcheckpointGpuPair(); p.oldUuid = old; p.newUuid = new; ps.append(p)
    a.gpuPairs = ps; a.gpuPairsCount = len(ps)
    return err(cu.cuCheckpointProcessRestore(pid, a))
def uuid_of(d):
    return check(cu.cuDeviceGetUuid(d))
def uuid_from(raw):
    import ctypes
    u = cu.CUuuid(); ctypes.memmove(u.getPtr(), raw, 16)
    return u
def node_uuid(node, gpu):
    h = 0xcbf29ce484222325
    for ch in node.encode():
        h = ((h ^ ch) * 0x100000001b3) % 2**64
    return uuid_from(b"cuipsim" + h.to_bytes(8, "little") + bytes([gpu]))
"""


@sim_only
def test_restore_onto_another_gpu_keeps_the_ordinal_and_the_bytes(spawn):
    """gpuPairs 0 -> 1: the process's ordinal 0 now names the GPU that was 1 (the
    driver keeps the ordinals, specs/records/2026-12-01-gpu-remap.md), its memory
    is back with its bytes at the same address."""
    t, c = spawn(), controller(spawn)
    t("d = check(cu.cuMemAlloc(2 * MiB)); write(d, pattern(5, 2 * MiB))")
    before = t("result = [bytes(check(cu.cuDeviceGetUuid(i)).bytes).hex() for i in (0, 1)]")
    c(REMAP)
    r = c(f"""
pid = {t.pid}
out = [lock(pid), ckpt(pid), remap_restore(pid, [(uuid_of(0), uuid_of(1))]), state(pid),
       unlock(pid)]
result = out
""")
    ok = "CUDA_SUCCESS"
    assert r == [ok, ok, ok, "LOCKED", ok]
    after = t("result = [bytes(check(cu.cuDeviceGetUuid(i)).bytes).hex() for i in (0, 1)]")
    assert after == [before[1], before[0]]  # 1 no pair named takes the GPU left over
    assert t("result = sha(d, 2 * MiB)") == psha(5, 2 * MiB)


@sim_only
@pytest.mark.parametrize(
    "case, pairs, extra, expected",
    [
        ("misses a checkpointed GPU", "[(uuid_of(1), uuid_of(0))]", {}, "INVALID_VALUE"),
        ("names a GPU twice", "[(uuid_of(0), uuid_of(1)), (uuid_of(0), uuid_of(0))]", {},
         "INVALID_VALUE"),
        ("onto another chip", "[(uuid_of(0), uuid_of(1))]", {"CUINTERPOSE_SIM_CHIP": "B"},
         "INVALID_VALUE"),
        ("onto a GPU without the memory", "[(uuid_of(0), uuid_of(1))]",
         {"CUINTERPOSE_SIM_MEM_MIB": "64"}, "OUT_OF_MEMORY"),
        ("onto a GPU of no node here", "[(uuid_of(0), node_uuid('elsewhere', 1))]", {},
         "INVALID_VALUE"),
    ],
)
def test_restore_remap_refused(spawn, case, pairs, extra, expected):
    """Each rule of the documented remap refused; the process stays CHECKPOINTED
    and a plain restore still works."""
    t = spawn()
    c = spawn(extra=extra)
    c(CTL)
    c(REMAP)
    t("d = check(cu.cuMemAlloc(128 * MiB))")
    r = c(f"""
pid = {t.pid}
out = [lock(pid), ckpt(pid)]
out += [remap_restore(pid, {pairs}), state(pid), restore(pid), unlock(pid)]
result = out
""")
    ok = "CUDA_SUCCESS"
    assert r == [ok, ok, f"CUDA_ERROR_{expected}", "CHECKPOINTED", ok, ok], case


@sim_only
def test_restore_on_another_node_takes_its_gpus(spawn):
    """A controller of node "b" restores a process of the default node onto b's GPU 1:
    the process's ordinal 0 is b's GPU 1 now; without pairs the restore is refused."""
    t = spawn()
    c = spawn(extra={"CUINTERPOSE_SIM_NODE": "b"})
    c(CTL)
    c(REMAP)
    t("d = check(cu.cuMemAlloc(2 * MiB)); write(d, pattern(6, 2 * MiB))")
    old = t("result = bytes(check(cu.cuDeviceGetUuid(0)).bytes).hex()")
    r = c(f"""
pid = {t.pid}
o = uuid_from(bytes.fromhex("{old}"))
out = [lock(pid), ckpt(pid), restore(pid), remap_restore(pid, [(o, node_uuid("b", 1))]),
       unlock(pid), bytes(node_uuid("b", 1).bytes).hex()]
result = out
""")
    ok = "CUDA_SUCCESS"
    assert r[:5] == [ok, ok, "CUDA_ERROR_INVALID_VALUE", ok, ok]
    assert t("result = bytes(check(cu.cuDeviceGetUuid(0)).bytes).hex()") == r[5]
    assert t("result = sha(d, 2 * MiB)") == psha(6, 2 * MiB)


def test_restore_thread_id_is_a_thread_of_the_target(spawn):
    t, c = spawn(), controller(spawn)
    t("result = None")  # started up (cuInit done)
    tid = c(f"result = int(check(cu.cuCheckpointProcessGetRestoreThreadId({t.pid})))")
    if simenv.is_simulated():
        assert Path(f"/proc/{t.pid}/task/{tid}").exists()
    assert tid > 0


def test_creator_checkpointed_alone_stops_sharing_with_its_importer(spawn):
    """The importer, still running, keeps the memory it maps; the restored
    creator works on a copy: writes no longer cross (as with an old FD)."""
    creator, importer, c = spawn(), spawn(), controller(spawn)
    size = 4 * MiB
    share(creator, importer, 11, size)
    pid = creator.pid
    assert c(f"result = [f({pid}) for f in (lock, ckpt, restore, unlock)]") == ["CUDA_SUCCESS"] * 4
    assert creator(f"result = sha(va, {size})") == psha(11, size)
    assert importer(f"result = sha(va, {size})") == psha(11, size)
    creator("write(va, b'creator')")
    importer("write(va, b'IMPORTER', off=64)")
    assert bytes.fromhex(creator("result = read(va, 72)"))[64:] != b"IMPORTER"
    assert bytes.fromhex(importer("result = read(va, 7)")) != b"creator"
