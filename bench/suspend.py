"""One-command suspend/resume of a creator/importer group, next to the native checkpoint.

On a real GPU (``--driver system``, the default) or the simulated driver (``--driver
sim``), through the ``cuinterpose`` command line only, as a person would run it:

1. cuinterpose: a creator shares N bytes with an importer (shim preloaded) and keeps a
   private allocation of N bytes. ``cuinterpose status``, ``cuinterpose suspend`` (capture,
   native lock and checkpoint of both), ``status`` while suspended with the GPU memory
   freed, ``cuinterpose resume`` (native restore and unlock, coordinator restore),
   ``status``; every byte verified at its VA in both processes.
2. native: one process (no shim) holding 2N bytes, the same bytes the group holds, is
   suspended and resumed with ``cuinterpose suspend --not-requested`` (the native
   checkpoint alone) and ``resume``.

Prints every step's seconds for both side by side, the GPU memory freed, and the
verification; ``--out`` writes it all as JSON. Exit status 0 only if both verified,
every status was as expected and the memory was freed. GB is 10^9 bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from cuinterpose import launch
from cuinterpose.demo import Worker, pattern_digest

SEED_SHARED = 7
SEED_PRIVATE = 8


def cli(args: list[str], env: dict[str, str], timeout_s: float = 1800) -> dict[str, Any]:
    """Run ``cuinterpose ARGS``; its JSON lines (or JSON document), exit status, stderr."""
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "cuinterpose", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"cuinterpose {args[0]} exited {done.returncode}: {done.stderr}")
    if args[0] == "status":
        return {"seconds": seconds, **json.loads(done.stdout)}
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    steps = {
        e["step"]: {"seconds": e["seconds"], "bytes": e["bytes"]}
        for e in events
        if e.get("event") == "step" and e.get("status") == "done"
    }
    return {"seconds": seconds, "steps": steps}


def states(answer: dict[str, Any]) -> list[tuple[str, str | None]]:
    return sorted({(p["native_state"], p["shim_phase"]) for p in answer["processes"]})


def run(size: int, driver: str, work: Path, log: Any) -> dict[str, Any]:
    control = launch.ensure_control_dir(work / "control")
    base = dict(os.environ)
    base.pop("LD_PRELOAD", None)
    if driver == "sim":
        base["CUINTERPOSE_SIM_NAMESPACE"] = f"suspend-{os.getpid()}"
    shim = launch.launch_env(driver=driver, control_dir=control, base=base)
    # The command line makes the native calls itself: the same driver as the workers.
    plain = launch.launch_env(driver=driver, control_dir=control, base=base, preload_shim=False)
    workers: list[Worker] = []
    out: dict[str, Any] = {"bytes_per_process": 2 * size, "driver": driver}

    def spawn(name: str, env: dict[str, str]) -> Worker:
        w = Worker(name, env, log_dir=work, timeout_s=1800.0)
        workers.append(w)
        return w

    def used(observer: Worker) -> int:
        info = observer.check("mem_info")
        return int(info["total"]) - int(info["free"])

    try:
        observer = spawn("observer", plain)
        out["device"] = observer.check("device")
        log(f"expected digests of {size / 2**30:.2f} GiB ...")
        shared, private = pattern_digest(SEED_SHARED, size), pattern_digest(SEED_PRIVATE, size)

        # 1. the group, through cuinterpose ------------------------------------------
        creator, importer = spawn("creator", shim), spawn("importer", shim)
        idle = used(observer)
        handle, va = creator.create_mapped(size, seed=SEED_SHARED)
        _, pva = creator.create_mapped(size, handle_type="none", seed=SEED_PRIVATE)
        fd = creator.send_fd_to(
            importer, int(creator.check("export", handle=handle)["fd"]), close=True
        )
        iva = importer.map_at_new_va(int(importer.check("import", fd=fd)["handle"]), size)
        filled = used(observer)
        procs = [w for p in (creator.pid, importer.pid) for w in ("--process", str(p), str(p))]
        where = ["--control-dir", str(control)]
        common = ["--checkpoint-dir", str(work / "group"), *where, *procs]
        before = cli(["status", *where, *procs, "--json"], plain)
        suspended = cli(["suspend", *common, "--progress", "json"], plain)
        freed = filled - used(observer)
        during = cli(["status", *where, *procs, "--json"], plain)
        resumed = cli(["resume", *common, "--progress", "json"], plain)
        after = cli(["status", *where, *procs, "--json"], plain)
        verified = (
            creator.digest(va, size) == shared
            and creator.digest(pva, size) == private
            and importer.digest(iva, size) == shared
        )
        out["cuinterpose"] = {
            "verified": verified,
            "gpu_bytes_in_use": filled - idle,
            "gpu_bytes_freed_while_suspended": freed,
            "status": {"before": states(before), "during": states(during), "after": states(after)},
            "suspend": suspended,
            "resume": resumed,
        }
        for w in (creator, importer):
            w.close()

        # 2. the same bytes, native checkpoint only ----------------------------------
        alone = spawn("native-only", plain)
        _, ava = alone.create_mapped(2 * size, seed=SEED_SHARED)
        expect = pattern_digest(SEED_SHARED, 2 * size)
        common = ["--checkpoint-dir", str(work / "native"), *where]
        common += ["--process", str(alone.pid), str(alone.pid)]
        nsus = cli(["suspend", *common, "--not-requested", "--progress", "json"], plain)
        nres = cli(["resume", *common, "--progress", "json"], plain)
        out["native"] = {"verified": alone.digest(ava, 2 * size) == expect}
        out["native"].update(suspend=nsus, resume=nres)
        alone.close()
        observer.close()
    finally:
        for w in workers:
            w.kill()
        if driver == "sim":
            Path(f"/dev/shm/cuinterpose-sim-{os.getuid()}-suspend-{os.getpid()}").unlink(
                missing_ok=True
            )
    return out


def _seconds(step: dict[str, Any] | None) -> str:
    return f"{step['seconds']:.3f}" if step else "-"


def report(result: dict[str, Any]) -> tuple[list[str], bool]:
    c, n = result["cuinterpose"], result["native"]
    total = result["bytes_per_process"]
    lines = [
        f"device: {result['device']['name']} (driver {result['device']['driver_version']}); "
        f"{total / 2**20:.0f} MiB per side: the group (creator {total / 2**21:.0f} MiB shared "
        f"with the importer + {total / 2**21:.0f} MiB private) vs one process natively",
        f"{'step':<32}{'cuinterpose s':>15}{'native s':>12}{'bytes copied':>16}",
    ]
    for command in ("suspend", "resume"):
        names = list(dict.fromkeys([*c[command]["steps"], *n[command]["steps"]]))
        for name in names:
            ours = c[command]["steps"].get(name)
            theirs = n[command]["steps"].get(name)
            lines.append(
                f"{command + ' ' + name:<32}{_seconds(ours):>15}{_seconds(theirs):>12}"
                f"{ours['bytes'] if ours else 0:>16,}"
            )
        lines.append(
            f"{command + ' (whole command)':<32}{c[command]['seconds']:>15.3f}"
            f"{n[command]['seconds']:>12.3f}"
        )
    freed = c["gpu_bytes_freed_while_suspended"]
    lines.append(
        f"GPU memory in use {c['gpu_bytes_in_use'] / 2**20:.1f} MiB, freed while suspended "
        f"{freed / 2**20:.1f} MiB; status before {c['status']['before']}, during "
        f"{c['status']['during']}, after {c['status']['after']}"
    )
    ok = (
        c["verified"]
        and n["verified"]
        and freed >= total
        and c["status"]["before"] == [["RUNNING", "ACTIVE"]]
        and c["status"]["during"] == [["CHECKPOINTED", "PREPARED"]]
        and c["status"]["after"] == [["RUNNING", "ACTIVE"]]
    )
    lines.append(f"verified: cuinterpose {c['verified']}, native {n['verified']}; ok {ok}")
    return lines, ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--gib", type=float, default=float(os.environ.get("CUINTERPOSE_BENCH_GIB", "2"))
    )
    parser.add_argument("--mib", type=int, default=0, help="size in MiB (overrides --gib)")
    parser.add_argument("--driver", choices=launch.DRIVERS, default="system")
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = parser.parse_args()
    gran = 2 << 20
    size = (args.mib << 20) if args.mib else int(args.gib * (1 << 30))
    size = max(gran, size // gran * gran)

    def log(text: str) -> None:
        print(f"[suspend] {text}", file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory(prefix="cip-suspend-") as tmp:
        result = run(size, args.driver, Path(tmp), log)
    # JSON turns the status tuples into lists: compare them as JSON has them.
    result = json.loads(json.dumps(result))
    lines, ok = report(result)
    print("\n".join(lines))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
