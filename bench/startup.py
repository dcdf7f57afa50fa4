"""What a ``cuinterpose`` command costs of its own before its first byte (issue 30 §4).

Each verb is run as a person runs it (the ``cuinterpose`` entry point beside this
interpreter, else ``python -m cuinterpose``), ``--runs`` times, interleaved with a bare
``python -c pass`` of the same interpreter, so that both see the same machine; reported:
each one's median wall time and its ratio to the bare interpreter's, then for each verb
one ``-X importtime`` run: what it imported of its own (the sum of the top-level imports'
cumulative time, inflated by the measurement), the heaviest imports by their own time,
and which of the heavy libraries it loaded (rich, cattrs, transitions, cuda.bindings,
ctypes). The children run with bytecode written and read (``PYTHONDONTWRITEBYTECODE``
removed, one warm-up run each), as an installed package does; ``--without-bytecode``,
every module compiled from its source in every command (the standard library's too).

Without shims (the default): ``status`` and ``status --json`` of an empty control
directory, ``--help``, ``suspend --help``, ``resume --help``, and a ``suspend`` refused
before anything is asked (its pid does not exist).

``--group`` (needs ``make build``): one process with the shim on the simulated driver,
holding ``--mib`` MiB; ``status`` of it, then ``--runs`` cycles of ``cuinterpose suspend``
and ``resume`` (``--progress json``), and as many through the library in this process
(``cuinterpose.engine.agent``); for each, the wall time, the sum of its steps, and the
rest (wall less steps: for a command its process start, imports and ``cuInit``).

``--native DRIVER`` (``sim``, or ``system`` on a machine with a GPU): in a fresh
interpreter, what the first native call costs: importing ``cuda.bindings.driver`` and
``cuInit(0)``, each timed (``--runs`` interpreters, medians).

    .venv/bin/python bench/startup.py --runs 20
    .venv/bin/python bench/startup.py --runs 10 --group --native sim --out /tmp/startup.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HEAVY = ("rich", "cattrs", "transitions", "cuda", "ctypes")


def cuinterpose_command() -> list[str]:
    """The command a person types: the entry point installed beside this interpreter."""
    entry = Path(sys.executable).parent / "cuinterpose"
    if entry.is_file():
        return [sys.executable, str(entry)]
    return [sys.executable, "-m", "cuinterpose"]


# --without-bytecode: an empty cache that nothing is written to, so that every module a
# command imports is compiled from its source (a package copied or installed without its
# bytecode, run where PYTHONDONTWRITEBYTECODE is set).
NO_BYTECODE: dict[str, str] = {}


def child_env(control_dir: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["SNAPSHOT_CONTROL_DIR"] = str(control_dir)
    env.pop("LD_PRELOAD", None)
    return {**env, **NO_BYTECODE, **(extra or {})}


def _cpu_of_children() -> float:
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def run_once(argv: Sequence[str], env: dict[str, str], ok: Sequence[int]) -> tuple[float, float]:
    """``argv``'s wall and CPU seconds (user + system: what other work on a shared machine
    adds to the wall time, it adds little to these)."""
    cpu = _cpu_of_children()
    began = time.perf_counter()
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120, check=False)
    seconds = time.perf_counter() - began
    if done.returncode not in ok:
        raise SystemExit(f"{' '.join(argv)} exited {done.returncode}: {done.stderr.strip()}")
    return seconds, _cpu_of_children() - cpu


Commands = dict[str, tuple[list[str], tuple[int, ...]]]


def timed(commands: Commands, env: dict[str, str], runs: int) -> dict[str, dict[str, list[float]]]:
    """Every command ``runs`` times, round by round (each round runs all of them): its
    wall and CPU seconds."""
    for argv, ok in commands.values():  # warm-up: bytecode written, files cached
        run_once(argv, env, ok)
    samples: dict[str, dict[str, list[float]]] = {n: {"wall": [], "cpu": []} for n in commands}
    for _ in range(runs):
        for name, (argv, ok) in commands.items():
            wall, cpu = run_once(argv, env, ok)
            samples[name]["wall"].append(wall)
            samples[name]["cpu"].append(cpu)
    return samples


def import_profile(argv: Sequence[str], env: dict[str, str], top: int) -> dict[str, Any]:
    """The least of three ``-X importtime`` runs of ``argv`` (a Python command line): the
    imports' total (the top-level ones' cumulative times), the ``top`` heaviest by their
    own time, the heavy libraries loaded, the cuinterpose modules."""
    return min((_import_run(argv, env, top) for _ in range(3)), key=lambda p: p["total_ms"])


def _import_run(
    argv: Sequence[str], env: dict[str, str], top: int, ok: Sequence[int] = (0, 1)
) -> dict[str, Any]:
    done = subprocess.run(
        [argv[0], "-X", "importtime", *argv[1:]],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if done.returncode not in ok:  # 1: the refused suspend, by default
        raise SystemExit(f"{' '.join(argv)} exited {done.returncode}: {done.stderr[-2000:]}")
    rows: list[tuple[str, int, int, int]] = []  # name, self us, cumulative us, depth
    for line in done.stderr.splitlines():
        if not line.startswith("import time:") or "imported package" in line:
            continue
        own, cumulative, name = line.removeprefix("import time:").split("|")
        depth = (len(name) - len(name.lstrip(" ")) - 1) // 2
        rows.append((name.strip(), int(own), int(cumulative), depth))
    names = {name for name, *_ in rows}
    return {
        "total_ms": sum(c for _, _, c, d in rows if d == 0) / 1000,
        "modules": len(rows),
        "top": [(name, own / 1000) for name, own, _, _ in sorted(rows, key=lambda r: -r[1])[:top]],
        "heavy": sorted({h for h in HEAVY for n in names if n == h or n.startswith(f"{h}.")}),
        "cuinterpose": sorted(
            n.removeprefix("cuinterpose.") for n in names if n.startswith("cuinterpose.")
        ),
    }


def verbs_without_shims(work: Path) -> Commands:
    cli = cuinterpose_command()
    gone = _free_pid()
    return {
        "status": ([*cli, "status"], (0,)),
        "status --json": ([*cli, "status", "--json"], (0,)),
        "--help": ([*cli, "--help"], (0,)),
        "suspend --help": ([*cli, "suspend", "--help"], (0,)),
        "resume --help": ([*cli, "resume", "--help"], (0,)),
        "suspend (refused: no such pid)": (
            [
                *cli,
                "suspend",
                "--checkpoint-dir",
                str(work / "refused"),
                "--pid",
                str(gone),
                "--progress",
                "json",
            ],
            (1,),
        ),
    }


def _free_pid() -> int:
    """A pid that names no process now (the highest the kernel could hand out)."""
    pid = int(Path("/proc/sys/kernel/pid_max").read_text())
    while Path(f"/proc/{pid}").exists():
        pid -= 1
    return pid


def _steps_s(stdout: str) -> float:
    """The sum of a command's finished steps, from its JSON lines."""
    events = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    return sum(
        float(e["seconds"])
        for e in events
        if e.get("event") == "step" and e.get("status") == "done"
    )


