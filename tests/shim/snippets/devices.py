"""DEVICES of tests/shim/test_owned_fidelity.py: a snippet the worker runs (tests/snippet.py)."""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tests.snippet import check, cu, err

import ctypes

home = check(cu.cuCtxGetCurrent())
ctxs = [check(cu.cuDevicePrimaryCtxRetain(check(cu.cuDeviceGet(d)))) for d in (0, 1)]
PA = cu.CUpointer_attribute
BATCH = ["MEMORY_TYPE", "RANGE_START_ADDR", "RANGE_SIZE", "BUFFER_ID", "MEMORY_BLOCK_ID"]
def ipc_open(text, flags):
    raw = ctypes.create_string_buffer(bytes.fromhex(text), 64)
    r = cu.cuIpcOpenMemHandle(cu.CUipcMemHandle(_ptr=ctypes.addressof(raw)), flags)
    return [err(r[0]), int(r[1]) if r[0] == 0 else 0]
def first_byte(va):
    buf = ctypes.create_string_buffer(1)
    check(cu.cuMemcpyDtoH(buf, va, 1))
    return buf.raw[0]
def read_from(dev, va):
    # The first byte as a context of device `dev` reads it.
    check(cu.cuCtxSetCurrent(ctxs[dev]))
    try:
        buf = ctypes.create_string_buffer(1)
        r = cu.cuMemcpyDtoH(buf, va, 1)[0]
        return [err(r), buf.raw[0] if r == 0 else None]
    finally:
        check(cu.cuCtxSetCurrent(home))
def attribute(name, va):
    return cu.cuPointerGetAttribute(getattr(PA, "CU_POINTER_ATTRIBUTE_" + name), va)
def ids(va):
    return [int(check(attribute(n, va))) for n in ("BUFFER_ID", "MEMORY_BLOCK_ID")]
def unknown(va):
    # How the driver's calls answer `va`.
    r = cu.cuPointerGetAttributes(
        len(BATCH), [getattr(PA, "CU_POINTER_ATTRIBUTE_" + n) for n in BATCH], va
    )
    return {
        "range": err(cu.cuMemGetAddressRange(va)[0]),
        "attribute": err(attribute("RANGE_SIZE", va)[0]),
        "attributes": [err(r[0]), [int(v) for v in r[1]] if r[0] == 0 else None],
    }
