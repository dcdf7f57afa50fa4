"""Memory pools beyond each device's default: cuMemPoolCreate, allocation from a
created pool, and sharing a pool and its pointers between processes (POSIX FD), with the
errors cuda.h documents (CUDA_ERROR_INVALID_VALUE)."""

from __future__ import annotations

import pytest

from tests import snippet
from tests.sim.simtest import MiB, hand_over, psha, sim_only
from tests.sim.test_checkpoint import controller

POOLS = snippet.load(__file__, "pools")


def worker(spawn):
    w = spawn()
    w(POOLS)
    return w


def shared_pool(a, b, size: int, seed: int) -> None:
    """``a`` makes an exportable pool and ``d`` in it (pattern(seed)), ``b`` imports
    the pool (``pool``) and the pointer (``p``)."""
    a(f"""
pool = check(cu.cuMemPoolCreate(pool_props()))
d = check(cu.cuMemAllocFromPoolAsync({size}, pool, 0)); write(d, pattern({seed}, {size}))
send_fd(check(cu.cuMemPoolExportToShareableHandle(pool, POSIX, 0)))
""")
    hand_over(a, b)
    text = a("result = export_ptr(d)")
    b(f"""
fd = recv_fd(); pool = check(cu.cuMemPoolImportFromShareableHandle(fd, POSIX, 0)); os.close(fd)
p = check(import_ptr(pool, {text!r}))
""")


def test_a_pool_pointer_is_shared_between_processes(spawn):
    a, b = worker(spawn), worker(spawn)
    size = 2 * MiB
    shared_pool(a, b, size, seed=8)
    assert b(f"result = sha(p, {size})") == psha(8, size)
    b("write(p, b'importer')")
    assert bytes.fromhex(a("result = read(d, 8)")) == b"importer"


def test_an_imported_pointer_is_freed_with_cumemfree(spawn):
    a, b = worker(spawn), worker(spawn)
    shared_pool(a, b, MiB, seed=9)
    assert b("result = [err(cu.cuMemFree(p)), err(cu.cuMemFree(p))]") == [
        "CUDA_SUCCESS",
        "CUDA_ERROR_INVALID_VALUE",
    ]


def test_an_imported_pool_allocates_nothing(spawn):
    a, b = worker(spawn), worker(spawn)
    shared_pool(a, b, MiB, seed=10)
    assert b("result = err(cu.cuMemAllocFromPoolAsync(4096, pool, 0)[0])") == (
        "CUDA_ERROR_INVALID_VALUE"
    )


def test_a_pointer_into_another_pool_is_invalid_value(spawn):
    a, b = worker(spawn), worker(spawn)
    shared_pool(a, b, MiB, seed=11)
    text = a("""
other = check(cu.cuMemPoolCreate(pool_props()))
e = check(cu.cuMemAllocFromPoolAsync(4096, other, 0))
result = export_ptr(e)
""")
    assert b(f"result = err(import_ptr(pool, {text!r})[0])") == "CUDA_ERROR_INVALID_VALUE"


def test_allocation_from_a_created_pool_names_it(spawn):
    w = worker(spawn)
    if w("result = check(cu.cuDeviceGetCount())") < 2:
        pytest.skip("a pool on another device than the stream's needs two devices")
    r = w("""
pool = check(cu.cuMemPoolCreate(pool_props(dev=1)))
d = check(cu.cuMemAllocFromPoolAsync(4096, pool, 0))
get = lambda a: int(check(cu.cuPointerGetAttribute(getattr(PA, "CU_POINTER_ATTRIBUTE_" + a), d)))
result = [get("MEMPOOL_HANDLE") == int(pool), get("DEVICE_ORDINAL"), get("ALLOWED_HANDLE_TYPES")]
""")
    assert r == [True, 1, 1]  # on the pool's device, whatever the stream's


def test_export_of_a_pool_without_handle_type_is_invalid_value(spawn):
    w = worker(spawn)
    r = w("""
pool = check(cu.cuMemPoolCreate(pool_props(NONE_H)))
d = check(cu.cuMemAllocFromPoolAsync(4096, pool, 0))
result = [err(cu.cuMemPoolExportToShareableHandle(pool, POSIX, 0)[0]),
          err(cu.cuMemPoolExportPointer(d)[0])]
""")
    assert r == ["CUDA_ERROR_INVALID_VALUE"] * 2


def test_export_pointer_of_cumemalloc_memory_is_invalid_value(spawn):
    w = worker(spawn)
    r = w("d = check(cu.cuMemAlloc(4096)); result = err(cu.cuMemPoolExportPointer(d)[0])")
    assert r == "CUDA_ERROR_INVALID_VALUE"


def test_the_default_pool_cannot_be_destroyed(spawn):
    w = worker(spawn)
    r = w("result = err(cu.cuMemPoolDestroy(check(cu.cuDeviceGetDefaultMemPool(0))))")
    assert r == "CUDA_ERROR_INVALID_VALUE"


def test_destroy_keeps_outstanding_allocations(spawn):
    w = worker(spawn)
    r = w("""
pool = check(cu.cuMemPoolCreate(pool_props()))
d = check(cu.cuMemAllocFromPoolAsync(4096, pool, 0)); write(d, b'alive')
out = [err(cu.cuMemPoolDestroy(pool)), read(d, 5)]
out.append(err(cu.cuMemFreeAsync(d, 0)))
result = out
""")
    assert r == ["CUDA_SUCCESS", b"alive".hex(), "CUDA_SUCCESS"]


def test_bad_pool_properties_are_invalid_value(spawn):
    w = worker(spawn)
    r = w("""
out = []
p = pool_props(); p.location.id = 9; out.append(err(cu.cuMemPoolCreate(p)[0]))
p = pool_props(); p.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_INVALID
out.append(err(cu.cuMemPoolCreate(p)[0]))
p = pool_props(); p.allocType = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_INVALID
out.append(err(cu.cuMemPoolCreate(p)[0]))
result = out
""")
    assert r == ["CUDA_ERROR_INVALID_VALUE"] * 3


def test_import_of_a_file_that_is_no_pool_is_invalid_value(spawn):
    w = worker(spawn)
    r = w("""
fd = os.open("/dev/null", os.O_RDONLY)
result = err(cu.cuMemPoolImportFromShareableHandle(fd, POSIX, 0)[0]); os.close(fd)
""")
    assert r == "CUDA_ERROR_INVALID_VALUE"


@sim_only
def test_native_restore_of_a_pool_importer_is_refused(spawn):
    """Not recorded on hardware: the simulator treats a pool import like a VMM import."""
    a, b = worker(spawn), worker(spawn)
    c = controller(spawn)
    shared_pool(a, b, MiB, seed=12)
    pids = [a.pid, b.pid]
    r = c(f"""
pids = {pids}
result = [f(p) for f in (lock, ckpt) for p in pids] + [restore(pids[0]), restore(pids[1])]
""")
    assert r == ["CUDA_SUCCESS"] * 5 + ["CUDA_ERROR_NOT_SUPPORTED"]
    b.kill()


@sim_only  # the real driver's answer to a destroyed pool's handle is not recorded
def test_destroy_of_a_destroyed_pool_is_invalid_value(spawn):
    w = worker(spawn)
    r = w("""
pool = check(cu.cuMemPoolCreate(pool_props()))
result = [err(cu.cuMemPoolDestroy(pool)), err(cu.cuMemPoolDestroy(pool))]
""")
    assert r == ["CUDA_SUCCESS", "CUDA_ERROR_INVALID_VALUE"]
