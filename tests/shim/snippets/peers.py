"""PEERS of tests/shim/test_owned.py: a snippet the worker runs (tests/snippet.py)."""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tests.snippet import check, cu, err

import ctypes

ctx0 = check(cu.cuDevicePrimaryCtxRetain(check(cu.cuDeviceGet(0))))
ctx1 = check(cu.cuDevicePrimaryCtxRetain(check(cu.cuDeviceGet(1))))
check(cu.cuCtxSetCurrent(ctx0))
a = int(check(cu.cuMemAlloc(1 << 20)))
check(cu.cuMemsetD8(a, 7, 1 << 20))
def read_from_1(ptr):
    check(cu.cuCtxSetCurrent(ctx1))
    buf = ctypes.create_string_buffer(16)
    try:
        return err(cu.cuMemcpyDtoH(buf, ptr, 16)), buf.raw[0]
    finally:
        check(cu.cuCtxSetCurrent(ctx0))
