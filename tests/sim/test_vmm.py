"""VMM with the real driver's rules (specs/records/2026-11-29-h200-driver-rules.jsonl):
sharing across processes, reference counting, access faults, bad arguments."""

from __future__ import annotations

import hashlib

from tests import simenv
from tests.sim.simtest import MiB, hand_over, pattern_bytes, psha, sim_only


def test_three_processes_share_bytes(spawn):
    a, b, c = spawn(), spawn(), spawn()
    size = 4 * MiB
    a(f"""
h, va = alloc({size})
assert write(va, pattern(1, {size})) == "CUDA_SUCCESS"
send_fd(check(cu.cuMemExportToShareableHandle(h, POSIX, 0)))
send_fd(check(cu.cuMemExportToShareableHandle(h, POSIX, 0)))
""")
    for w in (b, c):
        hand_over(a, w)
        got = w(f"h, va = import_map(recv_fd(), {size}); result = sha(va, {size})")
        assert got == psha(1, size)
    # A write in any process is seen by the other two.
    b("assert write(va, bytes([0xAB] * 4096), off=MiB) == 'CUDA_SUCCESS'")
    c("assert write(va, bytes([0xCD] * 16), off=3 * MiB + 5) == 'CUDA_SUCCESS'")
    expect = bytearray(pattern_bytes(1, size))
    expect[MiB : MiB + 4096] = b"\xab" * 4096
    expect[3 * MiB + 5 : 3 * MiB + 21] = b"\xcd" * 16
    for w in (a, b, c):
        assert w(f"result = sha(va, {size})") == hashlib.sha256(expect).hexdigest()


def test_memory_outlives_creator_while_imported(spawn):
    a, b = spawn(), spawn()
    a("""
h, va = alloc(2 * MiB)
write(va, pattern(7, 2 * MiB))
send_fd(check(cu.cuMemExportToShareableHandle(h, POSIX, 0)))
""")
    hand_over(a, b)
    b("""
h, va = import_map(recv_fd(), 2 * MiB)
check(cu.cuMemRelease(h))  # the mapping alone keeps it
""")
    a("""
check(cu.cuMemUnmap(va, 2 * MiB)); check(cu.cuMemRelease(h))
check(cu.cuMemAddressFree(va, 2 * MiB))
""")
    a.close()
    assert b("result = sha(va, 2 * MiB)") == psha(7, 2 * MiB)


def test_reference_counting(spawn):
    w = spawn()
    r = w("""
size = 4 * MiB
free0 = free_mem()
h, va = alloc(size)
free1 = free_mem()
write(va, pattern(3, size))
h2 = check(cu.cuMemRetainAllocationHandle(va))
out = dict(same=int(h2) == int(h),
           retain_unmapped=err(cu.cuMemRetainAllocationHandle(int(va) + size + 1024)))
out["rel1"] = err(cu.cuMemRelease(h))
out["rel2"] = err(cu.cuMemRelease(h))
out["readable"] = sha(va, size) == hashlib.sha256(pattern(3, size)).hexdigest()
out["rel3"] = err(cu.cuMemRelease(h))
if SIM:  # a released handle can crash the real driver (specs/records)
    out["props_after_release"] = err(cu.cuMemGetAllocationPropertiesFromHandle(h))
free2 = free_mem()
out["free_unmap_partial"] = err(cu.cuMemUnmap(va, 2 * MiB))
out["unmap"] = err(cu.cuMemUnmap(va, size))
out["unmap_twice"] = err(cu.cuMemUnmap(va, size))
free3 = free_mem()
small = ctypes.create_string_buffer(16)
out["copy_after_unmap"] = err(cu.cuMemcpyDtoH(ctypes.addressof(small), va, 16))
out["free"] = [free0 - free1, free0 - free2, free0 - free3]
check(cu.cuMemAddressFree(va, size))
result = out
""")
    assert r["same"] is True
    assert r["retain_unmapped"] == "CUDA_ERROR_INVALID_VALUE"
    assert r["rel1"] == r["rel2"] == "CUDA_SUCCESS"
    assert r["readable"] is True
    assert r["rel3"] == "CUDA_ERROR_INVALID_VALUE"
    assert r["free_unmap_partial"] == "CUDA_ERROR_INVALID_VALUE"
    assert r["unmap"] == r["unmap_twice"] == "CUDA_SUCCESS"
    assert r["copy_after_unmap"] == "CUDA_ERROR_INVALID_VALUE"
    if simenv.is_simulated():
        assert r["props_after_release"] == "CUDA_ERROR_INVALID_VALUE"
        # Held while mapped after the last release, freed with the last unmap.
        assert r["free"] == [4 * MiB, 4 * MiB, 0]


