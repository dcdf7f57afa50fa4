"""SAVE/LOAD staging throughput for big and for many small allocations (issue 12).

One run, one GPU, four workloads (``--sim``: the same shapes, small):

- ``1x8GiB``: one 8 GiB allocation;
- ``100x20MiB``: 100 allocations of 20 MiB (what torch's expandable segments make);
- ``96x6MiB``: 96 allocations of 6 MiB (NCCL-sized buffers);
- ``2048x2MiB``: 2048 allocations of 2 MiB.

For each, ``--repeat`` times: a creator with the shim preloaded holds the allocations
(each filled with a pattern per MiB, exported so the shim saves it); one ``cuinterpose
suspend`` (detect, capture: SAVE_ALLOCATIONS, native lock and checkpoint) and one
``cuinterpose resume`` (native restore and unlock, coordinator restore:
LOAD_ALLOCATIONS), each a process of its own, as a user runs them; the bytes are
checked on the first repetition. Then the native path alone: a process without the
shim holding the same allocations (unshared), ``cuinterpose suspend --not-requested``
and ``cuinterpose resume`` (the native steps only, the same process start). Once per
run: the pinned DtoH/HtoD copy ceiling (one buffer of ``--ceiling-mib``).

Reported per workload, median [min, max] over the repetitions: SAVE and LOAD end to end
(the shim's op, GB/s) and their copy GB/s; the shim's breakdown (SNAPSHOT_SHIM_TIMING:
pool start, setup, population, registration, copy, unregistration, release); each
command's total wall time and its steps (the process start, interpreter and imports,
is the total less the steps) against the native path alone; the coordinator's own
share (its capture or restore step outside the shim's SAVE/LOAD over the command's
total). With ``--variant keep:SNAPSHOT_SHIM_KEEP_HOST_COPY=1`` (issue 47) the group waits until
``cuinterpose status`` says the kept host copies are pinned (the time is reported), and
with ``--rewrite-mib N`` rewrites N MiB before each suspend after the first; each SAVE's
bytes copied and left unchanged, and its hash, are reported. GB is 10^9 bytes. Each
workload's lines go to stdout, and ``--out`` (the JSON) is
rewritten, as soon as that workload is done: a run cut short keeps the ones finished.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from cuinterpose import launch
from cuinterpose.demo import CliRun, Worker, coordinator_env

MIB = 1 << 20
GIB = 1 << 30
WORKLOADS = {
    "1x8GiB": (1, 8 * GIB),
    "100x20MiB": (100, 20 * MIB),  # torch's expandable segments map 20 MiB pieces
    "96x6MiB": (96, 6 * MIB),
    "2048x2MiB": (2048, 2 * MIB),
}
# Where the staging threads' time goes (the timing line's thread_s).
THREAD_PARTS = ("populate", "register", "copy", "unregister", "release", "memcpy", "stream")
SIM_WORKLOADS = {"1x32MiB": (1, 32 * MIB), "12x6MiB": (12, 6 * MIB), "48x2MiB": (48, 2 * MIB)}

# Runs in the worker (``exec``): allocations of SIZE bytes, COUNT of them, each MiB
# filled with a value of its own (cuMemsetD32), exported (a capability: the shim saves
# it) unless UNSHARED. CHECK() reads everything back and counts wrong MiBs.
SETUP = r"""
import ctypes, struct
POSIX = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
def _prop():
    p = cu.CUmemAllocationProp()
    p.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    p.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    p.location.id = 0
    p.requestedHandleTypes = POSIX
    return p
GEN = {}  # (allocation, MiB) -> how many times REWRITE changed it
def _value(k, mib):
    base = (0x9E3779B1 * (k + 1) + 0x85EBCA77 * (mib + 1)) & 0xFFFFFFFF
    return base ^ ((0x5BD1E995 * GEN.get((k, mib), 0)) & 0xFFFFFFFF)
def REWRITE(nmib):
    # the next `nmib` MiB (cycling through every allocation's MiBs) take new values
    global NEXT
    n = 0
    while n < nmib:
        k, mib = NEXT
        GEN[(k, mib)] = GEN.get((k, mib), 0) + 1
        check(cu.cuMemsetD32(A[k][1] + (mib << 20), _value(k, mib), 1 << 18))
        NEXT = (k, mib + 1) if mib + 1 < SIZE >> 20 else ((k + 1) % len(A), 0)
        n += 1
    check(cu.cuCtxSynchronize())
    return n << 20
NEXT = (0, 0)
A = []
for k in range(COUNT):
    h = check(cu.cuMemCreate(SIZE, _prop(), 0))
    va = int(check(cu.cuMemAddressReserve(SIZE, 0, 0, 0)))
    check(cu.cuMemMap(va, SIZE, 0, h, 0))
    d = cu.CUmemAccessDesc()
    d.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    d.location.id = 0
    d.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    check(cu.cuMemSetAccess(va, SIZE, [d], 1))
    for mib in range(SIZE >> 20):
        check(cu.cuMemsetD32(va + (mib << 20), _value(k, mib), 1 << 18))
    if not UNSHARED:
        os.close(int(check(cu.cuMemExportToShareableHandle(h, POSIX, 0))))
    A.append((h, va))
