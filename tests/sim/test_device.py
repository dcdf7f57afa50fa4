"""Devices, contexts, streams, events and memory info."""

from __future__ import annotations

from tests import simenv


def test_contexts_streams_events(spawn):
    w = spawn()
    r = w("""
A = cu.CUdevice_attribute
out = {}
out["attrs"] = [check(cu.cuDeviceGetAttribute(a, 0)) for a in (
    A.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
    A.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
    A.CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING)]
out["bad_device_attr"] = err(cu.cuDeviceGetAttribute(A.CU_DEVICE_ATTRIBUTE_WARP_SIZE, 99))
out["total"] = int(check(cu.cuDeviceTotalMem(0)))
out["primary_state"] = [int(x) for x in check(cu.cuDevicePrimaryCtxGetState(0))]
out["same_primary"] = int(check(cu.cuDevicePrimaryCtxRetain(0))) == int(ctx)
check(cu.cuDevicePrimaryCtxRelease(0))
out["cur_dev"] = int(check(cu.cuCtxGetDevice()))
# the context stack: push another context, pop back to the primary one
n = check(cu.cuDeviceGetCount())
other = check(cu.cuDevicePrimaryCtxRetain(n - 1))
check(cu.cuCtxPushCurrent(other))
out["pushed_dev"] = int(check(cu.cuCtxGetDevice()))
out["popped"] = int(check(cu.cuCtxPopCurrent())) == int(other)
out["back"] = int(check(cu.cuCtxGetCurrent())) == int(ctx)
s = check(cu.cuStreamCreate(0))
e1 = check(cu.cuEventCreate(0)); e2 = check(cu.cuEventCreate(0))
check(cu.cuEventRecord(e1, s)); check(cu.cuEventRecord(e2, s))
out["stream"] = [err(cu.cuEventSynchronize(e2)), err(cu.cuStreamSynchronize(s))]
out["elapsed"] = float(check(cu.cuEventElapsedTime(e1, e2))) >= 0
check(cu.cuEventDestroy(e1)); check(cu.cuEventDestroy(e2)); check(cu.cuStreamDestroy(s))
# no current context
check(cu.cuCtxSetCurrent(None))
out["no_ctx"] = [err(cu.cuCtxGetDevice()), err(cu.cuMemGetInfo()), err(cu.cuCtxSynchronize())]
check(cu.cuCtxSetCurrent(ctx))
result = out
""")
    assert r["attrs"] == [1, 1, 1]
    assert r["bad_device_attr"] == "CUDA_ERROR_INVALID_DEVICE"
    assert r["total"] > 0
    assert r["primary_state"][1] == 1
    assert r["same_primary"] is True
    assert r["cur_dev"] == 0
    assert r["popped"] is True and r["back"] is True
    assert r["stream"] == ["CUDA_SUCCESS", "CUDA_SUCCESS"] and r["elapsed"] is True
    assert r["no_ctx"] == ["CUDA_ERROR_INVALID_CONTEXT"] * 3
    if simenv.is_simulated():
        assert r["total"] == 143771 << 20
        assert r["pushed_dev"] == 1


def test_ctx_create_and_destroy(spawn):
    w = spawn()
    r = w("""
c2 = check(cu.cuCtxCreate(None, 0, 0))
out = [int(check(cu.cuCtxGetCurrent())) == int(c2), err(cu.cuCtxDestroy(c2)),
       int(check(cu.cuCtxGetCurrent()) or 0) != int(c2)]
check(cu.cuCtxSetCurrent(ctx))
result = out
""")
    assert r == [True, "CUDA_SUCCESS", True]
