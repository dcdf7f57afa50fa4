"""Every entry point that launches device work or waits for it passes the gate, by every
path the shim hands out (specs/quiesce.md, "What counts as launching and as
synchronizing"): the shim's own export (what a program linked by name calls), ``dlsym``
of the driver's name, and ``cuGetProcAddress`` (the base name; with
CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM for the ``_ptsz``/``_ptds`` variants).

The test holds the coordinator lease and closes the gate with QUIESCE; a thread of the
worker then calls the entry point. "Held" is observed, not waited for: the thread sleeps
in a futex on the shim's own gate (``/proc/self/task/<tid>/syscall`` names the futex
word, which lies inside the shim's static ``gate``, located from the library's symbol
table). RELEASE opens the gate and the call returns CUDA_SUCCESS. A per-thread variant is
called with stream 0, its thread's default stream: the batch copies' plain ABI refuses
stream 0 (the legacy stream), so their cases also show that each path reaches the driver's
per-thread symbol. One worker serves every case, each starting from an idle device.
"""

from __future__ import annotations

import os
import shutil
import struct
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from cuinterpose.demo import Worker
from cuinterpose.engine import wire

from tests import simenv
from tests.shim import shimenv

pytestmark = pytest.mark.skipif(
    not simenv.is_simulated(), reason="the cases' arguments are the simulated driver's"
)

Op, Phase, Status = wire.Op, wire.Phase, wire.Status
FUTEX = {"x86_64": 202, "aarch64": 98}  # the futex system call's number
PER_THREAD = 2  # CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM

