"""A user's first day (issue 29), what needs no real shim: the defaults say what they do,
the output contract, the smaller edges of the command line, CRIU's relative paths.

What needs real shims (the manifest's record of where the group lives, a member lost
while suspended, the native verbs, printed commands typed as printed) is in
tests/shim/test_first_day.py.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shlex
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import topologies
from cuinterpose import cli, criu_action, drivers, engine
from cuinterpose.engine import agent, criu, images
from cuinterpose.engine.client import control_dir_problem
from cuinterpose.engine.discovery import start_ticks
from cuinterpose.engine.native_checkpoint import NativeBackend, ProcessState
from cuinterpose.engine.progress import DoneEvent, human_line
from cuinterpose.engine.serial import to_json
from cuinterpose.engine.wire import Op, Phase
from cuinterpose.testing import Fault
from engine_harness import ALL_RUNNING, short_dir, team_of
from test_agent import running


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SNAPSHOT_CONTROL_DIR", raising=False)


def run(*argv: str, native: NativeBackend = ALL_RUNNING) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = cli.main(list(argv), stdout=out, stderr=err, native=native)
    return code, out.getvalue(), err.getvalue()


def last(out: str) -> dict[str, Any]:
    document = json.loads(out.splitlines()[-1])
    assert document["event"] == "summary", out
    return dict(document)


# ------------------------------------------------------------------ 1: the driver
def test_launch_runs_on_the_simulated_driver_where_no_nvidia_driver_is(tmp_path: Path) -> None:
    missing, no_device = tmp_path / "no-such-file", tmp_path / "no-device"
    chosen = drivers.installed(missing, no_device)
    assert chosen.kind == "sim"
    assert chosen.line() == (
        f"on the simulated driver: no NVIDIA driver here (no {missing}, no {no_device})"
    )


def test_launch_runs_on_the_systems_driver_where_one_is_installed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    version = tmp_path / "version"
    version.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  570.86.15\n")
    monkeypatch.setattr(drivers.ctypes.util, "find_library", lambda name: "libcuda.so.1")
    chosen = drivers.installed(version)
    assert chosen.kind == "system" and "570.86.15" in chosen.line(), chosen
    # A container given the control device, without /proc/driver/nvidia, has one too.
    device = tmp_path / "nvidiactl"
    device.touch()
    assert drivers.installed(tmp_path / "no-proc", device).kind == "system"
    # The kernel driver without its user-space library is not a driver to run on.
    monkeypatch.setattr(drivers.ctypes.util, "find_library", lambda name: None)
    monkeypatch.setattr(drivers, "_DRIVER_DIRS", (str(tmp_path),))
    assert drivers.installed(version).kind == "sim"


def test_launch_says_its_driver_first_and_check_agrees() -> None:
    with short_dir() as work:
        code, _, err = run("launch", "--control-dir", str(work / "c"), "--", sys.executable,
                           "-c", "")  # fmt: skip
        assert code == 0, err
        assert err.splitlines()[0] == f"cuinterpose launch: {drivers.installed().line()}"
        quiet = run("launch", "-q", "--control-dir", str(work / "c"), "--", sys.executable,
                    "-c", "")  # fmt: skip
        assert quiet == (0, "", ""), quiet
        # In a process of its own: loading a driver here would pin this one to it.
        env = {k: v for k, v in os.environ.items() if not k.startswith(("LD_", "ASAN_"))}
        done = subprocess.run(
            [sys.executable, "-m", "cuinterpose", "check", "--control-dir", str(work / "c"),
             "--json"], env=env, capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        driver = json.loads(done.stdout)["findings"][0]
        assert driver["verdict"] == "OK", driver
        assert f"as launch: {drivers.installed().line()}" in driver["detail"]


# ------------------------------------------------------------------ 5: the output contract
def test_json_output_ends_in_a_summary_even_for_an_early_error(tmp_path: Path) -> None:
    for verb in ("resume", "restore", "recover"):
        code, out, err = run(verb, "--checkpoint-dir", str(tmp_path / "missing"))
        assert code == 1, (verb, err)
        assert (last(out)["command"], last(out)["exit_code"]) == (verb, 1), out
        assert last(out)["reason"], out


def test_status_json_without_shims_is_json(tmp_path: Path) -> None:
    code, out, _ = run("status", "--control-dir", str(tmp_path), "--json")
    assert code == 0 and len(out.splitlines()) == 1  # one line: the summary, as every verb's
    document = json.loads(out)
    assert (document["processes"], document["control_dir"]) == ([], str(tmp_path))
    assert (document["event"], document["outcome"], document["exit_code"]) == ("summary", "done", 0)


def test_every_acting_verb_takes_progress_auto() -> None:
    parser = cli.build_parser()
    verbs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name in ("suspend", "resume", "prepare", "restore", "recover", "native"):
        progress = next(a for a in verbs.choices[name]._actions if a.dest == "progress")
        assert progress.default == "auto" and "auto" in (progress.choices or ()), name


def test_quiet_says_nothing_but_errors(tmp_path: Path) -> None:
    code, out, err = run("-q", "resume", "--checkpoint-dir", str(tmp_path / "missing"))
    assert code == 1 and out == "" and "no manifest" in err


# ------------------------------------------------------------------ 9: the smaller edges
def test_abbreviated_options_are_refused() -> None:
    code, _, err = run("resume", "--check", "ckpt")
    assert code == 2 and "--check" in err
    assert criu_action.main(["restore", "--check", "c", "--images", "i"]) == 2


def test_logging_options_before_the_verb() -> None:
    code, out, _ = run("-v", "diagram", "--machine", "capture")
    assert code == 0 and "stateDiagram" in out
    assert run("-v", "-q", "diagram", "--machine", "capture")[0] == 2
    code, _, err = run("-q", "criu", "restore", "--checkpoint-dir", "nowhere", "--images-dir",
                       "x", "--criu", "/nonexistent/criu")  # fmt: skip
    assert code == 1 and "nonexistent" in err, err  # passed on: refused, not a usage error


def test_the_options_a_newcomer_meets_have_help() -> None:
    parser = cli.build_parser()
    verbs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for verb, dest in (("launch", "driver"), ("launch", "control_dir"),
                       ("prepare", "progress"), ("diagram", "machine")):  # fmt: skip
        action = next(a for a in verbs.choices[verb]._actions if a.dest == dest)
        assert action.help, (verb, dest)


def test_criu_help_lists_its_verbs(capsys: pytest.CaptureFixture[str]) -> None:
    assert run("criu", "--help")[0] == 0
    text = capsys.readouterr().out
    for verb in criu_action._VERBS:
        assert f"\n  {verb} " in text, verb


def test_one_participant_is_singular() -> None:
    done = DoneEvent("capture", 0.5, 1, "ckpt")
    assert "(1 participant, ckpt)" in human_line(done)


def test_a_control_directory_open_to_others_says_chmod_700(tmp_path: Path) -> None:
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    problem = control_dir_problem(open_dir)
    assert problem is not None and problem.endswith(f"chmod 700 {open_dir}"), problem
    assert stat.S_IMODE(os.stat(open_dir).st_mode) == 0o777  # said, not done


def test_a_refused_suspend_or_dump_leaves_no_directory(tmp_path: Path) -> None:
    with short_dir() as work:
        code, _, err = run("suspend", "--checkpoint-dir", str(work / "ck"), "--control-dir",
                           str(work), "--pid", "999999")  # fmt: skip
        assert code == 1 and "does not exist" in err, err
        assert not (work / "ck").exists()
        environ = {"CUINTERPOSE_CRIU": str(tmp_path / "no-criu")}
        code = criu_action.main(["dump", "--checkpoint-dir", str(work / "ck"), "--images-dir",
                                 str(work / "img"), "--tree", "1", "--pid", "999999"],
                                stdout=io.StringIO(), stderr=io.StringIO(),
                                environ=environ)  # fmt: skip
        assert code == 1
        assert not (work / "ck").exists() and not (work / "img").exists()


# ------------------------------------------------------------------ 6: the public face
def test_the_public_face_is_an_embedders() -> None:
    assert {"suspend", "resume", "status", "Where", "read_manifest", "native_for"} <= set(
        engine.AGENT_API
    )
    # restore is the machine alone, said apart from resume (README, architecture.md)
    assert "restore" in engine.STEP_API and "restore" not in engine.AGENT_API
    assert "replay" not in engine.__all__ and "human_line" not in engine.__all__
    assert len(engine.__all__) < 60 and all(hasattr(engine, n) for n in engine.__all__)


# ------------------------------------------------------------------ 4: CRIU, relative paths
def test_criu_is_given_absolute_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """CRIU resolves -o and --pidfile against its images directory (-D)."""
    monkeypatch.chdir(tmp_path)
    seen: list[list[str]] = []
    fake = tmp_path / "criu"
    fake.write_text('#!/bin/sh\nprintf "%s\\n" "$@" > "$FAKE_ARGS"\nexit 1\n')
    fake.chmod(0o755)
    monkeypatch.setenv("FAKE_ARGS", str(tmp_path / "args"))
    binary = criu.Criu(fake, (4, 0))
    with pytest.raises(criu.CriuFailed):
        criu.run_criu(binary, ["dump", "-D", "img"], Path("img/dump.log"))
    argv = (tmp_path / "args").read_text().split("\n")
    assert argv[argv.index("-o") + 1] == str(tmp_path / "img" / "dump.log"), argv
    # restore: --pidfile and -D too, whatever the checkpoint and images directories are
    ck = Path("rc1/ck")
    ck.mkdir(parents=True)
    ck.chmod(0o700)
    agent.write_manifest(ck, agent.Manifest(False, False, (agent.Participant(1, 1, None),)))
    img = Path("rc1/img")
    img.mkdir()
    img.chmod(0o700)
    images.seal(img, ck)  # the images a dump left: trusted and sealed to the checkpoint

    def record(criu_: criu.Criu, args: list[str], log: Path, **_: Any) -> float:
        seen.append([*args, "-o", os.path.abspath(log)])
        raise criu.CriuFailed("fake", [])

    monkeypatch.setattr(criu, "run_criu", record)
    with pytest.raises(criu.CriuFailed):
        criu.restore(ck, Path("rc1/img"), criu=binary, where=agent.Where(tmp_path),
                     native=None, control_dir=None)  # type: ignore[arg-type]  # fmt: skip
    args = seen[0]
    assert args[args.index("-D") + 1] == str(tmp_path / "rc1" / "img")
    assert args[args.index("--pidfile") + 1] == str(tmp_path / "rc1" / "ck" / criu.RESTORED_PIDFILE)


# ------------------------------------------------------------------ 2: where the group lives
def test_the_manifest_keeps_its_origin_and_reads_one_without(tmp_path: Path) -> None:
    people = (agent.Participant(7, 7, "a" * 32), agent.Participant(8, 8, "b" * 32))
    origin = agent.Origin("/run/ctl", None, "/usr/lib/libcuda.so.1", (11, 12))
    written = agent.Manifest(True, False, people, origin=origin)
    assert agent.Manifest.from_json(to_json(written), tmp_path).origin == origin
    older = to_json(agent.Manifest(True, False, people))
    assert "origin" not in older and agent.Manifest.from_json(older, tmp_path).origin is None
    bad = {**to_json(written), "origin": {"control_dir": "/run/ctl", "started": [1]}}
    with pytest.raises(agent.ManifestError, match="one start time per participant"):
        agent.Manifest.from_json(bad, tmp_path)


def _suspended_here(work: Path, started: int) -> Path:
    """A manifest of this very process, suspended with its shim in ``work/ctl`` (where no
    shim answers), with the start time ``started``."""
    ck = work / "ck"
    ck.mkdir(mode=0o700)
    (ck / "cuinterpose.state").write_text("{}")
    me = os.getpid()
    origin = agent.Origin(str(work / "ctl"), None, None, (started,))
    manifest = agent.Manifest(True, True, (agent.Participant(me, me, "a" * 32),), origin=origin)
    agent.write_manifest(ck, manifest)
    return ck


class _Untouchable:
    """A native backend no call may reach: the refusals come before any step."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"native {name} called")


