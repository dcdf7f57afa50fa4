"""The host's provisioning floor for SAVE (issue 30): how fast fresh host memory takes bytes.

SAVE lands every staged byte in fresh anonymous memory; the kernel must give each page
(zeroed) before the bytes can stay there. This measures that, for ``--gib`` of fresh
anonymous memory per case (a new mapping each time, unmapped after), in GB/s (10^9):

- ``memset``: N threads (``--threads``, default 1 4 8 16) each writing its slice, the
  mapping advised MADV_HUGEPAGE (2 MiB pages where THP allows) and, at the most threads,
  MADV_NOHUGEPAGE too;
- ``memcpy``: what the staging threads do: N threads each copying from a buffer of its
  own (``--bounce-mib``, warm in cache) into its slice, THP;
- ``pwrite_memfd``: the same bytes written with pwrite from the same buffers into a
  memfd of each thread's own (a file's write takes its inode's lock: one per thread):
  shmem fills a page a write covers whole without zeroing it first, where a fault of
  fresh anonymous memory zeroes every page the memcpy then writes again;
- ``memcpy_resident``: at the most threads, each copying its slice between two mappings
  already faulted in: no page to provide, only the host's memory bandwidth (the rate
  SAVE's memcpy would have without the kernel's zeroing); not a way into fresh memory,
  so neither ``best`` nor ``best_memcpy``;
- ``memcpy_to_buffers``: LOAD's direction, N threads each copying its slice of a
  resident mapping into a buffer of its own (``--bounce-mib``), half by half
  (``best_load_memcpy``, the fastest); beside the floor, never taken for one: on the
  H200 it varied from 30 to 54 GB/s with 16 threads, and LOAD of 8 GiB ran faster;
- ``populate_write``: N threads calling madvise(MADV_POPULATE_WRITE) on their slices;
- ``map_populate``: one mmap(MAP_POPULATE) (the kernel faults it all in, one thread);
- with a GPU (not ``--no-gpu``): ``register``: cuMemHostRegister of fresh memory (one
  call, and N threads each registering their slice), and ``dma_registered``: a DtoH copy
  of the same bytes into memory registered just before (the copy alone, and register +
  copy).

``best`` is the fastest way to get the bytes into fresh memory the shim could use: the
best of memcpy (the bounce path, what SAVE does), memset (the same without reading a
source: an upper bound of it) and register + copy. One JSON object on stdout (``--out``
also writes it).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

MIB = 1 << 20
PAGE = 4096
MADV_HUGEPAGE, MADV_NOHUGEPAGE, MADV_POPULATE_WRITE = 14, 15, 23
MAP_POPULATE = 0x8000

libc = ctypes.CDLL(None, use_errno=True)
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
libc.memcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


def fresh(size: int, advice: int | None, populate: bool = False) -> int:
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | (MAP_POPULATE if populate else 0)
    p = libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, flags, -1, 0)
    if p in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), f"mmap of {size} bytes failed")
    if advice is not None and libc.madvise(p, size, advice) != 0:
        raise OSError(ctypes.get_errno(), f"madvise({advice}) failed")
    return int(p)


def parallel(n: int, size: int, work: Callable[[int, int, int], None]) -> float:
    """Seconds for n threads, thread i doing work(i, offset, length) on its slice; the
    clock starts once every thread is ready (ctypes calls drop the GIL)."""
    per = size // n // PAGE * PAGE
    ready = threading.Barrier(n + 1)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        ready.wait()
        try:
            work(i, i * per, size - i * per if i == n - 1 else per)
        except BaseException as exc:  # re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    ready.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    took = time.perf_counter() - start
    if errors:
        raise errors[0]
    return took


class Floor:
    def __init__(self, size: int, bounce: int, log: Callable[[str], None]):
        self.size, self.bounce, self.log = size, bounce, log

    def gbps(self, seconds: float) -> float:
        return round(self.size / seconds / 1e9, 2)

    def case(self, name: str, body: Callable[[int], float]) -> float:
        try:
            seconds = body(self.size)
        except OSError as exc:
            self.log(f"  {name}: {exc}")
            return float("nan")
        rate = self.gbps(seconds)
        self.log(f"  {name}: {rate} GB/s ({seconds:.3f} s)")
        return rate

    def memset(self, n: int, advice: int) -> float:
        p = fresh(self.size, advice)
        try:
            return parallel(n, self.size, lambda i, off, ln: libc.memset(p + off, 1, ln))
        finally:
            libc.munmap(p, self.size)

    def memcpy(self, n: int) -> float:
        p = fresh(self.size, MADV_HUGEPAGE)
        srcs = [ctypes.create_string_buffer(b"\1" * self.bounce, self.bounce) for _ in range(n)]

        def work(i: int, off: int, ln: int) -> None:
            src = ctypes.addressof(srcs[i])
            for at in range(0, ln, self.bounce):
                libc.memcpy(p + off + at, src, min(self.bounce, ln - at))

        try:
            return parallel(n, self.size, work)
        finally:
            libc.munmap(p, self.size)

    def memcpy_resident(self, n: int) -> float:
        src, dst = fresh(self.size, MADV_HUGEPAGE), fresh(self.size, MADV_HUGEPAGE)
        try:
            for p in (src, dst):  # faulted in first, untimed
                parallel(n, self.size, lambda i, off, ln, p=p: libc.memset(p + off, 1, ln))
            return parallel(n, self.size, lambda i, off, ln: libc.memcpy(dst + off, src + off, ln))
        finally:
            libc.munmap(src, self.size)
            libc.munmap(dst, self.size)

    def memcpy_to_buffers(self, n: int) -> float:
        """LOAD's direction: each thread copies its slice of a resident mapping into a
        buffer of its own (--bounce-mib), one half after the other, as LOAD memcpy's
        staged bytes into its bounce buffer's two pieces."""
        src = fresh(self.size, MADV_HUGEPAGE)
        half = self.bounce // 2
        dsts = [ctypes.create_string_buffer(self.bounce) for _ in range(n)]

        def work(i: int, off: int, ln: int) -> None:
            dst = ctypes.addressof(dsts[i])
            for k, at in enumerate(range(0, ln, half)):
                libc.memcpy(dst + (k % 2) * half, src + off + at, min(half, ln - at))

        try:
            parallel(n, self.size, lambda i, off, ln: libc.memset(src + off, 1, ln))  # untimed
            return parallel(n, self.size, work)
        finally:
            libc.munmap(src, self.size)

    def pwrite_memfd(self, n: int) -> float:
        srcs = [ctypes.create_string_buffer(b"\1" * self.bounce, self.bounce) for _ in range(n)]
        fds = [os.memfd_create(f"floor-{i}", os.MFD_CLOEXEC) for i in range(n)]

        def work(i: int, off: int, ln: int) -> None:
            view = memoryview(srcs[i]).cast("B")[: self.bounce]
            for at in range(0, ln, self.bounce):
                step = min(self.bounce, ln - at)
                if os.pwrite(fds[i], view[:step], at) != step:
                    raise OSError(0, f"a short pwrite into memfd {i}")

        try:
            return parallel(n, self.size, work)
        finally:
            for fd in fds:
                os.close(fd)

    def populate_write(self, n: int) -> float:
        p = fresh(self.size, MADV_HUGEPAGE)

        def work(i: int, off: int, ln: int) -> None:
            if libc.madvise(p + off, ln, MADV_POPULATE_WRITE) != 0:
                raise OSError(ctypes.get_errno(), "madvise(MADV_POPULATE_WRITE) failed")

        try:
            return parallel(n, self.size, work)
        finally:
            libc.munmap(p, self.size)

    def map_populate(self) -> float:
        start = time.perf_counter()
        p = fresh(self.size, None, populate=True)
        took = time.perf_counter() - start
        libc.munmap(p, self.size)
        return took