# (driver symbol, resolver name, version asked of cuGetProcAddress): the entry points
# gated by this change. Their per-thread variants follow, with those of the calls gated
# before (the suffix is cuda.h's: _ptds for the synchronous ones).
NEW = [
    ("cuMemcpy2D_v2", "cuMemcpy2D", 13000),
    ("cuMemcpy2DUnaligned_v2", "cuMemcpy2DUnaligned", 13000),
    ("cuMemcpy3D_v2", "cuMemcpy3D", 13000),
    ("cuMemcpy2DAsync_v2", "cuMemcpy2DAsync", 13000),
    ("cuMemcpy3DAsync_v2", "cuMemcpy3DAsync", 13000),
    ("cuMemcpyPeer", "cuMemcpyPeer", 13000),
    ("cuMemcpyPeerAsync", "cuMemcpyPeerAsync", 13000),
    ("cuMemcpy3DPeer", "cuMemcpy3DPeer", 13000),
    ("cuMemcpy3DPeerAsync", "cuMemcpy3DPeerAsync", 13000),
    ("cuMemcpyBatchAsync", "cuMemcpyBatchAsync", 12080),
    ("cuMemcpyBatchAsync_v2", "cuMemcpyBatchAsync", 13000),
    ("cuMemcpy3DBatchAsync", "cuMemcpy3DBatchAsync", 12080),
    ("cuMemcpy3DBatchAsync_v2", "cuMemcpy3DBatchAsync", 13000),
    ("cuMemAllocAsync", "cuMemAllocAsync", 13000),
    ("cuMemAllocFromPoolAsync", "cuMemAllocFromPoolAsync", 13000),
    ("cuMemFreeAsync", "cuMemFreeAsync", 13000),
    ("cuStreamWaitValue32_v2", "cuStreamWaitValue32", 13000),
    ("cuStreamWaitValue64_v2", "cuStreamWaitValue64", 13000),
    ("cuStreamWriteValue32_v2", "cuStreamWriteValue32", 13000),
    ("cuStreamWriteValue64_v2", "cuStreamWriteValue64", 13000),
    ("cuStreamBatchMemOp_v2", "cuStreamBatchMemOp", 13000),
    # the CUDA 8.0 ABI of the stream memory operations, which the driver still exports
    ("cuStreamWaitValue32", "cuStreamWaitValue32", 11000),
    ("cuStreamWaitValue64", "cuStreamWaitValue64", 11000),
    ("cuStreamWriteValue32", "cuStreamWriteValue32", 11000),
    ("cuStreamWriteValue64", "cuStreamWriteValue64", 11000),
    ("cuStreamBatchMemOp", "cuStreamBatchMemOp", 11000),
    ("cuStreamWaitEvent", "cuStreamWaitEvent", 13000),
    ("cuMemcpyAtoH_v2", "cuMemcpyAtoH", 13000),
    ("cuMemcpyHtoA_v2", "cuMemcpyHtoA", 13000),
    ("cuMemcpyAtoD_v2", "cuMemcpyAtoD", 13000),
    ("cuMemcpyDtoA_v2", "cuMemcpyDtoA", 13000),
    ("cuMemcpyAtoA_v2", "cuMemcpyAtoA", 13000),
    ("cuMemcpyAtoHAsync_v2", "cuMemcpyAtoHAsync", 13000),
    ("cuMemcpyHtoAAsync_v2", "cuMemcpyHtoAAsync", 13000),
    ("cuEventRecordWithFlags", "cuEventRecordWithFlags", 13000),
    ("cuStreamAddCallback", "cuStreamAddCallback", 13000),
    ("cuMemsetD2D8_v2", "cuMemsetD2D8", 13000),
    ("cuMemsetD2D16_v2", "cuMemsetD2D16", 13000),
    ("cuMemsetD2D32_v2", "cuMemsetD2D32", 13000),
    ("cuMemsetD2D8Async", "cuMemsetD2D8Async", 13000),
    ("cuMemsetD2D16Async", "cuMemsetD2D16Async", 13000),
    ("cuMemsetD2D32Async", "cuMemsetD2D32Async", 13000),
]
GATED_BEFORE = [
    ("cuMemcpy", "cuMemcpy", 13000),
    ("cuMemcpyAsync", "cuMemcpyAsync", 13000),
    ("cuMemcpyHtoD_v2", "cuMemcpyHtoD", 13000),
    ("cuMemcpyDtoH_v2", "cuMemcpyDtoH", 13000),
    ("cuMemcpyDtoD_v2", "cuMemcpyDtoD", 13000),
    ("cuMemcpyHtoDAsync_v2", "cuMemcpyHtoDAsync", 13000),
    ("cuMemcpyDtoHAsync_v2", "cuMemcpyDtoHAsync", 13000),
    ("cuMemcpyDtoDAsync_v2", "cuMemcpyDtoDAsync", 13000),
    ("cuMemsetD8_v2", "cuMemsetD8", 13000),
    ("cuMemsetD16_v2", "cuMemsetD16", 13000),
    ("cuMemsetD32_v2", "cuMemsetD32", 13000),
    ("cuMemsetD8Async", "cuMemsetD8Async", 13000),
    ("cuMemsetD16Async", "cuMemsetD16Async", 13000),
    ("cuMemsetD32Async", "cuMemsetD32Async", 13000),
    ("cuStreamSynchronize", "cuStreamSynchronize", 13000),
    ("cuEventRecord", "cuEventRecord", 13000),
    ("cuLaunchHostFunc", "cuLaunchHostFunc", 13000),
]
SYNCHRONOUS = {  # their per-thread variant is _ptds
    "cuMemcpy", "cuMemcpyHtoD_v2", "cuMemcpyDtoH_v2", "cuMemcpyDtoD_v2", "cuMemcpy2D_v2",
    "cuMemcpy2DUnaligned_v2", "cuMemcpy3D_v2", "cuMemcpyPeer", "cuMemcpy3DPeer",
    "cuMemsetD8_v2", "cuMemsetD16_v2", "cuMemsetD32_v2",
    "cuMemsetD2D8_v2", "cuMemsetD2D16_v2", "cuMemsetD2D32_v2",
    "cuMemcpyAtoH_v2", "cuMemcpyHtoA_v2", "cuMemcpyAtoD_v2", "cuMemcpyDtoA_v2", "cuMemcpyAtoA_v2",
}  # fmt: skip


def _per_thread(symbol: str) -> str:
    return symbol + ("_ptds" if symbol in SYNCHRONOUS else "_ptsz")


CASES = [(s, b, v, 0) for s, b, v in NEW] + [
    (_per_thread(s), b, v, PER_THREAD) for s, b, v in NEW + GATED_BEFORE
]
PATHS = ["export", "dlsym", "cuGetProcAddress"]

# The worker's side: resources made once, then per case the call's arguments (made
# while the gate is open), the call on a thread of its own, and the wait for the held
# thread. `ARGS[symbol]` is (argtypes, stream -> args) of the call, without the
# per-thread suffix; a per-thread variant gets stream 0, its thread's default stream.
WORKER_CODE = r"""
import ctypes, os, threading, time
from ctypes import c_void_p as P, c_size_t as SZ, c_uint as U, c_uint64 as U64, c_ulonglong as ULL
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
"""


