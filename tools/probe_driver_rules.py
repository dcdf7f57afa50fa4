"""Probe: the real driver's answers to the VMM and checkpoint calls the simulated
driver must imitate (error codes, reference counting, handle values).

Run on a real GPU (never calls cuMulticastCreate). Prints one JSON object per
line: {"case": ..., "result": ...}. The output is kept under specs/records/ and
is the specification the simulated driver (shim_c/sim/) is tested against.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

from cuda.bindings import driver as cu

MiB = 1 << 20


def name(err: Any) -> str:
    return str(cu.cuGetErrorName(err)[1].decode())


def res(r: Any) -> Any:
    """A call's CUresult name (and the value for a success, where printable)."""
    err = r[0] if isinstance(r, tuple) else r
    if err != cu.CUresult.CUDA_SUCCESS:
        return name(err)
    if isinstance(r, tuple) and len(r) > 1:
        v = r[1]
        try:
            return ["CUDA_SUCCESS", int(v)]
        except (TypeError, ValueError):
            return ["CUDA_SUCCESS", str(v)]
    return "CUDA_SUCCESS"


def ok(r: Any) -> Any:
    err = r[0] if isinstance(r, tuple) else r
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(name(err))
    if not isinstance(r, tuple) or len(r) == 1:
        return None
    return r[1] if len(r) == 2 else r[1:]


def out(case: str, result: Any) -> None:
    print(json.dumps({"case": case, "result": result}), flush=True)


def check(case: str, call: Any) -> None:
    """Record what one call returns; a Python-level failure is recorded too."""
    try:
        out(case, res(call()))
    except Exception as exc:  # the probe must go on past any one case
        out(case, f"python error: {type(exc).__name__}: {exc}")


def prop(htype: Any) -> Any:
    p = cu.CUmemAllocationProp()
    p.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    p.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    p.location.id = 0
    p.requestedHandleTypes = htype
    return p


def rw(flags: Any = None) -> Any:
    d = cu.CUmemAccessDesc()
    d.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    d.location.id = 0
    d.flags = flags or cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    return d


POSIX = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
NONE = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_NONE


