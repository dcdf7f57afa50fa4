"""CTL of tests/sim/test_checkpoint.py: a snippet the worker runs (tests/snippet.py)."""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tests.snippet import cu, err

def lock(pid, t=5000):
    a = cu.CUcheckpointLockArgs()
    a.timeoutMs = t
    return err(cu.cuCheckpointProcessLock(pid, a))
def ckpt(pid):
    return err(cu.cuCheckpointProcessCheckpoint(pid, cu.CUcheckpointCheckpointArgs()))
def restore(pid):
    return err(cu.cuCheckpointProcessRestore(pid, cu.CUcheckpointRestoreArgs()))
def unlock(pid):
    return err(cu.cuCheckpointProcessUnlock(pid, cu.CUcheckpointUnlockArgs()))
def state(pid):
    r = cu.cuCheckpointProcessGetState(pid)
    return r[1].name.replace("CU_PROCESS_STATE_", "") if r[0] == 0 else err(r)
