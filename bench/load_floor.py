"""LOAD's floor on this driver (issue 30 item 3): re-creating a shape's allocations while
their bytes are copied in, without the shim.

LOAD re-creates every allocation (cuMemCreate, cuMemMap at its kept reservation,
cuMemSetAccess) and copies its bytes back while it re-creates the next ones. For
``--count`` allocations of ``--mib`` MiB on GPU 0, through ctypes on libcuda (a ctypes
call releases the GIL, so the threads call the driver at once), with the reservations
made first, as LOAD finds them:

- ``recreate_s``: the three calls for every allocation from one thread, nothing else
  running (what LOAD's control thread does);
- ``copy_s``: the bytes alone into the allocations already made: ``--threads`` threads,
  each with a non-blocking stream of its own, copying whole allocations from a pinned
  buffer of its own in pieces of at most ``--piece-mib`` (queued, one sync per
  allocation); no memcpy out of pageable memory, so an upper bound of LOAD's copy;
- ``overlap_s``: both at once, as LOAD does them: one thread re-creates, and each
  allocation, once made, is copied by the first free copy thread. This is the floor:
  LOAD with its bytes already pinned and nothing of the shim's around it.

GB/s are 10^9 bytes over each time; ``overlap_of_htod`` is the floor over the pinned
HtoD ceiling of one ``--ceiling-mib`` buffer measured in the same run (one stream, one
thread). Medians of ``--repeat``, every run listed. Every result checked; everything
released. One JSON object to ``--out`` and stdout; ``--libcuda`` picks the driver (the
simulator's in the tests).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import queue
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vmm_probe import U64, Driver, free_reservations, reservations

MIB = 1 << 20
STREAM_NON_BLOCKING = 1


class Copier:
    """One copy thread's stream and pinned source buffer (in the primary context)."""

    def __init__(self, d: Driver, piece: int) -> None:
        self.d, self.piece = d, piece
        d.current()
        self.stream = ctypes.c_void_p()
        d.check("cuStreamCreate", ctypes.byref(self.stream), ctypes.c_uint(STREAM_NON_BLOCKING))
        self.buf = ctypes.c_void_p()
        d.check("cuMemHostAlloc", ctypes.byref(self.buf), ctypes.c_size_t(piece), ctypes.c_uint(0))

    def copy(self, va: int, size: int) -> None:
        """`size` bytes into `va`, in pieces from the pinned buffer; one sync."""
        for off in range(0, size, self.piece):
            n = min(self.piece, size - off)
            self.d.check("cuMemcpyHtoDAsync_v2", U64(va + off), self.buf, ctypes.c_size_t(n),
                         self.stream)  # fmt: skip
        self.d.check("cuStreamSynchronize", self.stream)

    def close(self) -> None:
        self.d.check("cuStreamDestroy_v2", self.stream)
        self.d.check("cuMemFreeHost", self.buf)


def make_one(d: Driver, va: int, size: int) -> int:
    h = d.create(size)
    d.map(va, size, h)
    r = d.set_access(va, size)
    if r != 0:
        raise SystemExit(f"cuMemSetAccess failed: {d.name(r)} ({r})")
    return h


def unmake(d: Driver, vas: Sequence[int], handles: Sequence[int], size: int) -> None:
    d.release_all(vas[: len(handles)], handles, size)


def recreate(d: Driver, vas: Sequence[int], size: int) -> tuple[float, list[int]]:
    t0 = time.perf_counter()
    handles = [make_one(d, va, size) for va in vas]
    return time.perf_counter() - t0, handles


def copy_threads(
    d: Driver, copiers: Sequence[Copier], work: queue.Queue[int | None], size: int
) -> tuple[list[threading.Thread], list[str]]:
    """Threads that copy every VA taken from `work` until they take None."""
    errors: list[str] = []

    def run(c: Copier) -> None:
        try:
            d.current()
            while (va := work.get()) is not None:
                c.copy(va, size)
        except SystemExit as e:
            errors.append(str(e))

    threads = [threading.Thread(target=run, args=(c,)) for c in copiers]
    for t in threads:
        t.start()
    return threads, errors


