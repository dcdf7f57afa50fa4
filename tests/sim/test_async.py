"""Device work queued on a stream runs after its call returned (simulator only: the
timing knob CUINTERPOSE_SIM_WORK_US has no counterpart on a GPU)."""

from __future__ import annotations

import pytest

from tests import simenv

pytestmark = [
    pytest.mark.skipif(
        not simenv.is_simulated(), reason="CUINTERPOSE_SIM_WORK_US is the simulator's"
    ),
    pytest.mark.threads,  # the simulator's stream threads: make tsan
]

SLOW = {"CUINTERPOSE_SIM_WORK_US": "300000"}  # each queued piece of work takes 0.3 s


def test_async_work_is_in_flight_until_synchronized(spawn):
    w = spawn(extra=SLOW)
    r = w("""
h, va = alloc(2 * MiB)
s = check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING))
check(cu.cuMemsetD8Async(va, 0x5A, 4096, s))
queued = err(cu.cuStreamQuery(s))
ctx_busy = err(cu.cuStreamQuery(None))
check(cu.cuStreamSynchronize(s))
result = {"queued": queued, "legacy": ctx_busy, "done": err(cu.cuStreamQuery(s)),
          "bytes": read(va, 4)}
""")
    assert r["queued"] == "CUDA_ERROR_NOT_READY"
    assert r["legacy"] == "CUDA_SUCCESS"  # the NULL stream has nothing queued
    assert r["done"] == "CUDA_SUCCESS"
    assert r["bytes"] == "5a5a5a5a"


def test_an_event_completes_in_stream_order(spawn):
    """As on the driver: an event recorded behind queued work is NOT_READY until that
    work ran, and synchronizing it waits for it (the staging pool's double-buffered
    bounce copies rely on it)."""
    w = spawn(extra=SLOW)
    r = w("""
h, va = alloc(2 * MiB)
s = check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING))
e = check(cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_BLOCKING_SYNC))
idle = check(cu.cuEventCreate(0))
never = err(cu.cuEventQuery(idle))
check(cu.cuMemsetD8Async(va, 0x6B, 4096, s))
check(cu.cuEventRecord(e, s))
queued = err(cu.cuEventQuery(e))
synced = err(cu.cuEventSynchronize(e))
result = {"never": never, "queued": queued, "synced": synced, "after": err(cu.cuEventQuery(e)),
          "bytes": read(va, 4)}
""")
    assert r == {
        "never": "CUDA_SUCCESS",  # never recorded: complete
        "queued": "CUDA_ERROR_NOT_READY",
        "synced": "CUDA_SUCCESS",
        "after": "CUDA_SUCCESS",
        "bytes": "6b6b6b6b",
    }


def test_a_synchronous_copy_waits_for_the_legacy_streams_work(spawn):
    w = spawn(extra=SLOW)
    r = w("""
h, va = alloc(2 * MiB)
check(cu.cuMemsetD8Async(va, 0x11, 64, None))
check(cu.cuMemsetD8Async(va, 0x22, 64, None))
result = read(va, 2)
""")
    assert r == "2222"


def test_work_in_flight_over_an_unmap_fails_the_context(spawn):
    """What the issue saw on the H200: the memory went away under queued work."""
    w = spawn(extra=SLOW)
    r = w("""
h, va = alloc(2 * MiB)
check(cu.cuMemsetD8(va, 0x33, 64))
s = check(cu.cuStreamCreate(0))
check(cu.cuMemsetD8Async(va, 0x44, 64, s))
unmapped = err(cu.cuMemUnmap(va, 2 * MiB))
synced = err(cu.cuStreamSynchronize(s))
after = err(cu.cuCtxSynchronize())
check(cu.cuMemMap(va, 2 * MiB, 0, h, 0))
access(va, 2 * MiB)
launch = err(cu.cuMemsetD8Async(va, 0x55, 64, s))
result = {"unmapped": unmapped, "synced": synced, "after": after, "launch": launch}
""")
    assert r["unmapped"] == "CUDA_SUCCESS"
    assert r["synced"] == "CUDA_ERROR_ILLEGAL_ADDRESS"
    assert r["after"] == "CUDA_ERROR_ILLEGAL_ADDRESS"  # sticky, as on the GPU
    assert r["launch"] == "CUDA_ERROR_ILLEGAL_ADDRESS"