def _elf_symbol(path: Path, name: str) -> tuple[int, int]:
    """(value, size) of a symbol of an ELF64 little-endian file's symbol table."""
    data = path.read_bytes()
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [
        struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)
    ]
    for _, kind, _, _, offset, size, link, _, _, entsize in sections:
        if kind != 2:  # SHT_SYMTAB
            continue
        strings = sections[link][4]
        for k in range(size // entsize):
            at, _, _, _, value, length = struct.unpack_from("<IBBHQQ", data, offset + k * entsize)
            end = data.index(b"\0", strings + at)
            if data[strings + at : end] == name.encode():
                return value, length
    raise LookupError(f"{path}: no symbol {name!r} in its symbol table (stripped?)")


@pytest.fixture(scope="module")
def app() -> Iterator[tuple[Worker, Path]]:
    """One worker with the shim preloaded, set up for every case; its control socket."""
    machine = os.uname().machine
    if machine not in FUTEX:
        pytest.skip(f"the futex system call's number on {machine} is not known here")
    control_dir = Path(tempfile.mkdtemp(prefix="cip-"))  # short: socket paths are limited
    control_dir.chmod(0o700)
    namespace = f"shim-{control_dir.name}"
    shim = shimenv.shim_library()
    gate, size = _elf_symbol(shim, "gate")
    env = shimenv.shim_env(control_dir=control_dir, namespace=namespace)
    worker = Worker("app", env, log_dir=control_dir, wait=False, init_cuda=False)
    worker.send(f"DEV = 0\n{shimenv.WORKER_SETUP}")
    worker.reply()
    real = os.path.realpath(shim)
    worker(
        f"SHIM = {str(shim)!r}\nFUTEX_NR = {FUTEX[machine]}\n"
        "base = min(int(line.split('-')[0], 16) for line in open('/proc/self/maps')\n"
        f"           if line.split()[-1] == {real!r} and int(line.split()[2], 16) == 0)\n"
        f"GATE = (base + {gate}, base + {gate + size})\n" + WORKER_CODE
    )
    try:
        yield worker, shimenv.wait_socket(control_dir, worker.pid)
        worker.close_clean()
    finally:
        Path(f"/dev/shm/cuinterpose-sim-{os.getuid()}-{namespace}").unlink(missing_ok=True)
        shutil.rmtree(control_dir, ignore_errors=True)


def _ask(socket: Path, op: wire.Op, participant: str, lease: bytes) -> wire.Reply:
    return shimenv.request(
        socket, wire.Request(op=op, participant=participant, authorization=lease)
    )[0]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("symbol", "base", "version", "flags"), CASES, ids=[c[0] for c in CASES])
def test_a_closed_gate_holds_the_call_and_an_open_one_lets_it_through(
    app: tuple[Worker, Path], symbol: str, base: str, version: int, flags: int, path: str
) -> None:
    worker, socket = app
    worker(f"prepare({symbol!r}, {base!r}, {version}, {flags}, {path!r})")
    participant = shimenv.handshake(socket).participant
    lease = os.urandom(16)
    assert _ask(socket, Op.HANDSHAKE, "", lease).status == Status.OK
    quiet = _ask(socket, Op.QUIESCE, participant, lease)
    assert (quiet.status, quiet.phase) == (Status.OK, Phase.QUIESCED), quiet.message
    try:
        fired = worker("result = fire()")
    finally:
        released = _ask(socket, Op.RELEASE, "", lease)
    assert fired == {"held": True, "returned": False}, f"{symbol} via {path}: {fired}"
    assert (released.status, released.phase) == (Status.OK, Phase.ACTIVE), released.message
    assert worker("result = finish()") == 0, f"{symbol} via {path}"


