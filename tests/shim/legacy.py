"""A creator sharing cudaMalloc memory with an importer by legacy CUDA IPC, on real shims.

The creator's memory comes from ``cuMemAlloc`` (one allocation of its own, and a small one
beside a private neighbour, owned with SNAPSHOT_SHIM_OWN_SMALL=1: each in a granularity of
its own), the importer opens both with ``cuIpcOpenMemHandle``: the sharing PyTorch's
default allocator makes, and CuPy's for small arrays. ``shared_both_ways``
proves the sharing is live after whatever a test did: every byte at its VA in both, a
write through either process seen by the other, and a handle made afterwards opens.
"""

from __future__ import annotations

import attrs
from cuinterpose.demo import Worker, pattern_digest

from tests.simenv import Spawn

BIG = 3 << 20  # rounded up to two granules by the shim
SMALL = 1000  # owned (SNAPSHOT_SHIM_OWN_SMALL=1), a granule of its own, beside PRIVATE
PRIVATE = 4096
# What SMALL needs to be owned (and its legacy IPC captured): the processes' environment.
OWN_SMALL = {"SNAPSHOT_SHIM_OWN_SMALL": "1"}


@attrs.frozen
class LegacyPair:
    creator: Worker
    importer: Worker
    big: int  # the creator's VAs
    small: int
    private: int
    big_in_importer: int  # the importer's VAs
    small_in_importer: int
    seed: int

    @property
    def pids(self) -> list[int]:
        return [self.creator.pid, self.importer.pid]


def share_legacy(spawn: Spawn, env: dict[str, str], seed: int) -> LegacyPair:
    env = {**env, **OWN_SMALL}
    creator = spawn("creator", env)
    importer = spawn("importer", env)
    big = int(creator.check("alloc", size=BIG)["va"])
    small = int(creator.check("alloc", size=SMALL)["va"])
    private = int(creator.check("alloc", size=PRIVATE)["va"])
    for va, size, k in ((big, BIG, 0), (small, SMALL, 1), (private, PRIVATE, 2)):
        creator.check("fill", va=va, size=size, seed=seed + k)
    opened = []
    for va in (big, small):
        handle = creator.check("ipc_get", va=va)["handle"]
        opened.append(int(importer.check("ipc_open", handle=handle)["va"]))
    return LegacyPair(creator, importer, big, small, private, opened[0], opened[1], seed)


def bytes_at_their_vas(pair: LegacyPair, seeds: tuple[int, int, int]) -> None:
    c, i = pair.creator, pair.importer
    assert c.digest(pair.big, BIG) == pattern_digest(seeds[0], BIG)
    assert c.digest(pair.small, SMALL) == pattern_digest(seeds[1], SMALL)
    assert c.digest(pair.private, PRIVATE) == pattern_digest(seeds[2], PRIVATE)
    assert i.digest(pair.big_in_importer, BIG) == pattern_digest(seeds[0], BIG)
    assert i.digest(pair.small_in_importer, SMALL) == pattern_digest(seeds[1], SMALL)


def shared_both_ways(pair: LegacyPair, *, write_seed: int) -> None:
    """Bytes as the pair left them, then live sharing both ways and a new share."""
    s = pair.seed
    bytes_at_their_vas(pair, (s, s + 1, s + 2))
    pair.importer.check("fill", va=pair.big_in_importer, size=BIG, seed=write_seed)
    assert pair.creator.digest(pair.big, BIG) == pattern_digest(write_seed, BIG)
    pair.creator.check("fill", va=pair.small, size=SMALL, seed=write_seed + 1)
    assert pair.importer.digest(pair.small_in_importer, SMALL) == pattern_digest(
        write_seed + 1, SMALL
    )
    fresh = int(pair.creator.check("alloc", size=BIG)["va"])
    pair.creator.check("fill", va=fresh, size=BIG, seed=write_seed + 2)
    handle = pair.creator.check("ipc_get", va=fresh)["handle"]
    theirs = int(pair.importer.check("ipc_open", handle=handle)["va"])
    assert pair.importer.digest(theirs, BIG) == pattern_digest(write_seed + 2, BIG)
    pair.importer.check("ipc_close", va=theirs)
    pair.creator.check("free", va=fresh)
