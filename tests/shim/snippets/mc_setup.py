"""MC_SETUP of tests/shim/test_multicast.py: a snippet the worker runs (tests/snippet.py)."""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tests.shim.snippets.worker_setup import POSIX, access, reserve
    from tests.snippet import DEV, check, cu

ctx = check(cu.cuDevicePrimaryCtxRetain(check(cu.cuDeviceGet(DEV))))
check(cu.cuCtxSetCurrent(ctx))
def mcprop(n, size):
    p = cu.CUmulticastObjectProp()
    p.numDevices = n
    p.size = size
    p.handleTypes = int(POSIX)
    p.flags = 0
    return p
def get_access(va):
    loc = cu.CUmemLocation()
    loc.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    loc.id = DEV
    return int(check(cu.cuMemGetAccess(loc, va)))
def mc_map(h, size):
    va = reserve(size)
    check(cu.cuMemMap(va, size, 0, h, 0))
    check(access(va, size, device=DEV))
    return va
