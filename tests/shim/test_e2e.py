"""End to end on the simulated driver: the shim, the coordinator CLI and the native
checkpoint calls together, with real processes sharing real memory.

Three processes (a creator with two exportable allocations and a private one; an
importer mapping one allocation twice; an importer of both) fill memory; then
``cuinterpose prepare``, native lock + checkpoint of all, native restore + unlock of
all, ``cuinterpose restore``. Every byte must be back at its VA, the old logical
handles must keep working, and a process arriving afterwards must be able to import
a capability exported before the checkpoint. Separately, a live raw import and an
unsupported exportable must each refuse the capture before anything destructive,
with the application still running.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from cuinterpose import demo, launch, native_calls
from cuinterpose.demo import coordinator_env, pattern_digest
from cuinterpose.engine import artifacts

from tests.shim.workers.cycle import (
    assert_refused,
    assert_replays,
    assert_still_active,
    cli,
    three_process_cycle,
)
from tests.simenv import Spawn


@pytest.mark.slow
def test_three_processes_checkpoint_and_restore(
    spawn: Spawn,
    shim_env: dict[str, str],
    plain_env: dict[str, str],
    control_dir: Path,
    tmp_path: Path,
) -> None:
    result = three_process_cycle(spawn, shim_env, plain_env, control_dir, tmp_path)
    assert result["gpu_used"]["checkpointed"] < result["gpu_used"]["filled"]


def test_live_raw_import_refuses_capture(
    spawn: Spawn,
    shim_env: dict[str, str],
    plain_env: dict[str, str],
    control_dir: Path,
    tmp_path: Path,
) -> None:
    outsider = spawn("outsider-no-shim", plain_env)
    app = spawn("app", shim_env)
    gran = int(app.check("granularity")["granularity"])
    mine, my_va = app.create_mapped(2 * gran, seed=31)
    app.check("close", fd=int(app.check("export", handle=mine)["fd"]))  # now shared
    raw, _ = outsider.create_mapped(gran, seed=32)
    raw_fd = int(outsider.check("export", handle=raw)["fd"])
    fd = outsider.send_fd_to(app, raw_fd, close=True)
    imported = int(app.check("import", fd=fd)["handle"])
    raw_va = app.map_at_new_va(imported, gran)
    assert app.digest(raw_va, gran) == pattern_digest(32, gran)

    assert_refused(cli("prepare", [app.pid], control_dir, tmp_path), "RAW_IMPORT", app.pid)
    assert_replays(tmp_path / "prepare.trace.jsonl")
    assert_still_active(app, mine, my_va, 2 * gran, 31)
    assert app.digest(raw_va, gran) == pattern_digest(32, gran)
    app.close_clean()
    outsider.close_clean()


def test_unsupported_exportable_refuses_capture(
    spawn: Spawn, shim_env: dict[str, str], control_dir: Path, tmp_path: Path
) -> None:
    app = spawn("app", shim_env)
    gran = int(app.check("granularity")["granularity"])
    mine, my_va = app.create_mapped(2 * gran, seed=41)
    app.check("close", fd=int(app.check("export", handle=mine)["fd"]))
    _fabric, fabric_va = app.create_mapped(gran, handle_type="fabric", seed=42)

    run = cli("prepare", [app.pid], control_dir, tmp_path)
    assert_refused(run, "UNSUPPORTED_EXPORTABLE", app.pid)
    assert_still_active(app, mine, my_va, 2 * gran, 41)
    assert app.digest(fabric_va, gran) == pattern_digest(42, gran)
    app.close_clean()


@pytest.mark.parametrize("seed,size,offset,length", [(1, 100, 0, None), (2, 5 << 20, 7, 1000)])
def test_pattern_digest_slices(seed: int, size: int, offset: int, length: int | None) -> None:
    """The controller's expected digests are slices of the very bytes ``fill`` writes."""
    import hashlib

    from cuinterpose.demo import worker  # needs cuda.bindings importable, not a driver

    data = b"".join(worker.pattern(seed, size))
    end = size if length is None else offset + length
    assert (
        pattern_digest(seed, size, offset, length) == hashlib.sha256(data[offset:end]).hexdigest()
    )


