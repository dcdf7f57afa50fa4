"""The CRIU images trusted and bound to their checkpoint, without CRIU (specs/criu.md,
"The images: trust and identity"): a stand-in ``criu`` that writes a page file and
says whether it was asked to restore, fake participants, the in-memory native driver.

Both directories created 0700 and the pages private; an images directory, or a file
in it, that others may write refused; the identity sealed into both at dump and a
restore of other images (an older dump of the group, another group's) refused
before CRIU runs, naming both; a ``--tree`` that leaves a process out refused before
the suspend; a ``criu`` that never returns killed at the time limit (a dump's group
resumed, a restore's outcome and the command that tries again said).
"""

from __future__ import annotations

import io
import os
import shutil
import stat
from pathlib import Path

import pytest
from cuinterpose import criu_action
from cuinterpose.engine import agent, criu, images, stored
from cuinterpose.engine.native_checkpoint import ProcessState
from cuinterpose.engine.wire import Phase
from engine_harness import Team, team_of
from test_agent import PIDS, TOPOLOGY, FakeNative, running
from test_criu import fake_proc, group_tree, work

__all__ = ["group_tree", "work"]  # the fixtures, used by name


def stand_in(path: Path, *, sleep: str = "") -> criu.Criu:
    """A ``criu`` whose dump writes a page file (mode 0644, as CRIU's followed the umask)
    and whose restore leaves a mark beside the images; ``sleep``: the verb that never
    returns (it sleeps, as the process itself, so that the kill ends it)."""
    path.write_text(
        "#!/bin/sh\n"
        'dir=""; prev=""\n'
        'for a in "$@"; do [ "$prev" = -D ] && dir=$a; prev=$a; done\n'
        f'[ "$1" = "{sleep}" ] && exec sleep 60\n'
        'case "$1" in\n'
        '  --version) echo "Version: 4.2" ;;\n'
        '  dump) echo "the GPU bytes" >"$dir/pages-1.img"; chmod 0644 "$dir/pages-1.img" ;;\n'
        '  restore) touch "$dir.restored"; exit 1 ;;\n'
        "esac\n"
    )
    path.chmod(0o755)
    return criu.Criu(path, (4, 2))


def dump_into(
    team: Team, fake: FakeNative, ckpt: Path, imgs: Path, binary: criu.Criu, **more: object
) -> criu.DumpResult:
    return criu.dump(
        [(p, p) for p in PIDS],
        ckpt,
        imgs,
        tree=1,
        criu=binary,
        where=agent.Where(team.control_dir),
        native=fake,
        **more,  # type: ignore[arg-type]
    )


def restored(team: Team, fake: FakeNative, ckpt: Path) -> None:
    """What a restore of the dump does to the fakes: back to running, resumed."""
    fake.states = {p: ProcessState.CHECKPOINTED for p in PIDS}
    agent.resume(ckpt, where=agent.Where(team.control_dir), native=fake)
    assert {f.phase for f in team.fakes} == {Phase.ACTIVE}


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_a_dump_makes_both_directories_and_the_pages_private_and_seals_them(work: Path) -> None:
    fake = running()
    binary = stand_in(work / "criu")
    with team_of(TOPOLOGY, work / "control") as team:
        done = dump_into(team, fake, work / "ckpt", work / "img", binary)
        assert {f.phase for f in team.fakes} == {Phase.PREPARED}
    assert (mode(work / "ckpt"), mode(work / "img")) == (0o700, 0o700)
    assert mode(work / "img" / "pages-1.img") == 0o600
    sealed = agent.read_manifest(work / "ckpt").images
    assert sealed is not None and sealed == done.manifest.images
    assert sealed.directory == str((work / "img").resolve())
    assert sealed.identity in (work / "img" / images.IDENTITY_FILE_NAME).read_text()
    assert mode(work / "img" / images.IDENTITY_FILE_NAME) == 0o600
    criu.before_restore(work / "ckpt", None, work / "img")  # its own images: accepted


@pytest.mark.parametrize("where", ["images directory", "page file"])
def test_images_others_may_write_are_refused(work: Path, where: str) -> None:
    fake = running()
    binary = stand_in(work / "criu")
    with team_of(TOPOLOGY, work / "control") as team:
        dump_into(team, fake, work / "ckpt", work / "img", binary)
    target = work / "img" if where == "images directory" else work / "img" / "pages-1.img"
    target.chmod(0o777 if where == "images directory" else 0o666)
    with pytest.raises(agent.ManifestError, match="writable by group or others") as info:
        criu.restore(
            work / "ckpt", work / "img", criu=binary, where=agent.Where(work / "control"),
            native=fake, control_dir=None,
        )  # fmt: skip
    assert str(target) in str(info.value) and "nothing was changed" in str(info.value)
    assert not Path(f"{work / 'img'}.restored").exists()  # CRIU never ran