def test_access_faults_are_errors_not_crashes(spawn):
    w = spawn()
    r = w("""
size = 4 * MiB
h = check(cu.cuMemCreate(size, prop(), 0))
va = check(cu.cuMemAddressReserve(2 * size, 0, 0, 0))
host = ctypes.create_string_buffer(size)
hp = ctypes.addressof(host)
out = {}
out["dtoh_unmapped"] = err(cu.cuMemcpyDtoH(hp, va, size))
out["htod_unmapped"] = err(cu.cuMemcpyHtoD(va, hp, size))
out["memset_unmapped"] = err(cu.cuMemsetD8(va, 1, size))
check(cu.cuMemMap(va, size, 0, h, 0))
out["dtoh_no_access"] = err(cu.cuMemcpyDtoH(hp, va, size))
out["htod_no_access"] = err(cu.cuMemcpyHtoD(va, hp, size))
out["get_access_unset"] = err(cu.cuMemGetAccess(cu.CUmemLocation(), va))
loc = cu.CUmemLocation(); loc.type = DEVICE; loc.id = 0
out["get_access_dev0"] = int(check(cu.cuMemGetAccess(loc, va)))
out["set_unmapped_tail"] = err(cu.cuMemSetAccess(int(va) + size, size, [desc()], 1))
out["set_spanning"] = err(cu.cuMemSetAccess(va, 2 * size, [desc()], 1))
out["set_count_zero"] = err(cu.cuMemSetAccess(va, size, [], 0))
check(cu.cuMemSetAccess(va, size, [desc(RO)], 1))
out["get_ro"] = int(check(cu.cuMemGetAccess(loc, va)))
out["htod_ro"] = err(cu.cuMemcpyHtoD(va, hp, size))
out["dtoh_ro"] = err(cu.cuMemcpyDtoH(hp, va, size))
access(va, size)
out["htod_rw"] = err(cu.cuMemcpyHtoD(va, hp, size))
out["straddling"] = err(cu.cuMemcpyDtoH(hp, int(va) + size - MiB, 2 * MiB))
out["sync"] = err(cu.cuCtxSynchronize())
# Access on device 1 only: device 0's context may not copy.
if SIM and check(cu.cuDeviceGetCount()) > 1:
    no = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_NONE
    check(cu.cuMemSetAccess(va, size, [desc(no, 0), desc(RW, 1)], 2))
    out["other_device_only"] = err(cu.cuMemcpyDtoH(hp, va, 16))
check(cu.cuMemUnmap(va, size)); check(cu.cuMemRelease(h)); check(cu.cuMemAddressFree(va, 2 * size))
result = out
""")
    iv = "CUDA_ERROR_INVALID_VALUE"
    assert r["dtoh_unmapped"] == r["htod_unmapped"] == r["memset_unmapped"] == iv
    assert r["dtoh_no_access"] == r["htod_no_access"] == iv
    assert r["get_access_unset"] == "CUDA_ERROR_INVALID_DEVICE"
    assert r["get_access_dev0"] == 0
    assert r["set_unmapped_tail"] == r["set_spanning"] == r["set_count_zero"] == iv
    assert r["get_ro"] == 1
    assert r["htod_ro"] == iv and r["dtoh_ro"] == "CUDA_SUCCESS"
    assert r["htod_rw"] == "CUDA_SUCCESS"
    assert r["straddling"] == iv
    assert r["sync"] == "CUDA_SUCCESS"
    if "other_device_only" in r and simenv.is_simulated():
        assert r["other_device_only"] == iv


@sim_only
def test_bad_host_pointer_is_an_error(spawn):
    """The real driver's behaviour here is not recorded (it may fault)."""
    w = spawn()
    r = w("""
d = check(cu.cuMemAlloc(2 * MiB))
result = [err(cu.cuMemcpyHtoD(d, 16, 64)), err(cu.cuMemcpyDtoH(16, d, 64))]
""")
    assert r == ["CUDA_ERROR_INVALID_VALUE"] * 2