def test_native_errors_name_pid_call_and_result(
    spawn: Spawn, plain_env: dict[str, str], control_dir: Path
) -> None:
    app = spawn("app", plain_env)
    stranger = os.getpid()  # not a CUDA process of the simulated driver
    with pytest.raises(native_calls.NativeError) as info:
        native_calls.run_in_subprocess("checkpoint-all", [app.pid, stranger], env=plain_env)
    err = info.value
    assert (err.pid, err.call) == (stranger, "cuCheckpointProcessLock")
    assert err.result.startswith("CUDA_ERROR_"), err
    assert f"pid {stranger}" in str(err) and err.result in str(err)
    # The lock that had succeeded was undone: the application runs on.
    assert f"unlocked again: {app.pid}" in str(err)
    states = native_calls.run_in_subprocess("state", [app.pid], env=plain_env)["states"]
    assert states == {str(app.pid): "RUNNING"}
    assert app.check("granularity")["granularity"] > 0
    tids = native_calls.run_in_subprocess("restore-thread-id", [app.pid], env=plain_env)
    tid = tids["restore_thread_ids"][str(app.pid)]
    assert Path(f"/proc/{app.pid}/task/{tid}").is_dir(), tids  # a thread of that process

    with pytest.raises(native_calls.NativeError) as info:
        native_calls.run_in_subprocess("restore-all", [app.pid], env=plain_env)
    assert (info.value.pid, info.value.call) == (app.pid, "cuCheckpointProcessRestore")
    assert info.value.result.startswith("CUDA_ERROR_")
    app.close_clean()


def test_launch_preloads_the_shim_and_creates_the_control_dir(control_dir: Path) -> None:
    try:
        shim, sim = artifacts.shim_library(), artifacts.sim_library_dir()
    except artifacts.ArtifactMissingError as exc:
        pytest.skip(str(exc))
    control = control_dir / "new" / "control"  # within the 60 bytes a shim accepts
    probe = (
        "import json, os, sys; "
        "print(json.dumps({k: os.environ.get(k, '') for k in "
        "('LD_PRELOAD', 'LD_LIBRARY_PATH', 'SNAPSHOT_CONTROL_DIR')})); sys.exit(3)"
    )
    env = coordinator_env()
    env["LD_PRELOAD"] = ""
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "cuinterpose",
            "launch",
            "--driver",
            "sim",
            "--control-dir",
            str(control),
            "--",
            sys.executable,
            "-c",
            probe,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert run.returncode == 3, run.stderr
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    assert seen["LD_PRELOAD"].split(":")[-1] == str(shim)
    assert seen["LD_LIBRARY_PATH"].split(":")[0] == str(sim)
    assert seen["SNAPSHOT_CONTROL_DIR"] == str(control)
    assert control.is_dir() and stat.S_IMODE(control.stat().st_mode) == 0o700

    system = launch.launch_env(driver="system", control_dir=None, base={"LD_LIBRARY_PATH": "/x"})
    assert system["LD_LIBRARY_PATH"] == "/x"
    assert system["SNAPSHOT_CONTROL_DIR"] == "/snapshot-control"
    with pytest.raises(launch.LaunchError, match="unknown driver"):
        launch.launch_env(driver="gpu", control_dir=None)


def test_native_group_arguments_and_timings_round_trip() -> None:
    for bad in ([], [5, 5], [0]):
        with pytest.raises(ValueError):
            native_calls.run_in_subprocess("state", bad, env={})
    with pytest.raises(ValueError, match="unknown native action"):
        native_calls.run_in_subprocess("freeze", [1], env={})
    timings = native_calls.GroupTimings(
        "checkpoint", (3, 4), 0.5, 1.5, 2.0, (native_calls.CallTiming(3, "lock", 0.25),)
    )
    assert native_calls.GroupTimings.from_json(json.loads(json.dumps(timings.to_json()))) == timings
    assert str(native_calls.NativeError(7, "cuCheckpointProcessLock", "CUDA_ERROR_TIMEOUT")) == (
        "pid 7: cuCheckpointProcessLock failed: CUDA_ERROR_TIMEOUT"
    )


@pytest.mark.slow
def test_demo_runs_clean(stack: None) -> None:
    """``make demo``'s job, on the release build: exit 0 and every byte verified."""
    try:
        artifacts.shim_library(), artifacts.sim_library_dir()
    except artifacts.ArtifactMissingError as exc:
        pytest.skip(str(exc))
    lines: list[str] = []
    assert demo.run_demo(driver="sim", out=lines.append) == 0, "\n".join(lines)
    assert lines[-1].startswith("PASS: 7 ranges"), lines
    assert "freed while suspended" in lines[-1]
    assert any(line.startswith("suspend: ") for line in lines), lines
