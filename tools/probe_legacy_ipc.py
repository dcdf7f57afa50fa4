"""Probe: what the real driver does with cuMemAlloc memory, legacy CUDA IPC
(memory and events), pointer attributes, and the native checkpoint of
processes that share through legacy IPC. Its output is a record in
specs/records/ that the simulated driver is checked against.

    python3 tools/probe_legacy_ipc.py > record.txt
    python3 tools/probe_legacy_ipc.py event-link   # an IPC event across the checkpoint

Workers are child processes obeying JSON commands on stdin; IPC handles travel
between them as hex. The driver is called through ctypes so that the 64 handle
bytes are exactly the driver's.
"""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
import time
from typing import Any

ATTRS = [
    "CONTEXT",
    "MEMORY_TYPE",
    "DEVICE_POINTER",
    "HOST_POINTER",
    "SYNC_MEMOPS",
    "BUFFER_ID",
    "IS_MANAGED",
    "DEVICE_ORDINAL",
    "IS_LEGACY_CUDA_IPC_CAPABLE",
    "RANGE_START_ADDR",
    "RANGE_SIZE",
    "MAPPED",
    "ALLOWED_HANDLE_TYPES",
    "IS_GPU_DIRECT_RDMA_CAPABLE",
    "ACCESS_FLAGS",
    "MEMPOOL_HANDLE",
    "MAPPING_SIZE",
    "MAPPING_BASE_ADDR",
    "MEMORY_BLOCK_ID",
]


class Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]


