"""WORKER_CODE of tests/shim/test_gate_coverage.py: a snippet the worker runs (tests/snippet.py)."""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tests.shim.snippets.worker_setup import ctx, dev
    from tests.snippet import check, cu

    FUTEX_NR = GATE = SHIM = ...  # set by the test before this snippet

import ctypes
import os
import threading
import time
from ctypes import c_size_t as SZ
from ctypes import c_uint as U
from ctypes import c_uint64 as U64
from ctypes import c_ulonglong as ULL
from ctypes import c_void_p as P

shim = ctypes.CDLL(SHIM)
driver = ctypes.CDLL("libcuda.so.1")
CTX = int(ctx)
S = int(check(cu.cuStreamCreate(0)))
E = int(check(cu.cuEventCreate(0)))
A = int(check(cu.cuMemAlloc(1 << 20)))
B = int(check(cu.cuMemAlloc(1 << 20)))
HOST = ctypes.create_string_buffer(1 << 16)
POOL = int(check(cu.cuDeviceGetDefaultMemPool(dev)))

def new_array(width=1024, height=4):
    d = cu.CUDA_ARRAY_DESCRIPTOR()
    d.Width, d.Height, d.NumChannels = width, height, 1
    d.Format = cu.CUarray_format.CU_AD_FORMAT_UNSIGNED_INT8
    return int(check(cu.cuArrayCreate(d)))

ARR = new_array()  # 4 rows of 1024 bytes
MT = cu.CUmemorytype
ORDER = cu.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
KEEP = []  # what the pending call's pointers point into

def keep(x):
    KEEP.append(x)
    return x

def ptr(x):
    return keep(x).getPtr()

def array(ctype, values):
    return ctypes.addressof(keep((ctype * len(values))(*values)))

def copy2d():
    p = cu.CUDA_MEMCPY2D()
    p.srcMemoryType, p.srcDevice, p.srcPitch = MT.CU_MEMORYTYPE_DEVICE, A, 256
    p.dstMemoryType, p.dstDevice, p.dstPitch = MT.CU_MEMORYTYPE_DEVICE, B, 256
    p.WidthInBytes, p.Height = 128, 4
    return ptr(p)

def copy3d(kind):
    p = kind()
    p.srcMemoryType, p.srcDevice, p.srcPitch, p.srcHeight = MT.CU_MEMORYTYPE_DEVICE, A, 256, 4
    p.dstMemoryType, p.dstHost, p.dstPitch, p.dstHeight = (
        MT.CU_MEMORYTYPE_HOST, ctypes.addressof(HOST), 256, 4)
    p.WidthInBytes, p.Height, p.Depth = 128, 4, 2
    if kind is cu.CUDA_MEMCPY3D_PEER:
        p.srcContext, p.dstContext = ctx, ctx
    return ptr(p)

def attrs():
    a = cu.CUmemcpyAttributes()
    a.srcAccessOrder = ORDER
    return ptr(a)

def batch3d():
    op = cu.CUDA_MEMCPY3D_BATCH_OP()
    for side, at in ((op.src, A), (op.dst, B)):
        side.type = cu.CUmemcpy3DOperandType.CU_MEMCPY_OPERAND_TYPE_POINTER
        side.op.ptr.ptr = at
    op.extent.width, op.extent.height, op.extent.depth = 64, 2, 2
    op.srcAccessOrder = ORDER
    return ptr(op)

def memops():
    ops = [cu.CUstreamBatchMemOpParams() for _ in range(2)]
    ops[0].writeValue.operation = cu.CUstreamBatchMemOpType.CU_STREAM_MEM_OP_WRITE_VALUE_32
    ops[0].writeValue.address, ops[0].writeValue.value = A, 7
    ops[1].waitValue.operation = cu.CUstreamBatchMemOpType.CU_STREAM_MEM_OP_WAIT_VALUE_32
    ops[1].waitValue.address, ops[1].waitValue.value = A, 7
    ops[1].waitValue.flags = cu.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_EQ
    size = 48  # sizeof(CUstreamBatchMemOpParams): its cuuint64_t pad[6]
    buf = keep(ctypes.create_string_buffer(size * len(ops)))
    for i, op in enumerate(ops):
        ctypes.memmove(ctypes.addressof(buf) + i * size, op.getPtr(), size)
        keep(op)
    return ctypes.addressof(buf)

def batch(n, tail):
    # n copies of 64 bytes, 4 KiB apart, from A to B; one attribute for all
    at = [4096 * i for i in range(n)]
    return [array(U64, [B + o for o in at]), array(U64, [A + o for o in at]),
            array(SZ, [64] * n), n, attrs(), array(SZ, [0]), 1, *tail]

def fresh():
    return int(check(cu.cuMemAlloc(1 << 16)))

