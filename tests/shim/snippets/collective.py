"""COLLECTIVE of tests/shim/test_quiesce.py: a snippet the worker runs (tests/snippet.py)."""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import ctypes

    from tests.shim.snippets.worker_setup import ctx
    from tests.snippet import check, cu, err

    REGION = ...  # set by the test before this snippet

import mmap
import os
import threading

LIB = ctypes.CDLL("libcuda.so.1")
LAUNCH = ctypes.CDLL(None).cuLaunchHostFunc  # the shim's: through the gate
LAUNCH.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
FN = ctypes.cast(LIB.cuinterposeSimCollective, ctypes.c_void_p).value
class Coll(ctypes.Structure):
    _fields_ = [("arrived", ctypes.c_void_p), ("abandon", ctypes.c_void_p),
                ("rank", ctypes.c_uint32), ("ranks", ctypes.c_uint32)]
ARENA = {}
def join(path, rank):
    fd = os.open(path, os.O_RDWR)
    ARENA["map"] = m = mmap.mmap(fd, 4096)
    os.close(fd)
    base = ctypes.addressof(ctypes.c_char.from_buffer(m))
    ARENA["coll"] = Coll(base, base + 64, rank, 2)
RUN = {"stop": False, "done": 0, "launched": 0, "errors": [], "pause": False, "paused_at": None}
GO = threading.Event()
def coll_loop(base):
    check(cu.cuCtxSetCurrent(ctx))
    s = check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING))
    i = 0
    while not RUN["stop"] and (i + 1) * 4 <= REGION:
        r = LAUNCH(int(s), FN, ctypes.addressof(ARENA["coll"]))
        if r == 0:
            r = err(cu.cuMemsetD32Async(base + 4 * i, i + 1, 1, s))
        if r not in (0, "CUDA_SUCCESS"):
            RUN["errors"].append(f"launch {i}: {r}")
            return
        RUN["launched"] = i + 1
        if RUN["pause"]:
            RUN["paused_at"] = i
            GO.wait()
        r = err(cu.cuStreamSynchronize(s))
        if r != "CUDA_SUCCESS":
            RUN["errors"].append(f"sync {i}: {r}")
            return
        RUN["done"] = i + 1
        i += 1
def coll_start(base):
    RUN["thread"] = threading.Thread(target=coll_loop, args=(base,), daemon=True)
    RUN["thread"].start()
def coll_stop():
    RUN["stop"] = True
    ctypes.c_uint32.from_address(ARENA["coll"].abandon).value = 1  # a peer may be gone
    GO.set()
    RUN["thread"].join()
def coll_missing(base):
    n = RUN["done"]
    buf = ctypes.create_string_buffer(4 * n)
    if n:
        check(cu.cuMemcpyDtoH(ctypes.addressof(buf), base, 4 * n))
    words = [int.from_bytes(buf.raw[4 * i:4 * i + 4], "little") for i in range(n)]
    return [f"word {i}: {w}" for i, w in enumerate(words) if w != i + 1]
