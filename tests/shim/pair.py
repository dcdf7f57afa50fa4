"""A creator and an importer sharing one allocation, on real shims: the smallest team.

Shared by the recovery and fault tests. ``shared_again`` proves the sharing is
live: the bytes are at the importer's address, and a write through the creator
is seen through the importer.
"""

from __future__ import annotations

import attrs
from cuinterpose.demo import Worker, pattern_digest

from tests.shim.workers.cycle import assert_still_active
from tests.simenv import Spawn


@attrs.frozen
class Pair:
    creator: Worker
    importer: Worker
    handle: int
    va: int
    importer_va: int
    size: int
    seed: int

    @property
    def pids(self) -> list[int]:
        return [self.creator.pid, self.importer.pid]


def share(spawn: Spawn, shim_env: dict[str, str], seed: int) -> Pair:
    creator = spawn("creator", shim_env)
    importer = spawn("importer", shim_env)
    size = 2 * int(creator.check("granularity")["granularity"])
    handle, va = creator.create_mapped(size, seed=seed)
    fd = int(creator.check("export", handle=handle)["fd"])
    theirs = creator.send_fd_to(importer, fd, close=True)
    imported = int(importer.check("import", fd=theirs)["handle"])
    importer_va = importer.map_at_new_va(imported, size)
    return Pair(creator, importer, handle, va, importer_va, size, seed)


def shared_again(pair: Pair, *, write_seed: int) -> None:
    assert pair.importer.digest(pair.importer_va, pair.size) == pattern_digest(pair.seed, pair.size)
    pair.creator.check("fill", va=pair.va, size=pair.size, seed=write_seed)
    assert pair.importer.digest(pair.importer_va, pair.size) == pattern_digest(
        write_seed, pair.size
    )


def running_as_before(pair: Pair, *, write_seed: int) -> None:
    """The creator's tracked calls work, the sharing is live; both workers end cleanly."""
    assert_still_active(pair.creator, pair.handle, pair.va, pair.size, pair.seed)
    shared_again(pair, write_seed=write_seed)
    pair.creator.close_clean()
    pair.importer.close_clean()
