"""Shared helpers of the simulated-driver suite (a uniquely named module: other
suites have their own conftest)."""

from __future__ import annotations

import hashlib
import os

import pytest
from cuinterpose.demo import Worker

from tests import simenv, snippet

MiB = 1 << 20

# Run first in every worker (the ``worker_defaults`` setup): a context on device DEV
# and small helpers, all through cuda.bindings.driver only.
PRELUDE = snippet.load(__file__, "prelude")


def pattern_bytes(seed: int, n: int) -> bytes:
    """Non-periodic test bytes (the workers' pattern())."""
    return hashlib.shake_256(seed.to_bytes(4, "little")).digest(n)


def pattern(seed: int, n: int) -> str:
    return pattern_bytes(seed, n).hex()


def psha(seed: int, n: int) -> str:
    """sha256 of pattern(seed, n): what the workers' sha() returns for it."""
    return hashlib.sha256(pattern_bytes(seed, n)).hexdigest()


def hand_over(src: Worker, dst: Worker) -> None:
    """Move the FD that `src` sent (send_fd) to `dst` (for its recv_fd)."""
    fd = src.take_fd()
    try:
        dst.give_fd(fd)
    finally:
        os.close(fd)


sim_only = pytest.mark.skipif(not simenv.is_simulated(), reason="simulator-specific")
needs_multicast = pytest.mark.skipif(
    not simenv.multicast_allowed(),
    reason="multicast on a real GPU needs CUINTERPOSE_ALLOW_MULTICAST=1",
)
