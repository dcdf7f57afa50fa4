"""ATTRS of tests/sim/test_pointer.py: a snippet the worker runs (tests/snippet.py)."""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tests.snippet import cu, err

PA = cu.CUpointer_attribute
NAMES = ["CONTEXT", "MEMORY_TYPE", "DEVICE_POINTER", "HOST_POINTER", "SYNC_MEMOPS",
         "BUFFER_ID", "IS_MANAGED", "DEVICE_ORDINAL", "IS_LEGACY_CUDA_IPC_CAPABLE",
         "RANGE_START_ADDR", "RANGE_SIZE", "MAPPED", "ALLOWED_HANDLE_TYPES",
         "IS_GPU_DIRECT_RDMA_CAPABLE", "ACCESS_FLAGS", "MEMPOOL_HANDLE", "MAPPING_SIZE",
         "MAPPING_BASE_ADDR", "MEMORY_BLOCK_ID"]
def attr(name, p):
    r = cu.cuPointerGetAttribute(getattr(PA, "CU_POINTER_ATTRIBUTE_" + name), p)
    return int(r[1]) if r[0] == 0 else err(r[0])
def attrs(p):
    return {n: attr(n, p) for n in NAMES}
def batch(p, names=NAMES):
    r = cu.cuPointerGetAttributes(len(names),
                                  [getattr(PA, "CU_POINTER_ATTRIBUTE_" + n) for n in names], p)
    return dict(zip(names, [int(v) for v in r[1]], strict=False)) if r[0] == 0 else err(r[0])
