"""CALLS of tests/sim/test_ipc_entry_points.py: a snippet the worker runs (tests/snippet.py)."""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import ctypes

    from tests.snippet import SIM

    FUTEX_NR = ...  # set by the test before this snippet

import threading
import time

lib = ctypes.CDLL("libcuda.so.1")
P, U64, SZ, U, I = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_uint, ctypes.c_int  # noqa: E741
class H64(ctypes.Structure):
    _fields_ = [("b", ctypes.c_char * 64)]
# (resolver name, version, argument types, arguments): each call's arguments are
# refused by the driver (no current context in the calling thread, NULL outputs), so that
# a call only says whether it passed the gate and what it answered.
CALLS = [
    ("cuMemAllocPitch", 3020, [P, P, SZ, SZ, U], [None, None, 0, 0, 0]),
    ("cuIpcGetMemHandle", 4010, [P, U64], [None, 0]),
    ("cuIpcOpenMemHandle", 4010, [P, H64, U], [None, H64(), 0]),
    ("cuIpcOpenMemHandle", 11000, [P, H64, U], [None, H64(), 0]),
    ("cuIpcCloseMemHandle", 4010, [U64], [0]),
    ("cuIpcGetEventHandle", 4010, [P, P], [None, None]),
    ("cuIpcOpenEventHandle", 4010, [P, H64], [None, H64()]),
    ("cuCtxEnablePeerAccess", 4000, [P, U], [None, 0]),
    ("cuCtxDisablePeerAccess", 4000, [P], [None]),
    ("cuPointerGetAttribute", 4000, [P, I, U64], [None, 1, 0]),
    ("cuPointerGetAttributes", 7000, [U, P, P, U64], [0, None, None, 0]),
    ("cuMemPoolCreate", 11020, [P, P], [None, None]),
    ("cuMemPoolDestroy", 11020, [P], [None]),
    ("cuMemPoolExportToShareableHandle", 11020, [P, P, I, U64], [None, None, 1, 0]),
    ("cuMemPoolImportFromShareableHandle", 11020, [P, P, I, U64], [None, None, 1, 0]),
    ("cuMemPoolExportPointer", 11020, [P, U64], [None, 0]),
    ("cuMemPoolImportPointer", 11020, [P, P, P], [None, None, None]),
]
def resolve(name, version, types):
    fn, status = P(), I(-1)
    r = lib.cuGetProcAddress_v2(name.encode(), ctypes.byref(fn), version, U64(0),
                                ctypes.byref(status))
    assert r == 0 and status.value == 0 and fn.value, (name, version, r, status.value)
    return ctypes.CFUNCTYPE(I, *types)(fn.value)
FNS = [(resolve(n, v, t), a) for n, v, t, a in CALLS]

def in_sim(tid):
    try:
        with open(f"/proc/self/task/{tid}/syscall") as f:
            fields = f.read().split()
    except FileNotFoundError:
        return False
    return len(fields) > 1 and fields[0] == str(FUTEX_NR) and SIM[0] <= int(fields[1], 16) < SIM[1]

def run_all():
    # One thread each (no current context there); the results in call order.
    out, tids = [None] * len(FNS), [None] * len(FNS)
    def one(i):
        tids[i] = threading.get_native_id()
        out[i] = FNS[i][0](*FNS[i][1])
    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(FNS))]
    for t in threads:
        t.start()
    return threads, out, tids

def held(threads, out, tids):
    give_up = time.monotonic() + 20  # ends a failing case sooner than the worker's timeout
    while time.monotonic() < give_up:
        if all(t is not None and in_sim(t) for t in tids):
            return [o is None for o in out]
        time.sleep(0.001)
    return [f"{c[0]}@{c[1]}: " + ("held" if t and in_sim(t) else f"not held, returned {o}")
            for c, t, o in zip(CALLS, tids, out, strict=False)]