check(cu.cuCtxSynchronize())
def CHECK():
    buf = (ctypes.c_char * (64 << 20))()
    bad = 0
    for k, (h, va) in enumerate(A):
        for off in range(0, SIZE, 64 << 20):
            n = min(64 << 20, SIZE - off)
            check(cu.cuMemcpyDtoH(ctypes.addressof(buf), va + off, n))
            raw = bytes(memoryview(buf)[:n])
            for m in range(n >> 20):
                mib = (off >> 20) + m
                want = struct.pack("<I", _value(k, mib)) * (1 << 18)
                bad += raw[m << 20 : (m + 1) << 20] != want
    return bad
result = len(A)
"""


def _stats(values: Sequence[float]) -> dict[str, float]:
    vals = [v for v in values if v == v]
    if not vals:
        return {"median": float("nan"), "min": float("nan"), "max": float("nan"), "n": 0}
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "n": len(vals)}


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("nan")


def _done(run: CliRun) -> float:
    """The machine's own elapsed time (the ``done`` event): the CLI's wall time less
    the interpreter's start and imports."""
    for event in run.events:
        if event.get("event") == "done":
            return float(event["elapsed_s"])
    raise SystemExit(f"no done event in {run.events}")


def _timing_lines(text: str) -> list[dict[str, Any]]:
    out = []
    for line in text.splitlines():
        if line.startswith("cuinterpose-timing "):
            out.append(json.loads(line.split(" ", 1)[1]))
    return out