def gpu_cases(fl: Floor, threads: int, out: dict[str, Any]) -> None:
    from cuda.bindings import driver as cu

    def ok(r: Any) -> Any:
        err = r[0] if isinstance(r, tuple) else r
        if err != cu.CUresult.CUDA_SUCCESS:
            raise OSError(0, cu.cuGetErrorName(err)[1].decode())
        return r[1] if isinstance(r, tuple) and len(r) == 2 else None

    ok(cu.cuInit(0))
    ctx = ok(cu.cuDevicePrimaryCtxRetain(ok(cu.cuDeviceGet(0))))
    ok(cu.cuCtxSetCurrent(ctx))
    dev = int(ok(cu.cuMemAlloc(fl.size)))
    try:

        def register_one(size: int) -> float:
            p = fresh(size, MADV_HUGEPAGE)
            start = time.perf_counter()
            ok(cu.cuMemHostRegister(p, size, 0))
            took = time.perf_counter() - start
            ok(cu.cuMemHostUnregister(p))
            libc.munmap(p, size)
            return took

        def register_threads(size: int) -> float:
            p = fresh(size, MADV_HUGEPAGE)
            per = size // threads // PAGE * PAGE

            def work(i: int, off: int, ln: int) -> None:
                ok(cu.cuCtxSetCurrent(ctx))
                ok(cu.cuMemHostRegister(p + off, ln, 0))

            took = parallel(threads, size, work)
            for i in range(threads):
                ok(cu.cuMemHostUnregister(p + i * per))
            libc.munmap(p, size)
            return took

        dma: dict[str, float] = {}

        def register_and_dma(size: int) -> float:
            p = fresh(size, MADV_HUGEPAGE)
            start = time.perf_counter()
            ok(cu.cuMemHostRegister(p, size, 0))
            mid = time.perf_counter()
            ok(cu.cuMemcpyDtoH(p, dev, size))
            end = time.perf_counter()
            ok(cu.cuMemHostUnregister(p))
            libc.munmap(p, size)
            dma["dma_alone"] = fl.gbps(end - mid)
            return end - start

        out["register_one"] = fl.case("cuMemHostRegister, one call", register_one)
        out[f"register_{threads}"] = fl.case(
            f"cuMemHostRegister, {threads} threads", register_threads
        )
        out["register_then_dma"] = fl.case("register + DtoH copy into it", register_and_dma)
        out["dma_registered"] = dma.get("dma_alone", float("nan"))
        fl.log(f"  DtoH copy into freshly registered memory alone: {out['dma_registered']} GB/s")
    finally:
        ok(cu.cuMemFree(dev))


