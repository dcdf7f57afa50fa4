"""The CRIU round trip's library and verbs, without CRIU: stand-in binaries, fake
participants and an in-memory native driver (specs/criu.md).

Finding a usable CRIU (named, ``$CUINTERPOSE_CRIU``, PATH; too old; ``criu check``
failing), what must hold before a restore (manifest, control directory, stale
sockets under both names), finding restored processes by namespace pid, a resume
of processes whose pids changed, a failed ``criu dump`` resuming the group, the
action script and the verbs' usage errors.
"""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest
from cuinterpose import cli, criu_action
from cuinterpose.engine import agent, criu, stored
from cuinterpose.engine.native_checkpoint import ProcessState
from cuinterpose.engine.statefile import STATE_FILE_NAME
from cuinterpose.engine.wire import Op, Phase, Status, socket_name
from cuinterpose.testing import Fault
from engine_harness import Team, short_dir, team_of
from test_agent import PIDS, TOPOLOGY, FakeNative, running


@pytest.fixture
def work() -> Iterator[Path]:
    with short_dir() as path:
        yield path


@pytest.fixture(autouse=True)
def group_tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The fake participants' pids as the tree of pid 1 (they are no processes), for the
    check that a dump's --tree holds every process of the group."""
    proc = fake_proc(tmp_path / "proc", {1: (0, [1]), **{p: (1, [p]) for p in PIDS}})
    monkeypatch.setattr(criu, "PROC", proc)
    return proc


def fake_criu(path: Path, *, version: str = "4.2", check: int = 0, dump: int = 0) -> Path:
    """A stand-in ``criu``: its version, ``check``'s status, ``dump``'s status (a failed
    dump writes an error line to its ``-o`` log, as CRIU does)."""
    path.write_text(
        "#!/bin/sh\n"
        'log=/dev/null; prev=""\n'
        'for a in "$@"; do [ "$prev" = -o ] && log=$a; prev=$a; done\n'
        'case "$1" in\n'
        f'  --version) echo "Version: {version}" ;;\n'
        f'  check) echo "Error (criu/cr-check.c:1): injected check failure" >&2; exit {check} ;;\n'
        f'  dump) echo "(00.1) Error (criu/cr-dump.c:2): injected dump failure" >"$log"; '
        f"exit {dump} ;;\n"
        "esac\n"
    )
    path.chmod(0o755)
    return path


# ------------------------------------------------------------------ finding CRIU
def test_criu_is_found_named_then_by_variable_then_on_path(work: Path) -> None:
    named = fake_criu(work / "named")
    by_env = fake_criu(work / "by-env")
    on_path = fake_criu(work / "criu")
    env = {criu.CRIU_ENV: str(by_env), "PATH": str(work)}
    assert criu.find_criu(named, env) == named
    assert criu.find_criu(None, env) == by_env
    assert criu.find_criu(None, {"PATH": str(work)}) == on_path
    with pytest.raises(criu.CriuUnavailable, match=r"\$CUINTERPOSE_CRIU\) is not an executable"):
        criu.find_criu(None, {criu.CRIU_ENV: str(work / "missing")})
    (work / "criu").unlink()
    if not any(Path(d, "criu").exists() for d in ("/usr/local/sbin", "/usr/sbin", "/sbin")):
        with pytest.raises(criu.CriuUnavailable, match="no criu on PATH"):
            criu.find_criu(None, {"PATH": str(work)})


def test_a_usable_criu_is_at_least_4_and_passes_its_check(work: Path) -> None:
    good = criu.usable_criu(fake_criu(work / "good"), {})
    assert good.version == (4, 2)
    with pytest.raises(criu.CriuUnavailable, match=r"CRIU 3\.17\.1: at least 4\.0 is needed"):
        criu.usable_criu(fake_criu(work / "old", version="3.17.1"), {})
    with pytest.raises(criu.CriuUnavailable, match=r"check` exited 1: .*injected check failure"):
        criu.usable_criu(fake_criu(work / "failing", check=1), {})


def test_criu_runs_without_ld_preload() -> None:
    env = criu.criu_env({"LD_PRELOAD": "libcuinterpose.so", "PATH": "/bin"})
    assert env == {"PATH": "/bin"}