def test_bad_arguments(spawn):
    w = spawn()
    r = w("""
out = {}
gmin = cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
out["gran"] = int(check(cu.cuMemGetAllocationGranularity(prop(), gmin)))
out["create_unaligned"] = err(cu.cuMemCreate(MiB, prop(), 0))
out["create_zero"] = err(cu.cuMemCreate(0, prop(), 0))
out["create_bad_dev"] = err(cu.cuMemCreate(2 * MiB, prop(dev=99), 0))
out["reserve_unaligned"] = err(cu.cuMemAddressReserve(MiB, 0, 0, 0))
size = 4 * MiB
h = check(cu.cuMemCreate(size, prop(), 0))
va = check(cu.cuMemAddressReserve(2 * size, 0, 0, 0))
out["map_unaligned_offset"] = err(cu.cuMemMap(va, 2 * MiB, MiB, h, 0))
out["map_unaligned_size"] = err(cu.cuMemMap(va, MiB, 0, h, 0))
out["map_past_end"] = err(cu.cuMemMap(va, 2 * size, 0, h, 0))
out["map_offset_past_end"] = err(cu.cuMemMap(va, 2 * MiB, size, h, 0))
out["map_flags"] = err(cu.cuMemMap(va, size, 0, h, 1))
out["map"] = err(cu.cuMemMap(va, size, 0, h, 0))
out["map_twice"] = err(cu.cuMemMap(va, size, 0, h, 0))
out["free_while_mapped"] = err(cu.cuMemAddressFree(va, 2 * size))
check(cu.cuMemUnmap(va, size))
out["free_wrong_size"] = err(cu.cuMemAddressFree(va, size))
out["free"] = err(cu.cuMemAddressFree(va, 2 * size))
out["free_twice"] = err(cu.cuMemAddressFree(va, 2 * size))
hn = check(cu.cuMemCreate(2 * MiB, prop(NONE_H), 0))
out["export_none"] = err(cu.cuMemExportToShareableHandle(hn, POSIX, 0))
check(cu.cuMemRelease(hn)); check(cu.cuMemRelease(h))
out["import_bogus"] = err(cu.cuMemImportFromShareableHandle(987, POSIX))
fd = os.open("/dev/null", os.O_RDONLY)
out["import_devnull"] = err(cu.cuMemImportFromShareableHandle(fd, POSIX))
os.close(fd)
result = out
""")
    iv, ns = "CUDA_ERROR_INVALID_VALUE", "CUDA_ERROR_NOT_SUPPORTED"
    assert r["gran"] == 2 * MiB
    assert r["create_unaligned"] == r["create_zero"] == r["reserve_unaligned"] == iv
    assert r["create_bad_dev"] in ("CUDA_ERROR_INVALID_DEVICE", iv)
    assert r["map_unaligned_offset"] == r["map_unaligned_size"] == ns
    assert r["map_past_end"] == r["map_offset_past_end"] == ns
    assert r["map_flags"] == iv and r["map"] == "CUDA_SUCCESS" and r["map_twice"] == iv
    assert r["free_while_mapped"] == r["free_wrong_size"] == iv
    assert r["free"] == "CUDA_SUCCESS" and r["free_twice"] == iv
    assert r["export_none"] == iv
    assert r["import_bogus"] == r["import_devnull"] == "CUDA_ERROR_UNKNOWN"


def test_properties_export_and_legacy_alloc(spawn):
    w = spawn()
    r = w("""
h, va = alloc(2 * MiB)
p = check(cu.cuMemGetAllocationPropertiesFromHandle(h))
out = dict(htype=int(p.requestedHandleTypes), loc=[int(p.location.type), p.location.id])
fd = check(cu.cuMemExportToShareableHandle(h, POSIX, 0))
out["fd_ok"] = fd > 2
os.close(fd)
d = check(cu.cuMemAlloc(3 * MiB))
out["memset"] = err(cu.cuMemsetD32(d, 0x01020304, 4))
out["alloc_bytes"] = read(d, 8)
out["free"] = err(cu.cuMemFree(d))
out["free_twice"] = err(cu.cuMemFree(d))
hp = check(cu.cuMemHostAlloc(4096, 0))
out["host_copy"] = err(cu.cuMemcpy(va, hp, 4096))
out["free_host"] = err(cu.cuMemFreeHost(hp))
s = check(cu.cuStreamCreate(0))
buf = ctypes.create_string_buffer(b"async!", 6)
out["async"] = err(cu.cuMemcpyHtoDAsync(va, ctypes.addressof(buf), 6, s))
check(cu.cuStreamSynchronize(s)); check(cu.cuStreamDestroy(s))
out["async_bytes"] = read(va, 6)
result = out
""")
    assert r["htype"] == 1 and r["loc"] == [1, 0]
    assert r["fd_ok"] is True
    assert r["memset"] == "CUDA_SUCCESS" and r["alloc_bytes"] == "0403020104030201"
    assert r["free"] == "CUDA_SUCCESS" and r["free_twice"] == "CUDA_ERROR_INVALID_VALUE"
    assert r["host_copy"] == r["free_host"] == r["async"] == "CUDA_SUCCESS"
    assert bytes.fromhex(r["async_bytes"]) == b"async!"


@sim_only
def test_mem_info_is_device_wide(spawn):
    """cuMemGetInfo counts every process's allocations on that device."""
    a, b, c = spawn(), spawn(), spawn(device=1)
    before = [b("result = free_mem()"), c("result = free_mem()")]
    a("h, va = alloc(64 * MiB)")
    after = [b("result = free_mem()"), c("result = free_mem()")]
    assert before[0] - after[0] == 64 * MiB
    assert before[1] == after[1]
    a.kill()  # a dead process's memory is free again
    assert b("result = free_mem()") == before[0]