def measure(
    size: int, bounce: int, threads: Sequence[int], gpu: bool, log: Callable[[str], None]
) -> dict[str, Any]:
    fl = Floor(size, bounce, log)
    top = max(threads)
    rates: dict[str, Any] = {"bytes": size, "threads": list(threads)}
    log(f"floor: {size / (1 << 30):.1f} GiB of fresh memory per case")
    # The process's first big fault-in is slower than the rest (measured: 1.9 against
    # ~10 GB/s for one thread): reported on its own, as SAVE's cold run is.
    rates["memset_first_1"] = fl.case(
        "memset, 1 thread, THP, the process's first", lambda _s: fl.memset(1, MADV_HUGEPAGE)
    )
    for n in threads:
        rates[f"memset_thp_{n}"] = fl.case(
            f"memset, {n} threads, THP", lambda _s, n=n: fl.memset(n, MADV_HUGEPAGE)
        )
    rates[f"memset_nothp_{top}"] = fl.case(
        f"memset, {top} threads, no THP", lambda _s: fl.memset(top, MADV_NOHUGEPAGE)
    )
    for n in threads:
        rates[f"memcpy_thp_{n}"] = fl.case(
            f"memcpy from {bounce >> 20} MiB buffers, {n} threads, THP",
            lambda _s, n=n: fl.memcpy(n),
        )
    for n in threads:
        rates[f"memcpy_to_buffers_{n}"] = fl.case(
            f"memcpy from resident memory into {bounce >> 20} MiB buffers (LOAD's), {n} threads",
            lambda _s, n=n: fl.memcpy_to_buffers(n),
        )
    rates[f"memcpy_resident_{top}"] = fl.case(
        f"memcpy between resident mappings, {top} threads", lambda _s: fl.memcpy_resident(top)
    )
    for n in threads:
        rates[f"pwrite_memfd_{n}"] = fl.case(
            f"pwrite from {bounce >> 20} MiB buffers into a memfd each, {n} threads",
            lambda _s, n=n: fl.pwrite_memfd(n),
        )
    for n in sorted({1, top}):
        rates[f"populate_write_{n}"] = fl.case(
            f"MADV_POPULATE_WRITE, {n} threads", lambda _s, n=n: fl.populate_write(n)
        )
    rates["map_populate"] = fl.case("mmap(MAP_POPULATE)", lambda _s: fl.map_populate())
    if gpu:
        try:
            gpu_cases(fl, top, rates)
        except OSError as exc:
            log(f"  GPU cases failed: {exc}")
    candidates = {
        k: v
        for k, v in rates.items()
        if isinstance(v, float)
        and v == v
        and (k.startswith(("memcpy_thp_", "memset_thp_")) or k == "register_then_dma")
    }
    best = max(candidates, key=lambda k: candidates[k]) if candidates else ""
    rates["best"] = {"case": best, "gbps": candidates.get(best, float("nan"))}
    rates["best_memcpy"] = max(
        (v for k, v in candidates.items() if k.startswith("memcpy_thp_")), default=float("nan")
    )
    rates["best_load_memcpy"] = best_load_memcpy(rates)
    return rates


