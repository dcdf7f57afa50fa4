"""Issue 19's torch jobs: cuinterpose suspend/resume against the native checkpoint alone.

On one GPU with torch (``bench/torch_job.py`` are the jobs; expandable segments on, so
every byte torch holds is a VMM allocation the shim tracks):

- ``single``: one process, ``--gib`` GiB of tensors, twice that reserved (mapped);
- ``pair``: a torch.multiprocessing producer/consumer, ``--pair-gib`` GiB of tensors
  shared by the producer plus private tensors in each;
- ``gpt2``: issue 30's small job, a 1.42 GB GPT-2 that has run a generation (where a
  command's own cost weighs most against the native checkpoint's).

For each job, ``--repeat`` times in one run, alternating which goes first (the first
host memory a fresh VM touches costs more, so order must not decide): the native path
alone (the job without the shim: ``cuinterpose suspend --not-requested`` and
``cuinterpose resume``, the native checkpoint and restore only) and cuinterpose (the job
with the shim: ``cuinterpose suspend`` and ``resume``), each a command as a user runs
it; then cuinterpose through the library (``cuinterpose.engine.suspend``/``resume`` in
this process: no process start). Once: the job with the shim and
``SNAPSHOT_SHIM_STAGE_PRIVATE=0`` (the native checkpoint moves the private memory with
the shim loaded: its native_checkpoint step against the native path alone's says what
loading the shim costs the native checkpoint). The pair's native path alone is tried
once: the native checkpoint refuses a process that maps another's memory, and its
error is recorded. Every tensor is checked after the first cycle of each path.

Reported: each command's total and steps (median [min, max]), the shim's SAVE/LOAD
(bytes, GB/s, from the summary's ``staging``), what was left to the native checkpoint,
the ratios against the native path alone, the host memory of the suspended job (its
processes' RSS over the bytes staged). ``--out`` writes the JSON. Needs a GPU, torch and
the release build (``build/``); ``--sim`` is not offered (torch needs a real driver).
"""

from __future__ import annotations

import argparse
import contextlib
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
from cuinterpose.demo import coordinator_env
from cuinterpose.engine import agent
from cuinterpose.engine.native_checkpoint import CudaBackend
from cuinterpose.engine.serial import to_json

HERE = Path(__file__).resolve().parent
JOB = HERE / "torch_job.py"


def _stats(values: Sequence[float]) -> dict[str, float]:
    vals = [float(v) for v in values]
    if not vals:
        return {"median": float("nan"), "min": float("nan"), "max": float("nan"), "n": 0}
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "n": len(vals)}


def _rss(pids: Sequence[int]) -> int:
    """Resident bytes of the processes now (VmRSS), summed."""
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


class Job:
    """A running torch job (``torch_job.py``), talked to over its stdin/stdout."""

    def __init__(
        self, kind: str, gib: float, env: dict[str, str], log_path: Path, script: Path = JOB
    ) -> None:
        self.log = log_path.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, str(script), kind, "--gib", str(gib)],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
        )
        self.ready = self._line()
        self.pids: list[int] = [int(p) for p in self.ready["pids"]]

    def _line(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"torch job exited {self.proc.wait()}: see {self.log.name}")
        return dict(json.loads(line))

    def check(self) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write("check\n")
        self.proc.stdin.flush()
        return self._line()

    def close(self) -> None:
        if self.proc.poll() is None and self.proc.stdin is not None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
        self.log.close()

    def kill(self) -> None:
        for pid in self.pids[1:]:
            with contextlib.suppress(OSError):
                os.kill(pid, 9)
        if self.proc.poll() is None:
            self.proc.kill()


