"""The staged bytes beside the images, engine side (engine/stored.py), against fakes.

After a suspend, ``store`` hands every shim ``Options.stored_parts`` new private files of
the checkpoint directory, its parts ``staged-<participant>.<k>.bin``, with STORE_STAGED; a
shim that fails is named, and its parts removed (it keeps its copies in memory).
``fetch`` finds every part again and hands them back in order, refusing a process whose
part is missing or one too many, naming the file; after a partial store only those that
stored (``missing_ok``); the survivors alone by their recorded pids. Every resume of a
directory holding such files fetches before its restore machine. A suspend told to store
beside (the CRIU verbs) does it while its native lock and checkpoint run: the undo of a
failed native step fetches what was stored before its restore, and a store that fails
where the native steps did not leaves a suspended group that a resume brings back.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest
from cuinterpose.engine import agent, stored, wire
from cuinterpose.engine.native_checkpoint import ProcessState
from cuinterpose.engine.options import Options, default_stored_parts
from cuinterpose.engine.wire import Op, Stats, Status
from cuinterpose.testing import Fault
from engine_harness import Team, short_dir, team_of
from test_agent import PIDS, TOPOLOGY, FakeNative, running

from tests.waiting import wait_until


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


def header(participant: str, part: int, parts: int, dump: str = "ab" * 16) -> bytes:
    return wire.STORED_HEADER_STRUCT.pack(
        wire.STORED_MAGIC, wire.STORED_VERSION, 0, part, parts, 0, 4096, participant.encode(),
        bytes.fromhex(dump), 0,
    )  # fmt: skip


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


# ------------------------------------------------------------------ beside the native steps
@attrs.define
class StoreAwaited:
    """``inner``, whose checkpoint of every process first waits until every fake of
    ``team`` has received STORE_STAGED: a suspend that stored only after its native
    steps never gets past them."""

    inner: FakeNative
    team: Team

    def lock(self, pid: int, timeout_ms: int) -> None:
        self.inner.lock(pid, timeout_ms)

    def checkpoint(self, pid: int) -> None:
        wait_until(
            lambda: all(Op.STORE_STAGED in f.received for f in self.team.fakes),
            "every shim sent STORE_STAGED while the native checkpoint runs",
        )
        self.inner.checkpoint(pid)

    def restore(self, pid: int) -> None:
        self.inner.restore(pid)

    def unlock(self, pid: int) -> None:
        self.inner.unlock(pid)

    def state(self, pid: int) -> ProcessState:
        return self.inner.state(pid)


def done_steps(events: list[agent.AgentEvent]) -> list[str]:
    return [e.step for e in events if isinstance(e, agent.StepEvent) and e.status == "done"]


def test_a_suspend_that_stores_beside_does_it_while_the_native_checkpoint_runs(
    work: Path,
) -> None:
    fake = running()
    with team_of(TOPOLOGY, work / "control") as team:
        where = agent.Where(team.control_dir)
        native = StoreAwaited(fake, team)
        events: list[agent.AgentEvent] = []
        done = agent.suspend(
            [(p, p) for p in PIDS],
            work / "ckpt",
            where=where,
            native=native,
            on_event=events.append,
            store_beside=True,
        )
        # Its step ends where it is joined, after the native steps: the order stays.
        steps = ["detect", "capture", "native_lock", "native_checkpoint", "store_staged"]
        assert [t.step for t in done.timings] == steps
        assert [t.step for t in done.manifest.timings] == steps
        assert done_steps(events) == steps
        assert len(stored.stored_files(work / "ckpt")) == 2 * default_stored_parts()
        assert set(fake.states.values()) == {ProcessState.CHECKPOINTED}
        back = agent.resume(work / "ckpt", where=where, native=fake)
        order = [t.step for t in back.timings]
        assert order.index("fetch_staged") < order.index("coordinator_restore"), order
        for f in team.fakes:
            assert f.received.count(Op.FETCH_STAGED) == 1


@pytest.mark.parametrize("store_fails", [False, True], ids=["stored", "one-store-failed"])
def test_a_native_checkpoint_failing_beside_the_store_fetches_what_was_stored_first(
    work: Path, store_fails: bool
) -> None:
    """The undo waits for the store, fetches what it wrote (not from a shim whose store
    failed: it kept its copies), then restores; the group runs as before."""
    fake = running()
    fake.fail = ("checkpoint", PIDS[1])
    script = {1: {Op.STORE_STAGED: Fault("fail", Status.INTERNAL, "pwrite failed (injected)")}}
    with team_of(TOPOLOGY, work / "control", scripts=script if store_fails else None) as team:
        where = agent.Where(team.control_dir)
        events: list[agent.AgentEvent] = []
        with pytest.raises(agent.SuspendFailed) as info:
            agent.suspend(
                [(p, p) for p in PIDS],
                work / "ckpt",
                where=where,
                native=StoreAwaited(fake, team),
                on_event=events.append,
                store_beside=True,
            )
        text = str(info.value)
        assert info.value.restored, text
        assert "CUDA_ERROR_INJECTED" in text and "the group runs as before the suspend" in text
        assert ("store_staged: STORE_STAGED failed:" in text) is store_fails, text
        assert "pwrite failed (injected)" in text or not store_fails
        steps = done_steps(events)
        assert steps.index("undo_fetch_staged") < steps.index("undo_coordinator_restore"), steps
        fetched = [Op.FETCH_STAGED in f.received for f in team.fakes]
        assert fetched == [True, not store_fails]
        for f in team.fakes:
            got = f.received
            if Op.FETCH_STAGED in got:
                assert got.index(Op.FETCH_STAGED) < got.index(Op.LOAD_ALLOCATIONS), got
        assert {f.phase for f in team.fakes} == {wire.Phase.ACTIVE}
        assert set(fake.states.values()) == {ProcessState.RUNNING}
        assert not (work / "ckpt" / "manifest.json").exists()


def test_a_store_failing_beside_a_native_checkpoint_that_works_leaves_a_resumable_group(
    work: Path,
) -> None:
    """The native steps went through: the suspend writes its manifest, then raises the
    store's failure naming the shim; a resume fetches what the other stored and brings
    every process back."""
    fake = running()
    script = {1: {Op.STORE_STAGED: Fault("fail", Status.INTERNAL, "pwrite failed (injected)")}}
    with team_of(TOPOLOGY, work / "control", scripts=script) as team:
        where = agent.Where(team.control_dir)
        with pytest.raises(stored.StoreFailed) as info:
            agent.suspend(
                [(p, p) for p in PIDS],
                work / "ckpt",
                where=where,
                native=fake,
                store_beside=True,
            )
        text = str(info.value)
        assert f"pid {PIDS[1]}" in text and "pwrite failed (injected)" in text, text
        assert info.value.changed
        assert set(fake.states.values()) == {ProcessState.CHECKPOINTED}
        manifest = agent.read_manifest(work / "ckpt")
        assert "store_staged" not in [t.step for t in manifest.timings]
        first = team.fakes[0].participant
        assert {p.name.split(".")[0] for p in stored.stored_files(work / "ckpt")} == {
            f"staged-{first}"
        }
        back = agent.resume(work / "ckpt", where=where, native=fake)
        assert back.coordinator_restored
        assert [Op.FETCH_STAGED in f.received for f in team.fakes] == [True, False]
        assert set(fake.states.values()) == {ProcessState.RUNNING}


def test_an_unexpected_error_of_the_store_thread_is_said_not_lost(
    work: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever the store raises on its thread reaches the suspend as a StoreFailed that
    names it; the group is suspended and its manifest written, for a resume."""
    fake = running()

    def broken(*args: object, **kwargs: object) -> None:
        raise ValueError("a bug in the store (injected)")

    monkeypatch.setattr(stored, "store", broken)
    with team_of(TOPOLOGY, work / "control") as team:
        where = agent.Where(team.control_dir)
        with pytest.raises(stored.StoreFailed, match="ValueError: a bug in the store"):
            agent.suspend(
                [(p, p) for p in PIDS], work / "ckpt", where=where, native=fake, store_beside=True
            )
        assert set(fake.states.values()) == {ProcessState.CHECKPOINTED}
        assert (work / "ckpt" / "manifest.json").exists()
        assert agent.resume(work / "ckpt", where=where, native=fake).coordinator_restored


