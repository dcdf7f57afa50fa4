"""The agent API and the suspend/resume/status verbs on real shims and the simulated driver.

A creator/importer group (tests/shim/agentgroup.py) suspended and resumed through the
CLI and through the library; a failure injected at each native step and at the
coordinator restore, each reported with every process's state, the group running again
with its bytes after a failed suspend; STATUS served while a phase op is in flight;
prepare and restore refusing a process in the wrong native state.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from cuinterpose.engine import StepFailed, agent, runner, watch, wire
from cuinterpose.engine.client import ParticipantHangup, call_all
from cuinterpose.engine.native_checkpoint import ProcessState
from cuinterpose.engine.serial import to_json

from tests.shim import shimenv
from tests.shim.agentgroup import FaultyBackend, Group, WorkerBackend, build_group
from tests.simenv import REPO, Spawn
from tests.waiting import wait_until


@pytest.fixture
def group(spawn: Spawn, shim_env: dict[str, str], plain_env: dict[str, str]) -> Group:
    return build_group(spawn, shim_env, plain_env)


def run_cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    env = dict(env)
    env.pop("SNAPSHOT_CONTROL_DIR", None)  # the command line says where
    return subprocess.run(
        [sys.executable, "-m", "cuinterpose", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def process_args(group: Group) -> list[str]:
    return [w for p in group.pids for w in ("--process", str(p), str(p))]


def status_json(group: Group, control_dir: Path, env: dict[str, str]) -> dict[int, Any]:
    run = run_cli(
        ["status", "--control-dir", str(control_dir), *process_args(group), "--json"], env
    )
    assert run.returncode == 0, run.stderr
    return {p["observed_pid"]: p for p in json.loads(run.stdout)["processes"]}


def states_of(rows: dict[int, Any]) -> set[tuple[str, str]]:
    return {(r["native_state"], r["shim_phase"]) for r in rows.values()}


@pytest.mark.slow
def test_suspend_and_resume_through_the_cli(
    group: Group, control_dir: Path, plain_env: dict[str, str], tmp_path: Path
) -> None:
    ckpt = tmp_path / "ckpt"
    env = dict(plain_env)  # the CLI loads the simulated driver for the native calls
    assert states_of(status_json(group, control_dir, env)) == {("RUNNING", "ACTIVE")}
    before = group.used()
    common = ["--checkpoint-dir", str(ckpt), "--control-dir", str(control_dir)]
    run = run_cli(["suspend", *common, *process_args(group), "--progress", "json"], env)
    assert run.returncode == 0, run.stderr
    events = [json.loads(line) for line in run.stdout.splitlines()]
    steps = [e["step"] for e in events if e["event"] == "step" and e["status"] == "done"]
    assert steps == ["detect", "capture", "native_lock", "native_checkpoint"], events
    save = next(e for e in events if e.get("phase") == "SAVE_ALLOCATIONS" and "machine" in e)
    assert save["allocation_bytes"] == 2 * group.size  # X and the private P
    summary = events[-1]
    assert summary["event"] == "summary"
    assert [t["phase"] for t in summary["timings"]] == steps

    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["cuinterpose"] == {"requested": True, "prepared": True}
    assert {p["observed_pid"] for p in manifest["participants"]} == set(group.pids)
    assert all(re.fullmatch("[0-9a-f]{32}", p["participant"]) for p in manifest["participants"])
    assert [t["phase"] for t in manifest["timings"]] == steps
    # Suspended: every process CHECKPOINTED, the shims PREPARED, the GPU memory free.
    assert states_of(status_json(group, control_dir, env)) == {("CHECKPOINTED", "PREPARED")}
    assert before - group.used() >= 2 * group.size

    run = run_cli(["resume", *common, *process_args(group), "--progress", "human"], env)
    assert run.returncode == 0, run.stderr
    assert "coordinator_restore" in run.stdout and "GB/s" in run.stdout, run.stdout
    assert states_of(status_json(group, control_dir, env)) == {("RUNNING", "ACTIVE")}
    assert group.mismatches() == []
    assert group.used() >= before
    group.close()


@pytest.mark.slow
def test_suspend_and_resume_through_the_library(
    group: Group, control_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    native = WorkerBackend(group.observer)
    where = agent.Where(control_dir)
    seen: list[agent.AgentEvent] = []
    caplog.set_level(logging.INFO, logger=agent.LOGGER_NAME)
    before = group.used()
    done = agent.suspend(
        group.processes, tmp_path, where=where, native=native, on_event=seen.append
    )
    assert done.manifest.prepared and done.manifest.requested
    assert {native.state(p) for p in group.pids} == {ProcessState.CHECKPOINTED}
    assert before - group.used() >= 2 * group.size
    phases = [t.step for t in done.timings]
    assert phases == ["detect", "capture", "native_lock", "native_checkpoint"]
    assert dict((t.step, t.bytes) for t in done.timings)["capture"] == 2 * group.size
    # Every event reached the logger too, with its fields in extra.
    logged = [r.cuinterpose for r in caplog.records if hasattr(r, "cuinterpose")]
    assert logged == [to_json(e) for e in seen]
    assert {"step", "phase", "done"} <= {f["event"] for f in logged}

    back = agent.resume(tmp_path, where=where, native=native, on_event=seen.append)
    assert back.coordinator_restored
    assert [t.step for t in back.timings] == [
        "native_restore",
        "native_unlock",
        "coordinator_restore",
    ]
    rows = agent.status(group.processes, where, native)
    assert {(r.native_state, r.shim_phase) for r in rows} == {("RUNNING", "ACTIVE")}
    assert group.mismatches() == []
    group.close()


@pytest.mark.slow
@pytest.mark.parametrize("step", ["lock", "checkpoint"])
def test_a_failed_suspend_leaves_the_group_running_as_before(
    group: Group, control_dir: Path, tmp_path: Path, step: str
) -> None:
    native = WorkerBackend(group.observer)
    faulty = FaultyBackend(native, step, group.importer.pid)  # the second one
    with pytest.raises(agent.SuspendFailed) as info:
        agent.suspend(group.processes, tmp_path, where=agent.Where(control_dir), native=faulty)
    failed = info.value
    text = str(failed)
    assert failed.restored, text
    assert f"native {step} failed: pid {group.importer.pid}" in text
    assert "CUDA_ERROR_INJECTED" in text
    assert "coordinator restore done" in text
    for pid in group.pids:  # every process named with its native state and shim phase
        assert f"now pid {pid} (ns pid {pid}): native RUNNING, shim ACTIVE" in text, text
    assert "the group runs as before the suspend" in text
    assert not (tmp_path / "manifest.json").exists()
    assert group.mismatches() == []
    # The shims serve the application again: a new allocation, exported.
    handle, _ = group.creator.create_mapped(group.size, seed=5)
    group.creator.check("close", fd=int(group.creator.check("export", handle=handle)["fd"]))
    group.close()


@pytest.mark.slow
@pytest.mark.parametrize("fails", [False, True], ids=["stored", "native-checkpoint-failed"])
def test_a_suspend_stores_beside_the_native_steps_of_real_shims(
    group: Group, control_dir: Path, tmp_path: Path, fails: bool
) -> None:
    """The CRIU verbs' suspend on real shims and the simulated driver's lock and
    checkpoint: STORE_STAGED runs beside them (it makes no CUDA call, so the lock that
    drains the calls in flight does not wait for it). Then a resume fetches and loads
    every byte. A checkpoint that fails instead is undone: what was stored fetched, the
    group running with its bytes."""
    native = WorkerBackend(group.observer)
    where = agent.Where(control_dir)
    backend = FaultyBackend(native, "checkpoint", group.importer.pid) if fails else native
    events: list[agent.AgentEvent] = []
    suspend = partial(agent.suspend, group.processes, tmp_path, where=where, on_event=events.append)
    if fails:
        with pytest.raises(agent.SuspendFailed) as info:
            suspend(native=backend, store_beside=True)
        assert info.value.restored, str(info.value)
        done = [e.step for e in events if isinstance(e, agent.StepEvent) and e.status == "done"]
        assert done.index("undo_fetch_staged") < done.index("undo_coordinator_restore"), done
    else:
        suspended = suspend(native=backend, store_beside=True)
        assert [t.step for t in suspended.timings][-1] == "store_staged"
        assert suspended.timings[-1].bytes == 2 * group.size
        assert {native.state(p) for p in group.pids} == {ProcessState.CHECKPOINTED}
        back = agent.resume(tmp_path, where=where, native=native)
        assert "fetch_staged" in [t.step for t in back.timings]
    rows = agent.status(group.processes, where, native)
    assert {(r.native_state, r.shim_phase) for r in rows} == {("RUNNING", "ACTIVE")}
    assert group.mismatches() == []
    group.close()


@pytest.mark.slow
def test_a_failed_native_restore_names_every_process(
    group: Group, control_dir: Path, tmp_path: Path
) -> None:
    native = WorkerBackend(group.observer)
    where = agent.Where(control_dir)
    agent.suspend(group.processes, tmp_path, where=where, native=native)
    faulty = FaultyBackend(native, "restore", group.importer.pid)
    with pytest.raises(agent.ResumeFailed) as info:
        agent.resume(tmp_path, where=where, native=faulty)
    text = str(info.value)
    assert f"native restore failed: pid {group.importer.pid}" in text
    creator, importer = group.creator.pid, group.importer.pid
    assert f"now pid {creator} (ns pid {creator}): native LOCKED, shim PREPARED" in text, text
    assert f"now pid {importer} (ns pid {importer}): native CHECKPOINTED, shim PREPARED" in text
    # The resume can be finished: the restored one is unlocked and the rest done by hand.
    native.restore(importer)
    for pid in group.pids:
        native.unlock(pid)
    runner.restore([where.endpoint(agent.Process(p, p)) for p in group.pids], tmp_path)
    assert group.mismatches() == []
    group.close()


@pytest.mark.slow
def test_a_failed_coordinator_restore_rolls_back_and_names_every_process(
    group: Group, control_dir: Path, tmp_path: Path
) -> None:
    native = WorkerBackend(group.observer)
    where = agent.Where(control_dir)
    agent.suspend(group.processes, tmp_path, where=where, native=native)

    def failing_load(calls: Any, *, timeout: float) -> list[Any]:
        results = call_all(calls, timeout=timeout)
        endpoint, request, _ = calls[0]
        if request.op is wire.Op.LOAD_ALLOCATIONS:
            results[0] = ParticipantHangup(endpoint, request.op, "injected hang-up")
        return results

    options = runner.Options(transport=failing_load)
    with pytest.raises(agent.ResumeFailed) as info:
        agent.resume(tmp_path, where=where, native=native, options=options)
    text = str(info.value)
    assert "LOAD_ALLOCATIONS" in text and "injected hang-up" in text, text
    assert "rolled back" in text
    for pid in group.pids:
        assert f"now pid {pid} (ns pid {pid}): native RUNNING, shim ACTIVE" in text, text
    assert group.mismatches() == []
    group.close()


def test_status_is_served_while_a_phase_op_is_in_flight(
    group: Group, control_dir: Path, tmp_path: Path
) -> None:
    """A natively locked process blocks its shim's driver calls: PREPARE_MULTICAST waits
    in its drain (cuCtxSynchronize), SAVE_ALLOCATIONS before its first chunk; STATUS
    answers meanwhile with the op in flight and its bytes."""
    native = WorkerBackend(group.observer)
    creator = group.creator.pid
    path = shimenv.socket_path(control_dir, creator)
    me = shimenv.handshake(path).participant
    endpoints = [agent.Where(control_dir).endpoint(agent.Process(p, p)) for p in group.pids]
    _, topology = runner.inspect(endpoints, timeout=30)

    def in_flight() -> wire.InFlight:
        # Anonymous (as `cuinterpose status` asks) and bound: the same answer.
        anonymous, _ = shimenv.request(path, wire.Request(wire.Op.STATUS))
        reply, _ = shimenv.request(path, wire.Request(wire.Op.STATUS, participant=me))
        assert reply.status is wire.Status.OK and reply.participant == me, reply
        assert anonymous.status is wire.Status.OK and anonymous.participant == me, anonymous
        return wire.InFlight.from_stats(reply.stats)

    assert in_flight() == wire.InFlight(None, 0, 0, 0)
    other, _ = shimenv.request(path, wire.Request(wire.Op.STATUS, participant="0" * 32))
    assert other.status is wire.Status.WRONG_PARTICIPANT
    steps = (
        (wire.Op.QUIESCE, 0),  # its idle check waits in cuCtxSynchronize
        (wire.Op.PREPARE_MULTICAST, 0),
        (wire.Op.SAVE_ALLOCATIONS, 2 * group.size),  # X and the private P
    )
    for op, total in steps:
        native.lock(creator, 10_000)
        answers: list[wire.Reply] = []
        sender = threading.Thread(
            target=lambda op=op, answers=answers: answers.append(
                shimenv.request(path, wire.Request(op, participant=me))[0]
            )
        )
        sender.start()
        wait_until(lambda op=op: in_flight().op is op, f"{op.name} in flight")
        flight = in_flight()
        assert (flight.bytes_done, flight.bytes_total) == (0, total), flight
        assert not answers  # still blocked on the locked driver
        if op is wire.Op.SAVE_ALLOCATIONS:  # the agent's progress sees it too
            seen: list[agent.CopyProgress] = []
            with watch.CopyWatcher([(endpoints[0], me)], seen.append):
                wait_until(lambda seen=seen: seen, "a copy progress event")
            assert seen[0].op == "SAVE_ALLOCATIONS"
            assert (seen[0].bytes_done, seen[0].bytes_total) == (0, 2 * group.size)
        native.unlock(creator)
        sender.join()
        assert answers[0].status is wire.Status.OK, answers[0]
        assert in_flight().op is None
    assert answers[0].stats.bytes == 2 * group.size
    assert in_flight().bytes_done == 0  # nothing in flight: nothing reported
    # Only the creator moved; bring it back with the importer.
    runner.rollback(endpoints, tmp_path, captured=topology)
    assert group.mismatches() == []
    group.close()


def test_prepare_and_restore_refuse_a_process_in_the_wrong_native_state(
    group: Group, control_dir: Path, plain_env: dict[str, str], tmp_path: Path
) -> None:
    native = WorkerBackend(group.observer)
    importer = group.importer.pid
    native.lock(importer, 10_000)
    common = ["--checkpoint-dir", str(tmp_path), "--control-dir", str(control_dir)]
    for command, hint in (("prepare", "resume"), ("restore", "native restore and unlock")):
        run = run_cli([command, *common, *process_args(group)], plain_env)
        assert run.returncode == 1, (command, run.stderr)
        assert f"pid {importer} (ns pid {importer}) is LOCKED, not RUNNING" in run.stderr
        assert hint in run.stderr, run.stderr
    native.unlock(importer)
    rows = agent.status(group.processes, agent.Where(control_dir), native)
    assert {(r.native_state, r.shim_phase) for r in rows} == {("RUNNING", "ACTIVE")}
    assert not (tmp_path / "cuinterpose.state").exists()
    group.close()


def test_the_readme_embedding_example_runs(group: Group, control_dir: Path, tmp_path: Path) -> None:
    text = (REPO / "README.md").read_text()
    match = re.search(r"<!-- embedding example -->\s*```python\n(.*?)```", text, re.S)
    assert match, "README.md has no embedding example"
    namespace: dict[str, Any] = {}
    exec(compile(match[1], "README.md", "exec"), namespace)
    native = WorkerBackend(group.observer)
    namespace["suspend_and_resume"](group.processes, tmp_path, control_dir, native)
    assert group.mismatches() == []
    group.close()


def test_the_cli_gives_a_clear_error_for_a_missing_manifest(
    group: Group, control_dir: Path, plain_env: dict[str, str], tmp_path: Path
) -> None:
    common = ["--checkpoint-dir", str(tmp_path), "--control-dir", str(control_dir)]
    run = run_cli(["resume", *common, *process_args(group)], plain_env)
    assert run.returncode == 1
    assert "no manifest" in run.stderr and "nothing was suspended" in run.stderr
    group.close()


@pytest.mark.slow
def test_the_suspend_benchmark_runs_on_the_simulator(stack: None, tmp_path: Path) -> None:
    """bench/suspend.py is what the H200 run executes (tests/gpu/run_h200.sh)."""
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    script = REPO / "bench" / "suspend.py"
    out = tmp_path / "suspend.json"
    run = subprocess.run(
        [sys.executable, str(script), "--driver", "sim", "--mib", "4", "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "suspend native_checkpoint" in run.stdout and "ok True" in run.stdout, run.stdout
    result = json.loads(out.read_text())
    assert result["cuinterpose"]["gpu_bytes_freed_while_suspended"] >= 8 << 20
    assert set(result["native"]["suspend"]["steps"]) == {
        "detect",
        "native_lock",
        "native_checkpoint",
    }


def test_a_drain_that_cannot_enter_a_context_refuses_before_any_teardown(
    spawn: Spawn, control_dir: Path, tmp_path: Path
) -> None:
    """QUIESCE waits for every known context, each call checked: an allocation whose
    context the application destroyed refuses it, and nothing is torn down."""
    app = spawn("app")
    app(
        "c2 = check(cu.cuCtxCreate(None, 0, dev))\n"
        "h2 = check(cu.cuMemCreate(2 * gran, prop(), 0))\n"
        "os.close(export(h2))\n"
        "check(cu.cuCtxSetCurrent(ctx))\n"
        "check(cu.cuCtxDestroy(c2))\n"
        "result = None"
    )
    endpoint = agent.Where(control_dir).endpoint(agent.Process(app.pid, app.pid))
    with pytest.raises(StepFailed) as info:
        runner.capture([endpoint], tmp_path)
    error = info.value
    assert error.step == "QUIESCE", error
    assert "cuCtxPushCurrent failed: CUDA_ERROR_INVALID_CONTEXT" in str(error), error
    assert not error.destroyed, error
    reply, _ = shimenv.request(
        shimenv.socket_path(control_dir, app.pid), wire.Request(wire.Op.STATUS)
    )
    assert reply.phase is wire.Phase.ACTIVE


@pytest.mark.slow
def test_ctrl_c_during_a_suspends_copy_is_acknowledged_at_once_with_the_bytes_in_flight(
    spawn: Spawn, shim_env: dict[str, str], plain_env: dict[str, str], control_dir: Path,
    tmp_path: Path,
) -> None:  # fmt: skip
    # Each copy chunk is a piece of stream work of 0.3 s on the simulated driver: the
    # SAVE of the group's 8 MiB in 1 MiB chunks takes seconds.
    slow = {**shim_env, "CUINTERPOSE_SIM_WORK_US": "300000", "SNAPSHOT_SHIM_COPY_CHUNK_MIB": "1",
            "SNAPSHOT_SHIM_COPY_THREADS": "1"}  # fmt: skip
    group = build_group(spawn, slow, plain_env)
    env = {k: v for k, v in plain_env.items() if k != "SNAPSHOT_CONTROL_DIR"}
    argv = [sys.executable, "-m", "cuinterpose", "suspend", "--checkpoint-dir",
            str(tmp_path / "ckpt"), "--control-dir", str(control_dir), "--progress", "json",
            *process_args(group)]  # fmt: skip
    suspend = subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert suspend.stdout is not None and suspend.stderr is not None
    for line in suspend.stdout:  # the watcher has seen the copy under way
        if json.loads(line).get("event") == "copy":
            break
    suspend.send_signal(signal.SIGINT)
    said = suspend.stderr.readline()
    still_copying = suspend.poll() is None
    out, err = suspend.communicate(timeout=120)
    assert still_copying, said
    assert re.match(
        r"cuinterpose: stopping: waiting for SAVE_ALLOCATIONS on every process \(in flight: "
        r"\d+(\.\d)? [KM]?i?B of 8\.0 MiB copied\) to end; "
        "then what was changed is undone, and the group runs as before\n",
        said,
    ), said
    # One exit status for "the group runs as before": the interrupted capture was undone.
    assert suspend.returncode == 1, err
    summary = json.loads(out.splitlines()[-1])
    assert (summary["event"], summary["exit_code"]) == ("summary", 1)
    assert not (tmp_path / "ckpt" / "manifest.json").exists()
    assert group.mismatches() == []
    group.close()