def _cycle(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
    """One verb's wall seconds and the sum of its steps (its JSON lines)."""
    began = time.perf_counter()
    done = subprocess.run(
        [*argv, "--progress", "json"], env=env, capture_output=True, text=True, timeout=120
    )
    wall = time.perf_counter() - began
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} exited {done.returncode}: {done.stderr.strip()}")
    return wall, _steps_s(done.stdout)


def _split(walls: list[float], steps: list[float]) -> dict[str, float]:
    return {
        "wall_s": statistics.median(walls),
        "steps_s": statistics.median(steps),
        "rest_s": statistics.median(w - s for w, s in zip(walls, steps, strict=True)),
    }


def group_cycles(runs: int, mib: int, work: Path, top: int) -> dict[str, Any]:
    """One shimmed process on the simulated driver: status, then ``runs`` suspend/resume
    cycles through the command line and as many through the library."""
    from cuinterpose import launch
    from cuinterpose.demo import Worker
    from cuinterpose.engine import agent

    namespace = f"bench-startup-{os.getpid()}"
    os.environ["CUINTERPOSE_SIM_NAMESPACE"] = namespace  # the library's native calls
    control = launch.ensure_control_dir(work / "control")
    env = child_env(control, {"CUINTERPOSE_SIM_NAMESPACE": namespace})
    shim = launch.launch_env(driver="sim", control_dir=control, base=env)
    cli = cuinterpose_command()
    worker = Worker("job", shim, log_dir=work, timeout_s=120.0)
    figures: dict[str, Any] = {"mib": mib}
    try:
        worker.create_mapped(mib << 20, seed=7)
        named = ["--pid", str(worker.pid)]
        commands: Commands = {"python -c pass": ([sys.executable, "-c", "pass"], (0,))}
        commands["status (one shim)"] = ([*cli, "status"], (0,))
        commands["status --json (one shim)"] = ([*cli, "status", "--json"], (0,))
        figures["samples_s"] = timed(commands, env, runs)
        figures["imports"] = {
            name: import_profile(argv, env, top)
            for name, (argv, _) in commands.items()
            if name != "python -c pass"
        }
        walls: dict[str, list[float]] = {"suspend": [], "resume": []}
        steps: dict[str, list[float]] = {"suspend": [], "resume": []}
        for cycle in range(runs + 1):  # the first: bytecode written, files cached
            directory = str(work / f"cli-{cycle}")
            suspended = _cycle([*cli, "suspend", "--checkpoint-dir", directory, *named], env)
            resumed = _cycle([*cli, "resume", "--checkpoint-dir", directory], env)
            if cycle:
                for verb, (wall, step) in (("suspend", suspended), ("resume", resumed)):
                    walls[verb].append(wall)
                    steps[verb].append(step)
        figures["command"] = {verb: _split(walls[verb], steps[verb]) for verb in walls}
        profiles: dict[str, list[dict[str, Any]]] = {"suspend": [], "resume": []}
        for cycle in range(3):  # each suspend resumed before the next
            directory = str(work / f"importtime-{cycle}")
            for verb, argv in (
                ("suspend", [*cli, "suspend", "--checkpoint-dir", directory, *named]),
                ("resume", [*cli, "resume", "--checkpoint-dir", directory]),
            ):
                profiles[verb].append(_import_run([*argv, "--progress", "json"], env, top, (0,)))
        for verb, runs_of_verb in profiles.items():
            figures["imports"][verb] = min(runs_of_verb, key=lambda p: p["total_ms"])
        walls = {"suspend": [], "resume": []}
        steps = {"suspend": [], "resume": []}
        where = agent.Where(control)
        for cycle in range(runs):
            directory = str(work / f"lib-{cycle}")
            began = time.perf_counter()
            done: agent.SuspendResult | agent.ResumeResult
            done = agent.suspend([(worker.pid, worker.pid)], Path(directory), where=where)
            walls["suspend"].append(time.perf_counter() - began)
            steps["suspend"].append(sum(t.seconds for t in done.timings))
            began = time.perf_counter()
            done = agent.resume(Path(directory), where=where)
            walls["resume"].append(time.perf_counter() - began)
            steps["resume"].append(sum(t.seconds for t in done.timings))
        figures["library"] = {verb: _split(walls[verb], steps[verb]) for verb in walls}
    finally:
        worker.kill()
        Path(f"/dev/shm/cuinterpose-sim-{os.getuid()}-{namespace}").unlink(missing_ok=True)
    return figures


