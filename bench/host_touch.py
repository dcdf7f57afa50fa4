"""How fast this machine hands out memory it has never handed out before, against memory it
has handed out and taken back: the same first touch twice, and the same buffered file
write twice, in one process.

On a virtual machine the host may back guest memory only when the guest first touches
it; a page the guest freed stays backed. Then the first suspend of a fresh machine pays
the host's provisioning (issue 30's cold SAVE) and so does a store into page cache the
guest never used (issue 32's store), while a machine that has run for a while does not.
This probe says which, on the machine it runs on: rounds of THREADS threads memsetting
fresh anonymous memory (THP advised, unmapped after each round), then rounds of THREADS
threads writing fresh files from an 8 MiB buffer (unlinked after each round). Each round
reports GB/s; a first round far below the next means the first touch is the host's.

    python3 bench/host_touch.py [--gib 32] [--file-gib 8] [--threads 16] [--rounds 2]
        [--dir /tmp] [--out touch.json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

# The same first touch and the same writes as the floor's memset case and the storage
# probe's write (siblings here: run as a script, this directory is on sys.path).
from floor import MADV_HUGEPAGE, Floor
from storage_rate import CHUNK, _run


def touch_round(total: int, threads: int) -> float:
    """GB/s of ``threads`` threads memsetting their slices of ``total`` fresh bytes (THP
    advised; unmapped after)."""
    fl = Floor(total, CHUNK, lambda _: None)
    return fl.gbps(fl.memset(threads, MADV_HUGEPAGE))


def write_round(directory: Path, total: int, threads: int) -> float:
    """GB/s of ``threads`` threads each writing its share of ``total`` into a fresh file
    from an 8 MiB buffer (the files unlinked after)."""
    share = total // threads // CHUNK * CHUNK
    paths = [directory / f"touch-{i}.bin" for i in range(threads)]
    try:
        seconds = _run(paths, share, write=True)
    finally:
        for p in paths:
            p.unlink(missing_ok=True)
    return share * threads / seconds / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=32.0, help="anonymous memory per round")
    parser.add_argument("--file-gib", type=float, default=8.0, help="file bytes per round")
    parser.add_argument("--threads", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.threads < 1 or args.rounds < 1:
        parser.error("--threads and --rounds must be at least 1")
    for name, gib in (("--gib", args.gib), ("--file-gib", args.file_gib)):
        if gib * (1 << 30) < args.threads * CHUNK:
            parser.error(f"{name} {gib:g} gives a thread less than {CHUNK >> 20} MiB")
    touch = [
        round(touch_round(int(args.gib * (1 << 30)), args.threads), 2) for _ in range(args.rounds)
    ]
    print(f"first touch of {args.gib:g} GiB, {args.threads} threads, GB/s by round: {touch}")
    work = Path(tempfile.mkdtemp(prefix="host-touch-", dir=args.dir))
    try:
        writes = [
            round(write_round(work, int(args.file_gib * (1 << 30)), args.threads), 2)
            for _ in range(args.rounds)
        ]
    finally:
        work.rmdir()
    print(f"buffered write of {args.file_gib:g} GiB into fresh files, GB/s by round: {writes}")
    if args.out is not None:
        args.out.write_text(
            json.dumps(
                {
                    "threads": args.threads,
                    "touch_gib": args.gib,
                    "touch_gbps": touch,
                    "file_gib": args.file_gib,
                    "write_gbps": writes,
                },
                indent=1,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
