"""A shim's control endpoint heals itself (specs/protocol.md, "Endpoint"), on real shims.

The socket file is removed, replaced by a foreign file, or goes with its whole
directory, while the group is ACTIVE and while it is suspended (shims PREPARED,
processes natively CHECKPOINTED): the shim re-creates its listener at the
published path within its heal period, and every later command reaches it.
Each case ends with ``resume`` (or a suspend and resume) succeeding and the
group running with its bytes, the sharing live.

Waits are on observable states: the socket file back at its path as a new
socket; a command sent at once relies on the client's bounded retry instead.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import pytest
from cuinterpose.demo import pattern_digest
from cuinterpose.engine.wire import socket_name

from tests.shim.pair import Pair, running_as_before, share
from tests.simenv import Spawn
from tests.waiting import wait_until

SEED = 97


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


def _processes(pair: Pair) -> list[str]:
    return [w for p in pair.pids for w in ("--process", str(p), str(p))]


def _verb(verb: str, pair: Pair, control_dir: Path, ckpt: Path, env: dict[str, str]) -> None:
    args = [verb, "--checkpoint-dir", str(ckpt), "--control-dir", str(control_dir)]
    run = run_cli([*args, *_processes(pair)], env)
    assert run.returncode == 0, f"{verb}: {run.stdout}{run.stderr}"


def _phases(pair: Pair, control_dir: Path, env: dict[str, str]) -> set[str]:
    run = run_cli(["status", "--control-dir", str(control_dir), *_processes(pair), "--json"], env)
    assert run.returncode == 0, run.stdout + run.stderr
    return {p["shim_phase"] for p in json.loads(run.stdout)["processes"]}


def _socket_ids(control_dir: Path, pair: Pair) -> dict[int, tuple[int, int]]:
    ids = {}
    for pid in pair.pids:
        st = os.lstat(control_dir / socket_name(pid))
        assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
        ids[pid] = (st.st_dev, st.st_ino)
    return ids


def _healed(control_dir: Path, pid: int, old: tuple[int, int]) -> bool:
    try:
        st = os.lstat(control_dir / socket_name(pid))
    except FileNotFoundError:
        return False
    return stat.S_ISSOCK(st.st_mode) and (st.st_dev, st.st_ino) != old


def _remove(control_dir: Path, pair: Pair) -> None:
    for pid in pair.pids:
        (control_dir / socket_name(pid)).unlink()


def _replace_with_foreign(control_dir: Path, pair: Pair) -> None:
    for pid in pair.pids:
        planted = control_dir / f"planted-{pid}"
        planted.write_text("not a socket\n")
        os.replace(planted, control_dir / socket_name(pid))


def _remove_directory(control_dir: Path, pair: Pair) -> None:
    shutil.rmtree(control_dir)  # a cleanup script, a container's fresh tmpfs


DAMAGE: dict[str, Callable[[Path, Pair], None]] = {
    "removed": _remove,
    "replaced": _replace_with_foreign,
    "directory-removed": _remove_directory,
}


def _wait_healed(control_dir: Path, pair: Pair, old: dict[int, tuple[int, int]]) -> None:
    for pid in pair.pids:
        wait_until(partial(_healed, control_dir, pid, old[pid]), f"pid {pid} re-binds")
    _socket_ids(control_dir, pair)  # a socket, mode 0600
    assert stat.S_IMODE(os.lstat(control_dir).st_mode) == 0o700


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_endpoint_heals_while_active(
    spawn: Spawn,
    shim_env: dict[str, str],
    plain_env: dict[str, str],
    control_dir: Path,
    tmp_path: Path,
    damage: str,
) -> None:
    pair = share(spawn, shim_env, SEED)
    old = _socket_ids(control_dir, pair)
    DAMAGE[damage](control_dir, pair)
    _wait_healed(control_dir, pair, old)
    ckpt = tmp_path / "ckpt"
    _verb("suspend", pair, control_dir, ckpt, plain_env)
    _verb("resume", pair, control_dir, ckpt, plain_env)
    running_as_before(pair, write_seed=SEED + 1)


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_endpoint_heals_while_suspended(
    spawn: Spawn,
    shim_env: dict[str, str],
    plain_env: dict[str, str],
    control_dir: Path,
    tmp_path: Path,
    damage: str,
) -> None:
    pair = share(spawn, shim_env, SEED)
    ckpt = tmp_path / "ckpt"
    _verb("suspend", pair, control_dir, ckpt, plain_env)
    old = _socket_ids(control_dir, pair)
    DAMAGE[damage](control_dir, pair)
    _wait_healed(control_dir, pair, old)
    assert _phases(pair, control_dir, plain_env) == {"PREPARED"}
    _verb("resume", pair, control_dir, ckpt, plain_env)
    running_as_before(pair, write_seed=SEED + 2)


@pytest.mark.threads  # make tsan
def test_a_command_sent_right_after_the_removal_reaches_the_shim(
    spawn: Spawn,
    shim_env: dict[str, str],
    plain_env: dict[str, str],
    control_dir: Path,
    tmp_path: Path,
) -> None:
    """No wait for the socket: the client retries a missing socket for a bounded time."""
    pair = share(spawn, shim_env, SEED)
    ckpt = tmp_path / "ckpt"
    _verb("suspend", pair, control_dir, ckpt, plain_env)
    _remove(control_dir, pair)
    _verb("resume", pair, control_dir, ckpt, plain_env)
    _remove(control_dir, pair)
    assert _phases(pair, control_dir, plain_env) == {"ACTIVE"}
    running_as_before(pair, write_seed=SEED + 3)


def test_a_gone_process_is_not_waited_for(
    spawn: Spawn, shim_env: dict[str, str], plain_env: dict[str, str], control_dir: Path
) -> None:
    """The client's retry is for live processes: a dead one's missing socket is final."""
    pair = share(spawn, shim_env, SEED)
    pair.importer.kill()
    args = ["inspect", "--control-dir", str(control_dir), *_processes(pair)]
    run = run_cli(args, plain_env)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "connection refused" in run.stderr and "retried" not in run.stderr, run.stderr
    # status says why without asking it: gone, its socket (SIGKILL: the file stays) stale.
    args = ["status", "--control-dir", str(control_dir), *_processes(pair)]
    run = run_cli(args, plain_env)
    sock = control_dir / socket_name(pair.importer.pid)
    assert run.returncode == 1, run.stdout + run.stderr
    assert f"pid {pair.importer.pid} is gone (no such process): its socket {sock} is stale" in (
        run.stderr
    ), run.stderr
    mine = ["status", "--control-dir", str(control_dir), "--pid", str(pair.creator.pid), "--json"]
    run = run_cli(mine, plain_env)
    assert [p["shim_phase"] for p in json.loads(run.stdout)["processes"]] == ["ACTIVE"]
    pair.creator.close_clean()


def test_a_peer_import_right_after_the_creator_s_socket_was_removed_succeeds(
    spawn: Spawn, shim_env: dict[str, str], control_dir: Path
) -> None:
    """A shim importing a capability reaches the creator's endpoint as the coordinator
    does: a missing socket of a live creator is waited for (it heals), not taken for a
    creator gone."""
    creator = spawn("creator", shim_env)
    importer = spawn("importer", shim_env)
    size = 2 * int(creator.check("granularity")["granularity"])
    handle, _ = creator.create_mapped(size, seed=SEED)
    fd = int(creator.check("export", handle=handle)["fd"])
    theirs = creator.send_fd_to(importer, fd, close=True)
    (control_dir / socket_name(creator.pid)).unlink()
    imported = int(importer.check("import", fd=theirs)["handle"])
    importer_va = importer.map_at_new_va(imported, size)
    assert importer.digest(importer_va, size) == pattern_digest(SEED, size)
    creator.close_clean()
    importer.close_clean()


def test_a_suspend_right_after_the_removal_detects_the_shims(
    spawn: Spawn,
    shim_env: dict[str, str],
    plain_env: dict[str, str],
    control_dir: Path,
    tmp_path: Path,
) -> None:
    """Detection looks again at a live process's missing socket while its shim heals it."""
    pair = share(spawn, shim_env, SEED)
    ckpt = tmp_path / "ckpt"
    _remove(control_dir, pair)
    _verb("suspend", pair, control_dir, ckpt, plain_env)
    _verb("resume", pair, control_dir, ckpt, plain_env)
    running_as_before(pair, write_seed=SEED + 4)
