"""FILL_FDS of tests/shim/test_deadends.py: a snippet the worker runs (tests/snippet.py)."""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import os

import resource

soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir('/proc/self/fd')) + 32, hard))
FILLED = []
try:
    while True:
        FILLED.append(os.open('/dev/null', os.O_RDONLY))
except OSError:
    pass
result = len(FILLED)
