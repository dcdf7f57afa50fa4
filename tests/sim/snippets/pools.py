"""POOLS of tests/sim/test_pools.py: a snippet the worker runs (tests/snippet.py)."""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import ctypes

    from tests.sim.snippets.prelude import DEVICE, POSIX
    from tests.snippet import DEV, check, cu

PA = cu.CUpointer_attribute
def pool_props(htype=POSIX, dev=DEV):
    p = cu.CUmemPoolProps()
    p.allocType = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    p.handleTypes = htype
    p.location.type = DEVICE
    p.location.id = dev
    return p
def export_ptr(p):
    data = check(cu.cuMemPoolExportPointer(p))
    return ctypes.string_at(data.getPtr(), 64).hex()
def import_ptr(pool, text):
    data = cu.CUmemPoolPtrExportData()
    ctypes.memmove(data.getPtr(), bytes.fromhex(text), 64)
    return cu.cuMemPoolImportPointer(pool, data)