OUT = ctypes.c_uint64(0)  # an allocation's address, from the calls that make one
FAIL = SZ(0)
ADDR = ctypes.addressof
HOSTP = ctypes.addressof(HOST)
ARGS = {
    "cuMemcpy2D_v2": ([P], lambda s: [copy2d()]),
    "cuMemcpy2DUnaligned_v2": ([P], lambda s: [copy2d()]),
    "cuMemcpy3D_v2": ([P], lambda s: [copy3d(cu.CUDA_MEMCPY3D)]),
    "cuMemcpy2DAsync_v2": ([P, P], lambda s: [copy2d(), s]),
    "cuMemcpy3DAsync_v2": ([P, P], lambda s: [copy3d(cu.CUDA_MEMCPY3D), s]),
    "cuMemcpyPeer": ([U64, P, U64, P, SZ], lambda s: [B, CTX, A, CTX, 4096]),
    "cuMemcpyPeerAsync": ([U64, P, U64, P, SZ, P], lambda s: [B, CTX, A, CTX, 4096, s]),
    "cuMemcpy3DPeer": ([P], lambda s: [copy3d(cu.CUDA_MEMCPY3D_PEER)]),
    "cuMemcpy3DPeerAsync": ([P, P], lambda s: [copy3d(cu.CUDA_MEMCPY3D_PEER), s]),
    "cuMemcpyBatchAsync": ([P, P, P, SZ, P, P, SZ, P, P], lambda s: batch(2, [ADDR(FAIL), s])),
    "cuMemcpyBatchAsync_v2": ([P, P, P, SZ, P, P, SZ, P], lambda s: batch(1, [s])),
    "cuMemcpy3DBatchAsync": ([SZ, P, P, ULL, P], lambda s: [1, batch3d(), ADDR(FAIL), 0, s]),
    "cuMemcpy3DBatchAsync_v2": ([SZ, P, ULL, P], lambda s: [1, batch3d(), 0, s]),
    "cuMemAllocAsync": ([P, SZ, P], lambda s: [ctypes.addressof(OUT), 4096, s]),
    "cuMemAllocFromPoolAsync": ([P, SZ, P, P], lambda s: [ctypes.addressof(OUT), 4096, POOL, s]),
    "cuMemFreeAsync": ([U64, P], lambda s: [fresh(), s]),
    "cuStreamWaitValue32_v2": ([P, U64, ctypes.c_uint32, U], lambda s: [s, A, 0, 0]),
    "cuStreamWaitValue64_v2": ([P, U64, U64, U], lambda s: [s, A, 0, 0]),
    "cuStreamWriteValue32_v2": ([P, U64, ctypes.c_uint32, U], lambda s: [s, A, 5, 0]),
    "cuStreamWriteValue64_v2": ([P, U64, U64, U], lambda s: [s, A, 5, 0]),
    "cuStreamBatchMemOp_v2": ([P, U, P, U], lambda s: [s, 2, memops(), 0]),
    "cuStreamWaitEvent": ([P, P, U], lambda s: [s, E, 0]),
    "cuEventRecordWithFlags": ([P, P, U], lambda s: [E, s, 0]),
    "cuMemcpyAtoH_v2": ([P, P, SZ, SZ], lambda s: [HOSTP, ARR, 0, 512]),
    "cuMemcpyHtoA_v2": ([P, SZ, P, SZ], lambda s: [ARR, 0, HOSTP, 512]),
    "cuMemcpyAtoD_v2": ([U64, P, SZ, SZ], lambda s: [B, ARR, 0, 512]),
    "cuMemcpyDtoA_v2": ([P, SZ, U64, SZ], lambda s: [ARR, 0, A, 512]),
    "cuMemcpyAtoA_v2": ([P, SZ, P, SZ, SZ], lambda s: [ARR, 1024, ARR, 0, 512]),
    "cuMemcpyAtoHAsync_v2": ([P, P, SZ, SZ, P], lambda s: [HOSTP, ARR, 0, 512, s]),
    "cuMemcpyHtoAAsync_v2": ([P, SZ, P, SZ, P], lambda s: [ARR, 0, HOSTP, 512, s]),
    "cuStreamAddCallback": ([P, P, P, U], lambda s: [s, CALLBACK, None, 0]),
    "cuMemsetD2D8_v2": ([U64, SZ, ctypes.c_ubyte, SZ, SZ], lambda s: [B, 256, 1, 64, 4]),
    "cuMemsetD2D16_v2": ([U64, SZ, ctypes.c_ushort, SZ, SZ], lambda s: [B, 256, 1, 64, 4]),
    "cuMemsetD2D32_v2": ([U64, SZ, U, SZ, SZ], lambda s: [B, 256, 1, 64, 4]),
    "cuMemsetD2D8Async": ([U64, SZ, ctypes.c_ubyte, SZ, SZ, P], lambda s: [B, 256, 1, 64, 4, s]),
    "cuMemsetD2D16Async": ([U64, SZ, ctypes.c_ushort, SZ, SZ, P], lambda s: [B, 256, 1, 64, 4, s]),
    "cuMemsetD2D32Async": ([U64, SZ, U, SZ, SZ, P], lambda s: [B, 256, 1, 64, 4, s]),
}
ARGS.update({v1: ARGS[v1 + "_v2"] for v1 in ("cuStreamWaitValue32", "cuStreamWaitValue64",
             "cuStreamWriteValue32", "cuStreamWriteValue64", "cuStreamBatchMemOp")})