class Bench:
    def __init__(
        self, work: Path, log: Callable[[str], None], driver: str = "system", script: Path = JOB
    ) -> None:
        self.work, self.log, self.script = work, log, script
        self.control = launch.ensure_control_dir(work / "control")
        base = coordinator_env()
        base["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
        base["SNAPSHOT_SHIM_TIMING"] = "1"
        self.shim = launch.launch_env(driver=driver, control_dir=self.control, base=base)
        self.plain = launch.launch_env(
            driver=driver, control_dir=self.control, base=base, preload_shim=False
        )
        self.jobs: list[Job] = []
        self.native = CudaBackend()
        self.count = 0

    def start(self, kind: str, gib: float, env: dict[str, str], name: str) -> Job:
        t = time.perf_counter()
        job = Job(kind, gib, env, self.work / f"{name}.log", self.script)
        self.jobs.append(job)
        self.log(
            f"  {name}: pids {job.pids}, {job.ready['tensor_bytes'] / 2**30:.1f} GiB of tensors,"
            f" {job.ready['reserved_bytes'] / 2**30:.1f} GiB reserved, up in"
            f" {time.perf_counter() - t:.1f} s"
        )
        return job

    def _dir(self, tag: str) -> Path:
        self.count += 1
        return self.work / f"ckpt-{tag}-{self.count}"

    def cli(self, command: str, job: Job, ckpt: Path, *extra: str) -> dict[str, Any]:
        """One ``cuinterpose suspend|resume`` as a user runs it: seconds, steps, staging."""
        argv = [sys.executable, "-m", "cuinterpose", command, "--checkpoint-dir", str(ckpt)]
        argv += ["--control-dir", str(self.control), "--progress", "json", *extra]
        for pid in job.pids:
            argv += ["--process", str(pid), str(pid)]
        start = time.perf_counter()
        done = subprocess.run(
            argv, env=self.plain, capture_output=True, text=True, timeout=1800, check=False
        )
        seconds = time.perf_counter() - start
        events = [json.loads(x) for x in done.stdout.splitlines() if x.startswith("{")]
        steps = {
            str(e["step"]): float(e["seconds"])
            for e in events
            if e.get("event") == "step" and e.get("status") == "done"
        }
        summary = next((e for e in events if e.get("event") == "summary"), {})
        return {
            "returncode": done.returncode,
            "stderr": done.stderr[-2000:] if done.returncode else "",
            "seconds": seconds,
            "steps": steps,
            "process_start_s": seconds - sum(steps.values()),
            "staging": summary.get("staging"),
        }

    def library(self, command: str, job: Job, ckpt: Path) -> dict[str, Any]:
        """The same through ``cuinterpose.engine`` in this process."""
        where = agent.Where(self.control)
        start = time.perf_counter()
        if command == "suspend":
            done: Any = agent.suspend(
                [(p, p) for p in job.pids], ckpt, where=where, native=self.native
            )
        else:
            done = agent.resume(ckpt, where=where, native=self.native)
        seconds = time.perf_counter() - start
        return {
            "returncode": 0,
            "seconds": seconds,
            "steps": {t.step: t.seconds for t in done.timings},
            "process_start_s": 0.0,
            "staging": to_json(done.staging) if done.staging is not None else None,
        }

    def cycle(self, job: Job, path: str, native_only: bool = False) -> dict[str, Any]:
        """Suspend, note the host memory, resume; through the CLI or the library."""
        ckpt = self._dir(path)
        extra = ("--not-requested",) if native_only else ()
        running = _rss(job.pids)
        if path == "library":
            sus = self.library("suspend", job, ckpt)
        else:
            sus = self.cli("suspend", job, ckpt, *extra)
        if sus["returncode"] != 0:
            return {"suspend": sus}
        rss = _rss(job.pids)
        res = (
            self.library("resume", job, ckpt)
            if path == "library"
            else self.cli("resume", job, ckpt)
        )
        return {
            "suspend": sus,
            "resume": res,
            "running_rss_bytes": running,
            "suspended_rss_bytes": rss,
        }

    def job(self, kind: str, gib: float, repeat: int, private_off: bool = True) -> dict[str, Any]:
        self.log(f"{kind}: {gib} GiB")
        out: dict[str, Any] = {"kind": kind, "gib": gib}
        ours = self.start(kind, gib, self.shim, f"{kind}-cuinterpose")
        out["job"] = ours.ready
        theirs = None
        if kind in ("single", "gpt2"):
            theirs = self.start(kind, gib, self.plain, f"{kind}-native")
        runs: dict[str, list[dict[str, Any]]] = {"cuinterpose": [], "native": [], "library": []}
        verified: dict[str, Any] = {}
        for i in range(repeat):
            order = ("native", "cuinterpose") if i % 2 == 0 else ("cuinterpose", "native")
            for path in order:
                if path == "native" and theirs is None:
                    continue
                job = theirs if path == "native" else ours
                assert job is not None
                run = self.cycle(job, path, native_only=path == "native")
                runs[path].append(run)
                self.log(f"  {path} {i}: {_brief(run)}")
                if i == 0:
                    verified[path] = job.check()
        for i in range(repeat):
            run = self.cycle(ours, "library")
            runs["library"].append(run)
            self.log(f"  library {i}: {_brief(run)}")
        verified["library"] = ours.check()
        ours.close()
        if theirs is not None:
            theirs.close()
        else:
            # The pair without the shim: the native checkpoint alone, tried once.
            alone = self.start(kind, gib, self.plain, f"{kind}-native")
            run = self.cycle(alone, "native", native_only=True)
            runs["native"].append(run)
            self.log(f"  native (pair, expected to be refused): {_brief(run)}")
            alone.kill()
        out["runs"] = runs
        out["verified"] = verified
        out["summary"] = _summarize(runs)
        if not private_off:
            return out
        # The shim loaded, the private memory left to the native checkpoint.
        kept = self.start(
            kind, gib, {**self.shim, "SNAPSHOT_SHIM_STAGE_PRIVATE": "0"}, f"{kind}-private-off"
        )
        run = self.cycle(kept, "cuinterpose")
        self.log(f"  private left to the native checkpoint: {_brief(run)}")
        out["private_off"] = run
        out["private_off_verified"] = kept.check()
        kept.close()
        return out


def _brief(run: dict[str, Any]) -> str:
    sus, res = run["suspend"], run.get("resume")
    if sus["returncode"] != 0:
        return f"suspend failed: {sus['stderr'].strip().splitlines()[-1:]}"
    text = f"suspend {sus['seconds']:.2f} s {sus['steps']}"
    if res is not None:
        text += f"; resume {res['seconds']:.2f} s {res['steps']}"
    if sus.get("staging"):
        st = sus["staging"]
        text += (
            f"; staged {st['staged_bytes'] / 2**30:.2f} GiB at {st['gb_per_s']:.1f} GB/s,"
            f" tracked left to native {st['native_tracked_bytes'] / 2**30:.2f} GiB"
        )
    return text


def _summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for path, items in runs.items():
        ok = [r for r in items if r["suspend"]["returncode"] == 0 and "resume" in r]
        if not ok:
            continue
        entry: dict[str, Any] = {}
        for command in ("suspend", "resume"):
            entry[command] = {
                "total_s": _stats([r[command]["seconds"] for r in ok]),
                "steps_s": {
                    name: _stats([r[command]["steps"].get(name, 0.0) for r in ok])
                    for name in ok[0][command]["steps"]
                },
            }
            staged = [r[command]["staging"] for r in ok if r[command].get("staging")]
            if staged:
                entry[command]["staged_bytes"] = staged[0]["staged_bytes"]
                entry[command]["native_tracked_bytes"] = staged[0]["native_tracked_bytes"]
                entry[command]["gb_per_s"] = _stats([s["gb_per_s"] for s in staged])
        entry["suspended_rss_bytes"] = _stats([r["suspended_rss_bytes"] for r in ok])
        entry["added_rss_bytes"] = _stats(
            [r["suspended_rss_bytes"] - r["running_rss_bytes"] for r in ok]
        )
        out[path] = entry
    native = out.get("native")
    for path in ("cuinterpose", "library"):
        if native and path in out:
            out[path]["suspend_x_faster"] = (
                native["suspend"]["total_s"]["median"] / out[path]["suspend"]["total_s"]["median"]
            )
            out[path]["resume_x_faster"] = (
                native["resume"]["total_s"]["median"] / out[path]["resume"]["total_s"]["median"]
            )
    return out


def report(result: dict[str, Any], out: Callable[[str], None]) -> None:
    for kind, job in result["jobs"].items():
        ready = job["job"]
        out(
            f"== {kind}: {ready['tensor_bytes'] / 2**30:.1f} GiB of tensors,"
            f" {ready['reserved_bytes'] / 2**30:.1f} GiB reserved; verified {job['verified']}"
        )
        for path, entry in job["summary"].items():
            for command in ("suspend", "resume"):
                e = entry[command]
                steps = ", ".join(f"{n} {v['median']:.3f}" for n, v in e["steps_s"].items())
                line = (
                    f"  {path:<11} {command:<7} {e['total_s']['median']:.3f}"
                    f" [{e['total_s']['min']:.3f}, {e['total_s']['max']:.3f}] s ({steps})"
                )
                if "staged_bytes" in e:
                    line += (
                        f"; staged {e['staged_bytes'] / 2**30:.2f} GiB at"
                        f" {e['gb_per_s']['median']:.1f} GB/s, tracked left to native"
                        f" {e['native_tracked_bytes'] / 2**30:.2f} GiB"
                    )
                out(line)
            if "suspend_x_faster" in entry:
                out(
                    f"  {path:<11} vs native alone: suspend {entry['suspend_x_faster']:.2f}x,"
                    f" resume {entry['resume_x_faster']:.2f}x faster"
                )
            rss = entry["suspended_rss_bytes"]["median"]
            added = entry["added_rss_bytes"]["median"]
            gpu = ready["reserved_bytes"]
            out(
                f"  {path:<11} host memory of the suspended job (RSS) {rss / 2**30:.2f} GiB,"
                f" {added / 2**30:.2f} GiB more than running = {added / gpu:.3f} x the"
                f" {gpu / 2**30:.2f} GiB torch reserved on the GPU"
            )
        off = job.get("private_off")
        if off is not None:
            out(f"  private left to the native checkpoint (shim loaded): {_brief(off)}")
        refused = [r for r in job["runs"]["native"] if r["suspend"]["returncode"] != 0]
        if refused:
            out(f"  native alone refused: {refused[0]['suspend']['stderr'].strip()[-300:]}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--gib", type=float, default=16.0, help="single: GiB of tensors")
    parser.add_argument("--pair-gib", type=float, default=2.0, help="pair: GiB shared")
    parser.add_argument("--only", choices=("single", "pair", "gpt2"), action="append")
    parser.add_argument(
        "--repeat-single", type=int, help="repetitions for single (default: --repeat)"
    )
    parser.add_argument(
        "--no-private-off",
        action="store_true",
        help="skip the run with SNAPSHOT_SHIM_STAGE_PRIVATE=0 (a native checkpoint of it all)",
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    try:
        import torch  # noqa: F401  (the jobs need it; fail here, with the reason)
    except ImportError as exc:
        print(f"torch_staging: torch is not importable ({exc}); nothing run")
        return 0
    chosen = args.only or ["single", "pair"]

    def log(text: str) -> None:
        print(f"[torch] {text}", file=sys.stderr, flush=True)

    result: dict[str, Any] = {"repeat": args.repeat, "jobs": {}}
    with tempfile.TemporaryDirectory(prefix="cip-torch-") as tmp:
        bench = Bench(Path(tmp), log)
        try:
            for kind in chosen:
                gib = 2 * args.pair_gib if kind == "pair" else args.gib
                repeat = args.repeat_single or args.repeat if kind == "single" else args.repeat
                result["jobs"][kind] = bench.job(
                    kind, gib, repeat, private_off=not args.no_private_off
                )
                if args.out:
                    args.out.write_text(json.dumps(result, indent=2))
        finally:
            for job in bench.jobs:
                job.kill()
    report(result, print)
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    ok = all(v.get("ok") for job in result["jobs"].values() for v in job["verified"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
