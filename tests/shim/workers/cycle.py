"""The issue's three-process checkpoint/restore cycle, as one function with assertions.

Shared by ``tests/shim/test_e2e.py`` (simulated driver) and ``tests/gpu`` (real GPU):
build the topology, ``cuinterpose prepare``, native lock + checkpoint of all, native
restore + unlock of all, ``cuinterpose restore``, then check every byte at its VA,
reuse the old logical handles, and import a capability exported before the checkpoint
in a fourth process. Returns the measurements (for the GPU run's record).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from cuinterpose import native_calls
from cuinterpose.demo import (
    CliRun,
    Scenario,
    Worker,
    coordinator_env,
    pattern_digest,
    run_cli,
)
from cuinterpose.phases import PHASE_OPS, TEARS_DOWN

from tests.shim import shimenv
from tests.simenv import Spawn

# The capture and restore ops that tear something down (QUIESCE is released by the
# lease's end; a refusal's rollback may still send the rollback ops).
FORWARD_TEARS_DOWN = {p.op for p in PHASE_OPS} & TEARS_DOWN


def cli(
    command: str,
    pids: list[int],
    control_dir: Path,
    work_dir: Path,
    *,
    timeout_s: float = 120.0,
) -> CliRun:
    ckpt = work_dir / "checkpoint"
    ckpt.mkdir(exist_ok=True)
    return run_cli(
        command,
        pids=pids,
        checkpoint_dir=ckpt,
        control_dir=control_dir,
        env=shimenv.coordinator_cli_env(control_dir),
        trace=work_dir / f"{command}.trace.jsonl",
        timeout_s=timeout_s,
    )


def assert_replays(trace: Path) -> None:
    """A trace recorded from real shims replays clean against fake participants."""
    run = subprocess.run(
        [sys.executable, "-m", "cuinterpose", "replay", str(trace)],
        env=coordinator_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 0, f"replay of {trace}: {run.stdout}{run.stderr}"


def used(observer: Worker) -> int:
    info = observer.check("mem_info")
    return int(info["total"]) - int(info["free"])


def assert_refused(run: CliRun, what: str, pid: int) -> None:
    assert run.returncode == 1, (run.returncode, run.stderr)
    assert what in run.stderr, run.stderr
    assert str(pid) in run.stderr, run.stderr
    sent = {e.get("phase") for e in run.events if e.get("event") == "phase"}
    assert not sent & FORWARD_TEARS_DOWN, f"phases that tear down ran before the refusal: {sent}"


def assert_still_active(app: Worker, handle: int, va: int, size: int, seed: int) -> None:
    """Nothing was torn down and the shim still serves tracked calls."""
    assert app.digest(va, size) == pattern_digest(seed, size)
    fd = int(app.check("export", handle=handle)["fd"])
    app.check("close", fd=fd)
    h2, va2 = app.create_mapped(size, seed=seed + 1)
    assert app.digest(va2, size) == pattern_digest(seed + 1, size)
    app.check("unmap", va=va2, size=size)
    app.check("release", handle=h2)


def three_process_cycle(
    spawn: Spawn,
    shim_env: dict[str, str],
    plain_env: dict[str, str],
    control_dir: Path,
    work_dir: Path,
    *,
    unit: int | None = None,
    trace_out: Path | None = None,
    trace_prefix: str = "three-process",
    timeout_s: float = 120.0,
    slack: int = 0,
) -> dict[str, Any]:
    """Run the cycle; ``unit`` (a multiple of the granularity) sizes X = 4u, Y = 2u, P = u.

    ``slack``: device memory the shim may itself take while prepared (a real driver
    can place its copy streams there); 0 on the simulated driver, where it is exact."""
    observer = spawn("observer", plain_env, wait=False)
    creator = spawn("creator", shim_env, wait=False)
    twice = spawn("importer-twice", shim_env, wait=False)
    both = spawn("importer-both", shim_env, wait=False)
    for worker in (observer, creator, twice, both):
        worker.wait_ready()
    gran = int(observer.check("granularity")["granularity"])
    unit = gran if unit is None else unit
    assert unit % gran == 0, f"unit {unit} is not a multiple of the granularity {gran}"
    scen = Scenario(
        creator,
        twice,
        both,
        x_size=4 * unit,
        y_size=2 * unit,
        p_size=unit,
    )
    all_bytes = scen.x_size + scen.y_size + scen.p_size
    used_idle = used(observer)
    scen.build()
    assert scen.mismatches() == []
    used_before = used(observer)
    assert used_before - used_idle >= all_bytes, (used_idle, used_before)

    prep = cli("prepare", scen.pids, control_dir, work_dir, timeout_s=timeout_s)
    assert prep.returncode == 0, prep.stderr
    assert (work_dir / "checkpoint" / "cuinterpose.state").is_file()
    save = prep.phase("SAVE_ALLOCATIONS")
    # The creator stages X, Y and its private P (SNAPSHOT_SHIM_STAGE_PRIVATE).
    assert save.get("allocation_count") == 3, prep.events
    assert save.get("allocation_bytes") == scen.staged_bytes, prep.events
    # Prepared: every allocation the shim owns is off the device (the application's calls
    # would wait at the closed gate: tests/shim/test_quiesce.py).
    used_prepared = used(observer)
    assert used_before - used_prepared >= scen.staged_bytes - slack, (used_before, used_prepared)

    ck = native_calls.run_in_subprocess("checkpoint-all", scen.pids, env=plain_env)
    assert set(ck["states"].values()) == {"CHECKPOINTED"}, ck
    used_ckpt = used(observer)
    assert used_before - used_ckpt >= all_bytes, (
        f"checkpointed, yet only {used_before - used_ckpt} of {all_bytes} bytes freed"
    )

    rs = native_calls.run_in_subprocess("restore-all", scen.pids, env=plain_env)
    assert set(rs["states"].values()) == {"RUNNING"}, rs

    rest = cli("restore", scen.pids, control_dir, work_dir, timeout_s=timeout_s)
    assert rest.returncode == 0, rest.stderr
    load = rest.phase("LOAD_ALLOCATIONS")
    assert load.get("allocation_count") == 3, rest.events
    assert load.get("allocation_bytes") == scen.staged_bytes, rest.events
    assert scen.mismatches() == []
    used_after = used(observer)
    assert used_after - used_ckpt >= all_bytes, (used_ckpt, used_after)

    # The old logical handles keep working: remap the second map, retain, release.
    twice, both, creator = scen.twice, scen.both, scen.creator
    va_second = scen.vas["twice_x_second"]
    twice.check("unmap", va=va_second, size=scen.x_size)
    twice.check("map", va=va_second, size=scen.x_size, handle=scen.handles["twice_x"])
    twice.check("set_access", va=va_second, size=scen.x_size)
    assert twice.digest(va_second, scen.x_size) == pattern_digest(Scenario.SEED_X, scen.x_size)
    both.check("unmap", va=scen.vas["both_y"], size=scen.y_size)
    both.check("release", handle=scen.handles["both_y"])
    retained = int(creator.check("retain", va=scen.vas["creator_x"])["handle"])
    creator.check("release", handle=retained)
    vp = scen.vas["creator_p"]
    creator.check("unmap", va=vp, size=scen.p_size)
    creator.check("map", va=vp, size=scen.p_size, handle=scen.handles["creator_p"])
    creator.check("set_access", va=vp, size=scen.p_size)
    assert creator.digest(vp, scen.p_size) == pattern_digest(Scenario.SEED_P, scen.p_size)
    # Y is still whole in the creator after its importer let go of it.
    assert creator.digest(scen.vas["creator_y"], scen.y_size) == pattern_digest(
        Scenario.SEED_Y_BOTH, scen.y_size
    )

    # A fourth process imports the capability exported before the checkpoint.
    fourth = spawn("fourth", shim_env)
    fd = creator.send_fd_to(fourth, scen.late_fd, close=True)
    handle = int(fourth.check("import", fd=fd)["handle"])
    va = fourth.map_at_new_va(handle, scen.x_size)
    assert fourth.digest(va, scen.x_size) == pattern_digest(Scenario.SEED_X, scen.x_size)
    fourth.check("unmap", va=va, size=scen.x_size)
    fourth.check("release", handle=handle)

    result: dict[str, Any] = {
        "device": observer.check("device"),
        "sizes": {"x": scen.x_size, "y": scen.y_size, "p": scen.p_size},
        "gpu_used": {
            "idle": used_idle,
            "filled": used_before,
            "prepared": used_prepared,
            "checkpointed": used_ckpt,
            "restored": used_after,
        },
        "prepare": {"seconds": prep.seconds, "events": list(prep.events)},
        "native_checkpoint": ck["timings"],
        "native_restore": rs["timings"],
        "restore": {"seconds": rest.seconds, "events": list(rest.events)},
    }
    for worker in (*scen.workers, fourth, observer):
        worker.close_clean()
    for command in ("prepare", "restore"):
        assert_replays(work_dir / f"{command}.trace.jsonl")

    if trace_out is not None:
        trace_out.mkdir(parents=True, exist_ok=True)
        for command, machine in (("prepare", "capture"), ("restore", "restore")):
            src = work_dir / f"{command}.trace.jsonl"
            assert src.is_file(), f"cuinterpose {command} wrote no trace at {src}"
            shutil.copy(src, trace_out / f"{trace_prefix}-{machine}.jsonl")
        (trace_out / f"{trace_prefix}-result.json").write_text(json.dumps(result, indent=2))
    return result