def best_load_memcpy(rates: dict[str, Any]) -> float:
    """The fastest memcpy out of resident memory into the buffers: shown, not a floor."""
    found = [
        float(v)
        for k, v in rates.items()
        if k.startswith("memcpy_to_buffers_") and isinstance(v, float) and v == v
    ]
    return max(found, default=float("nan"))


def summary(rates: dict[str, Any]) -> str:
    return (
        f"best floor {rates['best']['gbps']} GB/s ({rates['best']['case']}), "
        f"the bounce path's (memcpy) {rates['best_memcpy']} GB/s"
    )


def median_of(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per case, the median of several measure() results."""
    out: dict[str, Any] = {}
    for k, v in runs[0].items():
        if isinstance(v, float):
            vals = [float(r[k]) for r in runs if r.get(k) == r.get(k)]
            out[k] = statistics.median(vals) if vals else float("nan")
        else:
            out[k] = v
    # The first-of-the-process case only happens once: the first run's.
    out["memset_first_1"] = runs[0].get("memset_first_1", float("nan"))
    best = runs[0]["best"]["case"]
    out["best"] = {"case": best, "gbps": out.get(best, float("nan"))}
    out["best_load_memcpy"] = best_load_memcpy(out)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=4.0)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--bounce-mib", type=int, default=8)
    parser.add_argument("--no-gpu", action="store_true")
    parser.add_argument("--repeat", type=int, default=1, help="medians of this many runs")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)

    def log(text: str) -> None:
        print(f"[floor] {text}", file=sys.stderr, flush=True)

    size = int(args.gib * (1 << 30)) // (2 * MIB) * (2 * MIB)
    runs = [
        measure(size, args.bounce_mib * MIB, args.threads, not args.no_gpu, log)
        for _ in range(max(1, args.repeat))
    ]
    rates = median_of(runs)
    rates["runs"] = runs
    log(summary(rates))
    text = json.dumps(rates, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
