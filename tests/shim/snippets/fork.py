"""FORK of tests/shim/test_handles.py: a snippet the worker runs (tests/snippet.py)."""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import os

    from tests.shim.snippets.worker_setup import H
    from tests.snippet import cu, err

    FLAG = ...  # set by the test before this snippet

import time

flag = FLAG
r, wfd = os.pipe()
pid = os.fork()
if pid == 0:
    os.close(r)
    # The first tracked call in the child starts its own control server.
    e = cu.cuMemRelease(cu.CUmemGenericAllocationHandle(int(H['x'])))
    os.write(wfd, (err(e) + "\n").encode())
    deadline = time.time() + 20
    while not os.path.exists(flag) and time.time() < deadline:
        time.sleep(0.02)
    os._exit(0)
os.close(wfd)
line = os.read(r, 100).decode().strip()
os.close(r)
H['child'] = pid
result = {"child": pid, "err": line}
