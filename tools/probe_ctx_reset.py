"""Probe: what a reset of the primary context takes with it on the real driver (the shim
keeps each copy thread's pinned bounce buffer, stream and events from one phase to the
next, shim_c/staging.c, and the simulated driver must do what the driver does).

Run on a real GPU. One JSON object per line: {"case": ..., "result": ...}:
- whether the primary context's handle is the same after the reset;
- a cuMemHostAlloc'd buffer after the reset: touched in a forked child (a fault kills
  only the child: "SIGSEGV"), then given to cuMemFreeHost;
- a registered mapping after the reset: cuMemHostUnregister's answer;
- a VMM allocation mapped before the reset: a copy into it after;
- a stream and an event made before the reset: cuStreamQuery and cuEventQuery after it
  (last: a handle the driver forgot may crash the process).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import signal
from typing import Any

from cuda.bindings import driver as cu
from probe_driver_rules import name, ok, out  # run as tools/probe_ctx_reset.py

MIB = 1 << 20


def code(r: Any) -> str:
    return name(r[0] if isinstance(r, tuple) else r)


def touch_in_child(address: int) -> str:
    """Read and write one byte at `address` in a forked child: "readable" or how it died."""
    pid = os.fork()
    if pid == 0:  # no CUDA call in the child: only the memory
        byte = ctypes.c_char.from_address(address)
        byte.value = byte.value
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return signal.Signals(os.WTERMSIG(status)).name
    return "readable" if os.WEXITSTATUS(status) == 0 else f"exit {os.WEXITSTATUS(status)}"


def main() -> None:
    ok(cu.cuInit(0))
    dev = ok(cu.cuDeviceGet(0))
    before = ok(cu.cuDevicePrimaryCtxRetain(dev))
    ok(cu.cuCtxSetCurrent(before))
    pinned = int(ok(cu.cuMemHostAlloc(8 * MIB, cu.CU_MEMHOSTALLOC_PORTABLE)))
    ctypes.memset(pinned, 0x5A, 8 * MIB)
    region = mmap.mmap(-1, 8 * MIB)
    mapped = ctypes.addressof(ctypes.c_char.from_buffer(region))
    ok(cu.cuMemHostRegister(mapped, 8 * MIB, cu.CU_MEMHOSTREGISTER_PORTABLE))
    stream = ok(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING))
    event = ok(cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING))
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = 0
    handle = ok(cu.cuMemCreate(2 * MIB, prop, 0))
    va = ok(cu.cuMemAddressReserve(2 * MIB, 0, 0, 0))
    ok(cu.cuMemMap(va, 2 * MIB, 0, handle, 0))
    access = cu.CUmemAccessDesc()
    access.location = prop.location
    access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    ok(cu.cuMemSetAccess(va, 2 * MIB, [access], 1))
    out("pinned_touch_before_reset", touch_in_child(pinned))

    out("reset", code(cu.cuDevicePrimaryCtxReset(dev)))
    after = ok(cu.cuDevicePrimaryCtxRetain(dev))
    ok(cu.cuCtxSetCurrent(after))
    out("primary_handle_same", int(after) == int(before))
    out("pinned_touch_after_reset", touch_in_child(pinned))
    out("registered_unregister_after_reset", code(cu.cuMemHostUnregister(mapped)))
    src = bytes(range(256)) * 16
    out("vmm_copy_after_reset", code(cu.cuMemcpyHtoD(va, src, len(src))))
    # Last: a handle the driver no longer knows may crash the process (as a released
    # allocation handle does, specs/records/2026-11-29-h200-driver-rules.jsonl).
    out("pinned_free_after_reset", code(cu.cuMemFreeHost(pinned)))
    out("stream_query_after_reset", code(cu.cuStreamQuery(stream)))
    out("event_query_after_reset", code(cu.cuEventQuery(event)))
    ok(cu.cuMemUnmap(va, 2 * MIB))
    ok(cu.cuMemRelease(handle))
    ok(cu.cuMemAddressFree(va, 2 * MIB))


if __name__ == "__main__":
    main()
