"""The staged bytes beside the images, engine side (engine/stored.py), against fakes.

After a suspend, ``store`` hands every shim a new private file of the checkpoint
directory with STORE_STAGED; a shim that fails is named, and its file removed (it keeps
its copies in memory). ``fetch`` hands the files back; after a partial store only those
that stored (``missing_ok``); the survivors alone by their recorded pids. Every resume of
a directory holding such files fetches before its restore machine.
"""

from __future__ import annotations

import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from cuinterpose.engine import agent, stored
from cuinterpose.engine.wire import Op, Stats, Status
from cuinterpose.testing import Fault
from engine_harness import short_dir, team_of
from test_agent import PIDS, TOPOLOGY, running


@pytest.fixture
def work() -> Iterator[Path]:
    with short_dir() as path:
        yield path


def test_store_hands_each_shim_a_private_file_and_fetch_hands_it_back(work: Path) -> None:
    fake = running()
    with team_of(TOPOLOGY, work / "control") as team:
        where = agent.Where(team.control_dir)
        team.fakes[0].stats[Op.STORE_STAGED] = Stats(count=3, bytes=3 << 20, copy_ns=2_000_000)
        done = agent.suspend([(p, p) for p in PIDS], work / "ckpt", where=where, native=fake)
        files = stored.store(work / "ckpt", done.manifest, where=where)
        assert [f.process.observed_pid for f in files] == PIDS
        assert (files[0].allocations, files[0].bytes, files[0].seconds) == (3, 3 << 20, 0.002)
        assert stored.stored_files(work / "ckpt") == sorted(f.path for f in files)
        for f in files:
            assert f.path.name == f"staged-{team.fakes[files.index(f)].participant}.bin"
            assert stat.S_IMODE(f.path.stat().st_mode) == 0o600
        back = stored.fetch(work / "ckpt", done.manifest, done.manifest.processes(), where=where)
        assert [f.path for f in back] == [f.path for f in files]
        # The survivors alone, by the pids the manifest records.
        one = stored.fetch(work / "ckpt", done.manifest, done.manifest.processes()[1:], where=where)
        assert [f.process.observed_pid for f in one] == PIDS[1:]


def test_a_failed_store_names_the_process_and_leaves_no_file_of_it(work: Path) -> None:
    fake = running()
    script = {1: {Op.STORE_STAGED: Fault("fail", Status.INTERNAL, "pwrite failed (injected)")}}
    with team_of(TOPOLOGY, work / "control", scripts=script) as team:
        where = agent.Where(team.control_dir)
        done = agent.suspend([(p, p) for p in PIDS], work / "ckpt", where=where, native=fake)
        with pytest.raises(stored.StoreFailed) as info:
            stored.store(work / "ckpt", done.manifest, where=where)
        text = str(info.value)
        assert f"pid {PIDS[1]}" in text and "pwrite failed (injected)" in text, text
        assert info.value.changed
        left = stored.stored_files(work / "ckpt")
        assert left == [stored.staged_path(work / "ckpt", team.fakes[0].participant)]
        with pytest.raises(stored.StoreFailed, match="cannot be opened"):
            stored.fetch(work / "ckpt", done.manifest, done.manifest.processes(), where=where)
        got = stored.fetch(
            work / "ckpt", done.manifest, done.manifest.processes(), where=where, missing_ok=True
        )
        assert [f.process.observed_pid for f in got] == PIDS[:1]


def test_every_resume_fetches_before_its_restore_when_files_are_there(work: Path) -> None:
    fake = running()
    with team_of(TOPOLOGY, work / "control") as team:
        where = agent.Where(team.control_dir)
        done = agent.suspend([(p, p) for p in PIDS], work / "ckpt", where=where, native=fake)
        stored.store(work / "ckpt", done.manifest, where=where)
        back = agent.resume(work / "ckpt", where=where, native=fake)
        steps = [t.step for t in back.timings]
        assert steps.index("fetch_staged") < steps.index("coordinator_restore"), steps
        # Without files (an in-memory suspend), no such step.
        for path in stored.stored_files(work / "ckpt"):
            path.unlink()
        again = work / "again"
        agent.suspend([(p, p) for p in PIDS], again, where=where, native=fake)
        plain = agent.resume(again, where=where, native=fake)
        assert "fetch_staged" not in [t.step for t in plain.timings]
