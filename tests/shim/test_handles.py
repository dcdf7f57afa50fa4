"""Logical handles and participant identity.

Tagged values that are unknown or dead are rejected (CUDA_ERROR_INVALID_VALUE) and
never reach the driver (the real one crashes on a handle it never gave out). Handles
are counted explicitly (create, import and retain add one; release drops one).
A fork child gets a fresh participant id and its own socket on its first tracked
call; a pinned id is never shared by two live processes.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from cuinterpose.demo import Worker
from cuinterpose.engine import wire

from tests import snippet
from tests.shim import shimenv
from tests.simenv import Spawn

PIN = "SNAPSHOT_PARTICIPANT_ID"


@pytest.fixture
def worker(spawn: Spawn) -> Worker:
    return spawn()


@pytest.mark.parametrize("program", ["shim_direct", "shim_dlsym"])
def test_c_program_bogus_handles(program: str, control_dir: Path) -> None:
    env = shimenv.shim_env(control_dir=control_dir)
    out = subprocess.run(
        [str(shimenv.test_program(program)), "bogus"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_unknown_and_dead_handles_rejected(worker: Worker) -> None:
    got = worker(
        """
Handle = cu.CUmemGenericAllocationHandle
unknown = Handle(0xC1F0123400005678)
h = check(cu.cuMemCreate(gran, prop(), 0))
dead = Handle(int(h))
check(cu.cuMemRelease(h))
va = reserve(gran)
result = {
    "unknown_release": err(cu.cuMemRelease(unknown)),
    "unknown_props": err(cu.cuMemGetAllocationPropertiesFromHandle(unknown)),
    "unknown_export": err(cu.cuMemExportToShareableHandle(unknown, POSIX, 0)),
    "unknown_add_device": err(cu.cuMulticastAddDevice(unknown, 0)),
    "dead_release": err(cu.cuMemRelease(dead)),
    "dead_map": err(cu.cuMemMap(va, gran, 0, dead, 0)),
    "dead_props": err(cu.cuMemGetAllocationPropertiesFromHandle(dead)),
    # a reused slot gets a new generation: the old value stays dead
    "reused_is_new": int(check(cu.cuMemCreate(gran, prop(), 0))) != int(dead),
    "dead_still_dead": err(cu.cuMemRelease(dead)),
}
"""
    )
    assert got.pop("reused_is_new") is True
    assert set(got.values()) == {"CUDA_ERROR_INVALID_VALUE"}, got


def test_references_are_counted(worker: Worker) -> None:
    got = worker(
        """