# ------------------------------------------------------------------ before the restore
def suspended(work: Path, *, resumed: bool = False, state_file: bool = True) -> Path:
    directory = work / f"ckpt-{resumed}-{state_file}"
    directory.mkdir()
    participants = tuple(agent.Participant(p, p, f"{p:032x}") for p in (7, 8))
    manifest = agent.Manifest(True, True, participants, resumed_at="x" if resumed else "")
    agent.write_manifest(directory, manifest)
    if state_file:
        (directory / STATE_FILE_NAME).write_text("{}")
    return directory


def bound(path: Path, *, listening: bool) -> socket.socket | None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    if listening:
        s.listen()
        return s
    s.close()  # the file stays: stale
    return None


def test_before_restore_frees_both_names_of_the_recreated_processes(work: Path) -> None:
    directory = suspended(work)
    control = work / "control"
    control.mkdir(mode=0o700)
    bound(control / socket_name(7), listening=False)
    bound(control / ".cuinterpose-8.0a1b2c3d.tmp", listening=False)  # where CRIU binds again
    bound(control / socket_name(9), listening=False)  # another process's: left alone
    done = criu.before_restore(directory, control)
    assert set(done.removed) == {control / socket_name(7), control / ".cuinterpose-8.0a1b2c3d.tmp"}
    assert sorted(os.listdir(control)) == [socket_name(9)]


def test_before_restore_refuses_a_socket_a_live_shim_serves(work: Path) -> None:
    directory = suspended(work)
    control = work / "control"
    control.mkdir(mode=0o700)
    live = bound(control / socket_name(8), listening=True)
    assert live is not None
    with live, pytest.raises(agent.AgentError, match=r"pid 8 \(ns pid 8\): .* served by a live"):
        criu.before_restore(directory, control)


def test_before_restore_makes_a_missing_control_directory_and_refuses_an_open_one(
    work: Path,
) -> None:
    directory = suspended(work)
    fresh = work / "node" / "control"
    assert criu.before_restore(directory, fresh).removed == ()
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o700
    fresh.chmod(0o777)
    with pytest.raises(agent.AgentError, match="writable by group or others"):
        criu.before_restore(directory, fresh)


def test_before_restore_is_driven_by_the_manifest(work: Path) -> None:
    with pytest.raises(agent.ManifestError, match="no manifest"):
        criu.before_restore(work, work / "control")
    with pytest.raises(agent.ManifestError, match="was resumed at x"):
        criu.before_restore(suspended(work, resumed=True), work / "control")
    with pytest.raises(agent.ManifestError, match="says prepared, but there is no"):
        criu.before_restore(suspended(work, state_file=False), work / "control")
    # Not seen before the processes exist (a tmpfs of their mount namespace): no removal.
    assert criu.before_restore(suspended(work), None).removed == ()


def test_images_resumed_from_stay_restorable(work: Path) -> None:
    """A resume after a restore from images leaves them the group's checkpoint (restored
    again once that group is gone); a resume in place makes them stale."""
    directory = suspended(work, resumed=True)
    manifest = agent.read_manifest(directory)
    agent.write_manifest(directory, attrs.evolve(manifest, resumed_from_images=True))
    assert criu.before_restore(directory, None).manifest.resumed_from_images
    body = json.loads((directory / "manifest.json").read_text())
    assert body["resumed_from_images"] is True and body["resumed_at"] == "x"


# ------------------------------------------------------------------ after the restore
def fake_proc(root: Path, tasks: dict[int, tuple[int, list[int]]]) -> Path:
    """A /proc holding ``pid: (parent, NSpid fields)``."""
    for pid, (parent, nspid) in tasks.items():
        (root / str(pid)).mkdir(parents=True)
        (root / str(pid) / "stat").write_text(f"{pid} (py thon) S {parent} 1 1 0\n")
        fields = "\t".join(map(str, nspid))
        (root / str(pid) / "status").write_text(f"Name:\tpython\nNSpid:\t{fields}\n")
    return root


def test_restored_processes_are_found_by_namespace_pid_under_the_root(work: Path) -> None:
    # Restored into a new pid namespace: the root is 1 there, the workers 7 and 8.
    proc = fake_proc(
        work / "proc",
        {500: (1, [500, 1]), 501: (500, [501, 7]), 502: (500, [502, 8]), 600: (1, [600])},
    )
    recorded = [agent.Process(4242, 7), agent.Process(4243, 8)]
    assert criu.locate(recorded, 500, proc) == (agent.Process(501, 7), agent.Process(502, 8))
    with pytest.raises(agent.AgentError, match=r"pid 1 \(ns pid 600\): no process .* pid 500"):
        criu.locate([agent.Process(1, 600)], 500, proc)  # not under the root
    with pytest.raises(agent.AgentError, match="pid 999, does not exist"):
        criu.locate(recorded, 999, proc)


