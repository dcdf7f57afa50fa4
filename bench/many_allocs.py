"""Many allocations through suspend and resume (issue 30, item 5): bytes right, time per allocation.

One process under the shim per shape makes COUNT cuMemAlloc (cudaMalloc) allocations of
SIZE bytes, fills each with a value of its own (cuMemsetD32), then ``--repeat`` times one
``cuinterpose suspend`` and one ``cuinterpose resume`` (each a process of its own, as a
user runs them); after the first cycle every allocation is read back and compared. Small
ones are the driver's (packed into its 2 MiB chunks, kept by its own checkpoint), 2 MiB
ones are an allocation (and an INSPECT record pair) each: 20 000 of them are 40 000 of
INSPECT's 65 536 records.

Shapes: on a GPU (default) 100 000 x 4 KiB and 20 000 x 2 MiB; ``--sim`` 7 000 and
70 000 x 4 KiB on the simulated driver, and the ratio of their commands' times (10x the
allocations took 1.9x the time when issue 30 was filed). Reported per shape: the fill, each
command's total and its capture/restore step, the shim's SAVE and LOAD (SNAPSHOT_SHIM_TIMING)
and the INSPECT exchange, each also per allocation (microseconds). ``--out`` writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from staging import Bench, _command, _timing_lines

KIB, MIB = 1 << 10, 1 << 20
GPU_SHAPES = {"100000x4KiB": (100_000, 4 * KIB), "20000x2MiB": (20_000, 2 * MIB)}
SIM_SHAPES = {"7000x4KiB": (7_000, 4 * KIB), "70000x4KiB": (70_000, 4 * KIB)}

# Runs in the worker: COUNT cuMemAlloc of SIZE bytes, allocation k filled with _value(k);
# CHECK() reads every one back and counts the wrong ones.
SETUP = r"""
import ctypes
def _value(k):
    return (0x9E3779B1 * (k + 1)) & 0xFFFFFFFF
P = []
for k in range(COUNT):
    p = int(check(cu.cuMemAlloc(SIZE)))
    check(cu.cuMemsetD32(p, _value(k), SIZE // 4))
    P.append(p)
check(cu.cuCtxSynchronize())
def CHECK():
    buf = (ctypes.c_char * SIZE)()
    bad = 0
    for k, p in enumerate(P):
        check(cu.cuMemcpyDtoH(ctypes.addressof(buf), p, SIZE))
        bad += bytes(buf) != _value(k).to_bytes(4, "little") * (SIZE // 4)
    return bad
result = len(P)
"""


def shape(bench: Bench, name: str, count: int, size: int, repeat: int) -> dict[str, Any]:
    w = bench.spawn(f"many-{name}", bench.shim)
    t = time.perf_counter()
    w.send(f"COUNT, SIZE = {count}, {size}\n" + SETUP)
    if w.reply(timeout_s=1800) != count:
        raise SystemExit(f"{name}: the worker did not make {count} allocations")
    fill_s = time.perf_counter() - t
    bench.log(f"{name}: {count} x {size} bytes made and filled in {fill_s:.2f} s")
    reps = []
    verified = None
    for i in range(repeat):
        sus = bench.cli("suspend", w.pid, f"{name}-{i}")
        res = bench.cli("resume", w.pid, f"{name}-{i}")
        reps.append({"suspend": _command(sus), "resume": _command(res)})
        if i == 0:
            w.send("result = CHECK()")
            bad = int(w.reply(timeout_s=1800))
            verified = bad == 0
            bench.log(f"  verified: {verified} ({bad} allocations wrong)")
    w.close()
    timing = _timing_lines(w.stderr_text())
    ops = {
        op: [t for t in timing if t["op"] == op] for op in ("SAVE_ALLOCATIONS", "LOAD_ALLOCATIONS")
    }

    def per_alloc_us(seconds: float) -> float:
        return round(seconds / count * 1e6, 3)

    out: dict[str, Any] = {
        "allocations": count,
        "allocation_bytes": size,
        "verified": verified,
        "fill_s": fill_s,
        "staged_allocations": [int(t["allocations"]) for t in ops["SAVE_ALLOCATIONS"]],
        "repetitions": reps,
    }
    for command, step in (("suspend", "capture"), ("resume", "coordinator_restore")):
        totals = [r[command]["seconds"] for r in reps]
        steps = [r[command]["steps"].get(step, 0.0) for r in reps]
        out[command] = {
            "total_s": totals,
            f"{step}_s": steps,
            "total_us_per_allocation": [per_alloc_us(x) for x in totals],
            f"{step}_us_per_allocation": [per_alloc_us(x) for x in steps],
            "inspect_s": [r[command]["phases"].get("INSPECT", 0.0) for r in reps],
        }
    for op, lines in ops.items():
        out[op] = {
            "elapsed_s": [float(t["elapsed_s"]) for t in lines],
            "us_per_allocation": [per_alloc_us(float(t["elapsed_s"])) for t in lines],
            "setup_s": [float(t["setup_s"]) for t in lines],
        }
    bench.log(
        f"  suspend {out['suspend']['total_us_per_allocation']} us/allocation, resume "
        f"{out['resume']['total_us_per_allocation']}; SAVE "
        f"{out['SAVE_ALLOCATIONS']['us_per_allocation']}, LOAD "
        f"{out['LOAD_ALLOCATIONS']['us_per_allocation']}"
    )
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sim", action="store_true", help="simulated driver: 7000 and 70000")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--only", action="append", help="run only these shapes")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    table = SIM_SHAPES if args.sim else GPU_SHAPES
    chosen = {k: v for k, v in table.items() if not args.only or k in args.only}
    if not chosen or args.repeat < 1:
        parser.error(f"nothing to run: --only must name one of {', '.join(table)}")
    driver = "sim" if args.sim else "system"

    def log(text: str) -> None:
        print(f"[many] {text}", file=sys.stderr, flush=True)

    result: dict[str, Any] = {"driver": driver, "shapes": {}}
    with tempfile.TemporaryDirectory(prefix="cip-many-") as tmp:
        bench = Bench(driver, Path(tmp), log, args.repeat)
        try:
            for name, (count, size) in chosen.items():
                result["shapes"][name] = shape(bench, name, count, size, args.repeat)
                if args.out:
                    args.out.write_text(json.dumps(result, indent=2))
        finally:
            for w in bench.workers:
                w.kill()
            if driver == "sim":
                Path(f"/dev/shm/cuinterpose-sim-{os.getuid()}-bench-{os.getpid()}").unlink(
                    missing_ok=True
                )
    shapes = result["shapes"]
    if args.sim and set(SIM_SHAPES) <= set(shapes):
        small, large = (shapes[k] for k in SIM_SHAPES)
        # Medians: one command slowed by the machine's other work moves a mean.
        ratio = {
            c: statistics.median(large[c]["total_s"]) / statistics.median(small[c]["total_s"])
            for c in ("suspend", "resume")
        }
        result["time_ratio_70000_over_7000"] = ratio
        log(f"70000 over 7000 allocations: {ratio}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "shapes"}, indent=2))
    return 0 if all(s["verified"] for s in shapes.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