def copy_all(d: Driver, copiers: Sequence[Copier], vas: Sequence[int], size: int) -> float:
    """The bytes alone: every allocation already made."""
    work: queue.Queue[int | None] = queue.Queue()
    threads, errors = copy_threads(d, copiers, work, size)
    t0 = time.perf_counter()
    for va in vas:
        work.put(va)
    for _ in copiers:
        work.put(None)
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise SystemExit("; ".join(errors))
    return wall


def overlap(d: Driver, copiers: Sequence[Copier], vas: Sequence[int], size: int) -> float:
    """One thread re-creates; the copy threads copy each allocation once it is made."""
    work: queue.Queue[int | None] = queue.Queue()
    threads, errors = copy_threads(d, copiers, work, size)
    handles: list[int] = []
    t0 = time.perf_counter()
    try:
        for va in vas:
            handles.append(make_one(d, va, size))
            work.put(va)
    finally:
        for _ in copiers:
            work.put(None)
        for t in threads:
            t.join()
    wall = time.perf_counter() - t0
    unmake(d, vas, handles, size)
    if errors:
        raise SystemExit("; ".join(errors))
    return wall


def ceiling(d: Driver, mib: int) -> float:
    """Pinned HtoD GB/s of one buffer, one stream: the best of three."""
    size = mib * MIB
    c = Copier(d, size)
    dev = U64()
    d.check("cuMemAlloc_v2", ctypes.byref(dev), ctypes.c_size_t(size))
    best = 0.0
    for _ in range(3):
        t0 = time.perf_counter()
        c.copy(dev.value, size)
        best = max(best, size / (time.perf_counter() - t0) / 1e9)
    d.check("cuMemFree_v2", dev)
    c.close()
    return best


def stats(values: Sequence[float]) -> dict[str, Any]:
    return {"median": statistics.median(values), "runs": list(values)}


def measure(d: Driver, args: argparse.Namespace) -> dict[str, Any]:
    size, total = args.mib * MIB, args.count * args.mib * MIB
    vas = reservations(d, args.count, size)
    copiers = [Copier(d, min(args.piece_mib * MIB, size)) for _ in range(args.threads)]
    runs: dict[str, list[float]] = {"recreate_s": [], "copy_s": [], "overlap_s": []}
    try:
        wall, handles = recreate(d, vas[: min(64, args.count)], size)  # warm-up
        unmake(d, vas, handles, size)
        for _ in range(args.repeat):
            wall, handles = recreate(d, vas, size)
            runs["recreate_s"].append(wall)
            runs["copy_s"].append(copy_all(d, copiers, vas, size))
            unmake(d, vas, handles, size)
            runs["overlap_s"].append(overlap(d, copiers, vas, size))
    finally:
        for c in copiers:
            c.close()
        free_reservations(d, vas, size)
    out: dict[str, Any] = {
        "count": args.count,
        "bytes_each": size,
        "bytes": total,
        "threads": args.threads,
        "piece": min(args.piece_mib * MIB, size),
        "repeat": args.repeat,
    }
    for key, values in runs.items():
        out[key] = stats(values)
        out[key.replace("_s", "_gbps")] = total / statistics.median(values) / 1e9
    out["recreate_us_per_allocation"] = statistics.median(runs["recreate_s"]) / args.count * 1e6
    out["htod_ceiling_gbps"] = ceiling(d, args.ceiling_mib)
    out["overlap_of_htod"] = out["overlap_gbps"] / out["htod_ceiling_gbps"]
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=2048)
    parser.add_argument("--mib", type=int, default=2)
    parser.add_argument("--threads", type=int, default=16, help="copy threads")
    parser.add_argument("--piece-mib", type=int, default=8, help="largest single copy")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--ceiling-mib", type=int, default=1024)
    parser.add_argument("--libcuda", default="libcuda.so.1")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    for name in ("count", "mib", "threads", "piece_mib", "repeat", "ceiling_mib"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    result = measure(Driver(args.libcuda), args)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
