"""Issue 47: sleep and wake at the ceiling, in one run on one GPU, against what a user
would do instead.

Every figure below comes from the same run (``bench/sleep_job.py`` is the torch process,
``bench/torch_job.py gpt2`` the transformers one; expandable segments on):

1. the pinned DtoH and HtoD copy ceilings (``sleep_job.py ceiling``);
2. the native checkpoint alone: the job without the shim, ``cuinterpose suspend
   --not-requested`` / ``resume`` (the native checkpoint and restore only);
3. the kept host copy off: the job with the shim, ``cuinterpose suspend`` / ``resume``
   (command) and ``cuinterpose.engine.suspend`` / ``resume`` (library);
4. the kept host copy on (``SNAPSHOT_SHIM_KEEP_HOST_COPY=1``): how long after the job was
   up the copies were pinned (``cuinterpose status``); the first cycle, ``--repeat``
   cycles with nothing changed, then ``--cycles`` cycles with ``--rewrite-gib`` GiB of
   tensors rewritten before each suspend and every tensor checked after each resume
   (library), and ``--repeat`` such cycles by command;
5. vLLM's sleep mode by hand: the job without the shim copies every tensor to pinned CPU
   memory and gives the GPU memory back, then takes it again and copies back
   (``sleep_job.py``'s ``sleep`` / ``wake``);
6. unless ``--no-gen``: a transformers GPT-2 (gpt2-medium's shape, built from its config,
   no download) with the mode on, put to sleep and woken ``--gen-cycles`` times, a greedy
   generation between cycles checked against the first (the same tokens each time) and
   every parameter against its host copy.

Reported: each path's suspend and resume seconds (median [min, max]) and their ratio to
the native checkpoint alone; the shim's SAVE and LOAD from its timing lines
(SNAPSHOT_SHIM_TIMING=1): seconds, the bytes it copied and left, GB/s of the bytes the
process holds over the op and of the bytes copied, each against the ceilings; vLLM's by
hand the same way. ``--out`` writes the JSON (rewritten after each part). GB is 10^9
bytes. Needs a GPU, torch (and transformers for 6) and the release build (``build/``).

    .venv/bin/python bench/sleep_wake.py --gib 49 --out bench/results/<date>-<gpu>-sleep-wake.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from torch_staging import Bench, Job  # bench/ is the script's directory

HERE = Path(__file__).resolve().parent
SLEEP_JOB = HERE / "sleep_job.py"
GPT2_JOB = HERE / "torch_job.py"
KEEP = {"SNAPSHOT_SHIM_KEEP_HOST_COPY": "1"}


def _stats(values: Sequence[float]) -> dict[str, float]:
    vals = [float(v) for v in values if v == v]
    if not vals:
        return {"median": float("nan"), "min": float("nan"), "max": float("nan"), "n": 0}
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "n": len(vals)}


def _m(s: dict[str, float], fmt: str = "{:.3f}") -> str:
    return (fmt + " [" + fmt + ", " + fmt + "]").format(s["median"], s["min"], s["max"])


def _ask(job: Job, command: str) -> dict[str, Any]:
    assert job.proc.stdin is not None
    job.proc.stdin.write(command + "\n")
    job.proc.stdin.flush()
    return job._line()


def _timing(log: Path) -> list[dict[str, Any]]:
    """The shim's timing lines (SNAPSHOT_SHIM_TIMING=1) in a job's stderr."""
    out = []
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("cuinterpose-timing "):
            out.append(json.loads(line.split(" ", 1)[1]))
    return out


def _ops(log: Path) -> dict[str, list[dict[str, Any]]]:
    lines = _timing(log)
    return {
        "save": [t for t in lines if t["op"] == "SAVE_ALLOCATIONS"],
        "load": [t for t in lines if t["op"] == "LOAD_ALLOCATIONS"],
    }


class Run:
    def __init__(self, bench: Bench, log: Callable[[str], None], args: argparse.Namespace):
        self.bench, self.log, self.args = bench, log, args

    def pinned(self, job: Job) -> float:
        """Seconds until ``cuinterpose status`` says every kept host copy is pinned (the
        count stops growing and equals the job's allocations: two looks in a row)."""
        start, last = time.perf_counter(), (-1, -1)
        argv = [sys.executable, "-m", "cuinterpose", "status", "--control-dir",
                str(self.bench.control), "--json"]  # fmt: skip
        for pid in job.pids:
            argv += ["--process", str(pid), str(pid)]
        while True:
            proc = subprocess.run(
                argv, env=self.bench.plain, capture_output=True, text=True, timeout=120,
                check=False,
            )  # fmt: skip
            rows = json.loads(proc.stdout)["processes"] if proc.returncode == 0 else []
            held = [r.get("host_copy") or {} for r in rows]
            now = (sum(h.get("copies", 0) for h in held), sum(h.get("bytes", 0) for h in held))
            if now == last and now[1] >= int(job.ready["tensor_bytes"]):
                return time.perf_counter() - start
            if time.perf_counter() - start > 3600:
                raise SystemExit(f"the kept host copies were not pinned in an hour: {held}")
            last = now
            time.sleep(0.5)

    def cycles(
        self, job: Job, path: str, n: int, *, rewrite: float = 0.0, check: bool = False
    ) -> list[dict[str, Any]]:
        """``n`` suspend/resume cycles through ``path`` (cuinterpose, library, native)."""
        out = []
        for i in range(n):
            rewritten = _ask(job, f"rewrite {rewrite}")["rewritten_bytes"] if rewrite else 0
            cyc = self.bench.cycle(job, path if path != "native" else "cuinterpose",
                                   native_only=path == "native")  # fmt: skip
            if cyc["suspend"]["returncode"] != 0 or cyc["resume"]["returncode"] != 0:
                raise SystemExit(f"{path} cycle {i} failed: {cyc}")
            cyc["rewritten_bytes"] = rewritten
            if check or i == 0:
                cyc["check"] = job.check()
                if not cyc["check"]["ok"]:
                    raise SystemExit(f"{path} cycle {i}: tensors wrong: {cyc['check']}")
            out.append(cyc)
        return out

    def ceiling(self) -> dict[str, Any]:
        proc = subprocess.run(
            [sys.executable, str(SLEEP_JOB), "ceiling", "--gib", str(self.args.ceiling_gib)],
            env=self.bench.plain, capture_output=True, text=True, timeout=600, check=True,
        )  # fmt: skip
        got = json.loads(proc.stdout.strip().splitlines()[-1])
        return {
            "bytes": got["bytes"],
            "dtoh_gbps": _stats(got["dtoh_gbps"]),
            "htod_gbps": _stats(got["htod_gbps"]),
        }

    def job(self, name: str, env: dict[str, str], script: Path = SLEEP_JOB) -> Job:
        self.bench.script = script
        kind = "gpt2" if script == GPT2_JOB else "single"
        return self.bench.start(kind, self.args.gib, env, name)

    def native(self) -> dict[str, Any]:
        job = self.job("native", self.bench.plain)
        runs = self.cycles(job, "native", self.args.repeat)
        job.close()
        return {"job": job.ready, "cycles": runs}

    def off(self) -> dict[str, Any]:
        job = self.job("off", self.bench.shim)
        runs = self.cycles(job, "cuinterpose", self.args.repeat)
        lib = self.cycles(job, "library", self.args.repeat)
        job.close()
        return {"job": job.ready, "command": runs, "library": lib,
                **_ops(self.bench.work / "off.log")}  # fmt: skip

    def on(self) -> dict[str, Any]:
        job = self.job("on", {**self.bench.shim, **KEEP})
        pinned = self.pinned(job)
        self.log(f"  kept host copies pinned {pinned:.1f} s after the job was up")
        first = self.cycles(job, "cuinterpose", 1)
        same_cmd = self.cycles(job, "cuinterpose", self.args.repeat)
        same_lib = self.cycles(job, "library", self.args.repeat)
        rw = self.args.rewrite_gib
        changed_lib = self.cycles(job, "library", self.args.cycles, rewrite=rw, check=True)
        changed_cmd = self.cycles(job, "cuinterpose", self.args.repeat, rewrite=rw, check=True)
        job.close()
        return {
            "job": job.ready,
            "pinned_after_s": pinned,
            "first": first,
            "unchanged_command": same_cmd,
            "unchanged_library": same_lib,
            "rewritten_library": changed_lib,
            "rewritten_command": changed_cmd,
            **_ops(self.bench.work / "on.log"),
        }

    def vllm(self) -> dict[str, Any]:
        job = self.job("vllm", self.bench.plain)
        runs = []
        for i in range(self.args.vllm_repeat):
            sleep, wake = _ask(job, "sleep"), _ask(job, "wake")
            runs.append({"sleep": sleep, "wake": wake})
            if i == 0 and not job.check()["ok"]:
                raise SystemExit("vLLM by hand: tensors wrong after the first wake")
        job.close()
        return {"job": job.ready, "cycles": runs}

    def gen(self) -> dict[str, Any]:
        job = self.job("gen", {**self.bench.shim, **KEEP}, GPT2_JOB)
        pinned = self.pinned(job)
        runs = self.cycles(job, "library", self.args.gen_cycles, check=True)
        job.close()
        return {"job": job.ready, "pinned_after_s": pinned, "cycles": runs,
                **_ops(self.bench.work / "gen.log")}  # fmt: skip


def _secs(runs: list[dict[str, Any]], command: str) -> dict[str, float]:
    return _stats([float(r[command]["seconds"]) for r in runs])


def _gbps(nbytes: float, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("nan")


def report(result: dict[str, Any], out: Callable[[str], None]) -> None:
    ceil = result["ceiling"]
    dtoh, htod = ceil["dtoh_gbps"]["median"], ceil["htod_gbps"]["median"]
    d, h = _m(ceil["dtoh_gbps"], "{:.1f}"), _m(ceil["htod_gbps"], "{:.1f}")
    out(f"== {result['device']}: ceilings (pinned, {ceil['bytes'] / 2**30:.0f} GiB): DtoH {d}"
        f" GB/s, HtoD {h} GB/s")  # fmt: skip
    nat = result.get("native")
    if not nat:
        return
    held = float(nat["job"]["tensor_bytes"])
    ns, nr = _secs(nat["cycles"], "suspend")["median"], _secs(nat["cycles"], "resume")["median"]
    s_nat, r_nat = _m(_secs(nat["cycles"], "suspend")), _m(_secs(nat["cycles"], "resume"))
    out(f"native checkpoint alone ({held / 2**30:.1f} GiB of tensors): suspend {s_nat} s, "
        f"resume {r_nat} s")  # fmt: skip

    def line(title: str, runs: list[dict[str, Any]]) -> None:
        s, r = _secs(runs, "suspend"), _secs(runs, "resume")
        out(f"  {title}: suspend {_m(s)} s ({ns / s['median']:.1f}x the native), resume "
            f"{_m(r)} s ({nr / r['median']:.1f}x)")  # fmt: skip

    def ops(title: str, part: dict[str, Any], picks: slice = slice(None)) -> None:
        for label, ceiling in (("save", dtoh), ("load", htod)):
            chosen = part[label][picks]
            if not chosen:
                continue
            el = [float(t["elapsed_s"]) for t in chosen]
            held_rate = [_gbps(float(t["bytes"]), e) for t, e in zip(chosen, el, strict=True)]
            copied = [float(t.get("bytes_copied", t["bytes"])) for t in chosen]
            out(f"    {title} {label.upper()}: {_m(_stats(el), '{:.4f}')} s, held/op "
                f"{_m(_stats(held_rate), '{:.1f}')} GB/s = "
                f"{statistics.median(held_rate) / ceiling:.2f} of the ceiling; copied "
                f"{statistics.median(copied) / 2**30:.2f} GiB"
                + (f", hash {statistics.median(float(t['hash_s']) for t in chosen):.4f} s"
                   if label == "save" and "hash_s" in chosen[0] else ""))  # fmt: skip

    if "off" in result:
        off = result["off"]
        out("kept host copy off:")
        line("command", off["command"])
        line("library", off["library"])
        ops("all", off)
    if "on" in result:
        on = result["on"]
        r, c = result["args"]["repeat"], result["args"]["cycles"]
        out(f"kept host copy on (pinned {on['pinned_after_s']:.1f} s after the job was up):")
        line("first cycle, command", on["first"])
        line("unchanged, command", on["unchanged_command"])
        line("unchanged, library", on["unchanged_library"])
        line(f"{result['args']['rewrite_gib']} GiB rewritten, library ({c} cycles, every "
             "tensor checked)", on["rewritten_library"])  # fmt: skip
        line("rewritten, command", on["rewritten_command"])
        # the shim's ops in the order they ran: first, r+r unchanged, c+r rewritten
        ops("first", on, slice(0, 1))
        ops("unchanged", on, slice(1, 1 + 2 * r))
        ops("rewritten", on, slice(1 + 2 * r, 1 + 2 * r + c + r))
    if "vllm" in result:
        v = result["vllm"]["cycles"]
        s = _stats([float(x["sleep"]["seconds"]) for x in v])
        w = _stats([float(x["wake"]["seconds"]) for x in v])
        out(f"vLLM's sleep by hand: sleep {_m(s)} s ({ns / s['median']:.1f}x the native, "
            f"{_gbps(held, s['median']):.1f} GB/s = {_gbps(held, s['median']) / dtoh:.2f} of "
            f"DtoH), wake {_m(w)} s ({_gbps(held, w['median']):.1f} GB/s = "
            f"{_gbps(held, w['median']) / htod:.2f} of HtoD)")  # fmt: skip
    if "gen" in result:
        g = result["gen"]
        ok = all(c["check"]["ok"] for c in g["cycles"])
        out(f"transformers GPT-2, kept host copy on, {len(g['cycles'])} cycles, generation "
            f"and parameters right every time: {ok}")  # fmt: skip
        line("library", g["cycles"])
        ops("gen", g, slice(1, None))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=49.0, help="GiB of tensors in the job")
    parser.add_argument("--repeat", type=int, default=3, help="cycles per path (and variant)")
    parser.add_argument("--cycles", type=int, default=20, help="cycles with tensors rewritten")
    parser.add_argument("--rewrite-gib", type=float, default=1.0)
    parser.add_argument("--ceiling-gib", type=float, default=4.0)
    parser.add_argument("--gen-cycles", type=int, default=20)
    parser.add_argument("--no-gen", action="store_true", help="skip the transformers loop")
    parser.add_argument(
        "--only", action="append", choices=("native", "off", "on", "vllm", "gen"),
        help="run only these parts (the ceiling always runs)",
    )  # fmt: skip
    parser.add_argument("--vllm-repeat", type=int, default=2, help="vLLM by hand: cycles")
    parser.add_argument(
        "--merge", type=Path,
        help="a result of an earlier run on this machine (its --out): its parts are kept "
        "and those run now added, so that a run cut in parts (10 min a command on the "
        "device) reports as one; its ceiling is measured again and both kept",
    )  # fmt: skip
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    parts = args.only or ["native", "off", "on", "vllm"] + ([] if args.no_gen else ["gen"])

    def log(text: str) -> None:
        print(f"[bench] {text}", file=sys.stderr, flush=True)

    def save(result: dict[str, Any]) -> None:
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=2))

    with tempfile.TemporaryDirectory(prefix="cip-sleep-") as tmp:
        bench = Bench(Path(tmp), log)
        run = Run(bench, log, args)
        probe = subprocess.run(
            [sys.executable, "-c", "import torch; print(torch.cuda.get_device_name(0))"],
            env=bench.plain, capture_output=True, text=True, check=True,
        )  # fmt: skip
        earlier: dict[str, Any] = json.loads(args.merge.read_text()) if args.merge else {}
        device = probe.stdout.strip()
        if earlier and earlier.get("device") != device:
            raise SystemExit(f"--merge {args.merge}: measured on {earlier.get('device')}, "
                             f"not on this {device}")  # fmt: skip
        result: dict[str, Any] = {
            **earlier,
            "device": device,
            "args": vars(args) | {"out": str(args.out) if args.out else None,
                                  "merge": str(args.merge) if args.merge else None},
            "ceiling": run.ceiling(),
        }  # fmt: skip
        if earlier:
            result["earlier_ceiling"] = earlier["ceiling"]
        save(result)
        try:
            for part in parts:
                log(f"{part} ...")
                result[part] = getattr(run, part)()
                save(result)
        finally:
            for job in bench.jobs:
                job.kill()
        report(result, lambda text: print(text, flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