def test_a_live_tree_is_located_through_the_real_proc() -> None:
    with subprocess.Popen(
        [sys.executable, "-c", "import subprocess,sys; subprocess.run(['sleep', '30'])"]
    ) as root:
        try:
            for _ in range(500):
                children = Path(f"/proc/{root.pid}/task/{root.pid}/children").read_text().split()
                if children:
                    break
                subprocess.run(["sleep", "0.01"], check=True)
            child = int(children[0])
            assert criu.locate([agent.Process(1, child)], root.pid) == (
                agent.Process(child, child),
            )
        finally:
            root.kill()


def test_resume_takes_restored_processes_by_namespace_pid(work: Path) -> None:
    fake = running()
    with team_of(TOPOLOGY, work / "control") as team:
        # The fakes are served by this process, not by the pids CRIU "gave" them.
        where = agent.Where(team.control_dir, check_peer=False)
        agent.suspend([(p, p) for p in PIDS], work / "ckpt", where=where, native=fake)
        # CRIU recreated them in a new pid namespace: the same namespace pids, new pids here.
        moved = [agent.Process(p + 5000, p) for p in PIDS]
        fake.states = {p.observed_pid: ProcessState.CHECKPOINTED for p in moved}
        with pytest.raises(agent.ManifestError, match="namespace pids are not the manifest's"):
            agent.resume(
                work / "ckpt", where=where, native=fake, processes=moved[:1], restored=True
            )
        back = agent.resume(
            work / "ckpt", where=where, native=fake, processes=moved[::-1], restored=True
        )
        assert back.coordinator_restored
        assert {f.phase for f in team.fakes} == {Phase.ACTIVE}
        assert set(fake.states.values()) == {ProcessState.RUNNING}
        assert [pid for step, pid in fake.calls if step == "restore"] == [6000, 6001]


def test_resume_of_restored_processes_skips_what_criu_restored_natively(work: Path) -> None:
    fake = running()
    with team_of(TOPOLOGY, work / "control") as team:
        where = agent.Where(team.control_dir)
        agent.suspend([(p, p) for p in PIDS], work / "ckpt", where=where, native=fake)
        fake.states[PIDS[0]] = ProcessState.LOCKED  # half way: refused, nothing done
        with pytest.raises(agent.StateRefused, match=r"pid 1000 \(ns pid 1000\) is LOCKED"):
            agent.resume(
                work / "ckpt",
                where=where,
                native=fake,
                processes=[(p, p) for p in PIDS],
                restored=True,
            )
        # CRIU's CUDA plugin restored and unlocked the first one by itself.
        fake.states[PIDS[0]] = ProcessState.RUNNING
        fake.calls.clear()
        back = agent.resume(
            work / "ckpt",
            where=where,
            native=fake,
            processes=[(p, p) for p in PIDS],
            restored=True,
        )
        assert back.coordinator_restored
        assert fake.calls == [("restore", 1001), ("unlock", 1001)]
        assert {f.phase for f in team.fakes} == {Phase.ACTIVE}


# ------------------------------------------------------------------ a failed dump
@pytest.mark.parametrize("what", ["criu-dump", "store"])
def test_a_failed_dump_resumes_the_group(work: Path, what: str) -> None:
    """``criu dump`` itself failed, or the store beside the native checkpoint failed for
    one shim; then no ``criu dump`` runs (its images would lack that shim's bytes). Either
    way the group is resumed, the stored copies fetched back first."""
    fake = running()
    store_fails = what == "store"
    script = {1: {Op.STORE_STAGED: Fault("fail", Status.INTERNAL, "pwrite failed (injected)")}}
    binary = criu.usable_criu(fake_criu(work / "criu", dump=0 if store_fails else 1), {})
    with team_of(TOPOLOGY, work / "control", scripts=script if store_fails else None) as team:
        with pytest.raises(criu.CriuDumpFailed) as info:
            criu.dump(
                [(p, p) for p in PIDS],
                work / "ckpt",
                work / "images",
                tree=1,
                criu=binary,
                where=agent.Where(team.control_dir),
                native=fake,
            )
        assert info.value.restored
        assert {f.phase for f in team.fakes} == {Phase.ACTIVE}
        assert [Op.FETCH_STAGED in f.received for f in team.fakes] == [True, not store_fails]
        assert set(fake.states.values()) == {ProcessState.RUNNING}
    text = str(info.value)
    if store_fails:
        assert "pwrite failed (injected)" in text, text
        assert not (work / "images" / criu.DUMP_LOG).exists()
    else:
        assert "injected dump failure" in text and "exit status 1" in text, text
    assert "resumed: the group runs as before the suspend" in text


