"""The staged bytes beside the images, engine side (engine/stored.py), against fakes.

After a suspend, ``store`` hands every shim ``Options.stored_parts`` new private files of
the checkpoint directory, its parts ``staged-<participant>.<k>.bin``, with STORE_STAGED; a
shim that fails is named, and its parts removed (it keeps its copies in memory).
``fetch`` finds every part again and hands them back in order, refusing a process whose
part is missing or one too many, naming the file; after a partial store only those that
stored (``missing_ok``); the survivors alone by their recorded pids. Every resume of a
directory holding such files fetches before its restore machine.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from cuinterpose.engine import agent, stored, wire
from cuinterpose.engine.options import Options, default_stored_parts
from cuinterpose.engine.wire import Op, Stats, Status
from cuinterpose.testing import Fault
from engine_harness import short_dir, team_of
from test_agent import PIDS, TOPOLOGY, running


@pytest.fixture
def work() -> Iterator[Path]:
    with short_dir() as path:
        yield path


@pytest.mark.parametrize("n", [1, 3, 16])
def test_store_hands_each_shim_its_private_parts_and_fetch_hands_them_back(
    work: Path, n: int
) -> None:
    fake = running()
    options = Options(stored_parts=n)
    with team_of(TOPOLOGY, work / "control") as team:
        where = agent.Where(team.control_dir)
        team.fakes[0].stats[Op.STORE_STAGED] = Stats(count=3, bytes=3 << 20, copy_ns=2_000_000)
        done = agent.suspend([(p, p) for p in PIDS], work / "ckpt", where=where, native=fake)
        files = stored.store(work / "ckpt", done.manifest, where=where, options=options)
        assert [f.process.observed_pid for f in files] == PIDS
        assert (files[0].allocations, files[0].bytes, files[0].seconds) == (3, 3 << 20, 0.002)
        assert stored.stored_files(work / "ckpt") == sorted(p for f in files for p in f.paths)
        for f, shim in zip(files, team.fakes, strict=True):
            names = [f"staged-{shim.participant}.{k}.bin" for k in range(n)]
            assert [p.name for p in f.paths] == names
            assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in f.paths)
        back = stored.fetch(work / "ckpt", done.manifest, done.manifest.processes(), where=where)
        assert [f.paths for f in back] == [f.paths for f in files]
        # The survivors alone, by the pids the manifest records.
        one = stored.fetch(work / "ckpt", done.manifest, done.manifest.processes()[1:], where=where)
        assert [f.process.observed_pid for f in one] == PIDS[1:]


def test_a_failed_store_names_the_process_and_leaves_no_part_of_it(work: Path) -> None:
    fake = running()
    script = {1: {Op.STORE_STAGED: Fault("fail", Status.INTERNAL, "pwrite failed (injected)")}}
    with team_of(TOPOLOGY, work / "control", scripts=script) as team:
        where = agent.Where(team.control_dir)
        done = agent.suspend([(p, p) for p in PIDS], work / "ckpt", where=where, native=fake)
        with pytest.raises(stored.StoreFailed) as info:
            stored.store(work / "ckpt", done.manifest, where=where, options=Options(stored_parts=2))
        text = str(info.value)
        assert f"pid {PIDS[1]}" in text and "pwrite failed (injected)" in text, text
        # The shim names a part by its index: the line says which file that is.
        stem = f"{work / 'ckpt'}/staged-{team.fakes[1].participant}"
        assert f"(part k = {stem}.<k>.bin): INTERNAL: pwrite failed" in text, text
        assert info.value.changed
        left = stored.stored_files(work / "ckpt")
        first = team.fakes[0].participant
        assert left == [stored.part_path(work / "ckpt", first, k) for k in range(2)]
        missing = stored.part_path(work / "ckpt", team.fakes[1].participant, 0)
        with pytest.raises(stored.StoreFailed, match=f"{missing} is missing"):
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


def header(participant: str, part: int, parts: int) -> bytes:
    return wire.STORED_HEADER_STRUCT.pack(
        wire.STORED_MAGIC, wire.STORED_VERSION, 0, part, parts, 0, 4096, participant.encode()
    )


def test_fetch_refuses_a_missing_or_an_extra_part_naming_the_file(work: Path) -> None:
    """A gap in the parts' names, fewer parts than part 0's header records, or one more:
    refused before any shim is asked, naming the file; an earlier dump's parts are removed
    by the next store of the same process."""
    fake = running()
    with team_of(TOPOLOGY, work / "control") as team:
        where = agent.Where(team.control_dir)
        done = agent.suspend([(p, p) for p in PIDS], work / "ckpt", where=where, native=fake)
        ckpt, who = work / "ckpt", team.fakes[0].participant
        files = stored.store(ckpt, done.manifest, where=where, options=Options(stored_parts=3))
        paths = files[0].paths
        processes = done.manifest.processes()
        for k, path in enumerate(paths):  # what a shim writes first: each part's header
            path.write_bytes(header(who, k, 3))
        assert stored.parts_of(ckpt, who) == list(paths)
        paths[1].unlink()
        with pytest.raises(stored.StoreFailed, match=f"{paths[1]} is missing") as info:
            stored.fetch(ckpt, done.manifest, processes, where=where)
        assert "part 0 records 3 parts" in str(info.value)
        paths[1].write_bytes(header(who, 1, 3))
        paths[2].unlink()  # the last one: only part 0's header tells
        with pytest.raises(stored.StoreFailed, match=f"{paths[2]} is missing"):
            stored.fetch(ckpt, done.manifest, processes, where=where)
        paths[2].write_bytes(header(who, 2, 3))
        extra = stored.part_path(ckpt, who, 3)
        extra.write_bytes(header(who, 3, 3))
        with pytest.raises(stored.StoreFailed, match=f"{extra} is one part too many"):
            stored.fetch(ckpt, done.manifest, processes, where=where)
        paths[0].unlink()  # without part 0, the names alone
        with pytest.raises(stored.StoreFailed, match=f"{paths[0]} is missing") as info:
            stored.fetch(ckpt, done.manifest, processes, where=where)
        assert "by their names" in str(info.value)
        # The next store of the process removes every part it had, the extra one too.
        again = stored.store(ckpt, done.manifest, where=where, options=Options(stored_parts=1))
        assert [p.name for p in again[0].paths] == [f"staged-{who}.0.bin"]
        assert not extra.exists() and not paths[1].exists()


def test_the_parts_default_to_one_per_copy_thread_and_are_bounded() -> None:
    assert Options().stored_parts == default_stored_parts() == min(16, os.cpu_count() or 1)
    for bad in (0, wire.STORED_MAX_PARTS + 1):
        with pytest.raises(ValueError, match="stored_parts must be 1 to 64"):
            Options(stored_parts=bad)
