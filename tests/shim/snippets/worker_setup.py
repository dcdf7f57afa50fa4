"""WORKER_SETUP of tests/shim/shimenv.py: a snippet the worker runs (tests/snippet.py)."""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import os

    from tests.snippet import check, cu

import ctypes
import hashlib
import random

check(cu.cuInit(0))
dev = check(cu.cuDeviceGet(0))
ctx = check(cu.cuDevicePrimaryCtxRetain(dev))
check(cu.cuCtxSetCurrent(ctx))
POSIX = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
RW = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
def prop(ht=POSIX, device=0):
    p = cu.CUmemAllocationProp()
    p.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    p.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    p.location.id = device
    p.requestedHandleTypes = ht
    return p
def access(va, size, device=0, flags=RW):
    d = cu.CUmemAccessDesc()
    d.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    d.location.id = device
    d.flags = flags
    return cu.cuMemSetAccess(va, size, [d], 1)
gran = int(check(cu.cuMemGetAllocationGranularity(
    prop(), cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM)))
H = {}
def reserve(size):
    return int(check(cu.cuMemAddressReserve(size, 0, 0, 0)))
def map_rw(h, size, va=None, offset=0):
    va = reserve(size) if va is None else va
    check(cu.cuMemMap(va, size, offset, h, 0))
    check(access(va, size))
    return va
def fill(va, size, seed):
    data = random.Random(seed).randbytes(size)
    check(cu.cuMemcpyHtoD(va, data, size))
def digest(va, size):
    buf = (ctypes.c_char * size)()
    check(cu.cuMemcpyDtoH(ctypes.addressof(buf), va, size))
    return hashlib.sha256(bytes(buf)).hexdigest()[:16]
def expected(seed, size):
    return hashlib.sha256(random.Random(seed).randbytes(size)).hexdigest()[:16]
def export(h):
    return int(check(cu.cuMemExportToShareableHandle(h, POSIX, 0)))
def import_fd(fd):
    return check(cu.cuMemImportFromShareableHandle(fd, POSIX))
result = {"gran": gran, "pid": os.getpid()}
