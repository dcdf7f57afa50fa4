"""A control directory resolved inside a process's root (engine/_rooted.py), on this
test's own process and a fake proc root: no pods needed."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
from cuinterpose.engine._rooted import RootedDir, RootedError, open_in_root
from cuinterpose.engine.client import ParticipantError, endpoint_for
from cuinterpose.engine.wire import Op


def _proc(tmp_path: Path) -> tuple[Path, Path]:
    """A proc root whose process 7 has ``root`` as its root (a directory, as the
    magic link /proc/7/root opens as one)."""
    root = tmp_path / "proc" / "7" / "root"
    (root / "run" / "ctl").mkdir(parents=True)
    return tmp_path / "proc", root


def test_a_directory_is_found_inside_the_root_and_dotdot_stays_there(tmp_path: Path) -> None:
    proc, root = _proc(tmp_path)
    fd = open_in_root(proc, 7, Path("/run/ctl"))
    try:
        assert os.fstat(fd).st_ino == os.stat(root / "run" / "ctl").st_ino
    finally:
        os.close(fd)
    fd = open_in_root(proc, 7, Path("/../../../run/ctl"))  # ".." stops at the root
    os.close(fd)


@pytest.mark.parametrize("target", ["/", "ctl-elsewhere", "/proc/self/root/run"])
def test_a_symbolic_link_at_any_component_is_refused(tmp_path: Path, target: str) -> None:
    proc, root = _proc(tmp_path)
    (root / "run" / "ctl").rmdir()
    (root / "run").rename(root / "run.real")
    (root / "run").symlink_to(target)
    with pytest.raises(RootedError, match="symbolic link"):
        open_in_root(proc, 7, Path("/run/ctl"))
    rooted = RootedDir(proc, 7, Path("/run/ctl"))
    assert "symbolic link" in (rooted.resolve() or "")
    assert not rooted.missing


def test_a_missing_directory_is_looked_for_again(tmp_path: Path) -> None:
    proc, root = _proc(tmp_path)
    rooted = RootedDir(proc, 7, Path("/run/other"))
    assert "does not exist" in (rooted.resolve() or "") and rooted.missing
    (root / "run" / "other").mkdir()
    assert rooted.resolve() is None and not rooted.missing


def test_an_endpoint_through_a_proc_root_pickles_without_its_descriptor() -> None:
    me = os.getpid()
    endpoint = endpoint_for(me, me, control_dir=Path("/tmp"), proc_root=Path("/proc"))
    assert endpoint.rooted is not None and endpoint.rooted.resolve() is None
    copy = pickle.loads(pickle.dumps(ParticipantError(endpoint, Op.STATUS, "why")))
    assert copy.endpoint == endpoint and str(copy) == str(
        ParticipantError(endpoint, Op.STATUS, "why")
    )
