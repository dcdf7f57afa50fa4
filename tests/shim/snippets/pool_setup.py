"""POOL_SETUP of tests/shim/test_owned.py: a snippet the worker runs (tests/snippet.py)."""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tests.snippet import cu

import ctypes

POSIX = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
props = cu.CUmemPoolProps()
props.allocType = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
props.handleTypes = POSIX
props.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
props.location.id = 0
