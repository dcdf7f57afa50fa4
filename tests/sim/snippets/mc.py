"""MC of tests/sim/test_multicast.py: a snippet the worker runs (tests/snippet.py)."""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tests.sim.snippets.prelude import POSIX
    from tests.snippet import cu

def mcprop(n, size, htypes=POSIX):
    p = cu.CUmulticastObjectProp()
    p.numDevices = n
    p.size = size
    p.handleTypes = int(htypes)
    p.flags = 0
    return p