_NATIVE = """
import json, time
began = time.perf_counter()
from cuda.bindings import driver as cu
imported = time.perf_counter()
err = cu.cuInit(0)[0]
done = time.perf_counter()
assert err == cu.CUresult.CUDA_SUCCESS, err
print(json.dumps({"import_s": imported - began, "cuinit_s": done - imported}))
"""


def native_first_call(driver: str, runs: int, work: Path) -> dict[str, Any]:
    """What the first native call costs a fresh interpreter: the binding's import and
    ``cuInit(0)``, on the simulated driver or the system's."""
    from cuinterpose import launch

    env = child_env(work, {"CUINTERPOSE_SIM_NAMESPACE": f"bench-startup-{os.getpid()}"})
    env = launch.launch_env(driver=driver, control_dir=None, base=env, preload_shim=False)
    samples: dict[str, list[float]] = {"import_s": [], "cuinit_s": []}
    for run in range(runs + 1):  # the first warms the caches
        done = subprocess.run(
            [sys.executable, "-c", _NATIVE], env=env, capture_output=True, text=True, timeout=120
        )
        if done.returncode != 0:
            raise SystemExit(f"the native first call failed: {done.stderr.strip()}")
        if run:
            for key, value in json.loads(done.stdout.splitlines()[-1]).items():
                samples[key].append(float(value))
    return {"driver": driver, "median_s": {k: statistics.median(v) for k, v in samples.items()}}


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