DUMP = "ab" * 16
WHO = "c" * 32


def part_bytes(k: int, n: int, count: int = 0, dump: str = DUMP, version: int = 3) -> bytes:
    return wire.STORED_HEADER_STRUCT.pack(
        wire.STORED_MAGIC, version, count, k, n, 0, 4096, WHO.encode(), bytes.fromhex(dump), 0
    )


@pytest.mark.parametrize(
    ("parts", "words"),
    [
        ([part_bytes(0, 1, count=2**32 - 1)], "its table of 4294967295 entries is cut short"),
        ([part_bytes(0, 1, version=2)], "is of the stored format's version 2"),
        ([part_bytes(0, 1, dump="cd" * 16)], f"is of dump {'cd' * 16}, not of dump {DUMP}"),
        ([part_bytes(1, 2), part_bytes(0, 2)], "says it is part 1 of 2, not part 0 of 2"),
        ([part_bytes(0, 1) + b"\0"], "has 89 bytes, its table says 88"),
        ([b"\0" * 10], "is shorter than a part's header (88 bytes)"),
    ],
    ids=["lying-count", "version-2", "another-dump", "out-of-order", "grown", "cut"],
)
def test_what_can_be_known_without_the_data_is_checked(
    work: Path, parts: list[bytes], words: str
) -> None:
    """check_parts, a resume's check before its native restore: each hostile part named,
    a count that lies read no further than the file (no memory taken for it)."""
    stored.record_identity(work, DUMP)
    for k, raw in enumerate(parts):
        stored.part_path(work, WHO, k).write_bytes(raw)
    problems = stored.check_parts(work, [WHO])
    assert any(words in line for line in problems), problems


def test_parts_without_an_identity_record_or_others_may_write_are_refused(work: Path) -> None:
    path = stored.part_path(work, WHO, 0)
    path.write_bytes(part_bytes(0, 1))
    assert "holds staged parts but no cuinterpose.stored" in stored.check_parts(work, [WHO])[0]
    stored.record_identity(work, DUMP)
    assert stored.check_parts(work, [WHO]) == []
    path.chmod(0o620)
    assert "is writable by group or others (mode 0620)" in stored.check_parts(work, [WHO])[0]
    path.chmod(0o600)
    (work / "elsewhere.bin").write_bytes(part_bytes(0, 1))
    path.unlink()
    path.symlink_to(work / "elsewhere.bin")
    assert "is a symbolic link (never followed)" in stored.check_parts(work, [WHO])[0]
    (work / stored.IDENTITY_FILE_NAME).chmod(0o666)
    assert "not trusted" in stored.check_parts(work, [WHO])[0]