def test_a_dump_into_an_images_directory_others_may_write_is_refused_before_suspending(
    work: Path,
) -> None:
    fake = running()
    (work / "img").mkdir()
    (work / "img").chmod(0o777)
    with team_of(TOPOLOGY, work / "control") as team:
        with pytest.raises(agent.AgentError, match=r"images directory .* writable by group"):
            dump_into(team, fake, work / "ckpt", work / "img", stand_in(work / "criu"))
        assert {f.phase for f in team.fakes} == {Phase.ACTIVE}
    assert fake.calls == [] and not (work / "ckpt" / agent.MANIFEST_FILE_NAME).exists()


def test_a_restore_of_an_older_dump_into_the_same_checkpoint_is_refused(work: Path) -> None:
    fake = running()
    binary = stand_in(work / "criu")
    ckpt, first, second = work / "ckpt", work / "A", work / "B"
    with team_of(TOPOLOGY, work / "control") as team:
        dump_into(team, fake, ckpt, first, binary)
        restored(team, fake, ckpt)
        fake.states = {p: ProcessState.RUNNING for p in PIDS}
        dump_into(team, fake, ckpt, second, binary)
        with pytest.raises(agent.ManifestError) as info:
            criu.restore(
                ckpt, first, criu=binary, where=agent.Where(team.control_dir), native=fake,
                control_dir=team.control_dir,
            )  # fmt: skip
        assert {f.phase for f in team.fakes} == {Phase.PREPARED}
    text = str(info.value)
    assert f"the images in {first} are not the group's of {ckpt}" in text, text
    assert f"records the images dumped to {second.resolve()}" in text, text
    assert "an older dump of this group" in text and "nothing was changed" in text
    assert not Path(f"{first}.restored").exists()  # CRIU never ran
    criu.before_restore(ckpt, None, second)  # the newest: accepted


def test_another_groups_images_are_refused_naming_their_checkpoint(work: Path) -> None:
    fake = running()
    binary = stand_in(work / "criu")
    with team_of(TOPOLOGY, work / "control") as team:
        dump_into(team, fake, work / "X", work / "X-img", binary)
        restored(team, fake, work / "X")
        fake.states = {p: ProcessState.RUNNING for p in PIDS}
        dump_into(team, fake, work / "Y", work / "Y-img", binary)
    with pytest.raises(agent.ManifestError) as info:
        criu.before_restore(work / "Y", None, work / "X-img")
    text = str(info.value)
    assert f"they are another group's: restore them with --checkpoint-dir {work / 'X'}" in text
    assert f"or this group with --images-dir {(work / 'Y-img').resolve()}" in text, text


def test_images_without_a_seal_or_a_manifest_without_images_are_refused(work: Path) -> None:
    fake = running()
    binary = stand_in(work / "criu")
    with team_of(TOPOLOGY, work / "control") as team:
        dump_into(team, fake, work / "ckpt", work / "img", binary)
    (work / "img" / images.IDENTITY_FILE_NAME).unlink()
    with pytest.raises(agent.ManifestError, match=f"holds no {images.IDENTITY_FILE_NAME}"):
        criu.before_restore(work / "ckpt", None, work / "img")
    (work / "plain").mkdir()  # a suspend, never dumped
    manifest = agent.read_manifest(work / "ckpt")
    agent.write_manifest(work / "plain", manifest.__class__(True, False, manifest.participants))
    with pytest.raises(agent.ManifestError, match="records no images"):
        criu.before_restore(work / "plain", None, work / "img")


