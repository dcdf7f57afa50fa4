"""IPC of tests/sim/test_legacy_ipc.py: a snippet the worker runs (tests/snippet.py)."""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import ctypes

    from tests.snippet import check, cu

LAZY = cu.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
def hexof(h):
    return ctypes.string_at(h.getPtr(), 64).hex()
def mem_handle(p):
    return hexof(check(cu.cuIpcGetMemHandle(p)))
def as_handle(kind, text):
    h = kind()
    ctypes.memmove(h.getPtr(), bytes.fromhex(text), 64)
    return h
def ipc_open(text, flags=LAZY):
    return cu.cuIpcOpenMemHandle(as_handle(cu.CUipcMemHandle, text), flags)
def event_handle(e):
    return hexof(check(cu.cuIpcGetEventHandle(e)))
def event_open(text):
    return cu.cuIpcOpenEventHandle(as_handle(cu.CUipcEventHandle, text))
EF = cu.CUevent_flags
IPC_EVENT = int(EF.CU_EVENT_INTERPROCESS) | int(EF.CU_EVENT_DISABLE_TIMING)
