"""LOOPS of tests/shim/test_quiesce.py: a snippet the worker runs (tests/snippet.py)."""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import ctypes

    from tests.shim.snippets.worker_setup import ctx
    from tests.snippet import check, cu, err

    REGION = THREADS = ...  # set by the test before this snippet

import threading
import time

RUN = {"stop": False, "done": [0] * THREADS, "launched": [0] * THREADS, "errors": []}
def loop(t, base, sync):
    check(cu.cuCtxSetCurrent(ctx))
    s = check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING))
    i = 0
    while not RUN["stop"] and (i + 1) * 4 <= REGION:
        r = err(cu.cuMemsetD32Async(base + t * REGION + 4 * i, i + 1, 1, s))
        if r != "CUDA_SUCCESS":
            RUN["errors"].append(f"thread {t} launch {i}: {r}")
            return
        RUN["launched"][t] = i + 1
        if sync:
            r = err(cu.cuStreamSynchronize(s))
            if r != "CUDA_SUCCESS":
                RUN["errors"].append(f"thread {t} sync {i}: {r}")
                return
            RUN["done"][t] = i + 1
        else:
            time.sleep(0.004)
        i += 1
    r = err(cu.cuStreamSynchronize(s))
    if r != "CUDA_SUCCESS":
        RUN["errors"].append(f"thread {t} last sync: {r}")
    else:
        RUN["done"][t] = RUN["launched"][t]
def start(base, sync=True):
    RUN["threads"] = [threading.Thread(target=loop, args=(t, base, sync), daemon=True)
                      for t in range(THREADS)]
    for th in RUN["threads"]:
        th.start()
def stop():
    RUN["stop"] = True
    for th in RUN["threads"]:
        th.join()
def missing(base):
    # words that a thread counted as written but that do not hold their value
    bad = []
    for t in range(THREADS):
        n = RUN["done"][t]
        buf = ctypes.create_string_buffer(4 * n)
        if n:
            check(cu.cuMemcpyDtoH(ctypes.addressof(buf), base + t * REGION, 4 * n))
        words = [int.from_bytes(buf.raw[4 * i:4 * i + 4], "little") for i in range(n)]
        bad += [f"thread {t} word {i}: {w}" for i, w in enumerate(words) if w != i + 1]
    return bad
