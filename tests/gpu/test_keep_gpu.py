"""The kept host copy on a real GPU (SNAPSHOT_SHIM_KEEP_HOST_COPY=1; the simulated driver's
tests are tests/shim/test_keep.py): the shim's own hash kernel, JIT-compiled by the driver,
and the straight DMA into and out of the pinned copies. Allocations of several chunks are
copied whole by the first SAVE, not at all by an unchanged one, and by one after a rewrite
and single-byte flips only in the chunks they touched, every byte right after each LOAD.
Skipped without a GPU."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from cuinterpose.engine import wire

from tests.shim import shimenv
from tests.shim.test_content import finish, make_shared
from tests.shim.test_control import Shim
from tests.shim.test_keep import FLIP, KEEP, cycle, digests, host_copy, wait_pinned
from tests.simenv import Spawn

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("gpu")]
HashState = wire.HashState


def test_only_the_changed_chunks_move_on_a_gpu(
    spawn: Spawn, shim_env: dict[str, str], control_dir: Path
) -> None:
    creator = spawn("keep", shim_env, extra=KEEP, setup=shimenv.WORKER_SETUP)
    sizes = [8, 1, 3, 16]
    gran = make_shared(creator, sizes, seed=4700)
    assert gran == 2 << 20  # the hash's chunk: FLIP names chunks by granule
    total = sum(sizes) * gran
    c = Shim(control_dir, creator.pid)
    wait_pinned(c, len(sizes))
    before = digests(creator)
    save, _ = cycle(c)
    assert (host_copy(save).hash, host_copy(save).copied) == (HashState.FIRST, total), save.message
    assert digests(creator) == before
    save, _ = cycle(c)
    assert (host_copy(save).hash, host_copy(save).copied) == (HashState.COMPARED, 0)
    creator("h, va, size, _ = A[1]; fill(va, size, 4711); A[1] = (h, va, size, 4711)")
    after = digests(creator)
    save, _ = cycle(c)
    assert (host_copy(save).hash, host_copy(save).copied) == (HashState.COMPARED, sizes[1] * gran)
    assert digests(creator) == after
    rng = random.Random(47)
    for n in range(5):
        touched = creator(FLIP.format(seed=rng.randrange(1 << 30), flips=3))
        after = digests(creator)
        save, _ = cycle(c)
        kept = host_copy(save)
        assert (kept.hash, kept.copied) == (HashState.COMPARED, len(touched) * gran), touched
        assert digests(creator) == after, n
    finish(creator)