def _report(samples: dict[str, dict[str, list[float]]], imports: dict[str, Any]) -> dict[str, Any]:
    """Medians and ratios to ``python -c pass`` (wall and CPU), printed and returned."""
    medians = {
        name: {kind: statistics.median(values) for kind, values in taken.items()}
        for name, taken in samples.items()
    }
    bare = medians["python -c pass"]
    ratios = {name: {k: m[k] / bare[k] for k in m} for name, m in medians.items()}
    print(f"  {'command':<32} {'wall':>9} {'x pass':>7} {'cpu':>9} {'x pass':>7}  heavy imports")
    for name, median in medians.items():
        heavy = ", ".join(imports[name]["heavy"]) or "none" if name in imports else ""
        print(
            f"  {name:<32} {_ms(median['wall']):>9} {ratios[name]['wall']:6.2f}x "
            f"{_ms(median['cpu']):>9} {ratios[name]['cpu']:6.2f}x  {heavy}"
        )
    for name, seen in imports.items():
        heaviest = ", ".join(f"{module} {ms:.1f}" for module, ms in seen["top"])
        print(f"  {name}: imports {seen['total_ms']:.1f} ms (-X importtime); own ms: {heaviest}")
    return {"median_s": medians, "x_python_c_pass": ratios, "imports": imports}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=15, help="runs of each command (default 15)")
    parser.add_argument("--top", type=int, default=8, help="imports listed per verb (default 8)")
    parser.add_argument(
        "--group",
        action="store_true",
        help="also a shimmed process on the simulated driver: status, suspend and resume, "
        "by command and by library",
    )
    parser.add_argument("--mib", type=int, default=64, help="--group: the MiB it holds")
    parser.add_argument(
        "--native", choices=("sim", "system"), help="also the binding's import and cuInit(0)"
    )
    parser.add_argument(
        "--without-bytecode",
        action="store_true",
        help="compile every module from source in every command, the standard library's too "
        "(an upper bound of what a package without its bytecode costs)",
    )
    parser.add_argument("--out", type=Path, help="write the figures as JSON")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    work = Path(tempfile.mkdtemp(prefix="cuip-bench-startup-"))
    if args.without_bytecode:
        (work / "no-bytecode").mkdir()
        NO_BYTECODE.update(
            PYTHONDONTWRITEBYTECODE="1", PYTHONPYCACHEPREFIX=str(work / "no-bytecode")
        )
    results: dict[str, Any] = {
        "python": sys.version.split()[0],
        "cpus": os.cpu_count(),
        "runs": args.runs,
        "command": cuinterpose_command(),
        "bytecode": not args.without_bytecode,
    }
    try:
        empty = work / "empty-control"
        empty.mkdir(mode=0o700)
        env = child_env(empty)
        commands: Commands = {"python -c pass": ([sys.executable, "-c", "pass"], (0,))}
        commands.update(verbs_without_shims(work))
        samples = timed(commands, env, args.runs)
        imports = {
            name: import_profile(argv, env, args.top)
            for name, (argv, _) in commands.items()
            if name != "python -c pass"
        }
        print(
            f"without shims: {args.runs} runs of each command, medians "
            f"({results['cpus']} CPUs, Python {results['python']}):"
        )
        results["without_shims"] = {"samples_s": samples, **_report(samples, imports)}
        if args.group:
            group = group_cycles(args.runs, args.mib, work, args.top)
            print(f"one shimmed process on the simulated driver ({args.mib} MiB):")
            shown = {name: seen for name, seen in group["imports"].items() if "status" in name}
            group["status"] = _report(group["samples_s"], shown)  # fmt: skip
            for way in ("command", "library"):
                for verb, split in group[way].items():
                    print(
                        f"  {verb:<8} by {way:<8} {_ms(split['wall_s']):>9} = steps "
                        f"{_ms(split['steps_s'])} + the rest {_ms(split['rest_s'])}"
                    )
            for verb in ("suspend", "resume"):
                seen = group["imports"][verb]
                print(
                    f"  {verb}: imports {seen['total_ms']:.1f} ms (-X importtime), heavy: "
                    f"{', '.join(seen['heavy'])}; {len(seen['cuinterpose'])} cuinterpose modules"
                )
            results["group"] = group
        if args.native:
            native = native_first_call(args.native, args.runs, work)
            results["native_first_call"] = native
            print(
                f"the first native call on the {args.native} driver, in a fresh interpreter: "
                f"import cuda.bindings.driver {_ms(native['median_s']['import_s'])}, "
                f"cuInit(0) {_ms(native['median_s']['cuinit_s'])}"
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
