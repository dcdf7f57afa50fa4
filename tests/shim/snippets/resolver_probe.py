"""RESOLVER_PROBE of tests/shim/test_resolution.py: a snippet the worker runs (tests/snippet.py)."""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tests.snippet import cu, err

    SHIM = ...  # set by the test before this snippet

import ctypes

shim = ctypes.CDLL(SHIM)
def ours(name):
    return ctypes.cast(getattr(shim, name), ctypes.c_void_p).value
def gpa(name, version, flags=0):
    e, p, st = cu.cuGetProcAddress(name.encode(), version, flags)
    return (err(e), -1 if st is None else int(st), int(p) if p else 0)
def via_dlsym(name):
    lib = ctypes.CDLL("libcuda.so.1")
    try:
        return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
    except AttributeError:  # not exported by this driver: nothing to substitute
        return None
result = {
    "create": gpa("cuMemCreate", 10020)[2] == ours("cuMemCreate"),
    "create_ptds": gpa("cuMemCreate", 12000, 2)[2] == ours("cuMemCreate"),
    "import": gpa("cuMemImportFromShareableHandle", 10020)[2]
    == ours("cuMemImportFromShareableHandle"),
    "gpa_v2": gpa("cuGetProcAddress", 12000)[2] == ours("cuGetProcAddress_v2"),
    "gpa_v1": gpa("cuGetProcAddress", 11030)[2] == ours("cuGetProcAddress"),
    "bind_v1": gpa("cuMulticastBindMem", 12010)[2] == ours("cuMulticastBindMem"),
    # A 13.0 driver refuses a version above its own; else one of our two ABIs.
    "bind_13010": (lambda r: r[0] != "CUDA_SUCCESS" or r[2] in (
        ours("cuMulticastBindMem"), ours("cuMulticastBindMem_v2")))(
        gpa("cuMulticastBindMem", 13010)),
    "untracked_real": gpa("cuMemcpyDtoH", 3020)[2] not in (0, ours("cuMemCreate")),
    "unknown": gpa("cuNoSuchFunction", 12000),
    "too_old": gpa("cuMemCreate", 9000)[2] != ours("cuMemCreate"),
    "dlsym_handle": via_dlsym("cuMemCreate") == ours("cuMemCreate"),
    # Substituted only where the driver has it (13.0 drivers do not).
    "dlsym_handle_v2": via_dlsym("cuMulticastBindMem_v2") in (None, ours("cuMulticastBindMem_v2")),
    "dlsym_untracked": via_dlsym("cuMemcpyDtoH_v2") != 0,
}