def test_the_check_verb_says_why_criu_is_unusable(work: Path) -> None:
    err = io.StringIO()
    status = criu_action.main(
        ["check", "--criu", str(fake_criu(work / "old", version="3.17"))], stderr=err
    )
    assert status == criu_action.EXIT_FAILED
    assert "at least 4.0 is needed" in err.getvalue()


# ------------------------------------------------------------------ the action script
def test_the_action_script_bakes_its_arguments_and_environment(work: Path) -> None:
    directory = suspended(work)
    control = work / "control"
    control.mkdir(mode=0o700)
    bound(control / socket_name(7), listening=False)
    script = work / "action"
    out = io.StringIO()
    args = ["action-script", "--out", str(script), "--checkpoint-dir", str(directory)]
    args += ["--control-dir", str(control), "--process", "7", "7", "--process", "8", "8"]
    env = {"PYTHONPATH": os.environ.get("PYTHONPATH", ""), "KEPT": "a b'c"}
    assert criu_action.main([*args, "--keep-env", "KEPT"], stdout=out, environ=env) == 0
    text = script.read_text()
    assert "export KEPT='a b'\"'\"'c'" in text
    assert os.access(script, os.X_OK)

    def action(step: str, **more: str) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "CRTOOLS_SCRIPT_ACTION": step, **more}
        return subprocess.run(
            [str(script)], env=env, capture_output=True, text=True, timeout=60, check=False
        )

    assert action("network-lock").returncode == 0  # not ours: nothing done
    freed = action("pre-restore")
    assert freed.returncode == 0, freed.stderr
    assert f"removed the stale socket {control / socket_name(7)}" in freed.stderr
    lost = action("post-resume", CRTOOLS_INIT_PID="")
    assert lost.returncode == 1
    assert "$CRTOOLS_INIT_PID is '', not a pid" in lost.stderr
    # CRIU names its images directory by a descriptor of its own (/proc/<criu>/fd/<n>).
    images, other = work / "images", work / "other"
    images.mkdir()
    other.mkdir()
    (work / "fd").symlink_to(images)
    unsealed = action("post-dump")
    assert unsealed.returncode == 1 and "the images are not sealed" in unsealed.stderr
    sealed = action("post-dump", CRTOOLS_IMAGE_DIR=str(work / "fd"))
    assert sealed.returncode == 0, sealed.stderr
    seal = agent.read_manifest(directory).images
    assert seal is not None and seal.directory == str(images)
    wrong = action("pre-restore", CRTOOLS_IMAGE_DIR=str(other))
    assert wrong.returncode == 1 and f"{other} holds no cuinterpose.images" in wrong.stderr
    assert action("pre-restore", CRTOOLS_IMAGE_DIR=str(work / "fd")).returncode == 0