ARGS |= {
    "cuMemcpy": ([U64, U64, SZ], lambda s: [B, A, 4096]),
    "cuMemcpyAsync": ([U64, U64, SZ, P], lambda s: [B, A, 4096, s]),
    "cuMemcpyHtoD_v2": ([U64, P, SZ], lambda s: [A, HOSTP, 4096]),
    "cuMemcpyDtoH_v2": ([P, U64, SZ], lambda s: [HOSTP, A, 4096]),
    "cuMemcpyDtoD_v2": ([U64, U64, SZ], lambda s: [B, A, 4096]),
    "cuMemcpyHtoDAsync_v2": ([U64, P, SZ, P], lambda s: [A, HOSTP, 4096, s]),
    "cuMemcpyDtoHAsync_v2": ([P, U64, SZ, P], lambda s: [HOSTP, A, 4096, s]),
    "cuMemcpyDtoDAsync_v2": ([U64, U64, SZ, P], lambda s: [B, A, 4096, s]),
    "cuMemsetD8_v2": ([U64, ctypes.c_ubyte, SZ], lambda s: [B, 1, 64]),
    "cuMemsetD16_v2": ([U64, ctypes.c_ushort, SZ], lambda s: [B, 1, 64]),
    "cuMemsetD32_v2": ([U64, U, SZ], lambda s: [B, 1, 64]),
    "cuMemsetD8Async": ([U64, ctypes.c_ubyte, SZ, P], lambda s: [B, 1, 64, s]),
    "cuMemsetD16Async": ([U64, ctypes.c_ushort, SZ, P], lambda s: [B, 1, 64, s]),
    "cuMemsetD32Async": ([U64, U, SZ, P], lambda s: [B, 1, 64, s]),
    "cuStreamSynchronize": ([P], lambda s: [s]),
    "cuEventRecord": ([P, P], lambda s: [E, s]),
    "cuLaunchHostFunc": ([P, P, P], lambda s: [s, HOST_FN, None]),
}
HOST_FN = ctypes.CFUNCTYPE(None, P)(lambda _: None)
CALLED = []  # the streams cuStreamAddCallback's callback ran for, with their status
CALLBACK = ctypes.CFUNCTYPE(None, P, ctypes.c_int, P)(lambda s, r, _: CALLED.append((s, r)))

def entry(symbol, base, version, flags, path):
    if path == "export":
        return ctypes.cast(getattr(shim, symbol), P).value
    if path == "dlsym":
        return ctypes.cast(getattr(driver, symbol), P).value
    fn, status = P(), ctypes.c_int(-1)
    r = shim.cuGetProcAddress_v2(base.encode(), ctypes.byref(fn), version, ULL(flags),
                                 ctypes.byref(status))
    if r != 0 or status.value != 0 or not fn.value:
        raise RuntimeError(f"cuGetProcAddress({base}, {version}, {flags}): {r}/{status.value}")
    return fn.value

def in_gate(tid):
    # asleep on a futex word of the shim's gate (its mutex or condition variables)
    try:
        with open(f"/proc/self/task/{tid}/syscall") as f:
            fields = f.read().split()
    except FileNotFoundError:
        return False
    return (len(fields) > 1 and fields[0] == str(FUTEX_NR)
            and GATE[0] <= int(fields[1], 16) < GATE[1])

def prepare(symbol, base, version, flags, path):
    plain = symbol.removesuffix("_ptsz").removesuffix("_ptds")
    types, make = ARGS[plain]
    args = make(0 if flags or plain != symbol else S)
    call = ctypes.CFUNCTYPE(ctypes.c_int, *types)(entry(symbol, base, version, flags, path))
    CASE.clear()
    CASE.update(call=call, args=args, result=None)

def fire():
    def run():
        check(cu.cuCtxSetCurrent(ctx))  # a new thread has no current context
        CASE["tid"] = threading.get_native_id()
        CASE["result"] = CASE["call"](*CASE["args"])
    t = threading.Thread(target=run, daemon=True)
    CASE["thread"] = t
    t.start()
    # Until the thread is held at the gate, or (failures) returned or seen elsewhere for
    # long: the cap only ends a failing case sooner than the worker's own timeout.
    give_up = time.monotonic() + 20
    while True:
        tid = CASE.get("tid")
        if tid is not None and in_gate(tid):
            return {"held": True, "returned": CASE["result"] is not None}
        if not t.is_alive():
            return {"held": False, "returned": CASE["result"]}
        if time.monotonic() > give_up:
            with open(f"/proc/self/task/{tid}/syscall") as f:
                return {"held": False, "in": f.read().strip()}
        time.sleep(0.001)

def finish():
    CASE["thread"].join()
    check(cu.cuCtxSynchronize())
    if OUT.value:
        check(cu.cuMemFree(OUT.value))
        OUT.value = 0
    KEEP.clear()
    return CASE["result"]

CASE = {}
