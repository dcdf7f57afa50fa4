"""NATIVE of tests/shim/test_control.py: a snippet the worker runs (tests/snippet.py)."""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tests.snippet import check, cu

    PIDS = ...  # set by the test before this snippet

check(cu.cuInit(0))
states = []
for pid in PIDS:
    a = cu.CUcheckpointLockArgs()
    a.timeoutMs = 10000
    check(cu.cuCheckpointProcessLock(pid, a))
for pid in PIDS:
    check(cu.cuCheckpointProcessCheckpoint(pid, cu.CUcheckpointCheckpointArgs()))
states = [int(check(cu.cuCheckpointProcessGetState(pid))) for pid in PIDS]
for pid in PIDS:
    check(cu.cuCheckpointProcessRestore(pid, cu.CUcheckpointRestoreArgs()))
for pid in PIDS:
    check(cu.cuCheckpointProcessUnlock(pid, cu.CUcheckpointUnlockArgs()))
result = states