# The simulated driver's side of the new entry points, as cuda.h describes them (the
# test above only shows that they answer CUDA_SUCCESS).
SIM_BEHAVIOUR = r"""
def call(symbol, *args, base=None, flags=0):
    types = ARGS[symbol.removesuffix("_ptsz").removesuffix("_ptds")][0]
    fn = entry(symbol, base or symbol, 13000, flags, "cuGetProcAddress" if base else "export")
    return ctypes.CFUNCTYPE(ctypes.c_int, *types)(fn)(*args)

def host_bytes(at, n):
    buf = ctypes.create_string_buffer(n)
    check(cu.cuMemcpyDtoH(ctypes.addressof(buf), at, n))
    return buf.raw

got = {}
pattern = bytes(range(256)) * 8
check(cu.cuMemcpyHtoD(A, pattern, len(pattern)))
check(cu.cuMemsetD8(B, 0, 2048))
got["2d"] = call("cuMemcpy2D_v2", copy2d())  # 4 rows of 128 bytes, pitch 256
rows = host_bytes(B, 1024)
got["2d_rows"] = all(rows[256 * r:256 * r + 128] == pattern[256 * r:256 * r + 128]
                     for r in range(4))
got["2d_gaps"] = all(rows[256 * r + 128:256 * r + 256] == bytes(128) for r in range(4))
check(cu.cuMemsetD8(B, 0, 1024))
got["2d_memset"] = call("cuMemsetD2D16Async", B, 256, 0x0102, 64, 4, S)  # 128 bytes a row
check(cu.cuStreamSynchronize(S))
rows = host_bytes(B, 1024)
got["2d_memset_rows"] = all(rows[256 * r:256 * r + 128] == bytes([2, 1]) * 64 for r in range(4))
got["2d_memset_gaps"] = all(rows[256 * r + 128:256 * r + 256] == bytes(128) for r in range(4))
got["2d_memset_narrow_pitch"] = call("cuMemsetD2D16_v2", B, 64, 1, 64, 4)
CALLED.clear()
got["callback"] = call("cuStreamAddCallback", S, CALLBACK, None, 0)
check(cu.cuStreamSynchronize(S))
got["called"] = CALLED == [(S, 0)]
got["callback_flags"] = call("cuStreamAddCallback", S, CALLBACK, None, 1)
got["record_flags"] = call("cuEventRecordWithFlags", E, S, 2)
# Arrays: bytes in and out, a 2D copy out of one, and the bounds.
got["array_in"] = call("cuMemcpyDtoA_v2", ARR, 1024, A, 1024)  # row 1 of the array
got["array_out"] = call("cuMemcpyAtoD_v2", B, ARR, 1024, 1024)
got["array_round_trip"] = host_bytes(B, 1024) == pattern[:1024]
p = cu.CUDA_MEMCPY2D()
p.srcMemoryType, p.srcArray, p.srcXInBytes, p.srcY = MT.CU_MEMORYTYPE_ARRAY, ARR, 0, 1
p.dstMemoryType, p.dstHost, p.dstPitch = MT.CU_MEMORYTYPE_HOST, HOSTP, 2048
p.WidthInBytes, p.Height = 1024, 1
got["array_2d"] = call("cuMemcpy2D_v2", ptr(p))
got["array_2d_bytes"] = HOST.raw[:1024] == pattern[:1024]
p.Height = 4  # rows 1..4 of a 4-row array
got["array_2d_past_end"] = call("cuMemcpy2D_v2", ptr(p))
got["array_past_end"] = call("cuMemcpyAtoH_v2", HOSTP, ARR, 3584, 1024)
gone = new_array()
check(cu.cuArrayDestroy(gone))
got["array_destroyed"] = call("cuMemcpyAtoH_v2", HOSTP, gone, 0, 16)
d = cu.CUDA_ARRAY_DESCRIPTOR()
d.Width, d.Height, d.NumChannels = 16, 1, 3
d.Format = cu.CUarray_format.CU_AD_FORMAT_FLOAT
got["array_three_channels"] = err(cu.cuArrayCreate(d)[0])
ctypes.memset(HOST, 0, 2048)
got["3d"] = call("cuMemcpy3D_v2", copy3d(cu.CUDA_MEMCPY3D))  # 2 slices of 4 rows
got["3d_rows"] = all(HOST.raw[256 * r:256 * r + 128] == pattern[256 * r:256 * r + 128]
                     for r in range(8))
p = cu.CUDA_MEMCPY2D()
p.srcMemoryType, p.srcDevice, p.srcPitch = MT.CU_MEMORYTYPE_DEVICE, A, 64
p.dstMemoryType, p.dstDevice, p.dstPitch = MT.CU_MEMORYTYPE_DEVICE, B, 256
p.WidthInBytes, p.Height = 128, 4
got["2d_row_over_pitch"] = call("cuMemcpy2D_v2", ptr(p))
p.srcPitch, p.srcMemoryType = 256, MT.CU_MEMORYTYPE_ARRAY
got["2d_unknown_array"] = call("cuMemcpy2D_v2", ptr(p))
one = lambda: batch(1, [])
got["batch_legacy"] = call("cuMemcpyBatchAsync_v2", *one(), 0)
got["batch_per_thread"] = call("cuMemcpyBatchAsync_v2_ptsz", *one(), 0)
got["batch_per_thread_resolved"] = call(
    "cuMemcpyBatchAsync_v2_ptsz", *one(), 0, base="cuMemcpyBatchAsync", flags=2)
# a batch whose second copy runs past B's end queues nothing, and names that copy
check(cu.cuMemsetD8(B, 0, 64))
base, size = check(cu.cuMemGetAddressRange(B))
END_OF_B = int(base) + size
FAIL.value = 0
got["batch_bad_second"] = call(
    "cuMemcpyBatchAsync", array(U64, [B, END_OF_B - 16]), array(U64, [A, A]),
    array(SZ, [64, 64]), 2, attrs(), array(SZ, [0]), 1, ADDR(FAIL), S)
check(cu.cuStreamSynchronize(S))
got["batch_bad_second_index"] = FAIL.value
got["batch_bad_second_queued_nothing"] = host_bytes(B, 64) == bytes(64)
got["batch_no_attrs"] = call("cuMemcpyBatchAsync_v2", *one()[:6], 0, S)
got["write_barrier_flag"] = call("cuStreamWriteValue32_v2", S, A, 1, 1)
got["write_barrier_flag_v1"] = call("cuStreamWriteValue32", S, A, 1, 1)
got["write_misaligned"] = call("cuStreamWriteValue32_v2", S, A + 2, 1, 0)
got["wait_host_pointer"] = call("cuStreamWaitValue32_v2", S, HOSTP, 1, 0)
got["free_unknown"] = call("cuMemFreeAsync", A + 4096, S)
got["pool_unknown"] = call("cuMemAllocFromPoolAsync", ctypes.addressof(OUT), 64, HOSTP, S)
check(cu.cuCtxSynchronize())
# A wait holds its stream until the word is written: the memset after it waits too.
NB = cu.CUstream_flags.CU_STREAM_NON_BLOCKING
waiting, writer = (int(check(cu.cuStreamCreate(NB))) for _ in range(2))
check(cu.cuMemsetD32(A, 0, 1))
check(cu.cuMemsetD32(B, 0, 1))
got["wait"] = call("cuStreamWaitValue32_v2", waiting, A, 9, 1)  # EQ
check(cu.cuMemsetD32Async(B, 5, 1, waiting))
got["waiting"] = err(cu.cuStreamQuery(waiting))
got["memset_before_write"] = host_bytes(B, 4).hex()
got["write"] = call("cuStreamWriteValue32_v2", writer, A, 9, 0)
check(cu.cuStreamSynchronize(waiting))
got["memset_after_write"] = host_bytes(B, 4).hex()
# Stream-ordered memory: usable at once, freed in stream order.
got["alloc"] = call("cuMemAllocAsync", ctypes.addressof(OUT), 4096, S)
mem = OUT.value
got["alloc_usable"] = err(cu.cuMemsetD8Async(mem, 1, 4096, S))
got["free"] = call("cuMemFreeAsync", mem, S)
check(cu.cuStreamSynchronize(S))
OUT.value = 0
got["freed"] = call("cuMemFreeAsync", mem, S)
for s_ in (waiting, writer):
    check(cu.cuStreamDestroy(s_))
KEEP.clear()
result = got
"""


