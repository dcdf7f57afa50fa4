"""LOAD's floor on this driver (issue 30 item 3): re-creating a shape's allocations while
their bytes are copied in, without the shim.

LOAD re-creates every allocation (cuMemCreate, cuMemMap at its kept reservation,
cuMemSetAccess) and copies its bytes back while it re-creates the next ones. For
``--count`` allocations of ``--mib`` MiB on GPU 0, the C probe ``bench/load_floor.c``
(built with the shim, into ``$CUINTERPOSE_BUILD_DIR/bench``, default ``build/``; in C
because Python's copy threads took the GIL from the thread that re-creates) measures,
with the reservations made first, as LOAD finds them:

- ``recreate_s``: the three calls for every allocation from one thread, nothing else
  running (what LOAD's control thread does);
- ``copy_s``: the bytes alone into the allocations already made: N copy threads,
  each with a non-blocking stream of its own, copying whole allocations from a pinned
  buffer of its own in pieces of at most ``--piece-mib`` (queued, one sync per
  allocation); no memcpy out of pageable memory, so an upper bound of LOAD's copy;
- ``overlap_s``: both at once, as LOAD does them: one thread re-creates, and each
  allocation, once made, is copied by the first free copy thread. This is the floor:
  LOAD with its bytes already pinned and nothing of the shim's around it.

With ``--source staged`` the bytes come as LOAD finds them instead: from one populated
anonymous mapping (2 MiB pages where THP allows), cut in units of the shim's LOAD chunk
(about four per copy thread, 1 to 64 MiB, at most an allocation), each copy thread
memcpy'ing a piece into one half of its pinned buffer of two pieces while the copy
engine drains the other, waiting on blocking-sync events. That is the shim's bounce
design with nothing of the shim's around it: the driver's and the host's floor
together, for LOAD as built. ``memcpy_s`` is the host's part alone: the same memcpy's
into the same buffers, nothing copied to the device. Each thread drains its pipeline
after every unit, as the shim does after every chunk; with ``--source piped`` its
pipeline runs on across its units (the first piece of a unit memcpy'd while the last
of the one before copies) and is drained once, when the thread ends: the best this
design allows.

Each case for every N of ``--threads`` (default 4, 8, 16); the top-level figures are
those of the N fastest both at once (``by_threads`` has them all). GB/s are 10^9 bytes
over each time; ``overlap_of_htod`` is the floor over the pinned
HtoD ceiling of one ``--ceiling-mib`` buffer measured in the same run (one stream).
Medians of ``--repeat``, every run listed. One JSON object to ``--out`` and stdout;
``--libcuda`` picks the driver (the simulator's in the tests).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

MIB = 1 << 20
REPO = Path(__file__).resolve().parents[1]


def probe_path() -> Path:
    return Path(os.environ.get("CUINTERPOSE_BUILD_DIR") or REPO / "build") / "bench" / "load_floor"


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Every ``--threads`` count; the floor is the fastest of them both at once (more copy
    threads contend with the re-creation inside the driver: on the H200, 2048 x 2 MiB took
    0.100 s with 4 and 0.127-0.172 s with 16)."""
    runs = {t: measure_one(args, t) for t in args.threads}
    best = min(runs, key=lambda t: runs[t]["overlap_s"]["median"])
    return {**runs[best], "by_threads": {str(t): r for t, r in runs.items()}}


def measure_one(args: argparse.Namespace, threads: int) -> dict[str, Any]:
    probe = probe_path()
    if not probe.is_file():
        raise SystemExit(f"{probe} missing: build it first (make build)")
    argv = [str(probe), args.libcuda, str(args.count), str(args.mib), str(threads)]
    argv += [str(args.piece_mib), str(args.repeat), str(args.ceiling_mib), args.source]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{probe.name} failed ({done.returncode}): {done.stderr.strip()}")
    raw = json.loads(done.stdout)
    size = args.mib * MIB
    total = args.count * size
    out: dict[str, Any] = {
        "count": args.count,
        "bytes_each": size,
        "bytes": total,
        "threads": threads,
        "source": raw["source"],
        "piece": min(args.piece_mib * MIB, size),
        "repeat": args.repeat,
    }
    out["unit"] = int(raw["unit"])
    for key in ("recreate_s", "copy_s", "memcpy_s", "overlap_s"):
        if key not in raw:  # memcpy_s: not for a pinned source
            continue
        runs = [float(x) for x in raw[key]]
        out[key] = {"median": statistics.median(runs), "runs": runs}
        out[key.replace("_s", "_gbps")] = total / out[key]["median"] / 1e9
    out["recreate_us_per_allocation"] = out["recreate_s"]["median"] / args.count * 1e6
    out["htod_ceiling_gbps"] = float(raw["htod_ceiling_gbps"])
    out["overlap_of_htod"] = out["overlap_gbps"] / out["htod_ceiling_gbps"]
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=2048)
    parser.add_argument("--mib", type=int, default=2)
    parser.add_argument(
        "--threads", type=int, nargs="+", default=[4, 8, 16], help="copy threads (at most 64)"
    )
    parser.add_argument("--piece-mib", type=int, default=8, help="largest single copy")
    parser.add_argument(
        "--source",
        choices=("pinned", "staged", "piped"),
        default="pinned",
        help="pinned buffers (the driver's floor) or staged memory through bounce buffers"
        " (piped: one pipeline per thread across its units)",
    )
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--ceiling-mib", type=int, default=1024)
    parser.add_argument("--libcuda", default="libcuda.so.1")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    for name in ("count", "mib", "piece_mib", "repeat", "ceiling_mib"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if not all(1 <= t <= 64 for t in args.threads):
        parser.error("--threads must be from 1 to 64")
    result = measure(args)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
