"""cuMemAlloc and cuMemAllocPitch memory as the H200 showed it
(specs/records/2026-12-01-h200-legacy-ipc.txt): an allocation is the size asked for,
whatever the granule behind it."""

from __future__ import annotations

from tests.sim.simtest import MiB, sim_only


def test_address_range_is_the_size_asked_for(spawn):
    w = spawn()
    r = w("""
small = check(cu.cuMemAlloc(1000)); big = check(cu.cuMemAlloc(4 * MiB))
out = []
for p, off in ((small, 100), (big, 4096)):
    base, size = check(cu.cuMemGetAddressRange(int(p) + off))
    out.append([int(base) == int(p), size])
result = out
""")
    assert r == [[True, 1000], [True, 4 * MiB]]


@sim_only  # not recorded: the H200 packs small allocations into one 2 MiB mapping
def test_copies_stop_at_the_size_asked_for(spawn):
    w = spawn()
    r = w("""
d = check(cu.cuMemAlloc(1000))
result = [write(d, bytes(1000)), write(d, bytes(16), off=992),
          err(cu.cuMemGetAddressRange(int(d) + 1000)[0])]
""")
    assert r == ["CUDA_SUCCESS", "CUDA_ERROR_INVALID_VALUE", "CUDA_ERROR_NOT_FOUND"]


def test_pitch_rows_are_padded_to_512_bytes(spawn):
    w = spawn()
    r = w("""
d, pitch = check(cu.cuMemAllocPitch(1000, 10, 4))
base, size = check(cu.cuMemGetAddressRange(d))
result = [pitch, size, write(d, bytes(pitch * 10))]
""")
    assert r == [1024, 10240, "CUDA_SUCCESS"]  # the H200's pitch for 1000 bytes


def test_pitch_element_size_must_be_4_8_or_16(spawn):
    w = spawn()
    r = w("result = [err(cu.cuMemAllocPitch(64, 4, e)[0]) for e in (1, 2, 4, 8, 16, 32)]")
    ok, bad = "CUDA_SUCCESS", "CUDA_ERROR_INVALID_VALUE"
    assert r == [bad, bad, ok, ok, ok, bad]


def test_pitch_of_nothing_is_invalid_value(spawn):
    w = spawn()
    r = w("result = [err(cu.cuMemAllocPitch(0, 4, 4)[0]), err(cu.cuMemAllocPitch(64, 0, 4)[0])]")
    assert r == ["CUDA_ERROR_INVALID_VALUE"] * 2


def test_pitch_memory_is_freed_by_cumemfree(spawn):
    w = spawn()
    r = w("""
free0 = free_mem()
d, pitch = check(cu.cuMemAllocPitch(4096, 1024, 4))
free1 = free_mem()
check(cu.cuMemFree(d))
result = [free0 - free1 >= 4 * MiB, free_mem() - free1 >= 4 * MiB]
""")
    assert r == [True, True]