def vmm_cases() -> None:
    ok(cu.cuInit(0))
    dev = ok(cu.cuDeviceGet(0))
    ctx = ok(cu.cuDevicePrimaryCtxRetain(dev))
    ok(cu.cuCtxSetCurrent(ctx))
    check("driver_version", lambda: cu.cuDriverGetVersion())
    out("device_name", cu.cuDeviceGetName(64, dev)[1].split(b"\0")[0].decode())
    gmin = cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
    grec = cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
    check("granularity_min", lambda: cu.cuMemGetAllocationGranularity(prop(POSIX), gmin))
    check("granularity_rec", lambda: cu.cuMemGetAllocationGranularity(prop(POSIX), grec))
    check("create_unaligned_size", lambda: cu.cuMemCreate(MiB, prop(POSIX), 0))
    check("create_zero_size", lambda: cu.cuMemCreate(0, prop(POSIX), 0))
    check("reserve_unaligned", lambda: cu.cuMemAddressReserve(MiB, 0, 0, 0))
    size = 4 * MiB
    free0 = ok(cu.cuMemGetInfo())
    h = ok(cu.cuMemCreate(size, prop(POSIX), 0))
    out("create_handle_value", int(h))
    va = ok(cu.cuMemAddressReserve(2 * size, 0, 0, 0))
    host = ok(cu.cuMemHostAlloc(size, 0))
    check("copy_reserved_unmapped_dtoh", lambda: cu.cuMemcpyDtoH(host, va, size))
    check("sync_after_copy_reserved_unmapped_dtoh", lambda: cu.cuCtxSynchronize())
    check("copy_reserved_unmapped_htod", lambda: cu.cuMemcpyHtoD(va, host, size))
    check("sync_after_copy_reserved_unmapped_htod", lambda: cu.cuCtxSynchronize())
    check("memset_reserved_unmapped", lambda: cu.cuMemsetD8(va, 1, size))
    check("sync_after_memset_reserved_unmapped", lambda: cu.cuCtxSynchronize())
    check("map_unaligned_offset", lambda: cu.cuMemMap(va, 2 * MiB, MiB, h, 0))
    check("map_unaligned_size", lambda: cu.cuMemMap(va, MiB, 0, h, 0))
    check("map_past_end", lambda: cu.cuMemMap(va, 2 * size, 0, h, 0))
    check("map_offset_past_end", lambda: cu.cuMemMap(va, 2 * MiB, size, h, 0))
    check("map_partial_aligned_offset", lambda: cu.cuMemMap(va, 2 * MiB, 2 * MiB, h, 0))
    check("map_partial_aligned_size", lambda: cu.cuMemMap(va, 2 * MiB, 0, h, 0))
    check("map_flags_nonzero", lambda: cu.cuMemMap(va, size, 0, h, 1))
    check("map", lambda: cu.cuMemMap(va, size, 0, h, 0))
    check("map_twice_same_va", lambda: cu.cuMemMap(va, size, 0, h, 0))
    check("copy_mapped_no_access_dtoh", lambda: cu.cuMemcpyDtoH(host, va, size))
    check("sync_after_copy_mapped_no_access_dtoh", lambda: cu.cuCtxSynchronize())
    check("copy_mapped_no_access_htod", lambda: cu.cuMemcpyHtoD(va, host, size))
    check("sync_after_copy_mapped_no_access_htod", lambda: cu.cuCtxSynchronize())
    check("get_access_unset", lambda: cu.cuMemGetAccess(cu.CUmemLocation(), va))
    loc = cu.CUmemLocation()
    loc.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    loc.id = 0
    check("get_access_unset_dev0", lambda: cu.cuMemGetAccess(loc, va))
    check("set_access_unmapped_tail", lambda: cu.cuMemSetAccess(int(va) + size, size, [rw()], 1))
    check("set_access_spanning_tail", lambda: cu.cuMemSetAccess(va, 2 * size, [rw()], 1))
    ro = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READ
    check("set_access_read_only", lambda: cu.cuMemSetAccess(va, size, [rw(ro)], 1))
    check("get_access_read_only", lambda: cu.cuMemGetAccess(loc, va))
    check("copy_read_only_htod", lambda: cu.cuMemcpyHtoD(va, host, size))
    check("sync_after_copy_read_only_htod", lambda: cu.cuCtxSynchronize())
    check("copy_read_only_dtoh", lambda: cu.cuMemcpyDtoH(host, va, size))
    check("sync_after_copy_read_only_dtoh", lambda: cu.cuCtxSynchronize())
    check("set_access_rw", lambda: cu.cuMemSetAccess(va, size, [rw()], 1))
    check("copy_mapped_rw_htod", lambda: cu.cuMemcpyHtoD(va, host, size))
    check("sync_after_copy_mapped_rw_htod", lambda: cu.cuCtxSynchronize())
    check("copy_straddling_end", lambda: cu.cuMemcpyDtoH(host, int(va) + size - MiB, 2 * MiB))
    check("sync_after_copy_straddling_end", lambda: cu.cuCtxSynchronize())
    check("set_access_count_zero", lambda: cu.cuMemSetAccess(va, size, [], 0))
    r = cu.cuMemRetainAllocationHandle(va)
    check("retain_handle", lambda: r)
    out("retain_equals_create", int(r[1]) == int(h) if r[0] == cu.CUresult.CUDA_SUCCESS else None)
    check("retain_unmapped_va", lambda: cu.cuMemRetainAllocationHandle(int(va) + size))
    p = cu.cuMemGetAllocationPropertiesFromHandle(h)
    out("props_from_handle", [res(p), int(p[1].requestedHandleTypes) if p[0] == 0 else None])
    check("export_posix", lambda: cu.cuMemExportToShareableHandle(h, POSIX, 0))
    free1 = ok(cu.cuMemGetInfo())
    check("release_while_mapped", lambda: cu.cuMemRelease(h))
    check("release_second_ref(retain)", lambda: cu.cuMemRelease(h))
    free2 = ok(cu.cuMemGetInfo())
    check("copy_after_release_still_mapped", lambda: cu.cuMemcpyDtoH(host, va, size))
    check("sync_after_copy_after_release_still_mapped", lambda: cu.cuCtxSynchronize())
    check("release_third_time", lambda: cu.cuMemRelease(h))
    check("address_free_while_mapped", lambda: cu.cuMemAddressFree(va, 2 * size))
    check("unmap_partial", lambda: cu.cuMemUnmap(va, 2 * MiB))
    check("unmap_not_mapped_tail", lambda: cu.cuMemUnmap(int(va) + size, size))
    check("unmap", lambda: cu.cuMemUnmap(va, size))
    free3 = ok(cu.cuMemGetInfo())
    check("unmap_twice", lambda: cu.cuMemUnmap(va, size))
    check("copy_after_unmap", lambda: cu.cuMemcpyDtoH(host, va, size))
    check("sync_after_copy_after_unmap", lambda: cu.cuCtxSynchronize())
    out("mem_info_free_bytes", [int(f[0]) for f in (free0, free1, free2, free3)])
    check("address_free_wrong_size", lambda: cu.cuMemAddressFree(va, size))
    check("address_free", lambda: cu.cuMemAddressFree(va, 2 * size))
    check("address_free_twice", lambda: cu.cuMemAddressFree(va, 2 * size))
    hn = ok(cu.cuMemCreate(2 * MiB, prop(NONE), 0))
    check("export_handle_type_none", lambda: cu.cuMemExportToShareableHandle(hn, POSIX, 0))
    ok(cu.cuMemRelease(hn))
    check("import_bogus_fd", lambda: cu.cuMemImportFromShareableHandle(987, POSIX))
    fd = os.open("/dev/null", os.O_RDONLY)
    check("import_devnull_fd", lambda: cu.cuMemImportFromShareableHandle(fd, POSIX))
    os.close(fd)
    r = cu.cuGetProcAddress(b"cuNoSuchFunction", 13000, 0)
    out("proc_address_unknown", [name(r[0]), str(r[2]) if len(r) > 2 else None])
    r = cu.cuGetProcAddress(b"cuMemcpyDtoH", 3020, 0)
    out("proc_address_memcpy_3020", [name(r[0]), str(r[2]) if len(r) > 2 else None])
    r = cu.cuGetProcAddress(b"cuMemcpyDtoH", 99999, 0)
    out("proc_address_future_version", [name(r[0]), str(r[2]) if len(r) > 2 else None])
    out("mc_granularity_query_only", "skipped: multicast is never touched on lent GPUs")
    ok(cu.cuMemFreeHost(host))