h = check(cu.cuMemCreate(gran, prop(), 0))
va = map_rw(h, gran)
fill(va, gran, 21)
r = check(cu.cuMemRetainAllocationHandle(va))
same = int(r) == int(h)
rel = [err(cu.cuMemRelease(h)), err(cu.cuMemRelease(r)), err(cu.cuMemRelease(h))]
alive = digest(va, gran) == expected(21, gran)      # the mapping keeps it alive
again = check(cu.cuMemRetainAllocationHandle(va))   # retain through the mapping revives it
revived = int(again) == int(h)
check(cu.cuMemRelease(again))
check(cu.cuMemUnmap(va, gran))
gone = err(cu.cuMemRetainAllocationHandle(va))
result = [same, rel, alive, revived, gone, err(cu.cuMemRelease(h))]
"""
    )
    assert got == [
        True,
        ["CUDA_SUCCESS", "CUDA_SUCCESS", "CUDA_ERROR_INVALID_VALUE"],
        True,
        True,
        "CUDA_ERROR_INVALID_VALUE",
        "CUDA_ERROR_INVALID_VALUE",
    ]


FORK = snippet.load(__file__, "fork")


@pytest.mark.parametrize("pinned", [False, True])
def test_fork_child_gets_fresh_id_and_socket(spawn: Spawn, control_dir: Path, pinned: bool) -> None:
    pin = os.urandom(16).hex()
    w = spawn(extra={PIN: pin} if pinned else {})
    w("H['x'] = check(cu.cuMemCreate(gran, prop(), 0))")
    parent_sock = shimenv.wait_socket(control_dir, w.pid)
    parent = shimenv.handshake(parent_sock)
    if pinned:
        assert parent.participant == pin
    flag = control_dir / "child-may-exit"
    w(f"FLAG = {str(flag)!r}")
    got = w(FORK)
    # The inherited bookkeeping is gone: the parent's handle means nothing there.
    assert got["err"] == "CUDA_ERROR_INVALID_VALUE"
    child = shimenv.handshake(shimenv.wait_socket(control_dir, got["child"]))
    assert child.pid == got["child"] and child.phase == wire.Phase.ACTIVE
    assert wire.is_participant_id(child.participant)
    assert child.participant != parent.participant
    # The parent's socket is untouched and still answers.
    assert parent_sock.exists()
    assert shimenv.handshake(parent_sock).participant == parent.participant
    flag.touch()
    w("os.waitpid(H['child'], 0)")
    assert w("result = err(cu.cuMemRelease(H['x']))") == "CUDA_SUCCESS"
    w.close_clean()


def test_pinned_participant_id(spawn: Spawn, control_dir: Path) -> None:
    pin = os.urandom(16).hex()
    start = "check(cu.cuInit(0)); result = os.getpid()"
    first = spawn("first", extra={PIN: pin}, setup="")
    # An exec'd process that inherits the pin while its owner lives: fresh id.
    second = spawn("second", extra={PIN: pin}, setup="")
    bad = spawn("bad", extra={PIN: pin.upper()}, setup="")
    ids = []
    for w in (first, second, bad):
        # In order: a shim claims its id before its control server answers, so once
        # one has answered the handshake, the next one's claim comes after its claim.
        pid = w(start)
        ids.append(shimenv.handshake(shimenv.wait_socket(control_dir, pid)).participant)
    assert ids[0] == pin
    assert ids[1] != pin and wire.is_participant_id(ids[1])
    assert ids[2] != pin and wire.is_participant_id(ids[2])
    for w in (first, second, bad):
        w.close_clean()
    # Once its owner is gone, the pin is free again.
    third = spawn("third", extra={PIN: pin}, setup="")
    pid = third(start)
    assert shimenv.handshake(shimenv.wait_socket(control_dir, pid)).participant == pin


def test_no_control_dir_app_still_works(spawn: Spawn, tmp_path: Path) -> None:
    """An unusable control directory costs the checkpoint, never the application."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    w = spawn("app", shimenv.shim_env(control_dir=blocker / "sub"), setup=shimenv.WORKER_SETUP)
    assert w(
        """
h = check(cu.cuMemCreate(gran, prop(), 0)); va = map_rw(h, gran); fill(va, gran, 2)
fd = export(h); h2 = import_fd(fd); os.close(fd)
result = digest(va, gran) == expected(2, gran)
"""
    )
    w.close_clean()


def test_driver_handle_in_tag_range_refused(control_dir: Path) -> None:
    """A driver handle that collides with the tag range is released and refused
    (CUDA_ERROR_NOT_SUPPORTED), never handed out (stand-in driver, any machine)."""
    exe = shimenv.test_program("shim_collide")
    env = shimenv.shim_env(control_dir=control_dir)
    env["LD_LIBRARY_PATH"] = str(exe.parent / "collide")  # ahead of any real driver
    out = subprocess.run([str(exe)], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "collides with the shim's tag range" in out.stderr


def test_logging_into_a_closed_pipe_never_kills(tmp_path: Path) -> None:
    """The shim warns on stderr (here: no usable control dir); stderr being a pipe
    nobody reads must not raise SIGPIPE in a C program that does not ignore it."""
    env = shimenv.shim_env(control_dir="relative/not-absolute")
    r, w = os.pipe()
    os.close(r)
    try:
        out = subprocess.run(
            [str(shimenv.test_program("shim_direct")), "export"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=w,
            text=True,
            timeout=60,
        )
    finally:
        os.close(w)
    assert out.returncode != -13  # SIGPIPE
    # Without a control server the export is the driver's raw FD, the rest works.
    assert "capability=0 tagged=1 own_import_same_bytes=1" in out.stdout
