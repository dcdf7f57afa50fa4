"""Probe: what the real driver answers where the shim was seen to answer otherwise
(issue 28, section 6): a freed small cuMemAlloc pointer beside a live one, a pitch too
wide, BUFFER_ID and MEMORY_BLOCK_ID over the native checkpoint, and (with two devices)
the devices from which an IPC open of another device's memory is accessible, with and
without CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS.

    python3 tools/probe_fidelity.py > fidelity.jsonl

One JSON object a line, {"case": ..., "result": ...}, as tools/probe_driver_rules.py
prints them; specs/records/2026-12-01-h200-fidelity.jsonl holds the H200's, and
tests/sim/test_fidelity_pointers.py runs this probe on the simulated driver against it.
Two worker processes (A creates, B opens) obey JSON commands on stdin; the parent runs
the native checkpoint of A. Never creates a multicast object.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

MIB = 1 << 20
LAZY = 1  # CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS


def worker() -> None:
    """Obey one JSON command a line; answer each with one JSON line (an exception too)."""
    from cuda.bindings import driver as cu

    def name(err: Any) -> str:
        return str(cu.cuGetErrorName(err)[1].decode())

    def ok(r: Any) -> Any:
        err = r[0] if isinstance(r, tuple) else r
        if err != cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(name(err))
        return r[1] if isinstance(r, tuple) and len(r) == 2 else None

    ok(cu.cuInit(0))
    count = int(ok(cu.cuDeviceGetCount()))
    ctxs = [ok(cu.cuDevicePrimaryCtxRetain(ok(cu.cuDeviceGet(d)))) for d in range(count)]
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            ok(cu.cuCtxSetCurrent(ctxs[cmd.get("dev", 0)]))
            reply = serve(cu, name, ok, count, cmd)
        except Exception as exc:  # answered, so that the parent records it and goes on
            reply = {"r": f"python error: {type(exc).__name__}: {exc}"}
        print(json.dumps(reply), flush=True)


def _num(value: Any) -> int | None:
    return None if value is None else int(value)


def serve(cu: Any, name: Any, ok: Any, count: int, cmd: dict[str, Any]) -> dict[str, Any]:
    import ctypes
    import os

    op = cmd["op"]
    if op == "pid":
        return {"pid": os.getpid(), "devices": count}
    if op == "alloc":
        r = cu.cuMemAlloc(cmd["size"])
        if r[0] == cu.CUresult.CUDA_SUCCESS:
            ok(cu.cuMemsetD8(r[1], cmd.get("byte", 0), cmd["size"]))
        return {"r": name(r[0]), "ptr": _num(r[1])}
    if op == "free":
        return {"r": name(cu.cuMemFree(cmd["ptr"])[0])}
    if op == "range":
        r = cu.cuMemGetAddressRange(cmd["ptr"])
        return {"r": name(r[0]), "base": _num(r[1]), "size": _num(r[2])}
    if op == "attr":
        attr = getattr(cu.CUpointer_attribute, "CU_POINTER_ATTRIBUTE_" + cmd["name"])
        r = cu.cuPointerGetAttribute(attr, cmd["ptr"])
        return {"r": name(r[0]), "value": _num(r[1]) if r[0] == cu.CUresult.CUDA_SUCCESS else None}
    if op == "pitch":
        r = cu.cuMemAllocPitch(cmd["w"], cmd["h"], cmd["elem"])
        if r[0] == cu.CUresult.CUDA_SUCCESS:  # freed at once: the probe goes on to checkpoint
            ok(cu.cuMemFree(r[1])[0])
        return {"r": name(r[0])}
    if op == "ipc_get":
        r = cu.cuIpcGetMemHandle(cmd["ptr"])
        ok(r[0])
        return {"r": name(r[0]), "handle": ctypes.string_at(r[1].getPtr(), 64).hex()}
    if op == "ipc_open":
        raw = ctypes.create_string_buffer(bytes.fromhex(cmd["handle"]), 64)
        r = cu.cuIpcOpenMemHandle(cu.CUipcMemHandle(_ptr=ctypes.addressof(raw)), cmd["flags"])
        return {"r": name(r[0]), "ptr": _num(r[1]) if r[0] == cu.CUresult.CUDA_SUCCESS else None}
    if op == "ipc_close":
        return {"r": name(cu.cuIpcCloseMemHandle(cmd["ptr"])[0])}
    if op == "read":
        buf = ctypes.create_string_buffer(1)
        err = cu.cuMemcpyDtoH(buf, cmd["ptr"], 1)[0]
        return {"r": name(err), "byte": buf.raw[0] if err == cu.CUresult.CUDA_SUCCESS else None}
    raise ValueError(f"unknown op {op!r}")


class Worker:
    def __init__(self) -> None:
        self.p = subprocess.Popen([sys.executable, __file__, "worker"], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)  # fmt: skip
        hello = self("pid")
        self.pid, self.devices = int(hello["pid"]), int(hello["devices"])

    def __call__(self, op: str, **kw: Any) -> dict[str, Any]:
        assert self.p.stdin and self.p.stdout
        self.p.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.p.stdin.flush()
        line = self.p.stdout.readline()
        if not line:
            raise RuntimeError(f"the worker died during {op} (exit status {self.p.poll()})")
        return dict(json.loads(line))

    def kill(self) -> None:
        self.p.kill()
        self.p.wait()


def out(case: str, result: Any) -> None:
    print(json.dumps({"case": case, "result": result}), flush=True)


def native(pid: int) -> list[str]:
    """Lock, checkpoint, restore, unlock of ``pid``: each step's CUresult name."""
    from cuda.bindings import driver as cu

    steps = []
    lock = cu.CUcheckpointLockArgs()
    lock.timeoutMs = 10000
    for fn, args in (
        ("cuCheckpointProcessLock", lock),
        ("cuCheckpointProcessCheckpoint", cu.CUcheckpointCheckpointArgs()),
        ("cuCheckpointProcessRestore", cu.CUcheckpointRestoreArgs()),
        ("cuCheckpointProcessUnlock", cu.CUcheckpointUnlockArgs()),
    ):
        r = getattr(cu, fn)(pid, args)
        steps.append(str(cu.cuGetErrorName(r[0] if isinstance(r, tuple) else r)[1].decode()))
    return steps


