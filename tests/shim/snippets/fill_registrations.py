"""FILL_REGISTRATIONS of tests/shim/test_content.py, run by the worker (tests/snippet.py)."""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import ctypes

    from tests.snippet import cu, err

PAGE = 4096
BUF = (ctypes.c_char * (PAGE * 1024))()
base = (ctypes.addressof(BUF) + PAGE - 1) // PAGE * PAGE
REG = []
while len(REG) < 1000:
    e = cu.cuMemHostRegister(base + len(REG) * PAGE, PAGE, 0)[0]
    if e != cu.CUresult.CUDA_SUCCESS:
        break
    REG.append(base + len(REG) * PAGE)
result = (len(REG), err(e))