def test_the_cuinterpose_command_hands_criu_to_its_verbs(
    work: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(criu.CRIU_ENV, raising=False)
    out, err = io.StringIO(), io.StringIO()
    binary = fake_criu(work / "criu")
    assert cli.main(["criu", "check", "--criu", str(binary)], stdout=out, stderr=err) == 0
    assert out.getvalue() == f"{binary} (CRIU 4.2): `criu check` passes\n", err.getvalue()
    assert cli.main(["criu"], stdout=out, stderr=err) == 2


def test_the_verbs_usage_errors_exit_2(work: Path) -> None:
    err = io.StringIO()
    args = ["dump", "--checkpoint-dir", str(work), "--images-dir", str(work)]
    assert criu_action.main([*args, "--process", "1", "1"], stderr=err) == 2
    assert "--tree" in err.getvalue()
    err = io.StringIO()
    twice = [*args, "--tree", "1", "--process", "1", "1", "--process", "1", "1"]
    assert criu_action.main(twice, stderr=err, environ={criu.CRIU_ENV: "/bin/true"}) == 2
    assert "is given twice" in err.getvalue()
    err = io.StringIO()
    assert criu_action.main([*twice[:-3], "--phase-timeout", "-1"], stderr=err) == 2
    assert "'-1' is not a positive number of seconds" in err.getvalue()
    for parts in ("0", "65", "x"):
        err = io.StringIO()
        assert criu_action.main([*twice[:-3], "--stored-parts", parts], stderr=err) == 2
        assert f"{parts!r} is not" in err.getvalue(), err.getvalue()
    err = io.StringIO()
    restore = ["restore", "--checkpoint-dir", str(work), "--images-dir", str(work)]
    assert criu_action.main([*restore, "--gpu-map", "0=GPU-1"], stderr=err) == 2
    assert "is not OLD=NEW" in err.getvalue()


def test_a_restore_that_finds_a_pid_taken_names_what_holds_it(work: Path) -> None:
    holder, gone = os.getpid(), 4194303  # this test's own process; a pid past any in use
    stand_in = work / "criu"
    stand_in.write_text(
        "#!/bin/sh\n"
        'log=/dev/null; prev=""\n'
        'for a in "$@"; do [ "$prev" = -o ] && log=$a; prev=$a; done\n'
        f'echo "(00.1) Error (criu/cr-restore.c:1230): Can\'t fork for {holder}: File exists"'
        ' >"$log"\n'
        f'echo "(00.1) Error (criu/cr-restore.c:1230): Can\'t fork for {gone}: File exists"'
        ' >>"$log"\n'
        "exit 1\n"
    )
    stand_in.chmod(0o755)
    with pytest.raises(criu.CriuFailed) as failed:
        criu.run_criu(criu.Criu(stand_in, (4, 2)), ["restore", "-d"], work / "restore.log")
    lines = failed.value.lines()
    mine = next(line for line in lines if f"pid {holder} of the tree is taken by:" in line)
    assert "pytest" in mine or sys.executable in mine, mine
    assert any(f"pid {gone} of the tree is taken by: gone by now" in line for line in lines)


def test_a_pid_still_the_session_of_a_process_is_named_as_taken() -> None:
    # The H200 torch pair's restore: the tree's root (a session leader) was gone from
    # /proc, but a helper it forked still lived in its session, so its pid stayed taken.
    leader = subprocess.run(
        ["sh", "-c", "sleep 60 >/dev/null 2>&1 & echo $!"],
        start_new_session=True,
        capture_output=True,
        text=True,
        check=True,
    )
    helper = int(leader.stdout)
    try:
        session = int(Path(f"/proc/{helper}/stat").read_text().rsplit(")", 1)[1].split()[3])
        assert not Path(f"/proc/{session}").exists()
        (line,) = criu._pid_holders(
            [f"Error (cr-restore.c:1230): Can't fork for {session}: File exists"]
        )
        assert line.startswith(
            f"pid {session} of the tree is taken by: no process, but it is still"
        )
        assert f"the session id of pid {helper} (sleep 60)" in line, line
    finally:
        os.kill(helper, signal.SIGKILL)


def test_a_dump_that_finds_a_link_remap_left_names_it() -> None:
    errors = [
        "(00.045048) Warn  (criu/files-reg.c:1881): Can't link  -> ./dev/shm/link_remap.62",
        "(00.04) Error (criu/files-reg.c:1159): Can't link remap to /dev/shm/sem.W: File exists",
    ]
    (hint,) = criu._remaps_in_the_way(errors)
    assert hint.startswith("/dev/shm/link_remap.62 is left from an earlier dump"), hint
    assert "remove the file if it is abandoned" in hint
    assert criu._remaps_in_the_way(errors[1:]) == []


# ------------------------------------------------------------------ the shared command line
class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def dump_verb(
    work: Path, team: Team, *more: str, stdout: io.StringIO, native: FakeNative, dump: int = 0
) -> tuple[int, str, str]:
    binary = fake_criu(work / "criu", dump=dump)
    args = ["dump", "--checkpoint-dir", str(work / "ckpt"), "--images-dir", str(work / "img")]
    args += ["--control-dir", str(team.control_dir), "--tree", "1", "--criu", str(binary)]
    args += [w for p in PIDS for w in ("--pid", str(p))]
    err = io.StringIO()
    code = criu_action.main([*args, *more], stdout=stdout, stderr=err, environ={}, native=native)
    return code, stdout.getvalue(), err.getvalue()


def test_dump_names_processes_with_pid_and_speaks_to_a_person_on_a_terminal(work: Path) -> None:
    with team_of(TOPOLOGY, work / "control") as team:
        code, out, err = dump_verb(work, team, stdout=Terminal(), native=running())
        assert (code, err) == (0, ""), err
        assert {f.phase for f in team.fakes} == {Phase.PREPARED}
    assert "dumped 2 processes (the tree of pid 1) in " in out
    assert "{" not in out  # no JSON for a person
    assert (
        f"next: cuinterpose criu restore --checkpoint-dir {work / 'ckpt'} --images-dir "
        f"{work / 'img'}"
    ) in out


def test_the_backend_given_to_the_command_line_reaches_criu_dump(work: Path) -> None:
    """``cli.main(native=...)`` hands its backend on to ``cuinterpose criu``: the dump's
    native steps run on it, not on a driver."""
    fake = running()
    binary = fake_criu(work / "criu")
    with team_of(TOPOLOGY, work / "control") as team:
        args = ["criu", "dump", "--checkpoint-dir", str(work / "ckpt"), "--images-dir",
                str(work / "img"), "--control-dir", str(team.control_dir), "--tree", "1",
                "--criu", str(binary), "--progress", "none", "--stored-parts", "3",
                *team.processes]  # fmt: skip
        err = io.StringIO()
        code = cli.main(args, stdout=io.StringIO(), stderr=err, native=fake)
        assert (code, err.getvalue()) == (0, ""), err.getvalue()
    assert set(fake.states.values()) == {ProcessState.CHECKPOINTED}
    # --stored-parts: each process's staged bytes in that many files.
    names = [p.name for p in stored.stored_files(work / "ckpt")]
    assert names == sorted(f"staged-{f.participant}.{k}.bin" for f in team.fakes for k in range(3))


def test_dump_with_json_ends_with_its_outcome_and_exit_code(work: Path) -> None:
    with team_of(TOPOLOGY, work / "control") as team:
        code, out, err = dump_verb(
            work, team, "--json", stdout=Terminal(), native=running(), dump=1
        )
        assert {f.phase for f in team.fakes} == {Phase.ACTIVE}  # resumed after the failure
    assert code == criu_action.EXIT_FAILED == cli.EXIT_FAILED
    assert "cuinterpose criu: criu dump failed:" in err and err.count("injected dump failure") == 1
    last = json.loads(out.splitlines()[-1])
    assert (last["event"], last["command"], last["exit_code"]) == ("summary", "criu dump", 1)
    assert last["outcome"] == "refused or failed: the group runs as before"
    assert "resumed: the group runs as before the suspend" in last["reason"]


@pytest.mark.parametrize("verb", ["dump", "restore", "action-script", "action"])
def test_every_verb_takes_the_shared_options_and_shows_the_exit_table(
    verb: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert criu_action.main([verb, "--help"]) == 0
    text = capsys.readouterr().out
    for option in ("--driver {auto,sim,system}", "-v, --verbose", "-q, --quiet", "--log-file"):
        assert option in text, option
    assert ("--pid PID" in text) == (verb != "restore")
    assert "example:\n  " in text and cli.EXIT_TABLE in text


def test_the_action_script_bakes_the_pids_and_the_driver(work: Path) -> None:
    script = work / "action"
    args = ["action-script", "--out", str(script), "--checkpoint-dir", str(work / "ckpt")]
    args += ["--pid", "7", "--process", "8", "80", "--driver", "sim", "-v"]
    assert criu_action.main(args, stdout=io.StringIO(), environ={}) == 0
    text = script.read_text()
    assert "--process 7 7 --process 8 80" in text and "--driver sim" in text
    assert "--progress auto" in text and text.rstrip().endswith("-v")


def test_check_answers_json_on_request(work: Path) -> None:
    out = io.StringIO()
    binary = fake_criu(work / "criu")
    assert criu_action.main(["check", "--criu", str(binary), "--json"], stdout=out) == 0
    answer = json.loads(out.getvalue())
    assert answer.items() >= {"usable": True, "criu": str(binary), "version": "4.2"}.items()
    assert (answer["event"], answer["exit_code"]) == ("summary", 0)  # one line, the summary
