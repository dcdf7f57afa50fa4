"""Checkpoint/restore bandwidth: cuinterpose vs the native checkpoint vs the copy ceiling.

One run, same bytes, same machine:

1. cuinterpose: a creator shares N GiB with an importer (shim preloaded); ``cuinterpose
   prepare`` (SAVE_ALLOCATIONS), native lock + checkpoint of both, native restore +
   unlock, ``cuinterpose restore`` (LOAD_ALLOCATIONS); bytes verified afterwards.
2. native only (the probe's scenario B): a creator holding N GiB with an exported FD
   open, nothing shared, no shim; native checkpoint and restore of that process.
3. the copy ceiling: a plain cuMemcpyDtoH / HtoD of the same N GiB to pinned memory.

Prints SAVE/LOAD GB/s, the native GB/s, the copy GB/s and their ratios; ``--out``
writes them as JSON. Sizes: ``--gib`` (default ``$CUINTERPOSE_BENCH_GIB`` or 4), or
``--mib``. ``--driver sim`` runs the same thing on the simulated driver (small sizes).
GB here is 10^9 bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from cuinterpose import launch, native_calls
from cuinterpose.demo import CliRun, Worker, coordinator_env, pattern_digest, run_cli

SEED = 7


def _event(events: Any, phase: str) -> dict[str, Any]:
    for e in events:
        if e.get("event") == "phase" and e.get("phase") == phase:
            return dict(e)
    raise SystemExit(f"no {phase} progress event in {events}")


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("nan")


def _f(value: Any) -> str:
    return f"{value:.2f}" if isinstance(value, int | float) else str(value)


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def _coordinate(command: str, pids: list[int], ckpt: Path, control: Path, trace: Path) -> CliRun:
    """``cuinterpose <command>`` on ``pids``; exits with its stderr if it fails."""
    done = run_cli(
        command,
        pids=pids,
        checkpoint_dir=ckpt,
        control_dir=control,
        env=coordinator_env(),
        trace=trace,
        timeout_s=1800,
    )
    if done.returncode != 0:
        raise SystemExit(f"cuinterpose {command} failed: {done.stderr}")
    return done


def run(size: int, driver: str, work: Path, log: Any) -> dict[str, Any]:
    control = launch.ensure_control_dir(work / "control")
    ckpt = work / "checkpoint"
    ckpt.mkdir()
    base = coordinator_env()
    if driver == "sim":
        base["CUINTERPOSE_SIM_NAMESPACE"] = f"bench-{os.getpid()}"
    shim = launch.launch_env(driver=driver, control_dir=control, base=base)
    plain = launch.launch_env(driver=driver, control_dir=control, base=base, preload_shim=False)
    workers: list[Worker] = []

    def spawn(name: str, env: dict[str, str]) -> Worker:
        w = Worker(name, env, log_dir=work, timeout_s=1800.0)
        workers.append(w)
        return w

    out: dict[str, Any] = {"bytes": size, "driver": driver}
    try:
        log(f"expected digest of {size / 2**30:.2f} GiB ...")
        expect = pattern_digest(SEED, size)

        # 1. cuinterpose ----------------------------------------------------------
        creator, importer = spawn("creator", shim), spawn("importer", shim)
        out["device"] = creator.check("device")
        t = time.perf_counter()
        handle, va = creator.create_mapped(size, seed=SEED)
        log(f"filled in {time.perf_counter() - t:.2f} s")
        fd = int(creator.check("export", handle=handle)["fd"])
        imported = int(
            importer.check("import", fd=creator.send_fd_to(importer, fd, close=True))["handle"]
        )
        iva = importer.map_at_new_va(imported, size)
        pids = [creator.pid, importer.pid]

        prep = _coordinate("prepare", pids, ckpt, control, work / "capture.jsonl")
        ck = native_calls.run_in_subprocess("checkpoint-all", pids, env=plain, timeout_s=1800)
        rs = native_calls.run_in_subprocess("restore-all", pids, env=plain, timeout_s=1800)
        rest = _coordinate("restore", pids, ckpt, control, work / "restore.jsonl")
        ok = creator.digest(va, size) == expect and importer.digest(iva, size) == expect
        save, load = (
            _event(prep.events, "SAVE_ALLOCATIONS"),
            _event(rest.events, "LOAD_ALLOCATIONS"),
        )
        out["cuinterpose"] = {
            "verified": ok,
            "save_gbps": save.get("gb_per_s"),
            "save_copy_gbps": save.get("copy_gb_per_s"),
            "save_s": save.get("elapsed_s"),
            "load_gbps": load.get("gb_per_s"),
            "load_copy_gbps": load.get("copy_gb_per_s"),
            "load_s": load.get("elapsed_s"),
            "prepare_s": prep.seconds,
            "restore_cli_s": rest.seconds,
            "native_checkpoint": ck["timings"],
            "native_restore": rs["timings"],
        }
        for w in (creator, importer):
            w.close()

        # 2. native only: creator keeps its allocation, FD exported, nothing shared --
        alone = spawn("native-only", plain)
        handle, va = alone.create_mapped(size, seed=SEED)
        held_fd = int(alone.check("export", handle=handle)["fd"])
        in_child = native_calls.run_in_subprocess
        nck = in_child("checkpoint-all", [alone.pid], env=plain, timeout_s=1800)
        nrs = in_child("restore-all", [alone.pid], env=plain, timeout_s=1800)
        nck_s = float(nck["timings"]["second_s"])
        nrs_s = float(nrs["timings"]["first_s"])
        out["native"] = {
            "verified": alone.digest(va, size) == expect,
            "checkpoint_s": nck_s,
            "restore_s": nrs_s,
            "checkpoint_gbps": _gbps(size, nck_s),
            "restore_gbps": _gbps(size, nrs_s),
        }
        alone.check("close", fd=held_fd)

        # 3. copy ceiling ------------------------------------------------------------
        copy = alone.check("host_copy", va=va, size=size)
        out["copy"] = {k: copy[k] for k in ("dtoh_s", "htod_s", "dtoh_gbps", "htod_gbps")}
        alone.close()
    finally:
        for w in workers:
            w.kill()
        if driver == "sim":
            Path(f"/dev/shm/cuinterpose-sim-{os.getuid()}-bench-{os.getpid()}").unlink(
                missing_ok=True
            )

    c, n, cp = out["cuinterpose"], out["native"], out["copy"]
    save_gbps = float(c["save_gbps"] or float("nan"))
    load_gbps = float(c["load_gbps"] or float("nan"))
    ck_total = c["prepare_s"] + c["native_checkpoint"]["total_s"]
    rs_total = c["native_restore"]["total_s"] + c["restore_cli_s"]
    out["ratios"] = {
        "save_vs_native_checkpoint": _ratio(save_gbps, n["checkpoint_gbps"]),
        "load_vs_native_restore": _ratio(load_gbps, n["restore_gbps"]),
        "save_vs_copy_dtoh": _ratio(save_gbps, cp["dtoh_gbps"]),
        "load_vs_copy_htod": _ratio(load_gbps, cp["htod_gbps"]),
        "checkpoint_total_s_cuinterpose": ck_total,
        "checkpoint_total_s_native": n["checkpoint_s"],
        "restore_total_s_cuinterpose": rs_total,
        "restore_total_s_native": n["restore_s"],
    }
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--gib", type=float, default=float(os.environ.get("CUINTERPOSE_BENCH_GIB", "4"))
    )
    parser.add_argument("--mib", type=int, default=0, help="size in MiB (overrides --gib)")
    parser.add_argument("--driver", choices=launch.DRIVERS, default="system")
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    parser.add_argument("--keep", type=Path, help="copy the traces and worker logs here")
    args = parser.parse_args()
    gran = 2 << 20
    size = (args.mib << 20) if args.mib else int(args.gib * (1 << 30))
    size = max(gran, size // gran * gran)

    def log(text: str) -> None:
        print(f"[bench] {text}", file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory(prefix="cip-bench-") as tmp:
        result = run(size, args.driver, Path(tmp), log)
        if args.keep:
            args.keep.mkdir(parents=True, exist_ok=True)
            for f in Path(tmp).glob("*.jsonl"):
                shutil.copy(f, args.keep / f"bench-{f.name}")
            for f in Path(tmp).glob("*.stderr"):
                shutil.copy(f, args.keep / f"bench-{f.name}")
    c, n, cp, r = result["cuinterpose"], result["native"], result["copy"], result["ratios"]
    dev = result["device"]
    print(
        f"device: {dev['name']} (driver {dev['driver_version']}), "
        f"{size / 2**30:.2f} GiB shared by 2 processes"
    )
    print(
        f"cuinterpose SAVE {_f(c['save_gbps'])} GB/s (copy {_f(c['save_copy_gbps'])}), "
        f"LOAD {_f(c['load_gbps'])} GB/s (copy {_f(c['load_copy_gbps'])}); verified {c['verified']}"
    )
    print(
        f"native      checkpoint {_f(n['checkpoint_gbps'])} GB/s ({n['checkpoint_s']:.3f} s), "
        f"restore {_f(n['restore_gbps'])} GB/s ({n['restore_s']:.3f} s); verified {n['verified']}"
    )
    print(f"copy        DtoH {_f(cp['dtoh_gbps'])} GB/s, HtoD {_f(cp['htod_gbps'])} GB/s (pinned)")
    print(
        f"ratios      SAVE/native {_f(r['save_vs_native_checkpoint'])}x, "
        f"LOAD/native {_f(r['load_vs_native_restore'])}x, SAVE/DtoH {_f(r['save_vs_copy_dtoh'])}, "
        f"LOAD/HtoD {_f(r['load_vs_copy_htod'])}"
    )
    print(
        f"totals      checkpoint {r['checkpoint_total_s_cuinterpose']:.3f} s with cuinterpose vs "
        f"{r['checkpoint_total_s_native']:.3f} s native; restore "
        f"{r['restore_total_s_cuinterpose']:.3f} s vs {r['restore_total_s_native']:.3f} s"
    )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
    return 0 if c["verified"] and n["verified"] else 1


if __name__ == "__main__":
    sys.exit(main())
