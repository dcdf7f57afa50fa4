"""A Unix socket served by another user: what a hijacked control directory looks like.

Needs root (the child drops to ``nobody``); the tests that use it skip otherwise.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
from collections.abc import Iterator
from pathlib import Path

NOBODY = 65534


@contextlib.contextmanager
def served_by_nobody(path: Path) -> Iterator[int]:
    """Listen at ``path`` from a child running as ``nobody``; yields its pid once it
    listens. The child accepts one connection, reads the request and answers nothing."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    ready_r, ready_w = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child: listen (its credentials) as nobody
        try:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            listener.listen(1)
            os.write(ready_w, b"x")
            conn, _ = listener.accept()
            conn.recv(4096)
        finally:
            os._exit(0)
    listener.close()
    os.close(ready_w)
    try:
        assert os.read(ready_r, 1) == b"x"
        yield child
    finally:
        os.close(ready_r)
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