def test_the_simulated_driver_does_what_the_entry_points_promise(
    app: tuple[Worker, Path],
) -> None:
    worker, _ = app
    got = worker(SIM_BEHAVIOUR)
    invalid = 1  # CUDA_ERROR_INVALID_VALUE
    assert got == {
        "2d": 0, "2d_rows": True, "2d_gaps": True,
        "3d": 0, "3d_rows": True,
        "2d_row_over_pitch": invalid, "2d_unknown_array": invalid,
        "array_in": 0, "array_out": 0, "array_round_trip": True, "array_2d": 0,
        "array_2d_bytes": True, "array_2d_past_end": invalid, "array_past_end": invalid,
        "array_destroyed": invalid, "array_three_channels": "CUDA_ERROR_INVALID_VALUE",
        "2d_memset": 0, "2d_memset_rows": True, "2d_memset_gaps": True,
        "2d_memset_narrow_pitch": invalid,
        "callback": 0, "called": True, "callback_flags": invalid, "record_flags": invalid,
        # the legacy stream is refused; stream 0 of a _ptsz call is the thread's own
        "batch_legacy": invalid, "batch_per_thread": 0, "batch_per_thread_resolved": 0,
        "batch_no_attrs": invalid, "batch_bad_second": invalid, "batch_bad_second_index": 1,
        "batch_bad_second_queued_nothing": True,
        "write_barrier_flag": invalid, "write_barrier_flag_v1": 0, "write_misaligned": invalid,
        "wait_host_pointer": invalid, "free_unknown": invalid, "pool_unknown": invalid,
        "wait": 0, "waiting": "CUDA_ERROR_NOT_READY", "memset_before_write": "00000000",
        "write": 0, "memset_after_write": "05000000",
        "alloc": 0, "alloc_usable": "CUDA_SUCCESS", "free": 0, "freed": invalid,
    }  # fmt: skip