class Bench:
    def __init__(
        self,
        driver: str,
        work: Path,
        log: Callable[[str], None],
        repeat: int,
        native_repeat: int | None = None,
        load_floor_repeat: int = 3,
        rewrite_mib: int = 0,
    ):
        self.driver, self.work, self.log, self.repeat = driver, work, log, repeat
        self.load_floor_repeat = load_floor_repeat
        self.rewrite_mib = rewrite_mib
        self.native_repeat = repeat if native_repeat is None else native_repeat
        self.control = launch.ensure_control_dir(work / "control")
        base = coordinator_env()
        if driver == "sim":
            base["CUINTERPOSE_SIM_NAMESPACE"] = f"bench-{os.getpid()}"
        base["SNAPSHOT_SHIM_TIMING"] = "1"
        self.base = base
        self.shim = launch.launch_env(driver=driver, control_dir=self.control, base=base)
        self.plain = launch.launch_env(
            driver=driver, control_dir=self.control, base=base, preload_shim=False
        )
        self.workers: list[Worker] = []

    def spawn(self, name: str, env: dict[str, str]) -> Worker:
        w = Worker(name, env, log_dir=self.work, timeout_s=1800.0)
        self.workers.append(w)
        return w

    def cli(self, command: str, pid: int, tag: str, *extra: str) -> CliRun:
        """One ``cuinterpose suspend|resume`` for ``pid``, as a user runs it; its
        JSON events (steps, phases, summary)."""
        argv = [sys.executable, "-m", "cuinterpose", command, "--checkpoint-dir"]
        argv += [str(self.work / f"ckpt-{tag}"), "--control-dir", str(self.control)]
        argv += ["--process", str(pid), str(pid), "--progress", "json", *extra]
        start = time.perf_counter()
        # The command makes the native calls itself: the workers' driver, no shim.
        proc = subprocess.run(
            argv,
            env=coordinator_env(self.plain),
            capture_output=True,
            text=True,
            timeout=1800,
            check=False,
        )
        seconds = time.perf_counter() - start
        if proc.returncode != 0:
            raise SystemExit(f"cuinterpose {command} {' '.join(extra)} failed: {proc.stderr}")
        events = tuple(json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{"))
        return CliRun(proc.returncode, events, proc.stderr, seconds)

    def ceiling(self, size: int) -> dict[str, Any]:
        w = self.spawn("ceiling", self.plain)
        _, va = w.create_mapped(size)
        runs = [w.check("host_copy", va=va, size=size) for _ in range(3)]
        w.close()
        return {
            "bytes": size,
            "dtoh_gbps": _stats([r["dtoh_gbps"] for r in runs]),
            "htod_gbps": _stats([r["htod_gbps"] for r in runs]),
        }

    def pinned(self, pid: int, count: int) -> float:
        """SNAPSHOT_SHIM_KEEP_HOST_COPY: seconds until ``cuinterpose status`` says the
        shim pinned the kept host copies of all ``count`` allocations (in the background,
        while the application runs), so that the first suspend finds them made."""
        start = time.perf_counter()
        argv = [sys.executable, "-m", "cuinterpose", "status", "--control-dir",
                str(self.control), "--process", str(pid), str(pid), "--json"]  # fmt: skip
        while True:
            proc = subprocess.run(
                argv, env=coordinator_env(self.plain), capture_output=True, text=True,
                timeout=120, check=False,
            )  # fmt: skip
            rows = json.loads(proc.stdout)["processes"] if proc.returncode == 0 else []
            held = rows[0].get("host_copy") if rows else None
            if held and held["copies"] >= count:
                return time.perf_counter() - start
            if time.perf_counter() - start > 1800:
                raise SystemExit(f"the kept host copies were not pinned in 30 min: {held}")
            time.sleep(0.2)

    def setup(self, w: Worker, count: int, size: int, unshared: bool) -> None:
        t = time.perf_counter()
        code = f"COUNT, SIZE, UNSHARED = {count}, {size}, {unshared}\n" + SETUP
        w.send(code)
        assert w.reply(timeout_s=1800) == count
        took = time.perf_counter() - t
        self.log(f"  {w.name}: {count} x {size >> 20} MiB filled in {took:.2f} s")

    def group(self, name: str, count: int, size: int, extra: dict[str, str]) -> dict[str, Any]:
        """The creator under the shim (with ``extra`` in its environment): ``--repeat``
        one-command suspends and resumes, the shim's figures, the bytes checked."""
        total = count * size
        creator = self.spawn(f"creator-{name}", {**self.shim, **extra})
        self.setup(creator, count, size, unshared=False)
        kept = extra.get("SNAPSHOT_SHIM_KEEP_HOST_COPY") == "1"
        pinned_s = self.pinned(creator.pid, count) if kept else None
        if pinned_s is not None:
            self.log(f"  kept host copies pinned {pinned_s:.2f} s after the setup")
        rewritten: list[int] = []
        reps: list[dict[str, Any]] = []
        verified = None
        for i in range(self.repeat):
            tag = f"{name}-{i}"
            if kept and self.rewrite_mib and i > 0:
                creator.send(f"result = REWRITE({self.rewrite_mib})")
                rewritten.append(int(creator.reply(timeout_s=1800)))
            sus = self.cli("suspend", creator.pid, tag)
            res = self.cli("resume", creator.pid, tag)
            # The first cycle checked; with rewrites the last one too (what SAVE left
            # must still be right after the copies were changed and left again).
            last = i == self.repeat - 1 and bool(rewritten)
            if (i == 0 or last) and verified is not False:
                creator.send("result = CHECK()")
                bad = creator.reply(timeout_s=1800)
                verified = bad == 0
                self.log(f"  verified: {verified} ({bad} MiB wrong)")
            reps.append({"suspend": _command(sus), "resume": _command(res)})
        creator.close()
        timing = _timing_lines(creator.stderr_text())
        saves = [t for t in timing if t["op"] == "SAVE_ALLOCATIONS"]
        loads = [t for t in timing if t["op"] == "LOAD_ALLOCATIONS"]
        if len(saves) != self.repeat or len(loads) != self.repeat:
            raise SystemExit(f"{name}: expected {self.repeat} timing lines per op: {timing}")

        def per(op: list[dict[str, Any]], key: str) -> dict[str, float]:
            return _stats([float(t[key]) for t in op])

        def thread(op: list[dict[str, Any]], key: str) -> dict[str, float]:
            return _stats([float(t["thread_s"].get(key, 0.0)) for t in op])

        out: dict[str, Any] = {
            "settings": extra,
            "verified": verified,
            "threads": saves[0]["threads"],
            "chunk": saves[0]["chunk"],
            "thp": saves[0]["thp"],
            "bounce": saves[0]["bounce"],
            "depth": saves[0].get("depth"),
            "populate_threads": saves[0].get("populate_threads"),
            "chunks_per_thread": saves[0].get("chunks_per_thread"),
            "populate_method": saves[0].get("populate_method"),
            "populated_ahead": [t.get("populated_ahead") for t in saves],
            "resident": [bool(t["resident"]) for t in saves],
            # The kept host copy (SNAPSHOT_SHIM_KEEP_HOST_COPY): when it was pinned, what
            # each SAVE copied and left, its hash (state, seconds, why not), the bytes
            # rewritten before each suspend after the first.
            "kept": kept,
            "pinned_after_s": pinned_s,
            "rewritten_bytes": rewritten,
            "bytes_copied": [t.get("bytes_copied") for t in saves],
            "bytes_unchanged": [t.get("bytes_unchanged") for t in saves],
            "hash": [t.get("hash") for t in saves],
            "hash_s": [t.get("hash_s") for t in saves],
            "hash_why": [t.get("hash_why") for t in saves if t.get("hash_why")],
            # LOAD's staged copies freed on a thread of the shim's after the reply (none:
            # inside the op, its thread-s "release").
            "released_after_s": [
                float(t["elapsed_s"]) for t in timing if t["op"] == "LOAD_ALLOCATIONS/release"
            ],
        }
        for label, ops in (("save", saves), ("load", loads)):
            warm = ops[1:] or ops  # the first op of the process on its own
            out[label] = {
                "cold_gbps": _gbps(total, float(ops[0]["elapsed_s"])),
                "warm_gbps": _stats([_gbps(total, float(t["elapsed_s"])) for t in warm]),
                "elapsed_s": per(ops, "elapsed_s"),
                "gbps": _stats([_gbps(total, float(t["elapsed_s"])) for t in ops]),
                "copy_gbps": _stats([_gbps(total, float(t["copy_wall_s"])) for t in ops]),
                "breakdown_s": {
                    "pool_start": per(ops, "pool_start_s"),
                    "setup": per(ops, "setup_s"),
                    "drain": per(ops, "drain_s"),
                    "teardown": per(ops, "teardown_s"),
                    "copy_wall": per(ops, "copy_wall_s"),
                    # LOAD's setup: its driver calls (cuMemCreate; cuMemMap and
                    # cuMemSetAccess), against load_floor's bare re-creation.
                    "create": per(ops, "create_s"),
                    "map": per(ops, "map_s"),
                },
                "thread_s": {k: thread(ops, k) for k in THREAD_PARTS},
                "chunks": ops[0]["chunks"],
            }
        out["cuinterpose"] = _commands(reps)
        # The coordinator's own share of each total: its capture/restore step outside
        # the shim's SAVE/LOAD op. The process start and detect (the same for the
        # native path alone) are reported apart, in the totals.
        out["engine_share"] = {
            "suspend": _stats(
                [
                    (r["suspend"]["steps"]["capture"] - float(s["elapsed_s"]))
                    / r["suspend"]["seconds"]
                    for r, s in zip(reps, saves, strict=True)
                ]
            ),
            "resume": _stats(
                [
                    (r["resume"]["steps"]["coordinator_restore"] - float(ld["elapsed_s"]))
                    / r["resume"]["seconds"]
                    for r, ld in zip(reps, loads, strict=True)
                ]
            ),
        }
        # Split: the exchanges of the other phases (the shims' work: INSPECT, teardown
        # of the allocations at PREPARE_UNICAST, ...) and the engine alone (the step
        # outside every exchange: validation, topology, state file, the machine).
        step_of = {"suspend": "capture", "resume": "coordinator_restore"}
        out["engine_alone_share"] = {
            command: _stats(
                [
                    (r[command]["steps"][step] - sum(r[command]["phases"].values()))
                    / r[command]["seconds"]
                    for r in reps
                ]
            )
            for command, step in step_of.items()
        }
        out["phases_s"] = {
            command: {
                p: _stats([float(r[command]["phases"].get(p, 0.0)) for r in reps])
                for p in reps[0][command]["phases"]
            }
            for command in step_of
        }
        out["repetitions"] = reps
        return out

    def workload(
        self, name: str, count: int, size: int, variants: dict[str, dict[str, str]]
    ) -> dict[str, Any]:
        """The group once per variant of the shim's settings, then the native path
        alone; the first variant's figures also at the top level."""
        total = count * size
        self.log(f"{name}: {count} x {size >> 20} MiB = {total / GIB:.2f} GiB")
        groups = {}
        for vname, extra in variants.items():
            self.log(f"  variant {vname}: {extra or 'defaults'}")
            groups[vname] = self.group(f"{name}-{vname}", count, size, extra)

        nat: list[dict[str, Any]] = []
        native_ok = True  # --native-repeat 0: not run (its figures are NaN)
        if self.native_repeat:
            alone = self.spawn(f"native-{name}", self.plain)
            self.setup(alone, count, size, unshared=True)
            for i in range(self.native_repeat):
                tag = f"native-{name}-{i}"
                sus = self.cli("suspend", alone.pid, tag, "--not-requested")
                res = self.cli("resume", alone.pid, tag)
                nat.append({"suspend": _command(sus), "resume": _command(res)})
            alone.send("result = CHECK()")
            native_ok = alone.reply(timeout_s=1800) == 0
            alone.close()
        first = next(iter(groups.values()))
        return {
            "allocations": count,
            "allocation_bytes": size,
            "bytes": total,
            **first,
            "load_floor": load_floor(count, size, self.load_floor_repeat, self.plain, self.log),
            "load_floor_staged": load_floor(
                count, size, self.load_floor_repeat, self.plain, self.log, "staged"
            ),
            "load_floor_piped": load_floor(
                count, size, self.load_floor_repeat, self.plain, self.log, "piped"
            ),
            "native_verified": native_ok,
            "native_alone": _commands(nat),
            "native_repetitions": nat,
            "variants": groups,
        }


def load_floor(
    count: int,
    size: int,
    repeat: int,
    env: dict[str, str],
    log: Callable[[str], None],
    source: str = "pinned",
) -> dict[str, Any] | None:
    """bench/load_floor.py for one shape, in a process of its own without the shim: the
    driver re-creating the allocations while their bytes are copied in from pinned
    memory (``source`` "staged": memcpy'd out of staged memory into two 4 MiB pieces of
    each copy thread's pinned buffer, the shim's default bounce design; "piped": the same
    with each thread's pipeline running across its units), with 4, 8 and as
    many copy threads as the shim's (the fastest is the floor). None with ``repeat`` 0."""
    if repeat <= 0:
        return None
    most = min(16, os.cpu_count() or 1)  # the shim's default (settings.c)
    threads = sorted({t for t in (4, 8, most) if t <= most})
    argv = [sys.executable, str(Path(__file__).with_name("load_floor.py")), "--count", str(count)]
    argv += ["--mib", str(size >> 20), "--threads", *map(str, threads), "--repeat", str(repeat)]
    argv += ["--source", source] + (["--piece-mib", "4"] if source != "pinned" else [])
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"bench/load_floor.py failed ({proc.returncode}): {proc.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(proc.stdout)
    log(
        f"  LOAD floor ({source}): re-create {result['recreate_s']['median']:.4f} s, copy "
        f"{result['copy_s']['median']:.4f} s, both at once {result['overlap_s']['median']:.4f}"
        f" s ({result['overlap_gbps']:.1f} GB/s)"
    )
    return result


def floor(gib: float, sim: bool, log: Callable[[str], None]) -> dict[str, Any] | None:
    """bench/floor.py in a process of its own (medians of 3), before any workload."""
    if gib <= 0:
        return None
    argv = [sys.executable, str(Path(__file__).with_name("floor.py")), "--gib", str(gib)]
    argv += ["--repeat", "3"] + (["--no-gpu"] if sim else [])
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)
    for line in proc.stderr.splitlines():
        log(line)
    if proc.returncode != 0:
        raise SystemExit(f"bench/floor.py failed ({proc.returncode}): {proc.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(proc.stdout)
    return result


STEPS = {
    "suspend": ("detect", "capture", "native_lock", "native_checkpoint"),
    "resume": ("native_restore", "native_unlock", "coordinator_restore"),
}


def _commands(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median [min, max] of each command's total, process start and steps."""

    def cmd(command: str, key: str) -> dict[str, float]:
        return _stats([float(r[command][key]) for r in runs])

    def step(command: str, name: str) -> dict[str, float]:
        return _stats([float(r[command]["steps"].get(name, 0.0)) for r in runs])

    return {
        command: {
            "total_s": cmd(command, "seconds"),
            "process_start_s": cmd(command, "process_start_s"),
            "steps_s": {n: step(command, n) for n in names},
        }
        for command, names in STEPS.items()
    }


def _command(run: CliRun) -> dict[str, Any]:
    """A command's wall time, its steps' seconds, and the rest: the process start
    (interpreter, imports) and the exit."""
    steps = {
        str(e["step"]): float(e["seconds"])
        for e in run.events
        if e.get("event") == "step" and e.get("status") == "done"
    }
    phases: dict[str, float] = {}
    for e in run.events:
        if e.get("event") == "phase":  # the exchange: requests out, every reply in
            key = str(e["phase"])
            phases[key] = phases.get(key, 0.0) + float(e["elapsed_s"])
    return {
        "seconds": run.seconds,
        "steps": steps,
        "phases": phases,
        "process_start_s": run.seconds - sum(steps.values()),
    }


def _m(s: dict[str, float], fmt: str = "{:.3f}") -> str:
    return (fmt + " [" + fmt + ", " + fmt + "]").format(s["median"], s["min"], s["max"])


def save_reference(dtoh: float, floor: dict[str, Any] | None) -> tuple[float, str]:
    """What SAVE is held against: min(DtoH ceiling, the host's best floor), and which."""
    best = float(floor["best"]["gbps"]) if floor else float("nan")
    if best == best and best < dtoh:
        return best, f"the host's floor ({floor['best']['case'] if floor else ''})"
    return dtoh, "the DtoH ceiling"


def report_head(result: dict[str, Any], out: Callable[[str], None]) -> None:
    """The device, the ceiling, the floor and what SAVE is held against."""
    ceil = result["ceiling"]
    dtoh = ceil["dtoh_gbps"]["median"]
    out(f"device: {result['device']}; driver {result['driver_version']}")
    out(
        f"ceiling (pinned, {ceil['bytes'] >> 20} MiB): DtoH {_m(ceil['dtoh_gbps'], '{:.1f}')} GB/s,"
        f" HtoD {_m(ceil['htod_gbps'], '{:.1f}')} GB/s"
    )
    fl = result.get("floor")
    if fl:
        cases = ", ".join(f"{k} {v:.1f}" for k, v in fl.items() if isinstance(v, float) and v == v)
        out(f"floor (GB/s, fresh memory, {fl['bytes'] >> 20} MiB per case): {cases}")
    ref, limit = save_reference(dtoh, fl)
    out(f"SAVE is held against {ref:.1f} GB/s: {limit} limits")


def report_workload(
    result: dict[str, Any], name: str, wl: dict[str, Any], out: Callable[[str], None]
) -> None:
    """One shape's lines, every variant of it."""
    ceil = result["ceiling"]
    dtoh, htod = ceil["dtoh_gbps"]["median"], ceil["htod_gbps"]["median"]
    ref, _ = save_reference(dtoh, result.get("floor"))
    # The floor of the bounce path itself: memcpy into fresh pages, which the kernel
    # zeroes first (a populating floor writes each byte once, SAVE twice).
    copying = float((result.get("floor") or {}).get("best_memcpy", float("nan")))
    out(f"== {name}: {wl['bytes'] / GIB:.2f} GiB; native verified {wl['native_verified']}")
    lf = wl.get("load_floor")
    load_ref = (htod, "HtoD")
    if lf:
        out(
            f"  LOAD floor (the driver alone, the best of "
            f"{'/'.join(lf['by_threads'])} copy threads from pinned "
            f"memory: {lf['threads']}):"
            f" re-create {lf['recreate_s']['median']:.4f} s ({lf['recreate_us_per_allocation']:.0f}"
            f" us each), copy {lf['copy_s']['median']:.4f} s ({lf['copy_gbps']:.1f} GB/s), both"
            f" at once {lf['overlap_s']['median']:.4f} s ({lf['overlap_gbps']:.1f} GB/s, "
            f"{lf['overlap_gbps'] / htod:.2f} of HtoD)"
        )
        if lf["overlap_gbps"] < load_ref[0]:
            load_ref = (lf["overlap_gbps"], "the driver's LOAD floor")
    bounce = wl.get("load_floor_staged")
    piped = wl.get("load_floor_piped")
    if bounce:
        out(
            f"  LOAD floor through bounce buffers (staged memory memcpy'd into two 4 MiB "
            f"pieces per copy thread, no shim; the best of {'/'.join(bounce['by_threads'])}: "
            f"{bounce['threads']}; units of {bounce['unit'] >> 20} MiB): the memcpy alone "
            f"{bounce['memcpy_s']['median']:.4f} s ({bounce['memcpy_gbps']:.1f} GB/s), memcpy "
            f"and copy {bounce['copy_s']['median']:.4f} s ({bounce['copy_gbps']:.1f} GB/s), and"
            f" with the re-creation {bounce['overlap_s']['median']:.4f}"
            f" s ({bounce['overlap_gbps']:.1f} GB/s, {bounce['overlap_gbps'] / htod:.2f} of HtoD)"
        )
    if piped:
        out(
            f"  LOAD floor through bounce buffers piped (each thread's pipeline across its "
            f"units; the best of {'/'.join(piped['by_threads'])}: {piped['threads']}): memcpy "
            f"and copy {piped['copy_s']['median']:.4f} s ({piped['copy_gbps']:.1f} GB/s), and"
            f" with the re-creation {piped['overlap_s']['median']:.4f} s "
            f"({piped['overlap_gbps']:.1f} GB/s, {piped['overlap_gbps'] / htod:.2f} of HtoD)"
        )
    # The bounce floor is the better of the two: the best the design allows.
    bounce_floor = max((f["overlap_gbps"] for f in (bounce, piped) if f), default=float("nan"))
    # Shown, not taken for a floor: from Python threads it varied from 30 to 54 GB/s (16
    # threads) and LOAD of 8 GiB beat it (one H200, 2026-12-02, commit c53ba93).
    host = float((result.get("floor") or {}).get("best_load_memcpy", float("nan")))
    if host == host:
        out(f"  the host's memcpy out of resident memory into 8 MiB buffers: {host:.1f} GB/s")
    for vname, w in wl["variants"].items():
        _report_group(
            f"{name} {vname}",
            w,
            wl["native_alone"],
            (dtoh, ref, copying),
            (htod, *load_ref, bounce_floor),
            out,
        )


def _report_group(
    title: str,
    w: dict[str, Any],
    native: dict[str, Any],
    save_refs: tuple[float, float, float],
    load_refs: tuple[float, float, str, float],
    out: Callable[[str], None],
) -> None:
    s, ld = w["save"], w["load"]
    dtoh, ref, copying = save_refs
    htod, load_ref, load_limit, bounce_floor = load_refs
    extra = " ".join(f"{k}={v}" for k, v in w["settings"].items()) or "defaults"
    out(
        f"-- {title} ({extra}): {w['threads']} threads, chunk {w['chunk'] >> 20} MiB, thp "
        f"{w['thp']}, bounce {w['bounce'] >> 20} MiB, SAVE into resident memory "
        f"{w['resident']}, verified {w['verified']}"
    )
    out(
        f"  depth {w.get('depth')}, populate threads {w.get('populate_threads')} (pages "
        f"faulted in by {w.get('populate_method')}, chunks populated ahead per SAVE "
        f"{w.get('populated_ahead')}), chunks per thread {w.get('chunks_per_thread')}"
    )
    sw, lw = s["warm_gbps"]["median"], ld["warm_gbps"]["median"]
    out(
        f"  SAVE warm {_m(s['warm_gbps'], '{:.1f}')} GB/s ({sw / dtoh:.2f} of DtoH, "
        f"{sw / ref:.2f} of min(ceiling, floor), {sw / copying:.2f} of the memcpy floor); "
        f"cold {s['cold_gbps']:.1f} "
        f"({s['cold_gbps'] / dtoh:.2f} of DtoH); copy {_m(s['copy_gbps'], '{:.1f}')} GB/s, "
        f"{s['chunks']} chunks"
    )
    out(
        f"  LOAD warm {_m(ld['warm_gbps'], '{:.1f}')} GB/s ({lw / htod:.2f} of HtoD, "
        f"{lw / load_ref:.2f} of min(HtoD, LOAD floor): {load_limit} limits"
        + (f"; {lw / bounce_floor:.2f} of the bounce floor" if bounce_floor == bounce_floor else "")
        + "); cold "
        f"{ld['cold_gbps']:.1f} ({ld['cold_gbps'] / htod:.2f}); copy "
        f"{_m(ld['copy_gbps'], '{:.1f}')} GB/s, {ld['chunks']} chunks; staged copies freed "
        + (
            "after the reply in " + ", ".join(f"{x:.4f}" for x in w["released_after_s"]) + " s"
            if w.get("released_after_s")
            else "never: kept"
            if w.get("kept")
            else "inside the op"
        )
    )
    if w.get("kept"):
        # Per SAVE, in order: the first copies every byte, the unchanged ones nothing,
        # those after a rewrite what was rewritten; its GB/s counts the bytes it holds
        # (copied or found unchanged) over the op, the ceiling's terms for "at the DMA
        # ceiling"; the hash's share.
        out(
            f"  kept host copies pinned {w['pinned_after_s']:.2f} s after the setup; SAVE "
            f"copied {[c >> 20 for c in w['bytes_copied']]} MiB, left "
            f"{[u >> 20 for u in w['bytes_unchanged']]} MiB (rewritten before each: "
            f"{[r >> 20 for r in w['rewritten_bytes']]} MiB), hash {w['hash']} in "
            f"{[round(float(h), 4) for h in w['hash_s']]} s"
            + (f"; why not hashed: {w['hash_why']}" if w["hash_why"] else "")
        )
    for label, op in (("SAVE", s), ("LOAD", ld)):
        b, t = op["breakdown_s"], op["thread_s"]
        out(
            f"  {label} s: elapsed {op['elapsed_s']['median']:.4f} = pool start "
            f"{b['pool_start']['median']:.4f} + setup {b['setup']['median']:.4f} + drain "
            f"{b['drain']['median']:.4f} + teardown {b['teardown']['median']:.4f}; copy wall "
            f"{b['copy_wall']['median']:.4f}; thread-s populate {t['populate']['median']:.3f}"
            f" register {t['register']['median']:.3f} copy {t['copy']['median']:.3f} "
            f"unregister {t['unregister']['median']:.3f} release {t['release']['median']:.3f}"
            f" memcpy {t['memcpy']['median']:.3f} streams {t['stream']['median']:.3f}"
            + (
                f"; setup's driver calls: create {b['create']['median']:.4f} map+access "
                f"{b['map']['median']:.4f}"
                if label == "LOAD"
                else ""
            )
        )
    for command in ("suspend", "resume"):
        ours, theirs = w["cuinterpose"][command], native[command]
        total, native_total = ours["total_s"]["median"], theirs["total_s"]["median"]
        parts = ", ".join(
            f"{n} {v['median']:.3f}" for n, v in ours["steps_s"].items() if v["median"]
        )
        nparts = ", ".join(
            f"{n} {v['median']:.3f}" for n, v in theirs["steps_s"].items() if v["median"]
        )
        verdict = (
            f"{native_total / total:.2f}x faster"
            if command == "suspend"
            else f"{total / native_total:.2f} of it"
        )
        out(
            f"  {command:<7} {_m(ours['total_s'])} s (process start "
            f"{ours['process_start_s']['median']:.3f}, {parts}); native alone "
            f"{_m(theirs['total_s'])} s (process start "
            f"{theirs['process_start_s']['median']:.3f}, {nparts}): {verdict}"
        )
    out(
        f"  coordinator share: suspend {_m(w['engine_share']['suspend'])}, resume "
        f"{_m(w['engine_share']['resume'])}; of it the engine alone (outside every exchange):"
        f" suspend {_m(w['engine_alone_share']['suspend'])}, resume "
        f"{_m(w['engine_alone_share']['resume'])}"
    )
    for command, phases in w["phases_s"].items():
        out(
            f"  {command} exchanges s: "
            + ", ".join(f"{p} {v['median']:.4f}" for p, v in phases.items())
        )


def parse_shape(text: str) -> tuple[int, int] | None:
    """``2048x2MiB`` as (2048, 2 MiB); None unless COUNTxSIZE with a whole number of MiB
    or GiB, both positive."""
    count, _, size = text.partition("x")
    units = {"MiB": MIB, "GiB": GIB}
    unit = next((u for u in units if size.endswith(u)), None)
    if unit is None or not count.isdigit() or not size[: -len(unit)].isdigit():
        return None
    n, amount = int(count), int(size[: -len(unit)]) * units[unit]
    return (n, amount) if n > 0 and amount > 0 else None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sim", action="store_true", help="simulated driver, small sizes")
    parser.add_argument(
        "--repeat", type=int, default=4, help="the first (cold) run apart, medians of the rest"
    )
    parser.add_argument("--native-repeat", type=int, help="runs of the native path alone (0: none)")
    parser.add_argument(
        "--floor-gib", type=float, help="the floor's size per case (default 4, sim 0.125; 0: none)"
    )
    parser.add_argument("--only", action="append", help="run only these workloads")
    parser.add_argument(
        "--shape",
        action="append",
        default=[],
        metavar="COUNTxSIZE",
        help="also run this shape (e.g. 2048x2MiB on the simulator); --only may name it",
    )
    parser.add_argument("--ceiling-mib", type=int, default=0, help="default 1024 (sim: 32)")
    parser.add_argument(
        "--load-floor-repeat",
        type=int,
        default=3,
        help="runs of bench/load_floor.py per workload (0: none)",
    )
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    parser.add_argument(
        "--rewrite-mib",
        type=int,
        default=0,
        help="with SNAPSHOT_SHIM_KEEP_HOST_COPY=1 in a variant: rewrite this many MiB before "
        "each suspend after the first (so that SAVE copies them, and only them)",
    )
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME:VAR=VALUE,...",
        help="also run the group with these shim settings (the defaults run first)",
    )
    parser.add_argument(
        "--variant-only",
        action="append",
        default=[],
        metavar="WORKLOAD",
        help="run the --variant groups for these workloads only (default: all)",
    )
    args = parser.parse_args(argv)
    variants: dict[str, dict[str, str]] = {"default": {}}
    for text in args.variant:
        vname, _, pairs = text.partition(":")
        settings = dict(p.split("=", 1) for p in pairs.split(",") if "=" in p)
        if not vname or vname in variants or not settings:
            parser.error(f"--variant {text!r}: want a new NAME:VAR=VALUE[,VAR=VALUE...]")
        variants[vname] = settings
    driver = "sim" if args.sim else "system"
    table = dict(SIM_WORKLOADS if args.sim else WORKLOADS)
    for text in args.shape:
        parsed = parse_shape(text)
        if parsed is None:
            parser.error(f"--shape {text!r}: want COUNTxSIZE, SIZE in MiB or GiB (2048x2MiB)")
        table[text] = parsed
    chosen = {k: v for k, v in table.items() if not args.only or k in args.only}
    if not chosen or args.repeat < 1:
        parser.error(f"nothing to run: --only must name one of {', '.join(table)}, --repeat >= 1")

    def log(text: str) -> None:
        print(f"[bench] {text}", file=sys.stderr, flush=True)

    def out(text: str) -> None:
        print(text, flush=True)  # a run cut short by a timeout keeps what it printed

    def save(result: dict[str, Any]) -> None:
        if args.out:  # what is done survives a run cut short
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=2))

    with tempfile.TemporaryDirectory(prefix="cip-staging-") as tmp:
        bench = Bench(
            driver,
            Path(tmp),
            log,
            args.repeat,
            args.native_repeat,
            args.load_floor_repeat,
            args.rewrite_mib,
        )
        try:
            probe = bench.spawn("device", bench.plain)
            dev = probe.check("device")
            probe.close()
            result: dict[str, Any] = {
                "driver": driver,
                "device": dev["name"],
                "driver_version": dev["driver_version"],
                "repeat": args.repeat,
                "cpus": os.cpu_count(),
                "ceiling": bench.ceiling((args.ceiling_mib or (32 if args.sim else 1024)) * MIB),
                "floor": floor(
                    args.floor_gib if args.floor_gib is not None else 0.125 if args.sim else 4.0,
                    args.sim,
                    log,
                ),
                "workloads": {},
            }
            save(result)
            report_head(result, out)
            for n, (c, s) in chosen.items():
                mine = variants
                if args.variant_only and n not in args.variant_only:
                    mine = {"default": {}}
                result["workloads"][n] = bench.workload(n, c, s, mine)
                save(result)
                report_workload(result, n, result["workloads"][n], out)
        finally:
            for w in bench.workers:
                w.kill()
            if driver == "sim":
                Path(f"/dev/shm/cuinterpose-sim-{os.getuid()}-bench-{os.getpid()}").unlink(
                    missing_ok=True
                )
    ok = all(
        v["verified"] and w["native_verified"]
        for w in result["workloads"].values()
        for v in w["variants"].values()
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
