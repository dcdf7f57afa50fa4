"""HOG of tests/shim/test_rollback.py: a snippet the worker runs (tests/snippet.py)."""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tests.shim.snippets.worker_setup import gran, prop
    from tests.snippet import cu, err

HOG = []
while True:
    e, h = cu.cuMemCreate(gran, prop(), 0)
    if e != cu.CUresult.CUDA_SUCCESS:
        break
    HOG.append(h)
result = (len(HOG), err(e))
