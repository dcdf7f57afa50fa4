"""USED of tests/shim/test_private.py: a snippet the worker runs (tests/snippet.py)."""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tests.snippet import check, cu

used = 0
for d in range(2):
    pctx = check(cu.cuDevicePrimaryCtxRetain(check(cu.cuDeviceGet(d))))
    check(cu.cuCtxPushCurrent(pctx))
    free, total = check(cu.cuMemGetInfo())
    check(cu.cuCtxPopCurrent())
    used += int(total) - int(free)
result = used
