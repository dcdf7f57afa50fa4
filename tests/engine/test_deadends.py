"""No dead ends at the CLI (specs/recovery.md): one exit-code table for every verb, and
a resume whose native steps ran never reports "nothing changed"."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from cuinterpose import cli
from cuinterpose.engine.native_checkpoint import ProcessState
from cuinterpose.engine.statefile import MAX_STATE_NESTING, STATE_FILE_NAME
from cuinterpose.engine.wire import Op, Phase, Status
from cuinterpose.testing import Fault
from engine_harness import Team, short_dir, team_of
from test_agent import TOPOLOGY, run_cli, running

SPEC = Path(__file__).resolve().parents[2] / "specs" / "recovery.md"


@pytest.fixture
def work() -> Iterator[Path]:
    with short_dir() as path:
        yield path


@pytest.mark.parametrize("verb", [None, "prepare", "restore", "recover", "suspend", "resume"])
def test_every_verb_s_help_has_the_one_exit_code_table(
    verb: str | None, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main([*([verb] if verb else []), "--help"]) == 0
    assert cli.EXIT_TABLE in capsys.readouterr().out


def test_the_spec_has_the_same_table() -> None:
    spec = SPEC.read_text()
    block = re.search(r"## Exit status\n.*?```\n(.*?)```", spec, re.S)
    assert block, "specs/recovery.md has no exit status block"
    assert block[1] == cli.EXIT_TABLE


def test_a_resume_whose_native_steps_ran_exits_4_with_the_way_on(work: Path) -> None:
    fake = running()
    with team_of(TOPOLOGY, work / "control") as team:
        common = ["--checkpoint-dir", str(work / "ckpt"), "--control-dir", str(team.control_dir)]
        code, _, err = run_cli(["suspend", *common, *team.processes], fake)
        assert code == 0, err
        fake.fail = ("unlock", 1001)
        code, _, err = run_cli(["resume", *common, *team.processes], fake)
        assert code == cli.EXIT_NEEDS_RECOVER, err
        assert "the native restore ran" in err and "run: cuinterpose recover" in err, err
        assert fake.states[1000] is ProcessState.RUNNING  # it ran: not "nothing changed"
        assert {f.phase for f in team.fakes} == {Phase.PREPARED}
        # The way on: unlock the process, then recover rolls the group forward.
        fake.fail = None
        fake.unlock(1001)
        code, out, err = run_cli(["recover", *common, *team.processes, "--progress", "none"], fake)
        assert code == 0, err
        assert "recover: restored" in out
        assert {f.phase for f in team.fakes} == {Phase.ACTIVE}


def test_a_suspend_whose_capture_rolled_back_exits_1_not_3(work: Path) -> None:
    fake = running()
    script = {1: {Op.PREPARE_UNICAST: Fault("fail", status=Status.INTERNAL, message="boom")}}
    with team_of(TOPOLOGY, work / "control", scripts=script) as team:
        common = ["--checkpoint-dir", str(work / "ckpt"), "--control-dir", str(team.control_dir)]
        code, _, err = run_cli(["suspend", *common, *team.processes], fake)
        assert code == cli.EXIT_FAILED, err
        assert "rolled back: every process is running as before the run" in err, err
        assert {f.phase for f in team.fakes} == {Phase.ACTIVE}
    assert [c for c in fake.calls if c[0] != "state"] == []  # no native step ran


# -- a trusted checkpoint directory ----------------------------------------------------------


def _plant(kind: str, work: Path) -> tuple[Path, str]:
    """A checkpoint directory someone else could have planted, and the word refusing it."""
    ckpt = work / "ckpt"
    if kind == "symlink":
        real = work / "elsewhere"
        real.mkdir(mode=0o700)
        ckpt.symlink_to(real)
        return ckpt, "is a symbolic link"
    ckpt.mkdir(mode=0o700)
    if kind == "group-writable":
        ckpt.chmod(0o770)
        return ckpt, "is writable by group or others"
    if os.getuid() != 0:
        pytest.skip("making a directory owned by another user needs root")
    os.chown(ckpt, 4242, 4242)
    return ckpt, "is owned by uid 4242"


@pytest.mark.parametrize("kind", ["symlink", "group-writable", "foreign-owner"])
@pytest.mark.parametrize("verb", ["prepare", "suspend"])
def test_an_untrusted_checkpoint_directory_is_refused_before_anything_changes(
    work: Path, kind: str, verb: str
) -> None:
    ckpt, why = _plant(kind, work)
    fake = running()
    with team_of(TOPOLOGY, work / "control") as team:
        argv = [verb, "--checkpoint-dir", str(ckpt), "--control-dir", str(team.control_dir),
                *team.processes, "--progress", "none"]  # fmt: skip
        code, _, err = run_cli(argv, fake)
        assert code == cli.EXIT_FAILED, err
        assert why in err and "not trusted" in err, err
        assert all(not f.received or set(f.received) <= {Op.STATUS} for f in team.fakes)
        assert {f.phase for f in team.fakes} == {Phase.ACTIVE}
    assert [c for c in fake.calls if c[0] != "state"] == []
    assert not any(p.name.startswith("cuinterpose") for p in Path(os.path.realpath(ckpt)).iterdir())


# -- a state file nested too deeply ----------------------------------------------------------


def test_a_deeply_nested_state_file_is_refused_by_name(work: Path) -> None:
    fake = running()
    with team_of(TOPOLOGY, work / "control") as team:
        code, _, err = run_cli(machine("prepare", team, work), fake)
        assert code == 0, err
        (work / "ckpt" / STATE_FILE_NAME).write_text("[" * 100_000 + "]" * 100_000)
        code, _, err = run_cli(machine("restore", team, work), fake)
        assert code == cli.EXIT_FAILED, err
        assert f"nested deeper than {MAX_STATE_NESTING} levels" in err, err
        assert "internal error" not in err and "RecursionError" not in err
        # The group is as it was (PREPARED): recover rolls it back.
        code, out, err = run_cli(machine("recover", team, work), fake)
        assert code == 0, err
        assert "recover: rolled back" in out and "cannot be restored from" in out, out
        assert {f.phase for f in team.fakes} == {Phase.ACTIVE}


def machine(verb: str, team: Team, work: Path) -> list[str]:
    return [verb, "--checkpoint-dir", str(work / "ckpt"), "--control-dir", str(team.control_dir),
            *team.processes, "--progress", "none"]  # fmt: skip