def test_a_tree_that_leaves_a_process_out_is_refused_before_suspending(
    work: Path, group_tree: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = running()
    proc = fake_proc(work / "proc", {1: (0, [1]), 50: (1, [50]), PIDS[0]: (50, [PIDS[0]]),
                                     PIDS[1]: (1, [PIDS[1]])})  # fmt: skip
    monkeypatch.setattr(criu, "PROC", proc)
    with team_of(TOPOLOGY, work / "control") as team:
        with pytest.raises(agent.AgentError) as info:
            criu.dump(
                [(p, p) for p in PIDS], work / "ckpt", work / "img", tree=50,
                criu=stand_in(work / "criu"), where=agent.Where(team.control_dir), native=fake,
            )  # fmt: skip
        assert {f.phase for f in team.fakes} == {Phase.ACTIVE}
    assert f"pid {PIDS[1]} (ns pid {PIDS[1]}) is not in the tree of pid 50" in str(info.value)
    assert f"pid {PIDS[0]} " not in str(info.value)
    assert fake.calls == [] and not (work / "ckpt").exists()


def test_a_dump_past_its_time_limit_kills_criu_and_resumes_the_group(work: Path) -> None:
    fake = running()
    with team_of(TOPOLOGY, work / "control") as team:
        with pytest.raises(criu.CriuDumpFailed) as info:
            dump_into(team, fake, work / "ckpt", work / "img",
                      stand_in(work / "criu", sleep="dump"), criu_timeout_s=0.3)  # fmt: skip
        assert {f.phase for f in team.fakes} == {Phase.ACTIVE}
        assert set(fake.states.values()) == {ProcessState.RUNNING}
    assert info.value.restored
    text = str(info.value)
    assert "ran past its time limit of 0.3 s and was killed" in text, text
    assert "resumed: the group runs as before the suspend" in text
    assert agent.read_manifest(work / "ckpt").images is None


def test_a_restore_past_its_time_limit_says_what_is_left_and_how_to_try_again(
    work: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = running()
    with team_of(TOPOLOGY, work / "control") as team:
        dump_into(team, fake, work / "ckpt", work / "img", stand_in(work / "criu"))
    sleepy = stand_in(work / "criu-sleepy", sleep="restore")
    monkeypatch.setattr(criu, "usable_criu", lambda named, environ: sleepy)
    err = io.StringIO()
    code = criu_action.main(
        ["restore", "--checkpoint-dir", str(work / "ckpt"), "--images-dir", str(work / "img"),
         "--control-dir", str(work / "control"), "--criu-timeout", "0.3", "--progress", "none"],
        stdout=io.StringIO(), stderr=err, environ={}, native=fake,
    )  # fmt: skip
    text = err.getvalue()
    assert code == criu_action.EXIT_NEEDS_RECOVER, text
    assert "ran past its time limit of 0.3 s and was killed" in text
    assert "CRIU wrote no pid file" in text
    again = f"cuinterpose criu restore --checkpoint-dir {work / 'ckpt'} --images-dir {work / 'img'}"
    assert f"then run again: {again}" in text, text


def test_another_dumps_parts_with_their_record_are_refused_before_the_native_restore(
    work: Path,
) -> None:
    """The staged parts and their identity record of another dump of the group (the same
    participants) put beside this dump's images: a resume refuses them, naming both
    identities, before any native call; its own put back, it resumes."""
    fake = running()
    binary = stand_in(work / "criu")
    with team_of(TOPOLOGY, work / "control") as team:
        other = dump_into(team, fake, work / "other", work / "img-other", binary)
        restored(team, fake, work / "other")
        this = dump_into(team, fake, work / "ckpt", work / "img", binary)
        assert other.manifest.images is not None and this.manifest.images is not None
        mine = work / "mine"
        mine.mkdir()
        names = [p.name for p in stored.stored_files(work / "ckpt")]
        for name in [*names, stored.IDENTITY_FILE_NAME]:
            shutil.move(work / "ckpt" / name, mine / name)
            shutil.copy2(work / "other" / name, work / "ckpt" / name)
        fake.states = {p: ProcessState.CHECKPOINTED for p in PIDS}
        fake.calls.clear()
        with pytest.raises(stored.StoreFailed) as info:
            agent.resume(work / "ckpt", where=agent.Where(team.control_dir), native=fake)
        text = str(info.value)
        assert f"are of dump {other.manifest.images.identity}" in text, text
        assert f"the images and the manifest of dump {this.manifest.images.identity}" in text
        assert "nothing was changed" in text and not info.value.changed
        assert [c for c in fake.calls if c[0] != "state"] == [], fake.calls
        for name in [*names, stored.IDENTITY_FILE_NAME]:
            shutil.copy2(mine / name, work / "ckpt" / name)
        agent.resume(work / "ckpt", where=agent.Where(team.control_dir), native=fake)
        assert {f.phase for f in team.fakes} == {Phase.ACTIVE}
