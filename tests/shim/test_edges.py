"""The edges a new user met (issue 49), through the installed ``cuinterpose`` command on
real shims and the simulated driver: a zombie's status and its stale socket, a suspend
of a process that is no CUDA process, inspect's text, launch --exec's pid line."""

from __future__ import annotations

import json
import os
import pty
import re
import signal
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import pytest
from cuinterpose.engine.wire import socket_name

from tests.simenv import Spawn

BIN = Path(sys.executable).parent


def cuinterpose(env: Mapping[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """The installed command, from a shell that names the control directory itself."""
    env = {k: v for k, v in env.items() if k != "SNAPSHOT_CONTROL_DIR"}
    return subprocess.run(
        [str(BIN / "cuinterpose"), *args], env=env, capture_output=True, text=True,
        timeout=120, check=False,
    )  # fmt: skip


def on_a_terminal(env: Mapping[str, str], *args: str) -> str:
    """What a person at a (wide) terminal sees of ``cuinterpose ARGS`` on stdout."""
    env = {k: v for k, v in env.items() if k != "SNAPSHOT_CONTROL_DIR"}
    env.update(COLUMNS="200", TERM="xterm")
    main, sub = pty.openpty()
    try:
        with subprocess.Popen([str(BIN / "cuinterpose"), *args], env=env, stdout=sub,
                              stderr=subprocess.DEVNULL) as proc:  # fmt: skip
            os.close(sub)
            sub = -1
            chunks = []
            while True:
                try:
                    chunk = os.read(main, 65536)
                except OSError:  # EIO: the command closed the terminal
                    break
                if not chunk:
                    break
                chunks.append(chunk)
            proc.wait(timeout=120)
    finally:
        os.close(main)
        if sub >= 0:
            os.close(sub)
    return b"".join(chunks).decode(errors="replace")


def test_status_says_a_zombie_exited_and_clear_stale_removes_its_socket(
    spawn: Spawn, shim_env: dict[str, str], plain_env: dict[str, str], control_dir: Path
) -> None:
    """A killed child its parent has not reaped keeps its pid and leaves its socket: the
    listing says it exited and that the socket is stale (no CUDA error, no "not
    answering"); named, it is refused saying so; ``--clear-stale`` removes the socket."""
    worker = spawn("zombie", shim_env)
    pid = worker.pid
    sock = control_dir / socket_name(pid)
    assert sock.is_socket()
    os.kill(pid, signal.SIGKILL)
    os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped: a zombie
    where = ["--control-dir", str(control_dir)]
    try:
        listed = cuinterpose(plain_env, "status", *where)
        named = cuinterpose(plain_env, "status", *where, "--pid", str(pid))
        as_json = cuinterpose(plain_env, "status", *where, "--json")
        at_terminal = on_a_terminal(plain_env, "status", *where)
        assert sock.is_socket()  # only asked: nothing removed
        cleared = cuinterpose(plain_env, "status", *where, "--clear-stale")
    finally:
        worker.kill()
    exited = "exited (a zombie its parent has not reaped)"
    assert listed.returncode == 0, listed.stderr
    row = next(line for line in listed.stdout.splitlines() if line.startswith(str(pid)))
    assert exited in row and "stale socket" in row, listed.stdout
    assert "CUDA_ERROR" not in listed.stdout + listed.stderr, listed.stdout
    assert "not answering" not in listed.stdout, listed.stdout
    assert f"note: pid {pid} {exited}: its socket {sock} is stale" in listed.stderr
    assert "--clear-stale" in listed.stderr
    assert named.returncode == 1, named.stderr
    assert f"pid {pid} {exited}: its socket {sock} is stale" in named.stderr, named.stderr
    assert exited in " ".join(at_terminal.split()) and "stale socket" in at_terminal, (
        at_terminal
    )
    (doc,) = json.loads(as_json.stdout)["processes"]
    assert (doc["observed_pid"], doc["native_state"], doc["shim_phase"]) == (
        pid, exited, "stale socket"
    )  # fmt: skip
    assert cleared.returncode == 0, cleared.stderr
    assert f"removed the stale socket {sock}" in cleared.stderr
    assert not sock.exists()


def test_suspend_not_requested_of_a_process_that_is_no_cuda_one_says_so(
    plain_env: dict[str, str], control_dir: Path, tmp_path: Path
) -> None:
    """A pid that never used CUDA: "not a CUDA process", nothing about a resume."""
    plain = subprocess.Popen(["sleep", "60"])
    try:
        run = cuinterpose(plain_env, "suspend", "--not-requested", "--checkpoint-dir",
                          str(tmp_path / "ckpt"), "--control-dir", str(control_dir),
                          "--pid", str(plain.pid), "--progress", "none")  # fmt: skip
        assert plain.poll() is None  # untouched
    finally:
        plain.kill()
        plain.wait()
    assert run.returncode == 1, run.stderr
    assert f"pid {plain.pid} (ns pid {plain.pid}) is not a CUDA process of this driver" in (
        run.stderr
    ), run.stderr
    assert "resume" not in run.stderr and "CHECKPOINTED" not in run.stderr, run.stderr
    assert not (tmp_path / "ckpt" / "manifest.json").exists()


def test_inspect_text_shows_sizes_and_who_created_what(
    spawn: Spawn, shim_env: dict[str, str], plain_env: dict[str, str], control_dir: Path
) -> None:
    """What inspect's JSON has, its text says too: each record's size, and each
    allocation's role (the creator's, or an importer's naming its creator)."""
    from tests.shim.agentgroup import build_group

    group = build_group(spawn, shim_env, plain_env)
    where = ["--control-dir", str(control_dir), "--pid", str(group.creator.pid),
             "--pid", str(group.importer.pid)]  # fmt: skip
    text = cuinterpose(plain_env, "inspect", *where)
    doc = cuinterpose(plain_env, "inspect", *where, "--json")
    group.close()
    assert text.returncode == 0 and doc.returncode == 0, text.stderr + doc.stderr
    parts = json.loads(doc.stdout)["participants"]
    creator, importer = (p["participant"] for p in parts)
    size = group.size
    mib = f"{size / (1 << 20):.1f} MiB ({size:,} B)"
    lines = text.stdout.splitlines()
    allocations = [line.strip() for line in lines if line.strip().startswith("ALLOCATION")]
    shared = next(r["id"] for r in parts[1]["records"] if r["kind"] == "ALLOCATION")
    assert f"ALLOCATION {shared}, {mib}, creator" in allocations, text.stdout
    assert sum(line.endswith(", creator") for line in allocations) == 2  # X and P
    assert f"ALLOCATION {shared}, {mib}, importer (created by pid {group.creator.pid})" in (
        allocations
    ), text.stdout
    mapping = next(line for line in lines if line.strip().startswith("MAPPING"))
    assert mapping.endswith(f"), {mib}"), text.stdout
    assert creator != importer


@pytest.mark.slow
def test_the_demos_memory_figures_count_the_same_things(stack: None) -> None:
    """``cuinterpose demo``: the memory used before the suspend is measured once the
    multicast team is built, on every device the processes use, so that it, what the
    suspend saved, what it freed and what is used after the resume are one figure."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LD_", "ASAN_"))}
    run = subprocess.run([str(BIN / "cuinterpose"), "demo"], env=env, capture_output=True,
                         text=True, timeout=300, check=False)  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    text = run.stdout

    def mib(pattern: str) -> str:
        found = re.search(pattern, text)
        assert found is not None, (pattern, text)
        return found.group(1)

    before = mib(
        r"GPU memory used before the suspend: ([\d.]+ MiB) \(cuMemGetInfo on the "
        r"3 devices the processes use: the allocations and the team's members"
    )
    saved = mib(r"saved 6 allocations \(shared and private\), ([\d.]+ MiB)")
    freed = mib(r"GPU memory used 0\.0 MiB: ([\d.]+ MiB) freed while suspended")
    after = mib(r"loaded 6 allocations, [\d.]+ MiB, LOAD .*; GPU memory used ([\d.]+ MiB) "
                r"\(before the suspend: ")  # fmt: skip
    assert before == saved == freed == after == "40.0 MiB", text
    assert f"{freed} of GPU memory freed while suspended" in text.splitlines()[-1]
