"""SIM_BEHAVIOUR of tests/shim/test_gate_coverage.py, run by the worker (tests/snippet.py)."""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import ctypes

    from tests.shim.snippets.worker_code import (
        ADDR,
        ARGS,
        ARR,
        CALLBACK,
        CALLED,
        FAIL,
        HOST,
        HOSTP,
        KEEP,
        MT,
        OUT,
        SZ,
        U64,
        A,
        B,
        E,
        S,
        array,
        attrs,
        batch,
        copy2d,
        copy3d,
        entry,
        new_array,
        ptr,
    )
    from tests.snippet import check, cu, err

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
def one():
    return batch(1, [])
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