def child() -> None:
    """A CUDA process that sits RUNNING until killed: the checkpoint calls' target."""
    ok(cu.cuInit(0))
    ctx = ok(cu.cuDevicePrimaryCtxRetain(ok(cu.cuDeviceGet(0))))
    ok(cu.cuCtxSetCurrent(ctx))
    ok(cu.cuMemAlloc(64 * MiB))
    print("ready", flush=True)
    sys.stdin.readline()


def ckpt(pid: int) -> Any:
    return cu.cuCheckpointProcessCheckpoint(pid, cu.CUcheckpointCheckpointArgs())


def restore(pid: int) -> Any:
    return cu.cuCheckpointProcessRestore(pid, cu.CUcheckpointRestoreArgs())


def unlock(pid: int) -> Any:
    return cu.cuCheckpointProcessUnlock(pid, cu.CUcheckpointUnlockArgs())


def checkpoint_cases() -> None:
    ok(cu.cuInit(0))
    p = subprocess.Popen(
        [sys.executable, __file__, "child"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert p.stdout is not None and p.stdin is not None
    p.stdout.readline()
    pid = p.pid
    lock = cu.CUcheckpointLockArgs()
    lock.timeoutMs = 5000
    check("state_running", lambda: cu.cuCheckpointProcessGetState(pid))
    check("checkpoint_while_running", lambda: ckpt(pid))
    check("restore_while_running", lambda: restore(pid))
    check("unlock_while_running", lambda: unlock(pid))
    check("lock", lambda: cu.cuCheckpointProcessLock(pid, lock))
    check("state_locked", lambda: cu.cuCheckpointProcessGetState(pid))
    check("lock_twice", lambda: cu.cuCheckpointProcessLock(pid, lock))
    check("restore_while_locked", lambda: restore(pid))
    check("restore_thread_id_locked", lambda: cu.cuCheckpointProcessGetRestoreThreadId(pid))
    t = time.perf_counter()
    check("checkpoint", lambda: ckpt(pid))
    out("checkpoint_s", round(time.perf_counter() - t, 4))
    check("state_checkpointed", lambda: cu.cuCheckpointProcessGetState(pid))
    check("checkpoint_twice", lambda: ckpt(pid))
    check("lock_while_checkpointed", lambda: cu.cuCheckpointProcessLock(pid, lock))
    check("unlock_while_checkpointed", lambda: unlock(pid))
    check("restore", lambda: restore(pid))
    check("state_after_restore", lambda: cu.cuCheckpointProcessGetState(pid))
    check("unlock", lambda: unlock(pid))
    check("state_after_unlock", lambda: cu.cuCheckpointProcessGetState(pid))
    p.stdin.write("\n")
    p.stdin.flush()
    p.wait(timeout=30)
    check("state_exited_pid", lambda: cu.cuCheckpointProcessGetState(pid))
    check("state_non_cuda_pid", lambda: cu.cuCheckpointProcessGetState(1))
    check("lock_non_cuda_pid", lambda: cu.cuCheckpointProcessLock(1, lock))
    check("state_self", lambda: cu.cuCheckpointProcessGetState(os.getpid()))


def bogus_handle(call: str) -> None:
    """A handle value the driver never gave out: observed to crash the process."""
    ok(cu.cuInit(0))
    ok(cu.cuCtxSetCurrent(ok(cu.cuDevicePrimaryCtxRetain(ok(cu.cuDeviceGet(0))))))
    if call == "props":
        check("props_bogus_handle", lambda: cu.cuMemGetAllocationPropertiesFromHandle(0xDEAD0000))
    else:
        check("release_bogus", lambda: cu.cuMemRelease(0xDEAD0000))


def bogus_handle_cases() -> None:
    for call in ("props", "release"):
        p = subprocess.run(
            [sys.executable, __file__, "bogus", call], capture_output=True, text=True
        )
        out(f"bogus_handle_{call}_process", {"returncode": p.returncode, "stdout": p.stdout})


if __name__ == "__main__":
    if sys.argv[1:] == ["child"]:
        child()
    elif sys.argv[1:2] == ["bogus"]:
        bogus_handle(sys.argv[2])
    else:
        vmm_cases()
        bogus_handle_cases()
        checkpoint_cases()
