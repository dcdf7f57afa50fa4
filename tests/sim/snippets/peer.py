"""PEER of tests/sim/test_peer.py: a snippet the worker runs (tests/snippet.py)."""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tests.snippet import check, cu

ctx1 = check(cu.cuDevicePrimaryCtxRetain(check(cu.cuDeviceGet(1))))
ACCESS = cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_ACCESS_FLAGS
def on(c, fn):
    check(cu.cuCtxPushCurrent(c))
    try:
        return fn()
    finally:
        check(cu.cuCtxPopCurrent())
def from1(fn):
    return on(ctx1, fn)
