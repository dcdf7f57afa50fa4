"""Waiting for an observable state instead of for a while."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(ready: Callable[[], object], what: str, timeout_s: float = 30.0) -> None:
    """Poll ``ready()`` until it is true. ``timeout_s`` only turns a state that never
    comes into a failure naming ``what``; it orders nothing."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() >= deadline:
            raise TimeoutError(f"not within {timeout_s} s: {what}")
        time.sleep(0.01)
