"""FREE_FDS of tests/shim/test_deadends.py: a snippet the worker runs (tests/snippet.py)."""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import os
    import resource

    from tests.shim.snippets.fill_fds import FILLED, hard, soft

for fd in FILLED:
    os.close(fd)
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
result = len(FILLED)
