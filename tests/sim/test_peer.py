"""Peer access between contexts (cuCtxEnablePeerAccess / cuCtxDisablePeerAccess): the
driver's errors, and its effect on cuMemAlloc memory: a device reaches another device's
cuMemAlloc memory once its context enabled access to the allocating context. Copies reach
it either way (the driver stages them); device-side work (a stream write) and the pointer's
ACCESS_FLAGS follow peer access."""

from __future__ import annotations

import pytest

from tests import snippet
from tests.sim.simtest import sim_only

PEER = snippet.load(__file__, "peer")


def two_devices(spawn):
    w = spawn()
    if w("result = check(cu.cuDeviceGetCount())") < 2:
        pytest.skip("peer access needs two devices")
    w(PEER)
    return w


def test_can_access_peer_between_distinct_devices_only(spawn):
    w = two_devices(spawn)
    r = w("""
result = [check(cu.cuDeviceCanAccessPeer(0, 1)), check(cu.cuDeviceCanAccessPeer(0, 0)),
          err(cu.cuDeviceCanAccessPeer(0, 9)[0])]
""")
    assert r == [1, 0, "CUDA_ERROR_INVALID_DEVICE"]


def test_enable_twice_is_already_enabled(spawn):
    w = two_devices(spawn)
    r = w("result = [err(cu.cuCtxEnablePeerAccess(ctx1, 0)) for _ in range(2)]")
    assert r == ["CUDA_SUCCESS", "CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED"]


def test_disable_of_what_is_not_enabled_is_not_enabled(spawn):
    w = two_devices(spawn)
    r = w("""
out = [err(cu.cuCtxDisablePeerAccess(ctx1))]
check(cu.cuCtxEnablePeerAccess(ctx1, 0))
out += [err(cu.cuCtxDisablePeerAccess(ctx1)), err(cu.cuCtxDisablePeerAccess(ctx1))]
result = out
""")
    assert r == [
        "CUDA_ERROR_PEER_ACCESS_NOT_ENABLED",
        "CUDA_SUCCESS",
        "CUDA_ERROR_PEER_ACCESS_NOT_ENABLED",
    ]


def test_same_device_is_invalid_device(spawn):
    w = two_devices(spawn)
    assert w("result = err(cu.cuCtxEnablePeerAccess(ctx, 0))") == "CUDA_ERROR_INVALID_DEVICE"


def test_flags_must_be_zero(spawn):
    w = two_devices(spawn)
    assert w("result = err(cu.cuCtxEnablePeerAccess(ctx1, 1))") == "CUDA_ERROR_INVALID_VALUE"


@sim_only
def test_an_unknown_context_is_invalid_context(spawn):
    w = two_devices(spawn)
    r = w("""
bogus = cu.CUcontext(ctypes.addressof(ctypes.create_string_buffer(64)))
result = [err(cu.cuCtxEnablePeerAccess(bogus, 0)), err(cu.cuCtxDisablePeerAccess(bogus))]
""")
    assert r == ["CUDA_ERROR_INVALID_CONTEXT"] * 2


def test_access_is_one_way_and_covers_earlier_and_later_allocations(spawn):
    """Device 1's context enables access to device 0's: device 1 then reaches device 0's
    cuMemAlloc memory (made before and after), device 0 still not device 1's."""
    w = two_devices(spawn)
    r = w("""
before = check(cu.cuMemAlloc(MiB))
mine1 = from1(lambda: check(cu.cuMemAlloc(MiB)))
flags = lambda p: int(from1(lambda: check(cu.cuPointerGetAttribute(ACCESS, p))))
out = [flags(before), int(check(cu.cuPointerGetAttribute(ACCESS, mine1)))]
from1(lambda: check(cu.cuCtxEnablePeerAccess(ctx, 0)))
after = check(cu.cuMemAlloc(MiB))
out += [flags(before), flags(after), int(check(cu.cuPointerGetAttribute(ACCESS, mine1)))]
from1(lambda: check(cu.cuCtxDisablePeerAccess(ctx)))
out += [flags(before), flags(after)]
result = out
""")
    assert r == [0, 0, 3, 3, 0, 0, 0]


@sim_only
def test_device_work_on_a_peers_memory_needs_peer_access(spawn):
    """A stream write from device 1 into device 0's cuMemAlloc memory is refused until
    device 1's context enabled access; a copy is not (the driver stages it)."""
    w = two_devices(spawn)
    r = w("""
d = check(cu.cuMemAlloc(MiB))
poke = lambda: err(cu.cuStreamWriteValue32(0, d, 7, 0))
out = [from1(poke), from1(lambda: write(d, b'copied'))]
from1(lambda: check(cu.cuCtxEnablePeerAccess(ctx, 0)))
out += [from1(poke), from1(lambda: err(cu.cuCtxSynchronize()))]
out.append(read(d, 4))
result = out
""")
    ok = "CUDA_SUCCESS"
    assert r == ["CUDA_ERROR_INVALID_VALUE", ok, ok, ok, "07000000"]