def ids(a: Worker, ptr: int) -> list[Any]:
    """Each id's value, or the CUresult the driver answered instead (recorded, not fatal)."""
    answers = (a("attr", name=n, ptr=ptr) for n in ("BUFFER_ID", "MEMORY_BLOCK_ID"))
    return [got.get("value", got.get("r")) for got in answers]


def scenario_one_device(a: Worker) -> None:
    freed = a("alloc", size=4096)["ptr"]
    kept = a("alloc", size=4096, byte=7)["ptr"]
    big = a("alloc", size=4 * MIB, byte=9)["ptr"]
    out("free_small", a("free", ptr=freed)["r"])
    out("freed_small_range", a("range", ptr=freed)["r"])
    out("freed_small_interior_range", a("range", ptr=freed + 8)["r"])
    for name in ("RANGE_START_ADDR", "RANGE_SIZE"):
        out(f"freed_small_attribute_{name}", a("attr", name=name, ptr=freed)["r"])
    got = a("range", ptr=kept + 8)
    out("kept_small_range", [got["r"], got["base"] == kept, got["size"]])
    out("pitch_2p62_8_4", a("pitch", w=1 << 62, h=8, elem=4)["r"])
    out("pitch_2p31_8_4", a("pitch", w=1 << 31, h=8, elem=4)["r"])
    before = {"small": ids(a, kept), "big": ids(a, big)}
    out("ids", before)
    out("ids_known", all(isinstance(v, int) and v > 0 for p in before.values() for v in p))
    out("native_checkpoint_of_a_process_with_cumemalloc_memory", native(a.pid))
    after = {"small": ids(a, kept), "big": ids(a, big)}
    out("ids_kept_by_the_native_checkpoint", before == after)
    out("bytes_kept_by_the_native_checkpoint",
        [a("read", ptr=kept)["byte"], a("read", ptr=big)["byte"]])  # fmt: skip


def scenario_two_devices(a: Worker, b: Worker) -> None:
    """Memory of device 1 opened by a process whose context is on device 0."""
    for flags, label in ((0, "flags0"), (LAZY, "lazy")):
        mine = a("alloc", size=4 * MIB, byte=5, dev=1)["ptr"]
        handle = a("ipc_get", ptr=mine, dev=1)["handle"]
        opened = b("ipc_open", handle=handle, flags=flags, dev=0)
        out(f"other_device_open_{label}", opened["r"])
        if opened["r"] != "CUDA_SUCCESS":
            continue
        ptr = opened["ptr"]
        access = {str(d): b("attr", name="ACCESS_FLAGS", ptr=ptr, dev=d)["value"] for d in (0, 1)}
        out(f"other_device_open_{label}_access_flags", access)
        reads = {str(d): b("read", ptr=ptr, dev=d)["r"] for d in (0, 1)}
        out(f"other_device_open_{label}_read", reads)
        out(f"other_device_close_{label}", b("ipc_close", ptr=ptr, dev=0)["r"])


def main() -> None:
    from cuda.bindings import driver as cu

    cu.cuInit(0)
    out("driver_version", int(cu.cuDriverGetVersion()[1]))
    a = Worker()
    try:
        out("devices", a.devices)
        scenario_one_device(a)
    finally:
        a.kill()
    if a.devices < 2:
        out("two_devices", "skipped: one device")
        return
    a, b = Worker(), Worker()
    try:
        scenario_two_devices(a, b)
    finally:
        a.kill()
        b.kill()


if __name__ == "__main__":
    if sys.argv[1:] == ["worker"]:
        worker()
    else:
        main()
