"""Probe: how fast can a process get pinned host memory for SAVE_ALLOCATIONS?

SAVE copies device memory to pinned host memory at ~55 GB/s, but one
cuMemHostAlloc of the whole size ran at ~1.6 GB/s on the H200 machine: getting
the memory, not copying it, is the cost. This measures, for TOTAL bytes
(default 8 GiB) split in chunks: one allocation; serial chunks; chunks from N
threads at once; and mmap + parallel first touch + cuMemHostRegister.
Prints one JSON line per strategy with GB/s.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from cuda.bindings import driver as cu

GiB = 1 << 30
TOTAL = int(os.environ.get("PROBE_TOTAL_GIB", "8")) * GiB
CHUNK = int(os.environ.get("PROBE_CHUNK_MIB", "256")) << 20
THREADS = int(os.environ.get("PROBE_THREADS", "8"))
libc = ctypes.CDLL(None)
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]


def ok(r: Any) -> Any:
    err = r[0] if isinstance(r, tuple) else r
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(cu.cuGetErrorName(err)[1].decode())
    return r[1] if isinstance(r, tuple) and len(r) == 2 else None


def timed(name: str, body: Callable[[], Callable[[], None]]) -> None:
    t = time.perf_counter()
    release = body()
    took = time.perf_counter() - t
    t = time.perf_counter()
    release()
    freed = time.perf_counter() - t
    print(
        json.dumps(
            {
                "strategy": name,
                "gb_per_s": round(TOTAL / took / 1e9, 2),
                "seconds": round(took, 3),
                "free_seconds": round(freed, 3),
                "threads": THREADS,
                "chunk_mib": CHUNK >> 20,
            }
        ),
        flush=True,
    )


def in_threads(ctx: Any, work: Callable[[int], None], n: int) -> None:
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            ok(cu.cuCtxSetCurrent(ctx))
            for k in range(i, TOTAL // CHUNK, n):
                work(k)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def main() -> None:
    ok(cu.cuInit(0))
    ctx = ok(cu.cuDevicePrimaryCtxRetain(ok(cu.cuDeviceGet(0))))
    ok(cu.cuCtxSetCurrent(ctx))
    chunks = TOTAL // CHUNK

    def whole() -> Callable[[], None]:
        p = ok(cu.cuMemHostAlloc(TOTAL, 0))
        return lambda: ok(cu.cuMemFreeHost(p))

    def serial() -> Callable[[], None]:
        ps = [ok(cu.cuMemHostAlloc(CHUNK, 0)) for _ in range(chunks)]
        return lambda: [ok(cu.cuMemFreeHost(p)) for p in ps] and None

    def parallel() -> Callable[[], None]:
        ps: list[Any] = [None] * chunks

        def alloc(k: int) -> None:
            ps[k] = ok(cu.cuMemHostAlloc(CHUNK, 0))

        in_threads(ctx, alloc, THREADS)
        return lambda: in_threads(ctx, lambda k: ok(cu.cuMemFreeHost(ps[k])), THREADS)

    def touch_register() -> Callable[[], None]:
        m = mmap.mmap(-1, TOTAL, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        base = ctypes.addressof(ctypes.c_char.from_buffer(m))
        in_threads(ctx, lambda k: libc.memset(base + k * CHUNK, 0, CHUNK), THREADS)
        ok(cu.cuMemHostRegister(base, TOTAL, 0))

        def release() -> None:
            ok(cu.cuMemHostUnregister(base))

        return release

    def touch_only() -> Callable[[], None]:
        m = mmap.mmap(-1, TOTAL, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        base = ctypes.addressof(ctypes.c_char.from_buffer(m))
        in_threads(ctx, lambda k: libc.memset(base + k * CHUNK, 0, CHUNK), THREADS)
        return lambda: None

    def register_chunks_parallel() -> Callable[[], None]:
        m = mmap.mmap(-1, TOTAL, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        base = ctypes.addressof(ctypes.c_char.from_buffer(m))

        def touch_and_register(k: int) -> None:
            libc.memset(base + k * CHUNK, 0, CHUNK)
            ok(cu.cuMemHostRegister(base + k * CHUNK, CHUNK, 0))

        in_threads(ctx, touch_and_register, THREADS)
        return lambda: in_threads(
            ctx, lambda k: ok(cu.cuMemHostUnregister(base + k * CHUNK)), THREADS
        )

    for name, body in (
        ("touch_only", touch_only),
        ("register_chunks_parallel", register_chunks_parallel),
        ("parallel_chunks", parallel),
        ("one_allocation", whole),
        ("serial_chunks", serial),
        ("touch_then_register", touch_register),
        ("parallel_chunks_again", parallel),
    ):
        try:
            timed(name, body)
        except Exception as exc:  # one strategy failing must not hide the others
            print(
                json.dumps({"strategy": name, "error": f"{type(exc).__name__}: {exc}"}), flush=True
            )


if __name__ == "__main__":
    main()
