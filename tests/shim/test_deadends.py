"""No dead ends (specs/recovery.md, "Every way a run ends"), on real shims over the
simulated driver.

Each case ends with every survivor running with its bytes checked and a report that
says what happened. Waits are on observable states: a shim's STATUS naming the call
its gate holds, a process's exit.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from cuinterpose.demo import coordinator_env, pattern_digest
from cuinterpose.engine import (
    OpEvent,
    Options,
    StepFailed,
    capture,
    endpoint_for,
    restore,
    wire,
)

from tests import snippet
from tests.shim import shimenv
from tests.shim.pair import Pair, running_as_before, share
from tests.shim.workers.cycle import assert_still_active, cli
from tests.simenv import Spawn
from tests.waiting import wait_until

SEED = 131


def _held(control_dir: Path, pid: int) -> str:
    """What the shim's gate holds, from STATUS (empty when nothing)."""
    reply, _ = shimenv.request(shimenv.socket_path(control_dir, pid), wire.Request(wire.Op.STATUS))
    return reply.message


def run_cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    env = dict(env)
    env.pop("SNAPSHOT_CONTROL_DIR", None)
    return subprocess.run(
        [sys.executable, "-m", "cuinterpose", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _processes(pair: Pair) -> list[str]:
    return [w for p in pair.pids for w in ("--process", str(p), str(p))]


def _phases(pair: Pair, control_dir: Path, env: dict[str, str]) -> dict[int, str]:
    run = run_cli(["status", "--control-dir", str(control_dir), *_processes(pair), "--json"], env)
    assert run.returncode == 0, run.stdout + run.stderr
    return {p["observed_pid"]: p["shim_phase"] for p in json.loads(run.stdout)["processes"]}


# -- the gate opens last ---------------------------------------------------------------------


def test_a_call_held_while_prepared_runs_after_the_restore_is_verified(
    spawn: Spawn, shim_env: dict[str, str], control_dir: Path, tmp_path: Path
) -> None:
    """The importer unmaps its view while the group is PREPARED: the call waits at the
    gate through the whole restore, its last INSPECT and VERIFY included, and runs once
    the coordinator released the group; the restore succeeds."""
    pair = share(spawn, shim_env, SEED)
    importer = pair.importer
    kept = int(importer.check("retain", va=pair.importer_va)["handle"])  # to map it again
    prepared = cli("prepare", pair.pids, control_dir, tmp_path)
    assert prepared.returncode == 0, prepared.stderr
    importer.send(f"result = err(cu.cuMemUnmap(cu.CUdeviceptr({pair.importer_va}), {pair.size}))")
    wait_until(lambda: "cuMemUnmap" in _held(control_dir, importer.pid), "the unmap is held")
    restored = cli("restore", pair.pids, control_dir, tmp_path)
    assert restored.returncode == 0, restored.stderr
    assert importer.reply() == "CUDA_SUCCESS"  # it ran, after the verification
    assert _held(control_dir, importer.pid) == ""
    # The import is live: mapped again, its bytes are the creator's, and shared.
    va = importer.map_at_new_va(kept, pair.size)
    assert importer.digest(va, pair.size) == pattern_digest(SEED, pair.size)
    pair.creator.check("fill", va=pair.va, size=pair.size, seed=SEED + 1)
    assert importer.digest(va, pair.size) == pattern_digest(SEED + 1, pair.size)
    assert_still_active(pair.creator, pair.handle, pair.va, pair.size, SEED + 1)
    pair.creator.close_clean()
    importer.close_clean()


# -- fail closed -----------------------------------------------------------------------------


def _no_driver_env() -> dict[str, str]:
    env = coordinator_env()
    probe = "from cuinterpose.engine.native_checkpoint import CudaBackend; CudaBackend().driver()"
    loads = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, check=False)
    if loads.returncode == 0:
        pytest.skip("a CUDA driver loads without the simulated one here")
    return env


def _machine(verb: str, pair: Pair, control_dir: Path, ckpt: Path, *extra: str) -> list[str]:
    return [verb, "--checkpoint-dir", str(ckpt), "--control-dir", str(control_dir),
            *_processes(pair), "--progress", "json", *extra]  # fmt: skip


@pytest.mark.parametrize("verb", ["prepare", "restore"])
def test_a_native_state_that_cannot_be_checked_refuses(
    spawn: Spawn, shim_env: dict[str, str], control_dir: Path, tmp_path: Path, verb: str
) -> None:
    pair = share(spawn, shim_env, SEED)
    ckpt = tmp_path / "checkpoint"
    ckpt.mkdir()
    env = _no_driver_env()
    if verb == "restore":
        prepared = cli("prepare", pair.pids, control_dir, tmp_path)
        assert prepared.returncode == 0, prepared.stderr
    run = run_cli(_machine(verb, pair, control_dir, ckpt), env)
    assert run.returncode == 1, run.stdout + run.stderr
    assert f"{verb} refused: the native state of the processes cannot be checked" in run.stderr
    assert "--skip-native-check" in run.stderr
    assert '"event": "phase"' not in run.stdout  # nothing was sent
    # The override: for those who know every process is RUNNING.
    if verb == "prepare":
        run = run_cli(_machine("prepare", pair, control_dir, ckpt, "--skip-native-check"), env)
        assert run.returncode == 0, run.stderr
        assert "not checked (--skip-native-check)" in run.stderr
    run = run_cli(_machine("restore", pair, control_dir, ckpt, "--skip-native-check"), env)
    assert run.returncode == 0, run.stderr
    running_as_before(pair, write_seed=SEED + 2)


# -- survivors run ---------------------------------------------------------------------------


def _recover_cli(
    pids: list[int], control_dir: Path, tmp_path: Path
) -> subprocess.CompletedProcess[str]:
    argv = ["recover", "--checkpoint-dir", str(tmp_path / "checkpoint"), "--control-dir",
            str(control_dir), "--progress", "none"]  # fmt: skip
    for pid in pids:
        argv += ["--process", str(pid), str(pid)]
    return run_cli(argv, shimenv.coordinator_cli_env(control_dir))


@pytest.mark.parametrize("named", ["everyone", "survivor"])
def test_an_importer_dead_between_prepare_and_restore_leaves_a_way_back(
    spawn: Spawn, shim_env: dict[str, str], control_dir: Path, tmp_path: Path, named: str
) -> None:
    pair = share(spawn, shim_env, SEED)
    prepared = cli("prepare", pair.pids, control_dir, tmp_path)
    assert prepared.returncode == 0, prepared.stderr
    dead = pair.importer.pid
    pair.importer.kill()
    # The restore of the whole group refuses, naming the dead process and the way back.
    refused = cli("restore", pair.pids, control_dir, tmp_path)
    assert refused.returncode == 1, refused.stderr
    assert f"pid {dead} (ns pid {dead}) is gone" in refused.stderr, refused.stderr
    assert "cuinterpose recover" in refused.stderr, refused.stderr
    pids = pair.pids if named == "everyone" else [pair.creator.pid]
    if named == "survivor":  # the restore of the survivor alone names the way back too
        alone = cli("restore", pids, control_dir, tmp_path)
        assert alone.returncode == 1 and "cuinterpose recover" in alone.stderr, alone.stderr
    recovered = _recover_cli(pids, control_dir, tmp_path)
    assert recovered.returncode == 0, recovered.stdout + recovered.stderr
    assert "recover: rolled back" in recovered.stdout, recovered.stdout
    assert f"pid {dead}" in recovered.stdout, recovered.stdout  # named: gone, or not given
    assert_still_active(pair.creator, pair.handle, pair.va, pair.size, SEED)
    pair.creator.close_clean()


# -- late writes ---------------------------------------------------------------------------


def _small_files() -> None:
    # Room for the lock file's pid line, not for the restore marker or the manifest.
    resource.setrlimit(resource.RLIMIT_FSIZE, (16, 16))


def _limited(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    env = dict(env)
    env.pop("SNAPSHOT_CONTROL_DIR", None)
    return subprocess.run(
        [sys.executable, "-m", "cuinterpose", *args], env=env, capture_output=True, text=True,
        timeout=120, check=False, preexec_fn=_small_files,
    )  # fmt: skip


def test_a_restore_whose_marker_cannot_be_written_says_so_and_leaves_a_usable_directory(
    spawn: Spawn, shim_env: dict[str, str], control_dir: Path, tmp_path: Path
) -> None:
    pair = share(spawn, shim_env, SEED)
    ckpt = tmp_path / "checkpoint"
    assert cli("prepare", pair.pids, control_dir, tmp_path).returncode == 0
    run = _limited(_machine("restore", pair, control_dir, ckpt),
                   shimenv.coordinator_cli_env(control_dir))  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "Traceback" not in run.stderr
    assert "note: the group runs, but" in run.stderr and "removed instead" in run.stderr
    # The directory takes the next capture without --replace.
    again = cli("prepare", pair.pids, control_dir, tmp_path)
    assert again.returncode == 0, again.stderr
    assert cli("restore", pair.pids, control_dir, tmp_path).returncode == 0
    running_as_before(pair, write_seed=SEED + 3)


def test_a_resume_whose_manifest_cannot_be_written_says_so_and_leaves_a_usable_directory(
    spawn: Spawn,
    shim_env: dict[str, str],
    plain_env: dict[str, str],
    control_dir: Path,
    tmp_path: Path,
) -> None:
    pair = share(spawn, shim_env, SEED)
    ckpt = tmp_path / "ckpt"
    common = ["--checkpoint-dir", str(ckpt), "--control-dir", str(control_dir), *_processes(pair)]
    assert run_cli(["suspend", *common], plain_env).returncode == 0
    run = _limited(["resume", *common, "--progress", "none"], plain_env)
    assert run.returncode == 0, run.stderr
    assert "Traceback" not in run.stderr
    assert "manifest.json was removed instead" in run.stderr, run.stderr
    assert run_cli(["suspend", *common], plain_env).returncode == 0  # not "resume it first"
    assert run_cli(["resume", *common], plain_env).returncode == 0
    running_as_before(pair, write_seed=SEED + 4)


# -- one control-path limit ------------------------------------------------------------------


def _dir_of_length(base: Path, size: int) -> Path:
    path = base / ("d" * (size - len(str(base)) - 1))
    assert len(str(path)) == size
    return path


def test_the_control_path_limit_is_the_same_for_launch_the_shim_and_the_coordinator(
    spawn: Spawn, shim_env: dict[str, str], control_dir: Path
) -> None:
    base = Path("/tmp") / f"cip-limit-{control_dir.name}"
    base.mkdir(mode=0o700)
    try:
        at_limit, over = _dir_of_length(base, 60), _dir_of_length(base, 61)
        for path in (at_limit, over):
            path.mkdir(mode=0o700)
        # The shim: serves at the limit, refuses one byte more with the reason.
        served = spawn("served", {**shim_env, "SNAPSHOT_CONTROL_DIR": str(at_limit)})
        shimenv.wait_socket(at_limit, served.pid)
        refused = spawn("refused", {**shim_env, "SNAPSHOT_CONTROL_DIR": str(over)})
        refused.check("granularity")  # a tracked start of the shim
        wait_until(lambda: "at most 60 bytes" in refused.stderr_text(), "the shim says why")
        assert not list(over.iterdir())
        # The coordinator and launch refuse the same path, with the same reason.
        env = shimenv.coordinator_cli_env(control_dir)
        for args in (
            ["status", "--control-dir", str(over), "--process", "1", "1"],
            ["launch", "--control-dir", str(over), "--", "true"],
        ):
            run = run_cli(args, env)
            assert run.returncode in (1, 2), run.stdout + run.stderr
            assert "over the 60 a shim accepts" in run.stderr, run.stderr
        run = run_cli(["status", "--control-dir", str(at_limit), "--process", str(served.pid),
                       str(served.pid), "--json"], env)  # fmt: skip
        assert run.returncode == 0, run.stderr
        served.close_clean()
        refused.close_clean()
    finally:
        shutil.rmtree(base)


# -- a shim out of file descriptors ----------------------------------------------------------

FILL_FDS = snippet.load(__file__, "fill_fds")
FREE_FDS = snippet.load(__file__, "free_fds")


def test_a_shim_out_of_file_descriptors_is_named_at_once(
    spawn: Spawn, shim_env: dict[str, str], control_dir: Path, tmp_path: Path
) -> None:
    pair = share(spawn, shim_env, SEED)
    assert pair.importer(FILL_FDS) > 0
    run = cli("prepare", pair.pids, control_dir, tmp_path, timeout_s=60)
    assert run.returncode == 1, run.stderr
    assert "out of file descriptors (EMFILE" in run.stderr, run.stderr
    assert str(pair.importer.pid) in run.stderr
    assert run.seconds < 30, run.seconds  # named at once, not after the phase timeout
    pair.importer(FREE_FDS)
    assert cli("prepare", pair.pids, control_dir, tmp_path).returncode == 0
    assert cli("restore", pair.pids, control_dir, tmp_path).returncode == 0
    running_as_before(pair, write_seed=SEED + 5)


# -- a lease that lapses ---------------------------------------------------------------------


def test_a_lease_taken_on_a_prepared_group_lapses_when_its_holder_is_silent(
    spawn: Spawn, shim_env: dict[str, str], control_dir: Path, tmp_path: Path
) -> None:
    pair = share(spawn, {**shim_env, "SNAPSHOT_LEASE_IDLE_S": "5"}, SEED)
    assert cli("prepare", pair.pids, control_dir, tmp_path).returncode == 0
    # This test's process takes the free lease with one HANDSHAKE, and lives on.
    path = shimenv.socket_path(control_dir, pair.creator.pid)
    taken, _ = shimenv.request(path, wire.Request(wire.Op.HANDSHAKE, authorization=os.urandom(16)))
    assert taken.status is wire.Status.OK
    refused = cli("restore", pair.pids, control_dir, tmp_path)
    assert refused.returncode == 1, refused.stderr
    assert f"another coordinator holds this process (pid {os.getpid()}" in refused.stderr
    # Silent for SNAPSHOT_LEASE_IDLE_S while PREPARED: the lease lapses, a restore goes on.
    outcomes: list[int] = []

    def restored() -> bool:
        outcomes.append(cli("restore", pair.pids, control_dir, tmp_path).returncode)
        return outcomes[-1] == 0

    wait_until(restored, "the lease lapses")
    assert set(outcomes) <= {0, 1}, outcomes  # refused, never failed half way
    running_as_before(pair, write_seed=SEED + 6)


def test_a_stray_handshake_does_not_keep_a_prepared_group_from_its_restore(
    spawn: Spawn, shim_env: dict[str, str], control_dir: Path, tmp_path: Path
) -> None:
    """A process that HANDSHAKEs (and INSPECTs) and lives on, doing nothing else: the next
    coordinator takes the lease once SNAPSHOT_LEASE_HANDSHAKE_S has passed (1 ms here,
    10 s by default), not after SNAPSHOT_LEASE_IDLE_S (600 s)."""
    pair = share(spawn, {**shim_env, "SNAPSHOT_LEASE_HANDSHAKE_S": "0.001"}, SEED)
    assert cli("prepare", pair.pids, control_dir, tmp_path).returncode == 0
    for pid in pair.pids:
        path = shimenv.socket_path(control_dir, pid)
        stray = os.urandom(16)
        taken, _ = shimenv.request(path, wire.Request(wire.Op.HANDSHAKE, authorization=stray))
        assert taken.status is wire.Status.OK
        read, _ = shimenv.request(path, wire.Request(
            wire.Op.INSPECT, participant=taken.participant, authorization=stray))  # fmt: skip
        assert read.status is wire.Status.OK and read.phase is wire.Phase.PREPARED
    restored = cli("restore", pair.pids, control_dir, tmp_path)
    assert restored.returncode == 0, restored.stderr
    running_as_before(pair, write_seed=SEED + 6)


# -- a creator lost mid-restore --------------------------------------------------------------


@pytest.mark.parametrize("phase", ["LOAD_ALLOCATIONS", "INSPECT"])
def test_a_creator_lost_mid_restore_leaves_its_importer_running_with_its_own_memory(
    spawn: Spawn, shim_env: dict[str, str], control_dir: Path, tmp_path: Path, phase: str
) -> None:
    pair = share(spawn, shim_env, SEED)
    importer = pair.importer
    own_handle, own_va = importer.create_mapped(pair.size, seed=SEED + 9)  # private memory
    endpoints = [endpoint_for(w.pid, w.pid, control_dir=control_dir) for w in
                 (pair.creator, importer)]  # fmt: skip
    ckpt = tmp_path / "checkpoint"
    ckpt.mkdir()
    capture(endpoints, ckpt, Options(60.0))
    creator = pair.creator

    def on_progress(event: object) -> None:
        done = isinstance(event, OpEvent) and (event.machine, event.phase) == ("restore", phase)
        if done and not creator.closed:
            creator.kill()

    with pytest.raises(StepFailed) as caught:
        restore(endpoints, ckpt, Options(60.0, on_progress=on_progress))
    error = caught.value
    assert str(creator.pid) in str(error)
    assert error.rolled_back, error.rollback_error
    # The importer runs: ACTIVE, its gate open, its own bytes there, and the range it
    # imported from the dead creator named as lost.
    assert any("lost (creator gone)" in line and f"0x{pair.importer_va:x}" in line
               for line in error.rollback_lost), error.rollback_lost  # fmt: skip
    assert _held(control_dir, importer.pid) == ""
    assert importer.digest(own_va, pair.size) == pattern_digest(SEED + 9, pair.size)
    assert_still_active(importer, own_handle, own_va, pair.size, SEED + 9)
    importer.close_clean()


# How each process is left natively before recover: a suspend or a resume stopped
# between its native steps (none, one, or both steps done on a process).
NATIVE_MIXES = {
    "checkpointed": ((), ()),
    "locked+checkpointed": (("restore",), ()),
    "running+locked": (("restore", "unlock"), ("restore",)),
}


@pytest.mark.parametrize("mix", sorted(NATIVE_MIXES))
def test_recover_takes_any_mix_of_native_states_back_and_fails_closed(
    spawn: Spawn,
    shim_env: dict[str, str],
    plain_env: dict[str, str],
    control_dir: Path,
    tmp_path: Path,
    mix: str,
) -> None:
    """A restore or rollback of a process whose CUDA state is natively locked or
    checkpointed would wedge it: recover first takes every process back natively
    itself (restore the CHECKPOINTED, unlock the LOCKED), whatever the mix, then brings
    the group back; it refuses when no driver can tell the states."""
    pair = share(spawn, shim_env, SEED)
    ckpt = tmp_path / "checkpoint"
    common = ["--checkpoint-dir", str(ckpt), "--control-dir", str(control_dir), *_processes(pair)]
    assert run_cli(["suspend", *common], plain_env).returncode == 0
    for pid, actions in zip(pair.pids, NATIVE_MIXES[mix], strict=True):
        for action in actions:
            step = ["native", "--action", action, "--control-dir", str(control_dir),
                    "--process", str(pid), str(pid)]  # fmt: skip
            assert run_cli(step, plain_env).returncode == 0, action
    blind = run_cli(["recover", *common, "--progress", "none"], _no_driver_env())
    assert blind.returncode == 1 and "recover refused: the native state" in blind.stderr
    assert _phases(pair, control_dir, plain_env) == {
        pair.creator.pid: "PREPARED",
        pair.importer.pid: "PREPARED",
    }
    recovered = run_cli(["recover", *common, "--progress", "none"], plain_env)
    assert recovered.returncode == 0, recovered.stdout + recovered.stderr
    held = [p for p, actions in zip(pair.pids, NATIVE_MIXES[mix], strict=True)
            if actions != ("restore", "unlock")]  # fmt: skip
    for pid in held:
        assert f"pid {pid}: native unlock done" in recovered.stderr, recovered.stderr
    assert "recover: restored" in recovered.stdout, recovered.stdout
    # The suspend is over: its directory takes the next one.
    assert run_cli(["suspend", *common], plain_env).returncode == 0
    assert run_cli(["resume", *common], plain_env).returncode == 0
    running_as_before(pair, write_seed=SEED + 8)