def worker() -> None:
    from cuda.bindings import driver as cu

    lib = ctypes.CDLL("libcuda.so.1")
    names: dict[int, str] = {}

    def name(r: int) -> str:
        if r not in names:
            s = ctypes.c_char_p()
            lib.cuGetErrorName(r, ctypes.byref(s))
            names[r] = (s.value or b"?").decode()
        return names[r]

    def call(fn: str, *args: Any) -> str:
        f = getattr(lib, fn, None)
        return "MISSING" if f is None else name(f(*args))

    u64 = ctypes.c_uint64
    assert call("cuInit", 0) == "CUDA_SUCCESS"
    dev = ctypes.c_int()
    call("cuDeviceGet", ctypes.byref(dev), 0)
    ctx = ctypes.c_void_p()
    call("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), dev)
    call("cuCtxSetCurrent", ctx)
    stream = ctypes.c_void_p()
    call("cuStreamCreate", ctypes.byref(stream), 1)
    events: dict[int, ctypes.c_void_p] = {}

    def attrs(ptr: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for a in ATTRS:
            buf = (ctypes.c_uint64 * 8)()
            code = int(getattr(cu.CUpointer_attribute, "CU_POINTER_ATTRIBUTE_" + a))
            r = call("cuPointerGetAttribute", buf, code, u64(ptr))
            out[a] = buf[0] if r == "CUDA_SUCCESS" else r
        return out

    def vmm(size: int) -> int:
        p = cu.CUmemAllocationProp()
        p.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        p.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        p.location.id = 0
        p.requestedHandleTypes = (
            cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        )
        _, h = cu.cuMemCreate(size, p, 0)
        _, va = cu.cuMemAddressReserve(size, 0, 0, 0)
        cu.cuMemMap(va, size, 0, h, 0)
        d = cu.CUmemAccessDesc()
        d.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        d.location.id = 0
        d.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        cu.cuMemSetAccess(va, size, [d], 1)
        return int(va)

    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        out: dict[str, Any] = {"op": op}
        if op == "pid":
            import os

            out["pid"] = os.getpid()
        elif op == "alloc":
            p = u64()
            out["r"] = call("cuMemAlloc_v2", ctypes.byref(p), ctypes.c_size_t(cmd["size"]))
            out["ptr"] = p.value
        elif op == "pitch":
            p, pitch = u64(), ctypes.c_size_t()
            out["r"] = call(
                "cuMemAllocPitch_v2",
                ctypes.byref(p),
                ctypes.byref(pitch),
                ctypes.c_size_t(cmd["w"]),
                ctypes.c_size_t(cmd["h"]),
                cmd["elem"],
            )
            out.update(ptr=p.value, pitch=pitch.value)
        elif op == "vmm":
            out["ptr"] = vmm(cmd["size"])
        elif op == "free":
            out["r"] = call("cuMemFree_v2", u64(cmd["ptr"]))
        elif op == "range":
            b, s = u64(), ctypes.c_size_t()
            out["r"] = call(
                "cuMemGetAddressRange_v2", ctypes.byref(b), ctypes.byref(s), u64(cmd["ptr"])
            )
            out.update(base=b.value, size=s.value)
        elif op == "attrs":
            out["attrs"] = attrs(cmd["ptr"])
        elif op == "write":
            data = bytes([cmd["byte"]]) * cmd["n"]
            out["r"] = call("cuMemcpyHtoD_v2", u64(cmd["ptr"]), data, ctypes.c_size_t(cmd["n"]))
        elif op == "read":
            buf = ctypes.create_string_buffer(cmd["n"])
            out["r"] = call("cuMemcpyDtoH_v2", buf, u64(cmd["ptr"]), ctypes.c_size_t(cmd["n"]))
            out["bytes"] = sorted(set(buf.raw))
        elif op == "ipc_get":
            h = Handle()
            out["r"] = call("cuIpcGetMemHandle", ctypes.byref(h), u64(cmd["ptr"]))
            out["handle"] = ctypes.string_at(ctypes.byref(h), 64).hex()
        elif op == "ipc_open":
            h = Handle.from_buffer_copy(bytes.fromhex(cmd["handle"]))
            p = u64()
            out["r"] = call("cuIpcOpenMemHandle_v2", ctypes.byref(p), h, cmd.get("flags", 1))
            out["ptr"] = p.value
        elif op == "ipc_close":
            out["r"] = call("cuIpcCloseMemHandle", u64(cmd["ptr"]))
        elif op == "event":
            e = ctypes.c_void_p()
            out["r"] = call("cuEventCreate", ctypes.byref(e), cmd["flags"])
            events[len(events)] = e
            out["event"] = len(events) - 1
        elif op == "event_handle":
            h = Handle()
            out["r"] = call("cuIpcGetEventHandle", ctypes.byref(h), events[cmd["event"]])
            out["handle"] = ctypes.string_at(ctypes.byref(h), 64).hex()
        elif op == "event_open":
            h = Handle.from_buffer_copy(bytes.fromhex(cmd["handle"]))
            e = ctypes.c_void_p()
            out["r"] = call("cuIpcOpenEventHandle", ctypes.byref(e), h)
            events[len(events)] = e
            out["event"] = len(events) - 1
        elif op == "event_record":
            out["r"] = call("cuEventRecord", events[cmd["event"]], stream)
        elif op == "event_query":
            out["r"] = call("cuEventQuery", events[cmd["event"]])
        elif op == "event_sync":
            out["r"] = call("cuEventSynchronize", events[cmd["event"]])
        elif op == "wait_event":
            out["r"] = call("cuStreamWaitEvent", stream, events[cmd["event"]], 0)
        elif op == "event_destroy":
            out["r"] = call("cuEventDestroy_v2", events[cmd["event"]])
        elif op == "busy":  # queue ~`n` GiB of memsets on the stream, then record the event
            buf = u64()
            call("cuMemAlloc_v2", ctypes.byref(buf), ctypes.c_size_t(1 << 30))
            for _ in range(cmd["n"]):
                call("cuMemsetD8Async", buf, 1, ctypes.c_size_t(1 << 30), stream)
            out["r"] = call("cuEventRecord", events[cmd["event"]], stream)
        elif op == "sync":
            out["r"] = call("cuCtxSynchronize")
        elif op == "quit":
            print(json.dumps(out), flush=True)
            return
        print(json.dumps(out), flush=True)


class W:
    def __init__(self, label: str) -> None:
        self.label = label
        self.p = subprocess.Popen(
            [sys.executable, __file__, "worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.pid = self("pid")["pid"]

    def __call__(self, op: str, **kw: Any) -> dict[str, Any]:
        assert self.p.stdin and self.p.stdout
        self.p.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.p.stdin.flush()
        line = self.p.stdout.readline()
        out = json.loads(line) if line else {"op": op, "dead": True}
        print(self.label, json.dumps(out), flush=True)
        return out

    def kill(self) -> None:
        self.p.kill()
        self.p.wait()


def native(pids: list[int], label: str) -> dict[str, Any]:
    from cuda.bindings import driver as cu

    res: dict[str, Any] = {"label": label}

    def step(fn: str, pid: int, args: Any) -> str:
        r = getattr(cu, fn)(pid, args)
        err = r[0] if isinstance(r, tuple) else r
        return str(cu.cuGetErrorName(err)[1].decode())

    def state(pid: int) -> str:
        r = cu.cuCheckpointProcessGetState(pid)
        return str(r[1]) if r[0] == cu.CUresult.CUDA_SUCCESS else str(r[0])

    for fn, args in (
        ("cuCheckpointProcessLock", cu.CUcheckpointLockArgs()),
        ("cuCheckpointProcessCheckpoint", cu.CUcheckpointCheckpointArgs()),
        ("cuCheckpointProcessRestore", cu.CUcheckpointRestoreArgs()),
        ("cuCheckpointProcessUnlock", cu.CUcheckpointUnlockArgs()),
    ):
        if fn == "cuCheckpointProcessLock":
            args.timeoutMs = 10000
        for pid in pids:
            t = time.perf_counter()
            res[f"{fn}[{pid}]"] = step(fn, pid, args)
            res[f"{fn}[{pid}]_s"] = round(time.perf_counter() - t, 3)
        res[f"states after {fn}"] = [state(p) for p in pids]
    print("native", json.dumps(res), flush=True)
    return res


MIB = 1 << 20


def scenario_rules() -> None:
    print("== rules: cuMemAlloc, ranges, attributes, IPC handles")
    a, b = W("A"), W("B")
    try:
        small = a("alloc", size=1000)["ptr"]
        a("range", ptr=small + 100)
        a("attrs", ptr=small)
        big = a("alloc", size=4 * MIB)["ptr"]
        a("range", ptr=big + 4096)
        a("pitch", w=1000, h=10, elem=4)
        v = a("vmm", size=2 * MIB)["ptr"]
        a("attrs", ptr=v)
        a("ipc_get", ptr=v)
        h1 = a("ipc_get", ptr=big)["handle"]
        h2 = a("ipc_get", ptr=big + 4096)["handle"]
        print("same handle for base and interior:", h1 == h2)
        a("ipc_get", ptr=big)
        hs = a("ipc_get", ptr=small)["handle"]
        a("ipc_open", handle=h1)
        a("write", ptr=big, byte=7, n=4 * MIB)
        pb = b("ipc_open", handle=h1)["ptr"]
        b("range", ptr=pb + 8)
        b("attrs", ptr=pb)
        b("read", ptr=pb, n=4 * MIB)
        b("ipc_open", handle=h1)
        b("ipc_open", handle=h2)
        b("write", ptr=pb, byte=9, n=MIB)
        b("sync")
        a("read", ptr=big, n=MIB)
        b("ipc_open", handle=hs)
        b("ipc_close", ptr=pb + 8)
        b("ipc_close", ptr=pb)
        b("ipc_close", ptr=pb)
        b("ipc_close", ptr=pb)
        b("ipc_open", handle="00" * 64)
        pb = b("ipc_open", handle=h1)["ptr"]
        a("free", ptr=big)
        b("read", ptr=pb, n=MIB)
        b("ipc_close", ptr=pb)
        b("ipc_open", handle=h1)
        # events
        a("event", flags=4)
        e = a("event", flags=6)["event"]
        eh = a("event_handle", event=e)["handle"]
        a("event_handle", event=0)
        a("event_open", handle=eh)
        be = b("event_open", handle=eh)["event"]
        b("event_open", handle=eh)
        a("event_record", event=e)
        b("event_query", event=be)
        b("event_sync", event=be)
        b("event_record", event=be)
        b("event_destroy", event=be)
    finally:
        a.kill()
        b.kill()


def scenario_native(kind: str) -> None:
    print(f"== native checkpoint, {kind}")
    a, b = W("A"), W("B")
    try:
        big = a("alloc", size=64 * MIB)["ptr"]
        a("write", ptr=big, byte=5, n=64 * MIB)
        if kind in ("memory", "memory-closed"):
            h = a("ipc_get", ptr=big)["handle"]
            pb = b("ipc_open", handle=h)["ptr"]
            if kind == "memory-closed":
                b("ipc_close", ptr=pb)
        elif kind == "exporter-only":
            h = a("ipc_get", ptr=big)["handle"]
        elif kind in ("event", "event-creator-only"):
            e = a("event", flags=6)["event"]
            eh = a("event_handle", event=e)["handle"]
            if kind == "event":
                be = b("event_open", handle=eh)["event"]
        pids = [a.pid] if kind in ("exporter-only", "event-creator-only") else [a.pid, b.pid]
        native(pids, kind)
        a("read", ptr=big, n=MIB)
        if kind == "exporter-only":
            pb = b("ipc_open", handle=h)["ptr"]
            b("read", ptr=pb, n=MIB)
        if kind == "memory":
            b("read", ptr=pb, n=MIB)
        if kind == "event":
            a("event_record", event=e)
            b("event_sync", event=be)
            b("event_query", event=be)
        if kind == "event-creator-only":
            a("event_record", event=e)
            a("event_sync", event=e)
            be = b("event_open", handle=eh)["event"]
            b("event_query", event=be)
    finally:
        a.kill()
        b.kill()


def scenario_event_link() -> None:
    """Does an event opened in B still follow A's records after both were checkpointed
    and restored? A queues long work, records; B's query must say NOT_READY."""
    print("== IPC event link across the native checkpoint")
    a, b = W("A"), W("B")
    try:
        e = a("event", flags=6)["event"]
        be = b("event_open", handle=a("event_handle", event=e)["handle"])["event"]
        a("busy", event=e, n=400)
        b("event_query", event=be)  # before: NOT_READY expected
        b("event_sync", event=be)
        native([a.pid, b.pid], "event-link")
        a("busy", event=e, n=400)
        b("event_query", event=be)  # NOT_READY: still linked; SUCCESS: the link is gone
        b("event_sync", event=be)
        a("event_query", event=e)
    finally:
        a.kill()
        b.kill()


def main() -> None:
    from cuda.bindings import driver as cu

    cu.cuInit(0)
    print("driver", cu.cuDriverGetVersion())
    if sys.argv[1:] == ["event-link"]:
        scenario_event_link()
        return
    scenario_rules()
    for kind in ("exporter-only", "memory-closed", "event-creator-only", "event", "memory"):
        scenario_native(kind)


if __name__ == "__main__":
    if sys.argv[1:] == ["worker"]:
        worker()
    else:
        main()  # `event-link`: only the event scenario
