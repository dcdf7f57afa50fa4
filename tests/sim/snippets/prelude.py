"""PRELUDE of tests/sim/simtest.py: a snippet the worker runs (tests/snippet.py)."""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import os

    from tests.snippet import DEV, check, cu, err

import ctypes

MiB = 1 << 20
POSIX = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
NONE_H = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_NONE
DEVICE = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
RW = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
RO = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READ
check(cu.cuInit(0))
ctx = check(cu.cuDevicePrimaryCtxRetain(check(cu.cuDeviceGet(DEV))))
check(cu.cuCtxSetCurrent(ctx))

def prop(htype=POSIX, dev=DEV):
    p = cu.CUmemAllocationProp()
    p.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    p.location.type = DEVICE
    p.location.id = dev
    p.requestedHandleTypes = htype
    return p

def desc(flags=RW, dev=DEV):
    d = cu.CUmemAccessDesc()
    d.location.type = DEVICE
    d.location.id = dev
    d.flags = flags
    return d

def access(va, size, flags=RW, dev=DEV):
    check(cu.cuMemSetAccess(va, size, [desc(flags, dev)], 1))

def alloc(size, htype=POSIX):
    h = check(cu.cuMemCreate(size, prop(htype), 0))
    va = check(cu.cuMemAddressReserve(size, 0, 0, 0))
    check(cu.cuMemMap(va, size, 0, h, 0))
    access(va, size)
    return h, va

def write(va, data, off=0):
    buf = ctypes.create_string_buffer(bytes(data), len(data))
    return err(cu.cuMemcpyHtoD(int(va) + off, ctypes.addressof(buf), len(data)))

def read(va, n, off=0):
    buf = ctypes.create_string_buffer(n)
    check(cu.cuMemcpyDtoH(ctypes.addressof(buf), int(va) + off, n))
    return buf.raw.hex()

import hashlib


def pattern(seed, n):
    return hashlib.shake_256(seed.to_bytes(4, "little")).digest(n)

def sha(va, n, off=0):
    buf = ctypes.create_string_buffer(n)
    check(cu.cuMemcpyDtoH(ctypes.addressof(buf), int(va) + off, n))
    return hashlib.sha256(buf.raw).hexdigest()

def import_map(fd, size):
    # import an FD (closing it), map it at a fresh VA with read-write access
    h = check(cu.cuMemImportFromShareableHandle(fd, POSIX))
    os.close(fd)
    va = check(cu.cuMemAddressReserve(size, 0, 0, 0))
    check(cu.cuMemMap(va, size, 0, h, 0))
    access(va, size)
    return h, va

def free_mem():
    return int(check(cu.cuMemGetInfo())[0])
