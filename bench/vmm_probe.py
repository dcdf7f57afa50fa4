"""What LOAD's re-creation costs the driver (issue 30 item 3), without the shim.

LOAD re-creates every allocation: cuMemCreate, cuMemMap at its (kept) reservation,
cuMemSetAccess. For ``--count`` allocations of ``--mib`` MiB on GPU 0 this measures,
through ctypes on libcuda (a ctypes call releases the GIL, so threads call the driver
at once):

1. each call's time, one thread, summed over the allocations (the reservations made
   first, as LOAD finds them);
2. the three calls per allocation from 1, 2, 4 and 8 threads (each with the primary
   context current, the allocations interleaved), wall time: whether the driver runs
   them in parallel;
3. one cuMemSetAccess over ``--run`` allocations mapped back to back, against one call
   each: inside one reservation (documented), and across ``--run`` reservations that
   lie next to each other (asked for at the previous one's end; not documented): its
   result and time. That says whether one access call per run of contiguous mappings
   could replace ``--run`` of them.

Every result checked; everything released. One JSON object to ``--out`` and stdout.
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import json
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

MIB = 1 << 20


class Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class AllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class Prop(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", Location),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", AllocFlags),
    ]


class AccessDesc(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", Location), ("flags", ctypes.c_int)]


PINNED, POSIX_FD, DEVICE, READWRITE = 1, 1, 1, 3
U64 = ctypes.c_uint64


class Driver:
    def __init__(self, path: str) -> None:
        self.lib = ctypes.CDLL(path)
        self.check("cuInit", 0)
        dev = ctypes.c_int()
        self.check("cuDeviceGet", ctypes.byref(dev), 0)
        self.ctx = ctypes.c_void_p()
        self.check("cuDevicePrimaryCtxRetain", ctypes.byref(self.ctx), dev)
        self.current()
        self.prop = Prop(PINNED, POSIX_FD, Location(DEVICE, 0), None, AllocFlags())
        self.access = AccessDesc(Location(DEVICE, 0), READWRITE)

    def call(self, name: str, *args: Any) -> int:
        return int(getattr(self.lib, name)(*args))

    def check(self, name: str, *args: Any) -> None:
        r = self.call(name, *args)
        if r != 0:
            raise SystemExit(f"{name} failed: {self.name(r)} ({r})")

    def name(self, r: int) -> str:
        s = ctypes.c_char_p()
        if self.lib.cuGetErrorName(r, ctypes.byref(s)) == 0 and s.value:
            return s.value.decode()
        return str(r)

    def current(self) -> None:
        self.check("cuCtxSetCurrent", self.ctx)

    def reserve(self, size: int, hint: int = 0) -> int:
        va = U64()
        self.check("cuMemAddressReserve", ctypes.byref(va), U64(size), U64(0), U64(hint), U64(0))
        return va.value

    def create(self, size: int) -> int:
        h = U64()
        self.check("cuMemCreate", ctypes.byref(h), U64(size), ctypes.byref(self.prop), U64(0))
        return h.value

    def map(self, va: int, size: int, h: int) -> None:
        self.check("cuMemMap", U64(va), U64(size), U64(0), U64(h), U64(0))

    def set_access(self, va: int, size: int) -> int:
        return self.call("cuMemSetAccess", U64(va), U64(size), ctypes.byref(self.access), U64(1))

    def release_all(self, vas: Sequence[int], handles: Sequence[int], size: int) -> None:
        for va in vas:
            self.call("cuMemUnmap", U64(va), U64(size))
        for h in handles:
            self.check("cuMemRelease", U64(h))


def reservations(d: Driver, count: int, size: int) -> list[int]:
    return [d.reserve(size) for _ in range(count)]


def free_reservations(d: Driver, vas: Sequence[int], size: int) -> None:
    for va in vas:
        d.check("cuMemAddressFree", U64(va), U64(size))


def per_call(d: Driver, count: int, size: int) -> dict[str, float]:
    """Seconds summed per call, one thread."""
    vas = reservations(d, count, size)
    spent = {"cuMemCreate": 0.0, "cuMemMap": 0.0, "cuMemSetAccess": 0.0}
    handles = []
    for va in vas:
        t0 = time.perf_counter()
        h = d.create(size)
        t1 = time.perf_counter()
        d.map(va, size, h)
        t2 = time.perf_counter()
        r = d.set_access(va, size)
        t3 = time.perf_counter()
        if r != 0:
            raise SystemExit(f"cuMemSetAccess failed: {d.name(r)}")
        handles.append(h)
        spent["cuMemCreate"] += t1 - t0
        spent["cuMemMap"] += t2 - t1
        spent["cuMemSetAccess"] += t3 - t2
    d.release_all(vas, handles, size)
    free_reservations(d, vas, size)
    return spent


def threaded(d: Driver, count: int, size: int, threads: int) -> float:
    """Wall seconds for the three calls of every allocation from `threads` threads."""
    vas = reservations(d, count, size)
    handles: list[list[int]] = [[] for _ in range(threads)]
    errors: list[str] = []
    start = threading.Barrier(threads + 1)

    def work(k: int) -> None:
        try:
            d.current()
            start.wait()
            for va in vas[k::threads]:
                h = d.create(size)
                handles[k].append(h)
                d.map(va, size, h)
                r = d.set_access(va, size)
                if r != 0:
                    raise SystemExit(f"cuMemSetAccess failed: {d.name(r)}")
        except SystemExit as e:
            errors.append(str(e))

    ts = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
    for t in ts:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in ts:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise SystemExit("; ".join(errors))
    d.release_all(vas, [h for hs in handles for h in hs], size)
    free_reservations(d, vas, size)
    return wall


def timed(fn: Callable[[], int]) -> tuple[int, float]:
    t0 = time.perf_counter()
    r = fn()
    return r, time.perf_counter() - t0


def one_reservation(d: Driver, run: int, size: int) -> dict[str, Any]:
    """`run` allocations back to back in one reservation: one access call for all,
    then (mapped again) one each."""
    base = d.reserve(run * size)
    handles = [d.create(size) for _ in range(run)]
    vas = [base + k * size for k in range(run)]
    for va, h in zip(vas, handles, strict=True):
        d.map(va, size, h)
    r, one = timed(lambda: d.set_access(base, run * size))
    for va in vas:
        d.check("cuMemUnmap", U64(va), U64(size))
    for va, h in zip(vas, handles, strict=True):
        d.map(va, size, h)
    t0 = time.perf_counter()
    each = [d.set_access(va, size) for va in vas]
    each_s = time.perf_counter() - t0
    d.release_all(vas, handles, size)
    d.check("cuMemAddressFree", U64(base), U64(run * size))
    return {
        "one_call": d.name(r),
        "one_call_s": one,
        "each": sorted({d.name(x) for x in each}),
        "each_s": each_s,
    }


def adjacent_reservations(d: Driver, run: int, size: int) -> dict[str, Any]:
    """`run` reservations asked for at the previous one's end; when they lie back to
    back, one access call across all of them (not documented), then one each."""
    vas = [d.reserve(size)]
    for _ in range(run - 1):
        vas.append(d.reserve(size, hint=vas[-1] + size))
    adjacent = all(b == a + size for a, b in itertools.pairwise(vas))
    out: dict[str, Any] = {"adjacent": adjacent}
    handles = [d.create(size) for _ in range(run)]
    for va, h in zip(vas, handles, strict=True):
        d.map(va, size, h)
    if adjacent:
        r, one = timed(lambda: d.set_access(vas[0], run * size))
        out.update(one_call=d.name(r), one_call_s=one)
    t0 = time.perf_counter()
    each = [d.set_access(va, size) for va in vas]
    out.update(each=sorted({d.name(x) for x in each}), each_s=time.perf_counter() - t0)
    d.release_all(vas, handles, size)
    free_reservations(d, vas, size)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=2048)
    parser.add_argument("--mib", type=int, default=2)
    parser.add_argument("--run", type=int, default=32, help="allocations per access call")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--libcuda", default="libcuda.so.1")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    size = args.mib * MIB
    d = Driver(args.libcuda)
    result: dict[str, Any] = {"count": args.count, "bytes_each": size, "run": args.run}
    per_call(d, min(64, args.count), size)  # warm-up: the driver's first VMM calls
    calls = per_call(d, args.count, size)
    result["one_thread_s"] = calls
    result["one_thread_us_per_allocation"] = sum(calls.values()) / args.count * 1e6
    result["threads_wall_s"] = {str(t): threaded(d, args.count, size, t) for t in args.threads}
    result["one_reservation"] = one_reservation(d, args.run, size)
    result["adjacent_reservations"] = adjacent_reservations(d, args.run, size)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