def test_a_silent_shim_of_a_living_process_is_refused_before_anything() -> None:
    with short_dir() as work:
        ck = _suspended_here(work, start_ticks(os.getpid()))
        with pytest.raises(agent.AgentError, match="alive but its shim does not answer") as e:
            agent.resume(ck, native=_Untouchable())  # type: ignore[arg-type]
        text = "\n".join(e.value.lines())
        assert f"looked in {work / 'ctl'}" in text and "nothing was changed" in str(e.value)


def test_a_pid_now_of_another_process_is_a_member_gone() -> None:
    with short_dir() as work:  # this pid, started at another time: another process
        ck = _suspended_here(work, start_ticks(os.getpid()) + 1)
        with pytest.raises(agent.ManifestError, match="every process of the group is gone"):
            agent.resume(ck, native=_Untouchable())  # type: ignore[arg-type]


# ------------------------------------------------------------------ 3: printed commands
def test_the_printed_recover_works_as_printed_from_a_plain_shell(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    script = {1: {Op.PREPARE_UNICAST: Fault("fail", message="cuMemRelease: CUDA_ERROR_Z")}}
    with (
        short_dir() as work,
        team_of(topologies.team(2, 2, multicast=False), work / "control", scripts=script) as t,
    ):
        monkeypatch.setenv("SNAPSHOT_CONTROL_DIR", str(t.control_dir))  # this shell only
        code, _, err = run("prepare", "--checkpoint-dir", str(work / "ck"), *t.processes,
                           "--no-rollback")  # fmt: skip
        assert code == cli.EXIT_NEEDS_RECOVER, err
        printed = err.split("run: ", 1)[1].splitlines()[0]
        assert f"--control-dir {t.control_dir}" in printed, printed
        monkeypatch.delenv("SNAPSHOT_CONTROL_DIR")  # another shell
        words = shlex.split(printed)
        assert words[0] == "cuinterpose"
        code, _, err = run(*words[1:])
        assert code == cli.EXIT_OK, err
        assert [f.phase for f in t.fakes] == [Phase.ACTIVE] * len(t.fakes)


# ------------------------------------------------------------------ 7: the native steps
def test_a_native_step_that_fails_half_way_prints_the_way_back() -> None:
    fake = running()
    fake.fail = ("lock", 1001)
    code, out, err = run(
        "native", "--action", "lock", "--pid", "1000", "--pid", "1001", native=fake
    )
    assert code == cli.EXIT_NEEDS_RECOVER, err
    assert last(out)["exit_code"] == cli.EXIT_NEEDS_RECOVER
    printed = err.split("undo it there with `", 1)[1].split("`", 1)[0]
    assert printed == "cuinterpose native --action unlock --pid 1000", printed
    fake.fail = None
    code, out, err = run(*shlex.split(printed)[1:], native=fake)
    assert code == 0, err
    assert last(out)["states"] == {"1000": "RUNNING"}
    assert set(fake.states.values()) == {ProcessState.RUNNING}
