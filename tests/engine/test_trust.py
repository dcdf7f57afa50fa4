"""Trusted endpoints on the coordinator's side: control directories and servers (uid).

The shim refuses the same directories (tests/shim/test_teams.py); here the client
refuses them before sending anything, refuses a server running as another user, and
``cuinterpose launch`` creates the directory safely or refuses an unsafe one.
"""

from __future__ import annotations

import os
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from cuinterpose.engine import UntrustedEndpoint, control_dir_problem, endpoint_for, wire
from cuinterpose.engine.client import call
from cuinterpose.launch import LaunchError, ensure_control_dir

from tests.stranger import NOBODY, served_by_nobody


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A private directory with a short path (AF_UNIX paths are limited to 107 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="cipt-"))
    path.chmod(0o700)
    yield path
    for child in sorted(path.rglob("*"), reverse=True):
        if child.is_dir() and not child.is_symlink():
            child.rmdir()
        else:
            child.unlink()
    path.rmdir()


def test_control_dir_problems(short_dir: Path) -> None:
    assert control_dir_problem(short_dir) is None
    assert control_dir_problem(short_dir / "missing") is None  # connecting says so
    loose = short_dir / "loose"
    loose.mkdir()
    loose.chmod(0o777)
    assert "is writable by group or others (uid" in str(control_dir_problem(loose))
    assert "mode 0777" in str(control_dir_problem(loose))
    link = short_dir / "link"
    link.symlink_to(short_dir)
    assert f"{link} is a symbolic link" in str(control_dir_problem(link))
    plain = short_dir / "file"
    plain.write_text("")
    assert "is not a directory" in str(control_dir_problem(plain))
    # Owned by somebody else: judged against the uid the caller trusts.
    own = os.getuid() + 1 if os.getuid() != 0 else 4242
    foreign = control_dir_problem(short_dir, own_uid=own)
    if os.getuid() == 0:
        assert foreign is None  # root's directory is trusted by everyone
    else:
        assert f"is owned by uid {os.getuid()}, not root nor uid {own}" in str(foreign)


def test_the_client_sends_nothing_through_an_untrusted_dir(short_dir: Path) -> None:
    loose = short_dir / "d"
    loose.mkdir()
    loose.chmod(0o777)
    endpoint = endpoint_for(4321, 4321, control_dir=loose)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(str(endpoint.path))
        listener.listen(1)
        listener.setblocking(False)
        with pytest.raises(UntrustedEndpoint, match="writable by group or others"):
            call(endpoint, wire.Request(wire.Op.HANDSHAKE), timeout=2, expect_participant=None)
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody connected


@pytest.mark.skipif(os.getuid() != 0, reason="serving as another uid needs root")
def test_the_client_refuses_a_server_of_another_uid(short_dir: Path) -> None:
    endpoint = endpoint_for(4321, 4321, control_dir=short_dir)
    with served_by_nobody(endpoint.path) as child:
        with pytest.raises(UntrustedEndpoint) as caught:
            call(endpoint, wire.Request(wire.Op.HANDSHAKE), timeout=5, expect_participant=None)
        assert f"served by pid {child} of uid {NOBODY}, not root nor uid 0" in str(caught.value)


def test_launch_creates_a_private_control_dir(short_dir: Path) -> None:
    made = ensure_control_dir(short_dir / "new" / "ctl")
    assert made.is_dir() and (made.stat().st_mode & 0o777) == 0o700
    assert ensure_control_dir(made) == made  # an existing trusted one is kept


@pytest.mark.parametrize("unsafe", ["mode 0777", "symlink", "file"])
def test_launch_refuses_an_unsafe_control_dir(short_dir: Path, unsafe: str) -> None:
    target = short_dir / "ctl"
    if unsafe == "mode 0777":
        target.mkdir()
        target.chmod(0o777)
        why = "is writable by group or others"
    elif unsafe == "symlink":
        real = short_dir / "real"
        real.mkdir(mode=0o700)
        target.symlink_to(real)
        why = "is a symbolic link"
    else:
        target.write_text("")
        why = "is not a directory"
    with pytest.raises(LaunchError, match=why):
        ensure_control_dir(target)
