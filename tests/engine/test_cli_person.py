"""The command a person reaches for (issue 21): naming processes simply, the group taken
from where it is recorded, one message per failure, the outcome and the next step,
Ctrl-C acknowledged at once, the driver the shims report, ``check``, ``--version``,
an example and the exit codes in every ``--help``, the public API.

Against fake participants (and tests/engine/test_agent.py's in-memory native driver);
what needs a real shim is in tests/shim (test_using_it.py: README's session), what
needs the installed wheel in tests/packaging.
"""

from __future__ import annotations

import ctypes.util
import importlib.metadata
import io
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import topologies
from cuinterpose import cli, engine, logs, targets
from cuinterpose.engine import discovery
from cuinterpose.engine.native_checkpoint import CudaBackend, NativeBackend, NativeUnavailableError
from cuinterpose.engine.wire import Op, Phase, socket_name
from cuinterpose.testing import Fault
from engine_harness import ALL_RUNNING, short_dir, team_of
from test_agent import running

TOPOLOGY = topologies.team(2, 2, multicast=False)
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def work() -> Iterator[Path]:
    with short_dir() as path:
        yield path


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SNAPSHOT_CONTROL_DIR", raising=False)
    monkeypatch.delenv("SNAPSHOT_PHASE_TIMEOUT_S", raising=False)


def run(
    *argv: str, native: NativeBackend | None = ALL_RUNNING, **patch: Any
) -> tuple[int, str, str]:
    """``native=None``: the driver ``--driver`` names, loaded as a user's command would."""
    out, err = io.StringIO(), io.StringIO()
    code = cli.main(list(argv), stdout=out, stderr=err, native=native)
    return code, out.getvalue(), err.getvalue()


def summary(out: str) -> dict[str, Any]:
    last = json.loads(out.splitlines()[-1])
    assert last["event"] == "summary", last
    return dict(last)


def a_gone_pid() -> int:
    """A pid that named a process a moment ago and names none now."""
    child = subprocess.Popen([sys.executable, "-c", ""])
    child.wait()
    assert not discovery.pid_exists(child.pid)
    return child.pid


# ------------------------------------------------------------------ naming processes
def test_pid_names_the_same_pid_in_both_namespaces_and_restore_takes_the_state_files(
    work: Path,
) -> None:
    with team_of(TOPOLOGY, work / "control") as t:
        common = ["--checkpoint-dir", str(work / "ckpt"), "--control-dir", str(t.control_dir)]
        pids = [w for f in t.fakes for w in ("--pid", str(f.pid))]
        code, _, err = run("prepare", *common, *pids, "--progress", "none")
        assert (code, err) == (0, "")
        assert {f.phase for f in t.fakes} == {Phase.PREPARED}
        code, _, err = run("restore", *common, "--pid", str(t.fakes[0].pid))
        assert code == cli.EXIT_FAILED
        assert "not the group recorded in" in err and f"given pid {t.fakes[0].pid}" in err
        assert {f.phase for f in t.fakes} == {Phase.PREPARED}  # nothing was sent
        code, _, err = run("restore", *common, "--progress", "none")  # the state file's group
        assert (code, err) == (0, "")
        assert {f.phase for f in t.fakes} == {Phase.ACTIVE}
        code, out, err = run("recover", *common)
        assert code == 0 and "recover: nothing" in out, err


def test_a_recorded_process_not_given_is_named_with_whether_it_runs(work: Path) -> None:
    me, other = os.getpid(), subprocess.Popen(["sleep", "60"])
    try:
        with team_of(TOPOLOGY, work / "control", pids={0: me, 1: other.pid}) as t:
            common = ["--checkpoint-dir", str(work / "ckpt"), "--control-dir", str(t.control_dir)]
            code, _, err = run("prepare", *common, "--pid", str(me), "--pid", str(other.pid),
                               "--progress", "none")  # fmt: skip
            assert (code, err) == (0, "")
            stranger = os.getppid()  # runs, and is not recorded
            given = ["--pid", str(me), "--pid", str(stranger)]
            code, _, err = run("restore", *common, *given)
            assert code == cli.EXIT_FAILED
            assert f"recorded pid {other.pid} is not given: it runs" in err, err
            assert "survivors" not in err
            other.kill()
            os.waitid(os.P_PID, other.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped
            code, _, err = run("restore", *common, *given)
            assert code == cli.EXIT_FAILED
            assert f"recorded pid {other.pid} is not given: it exited (a zombie" in err, err
            # A zombie is gone: the survivor alone may be named (specs/recovery.md).
            survivor = [(me, me)]
            assert targets.resolve(survivor, work / "ckpt", proc_root=None) == survivor
            other.wait()
            code, _, err = run("restore", *common, *given)
            assert code == cli.EXIT_FAILED
            assert (
                f"recorded pid {other.pid} is not given: no process has that pid (it is gone)"
                in err
            ), err
            assert f"pid {stranger} is given but not recorded there" in err
            assert f"or only the survivors, pid {me}, to leave the gone ones out" in err
            assert {f.phase for f in t.fakes} == {Phase.PREPARED}  # nothing was sent
    finally:
        other.kill()
        other.wait()


def test_a_state_file_naming_an_extra_participant_says_which_one(work: Path) -> None:
    """The state file names one process more than the group given, one that runs with no
    shim (another group's record, or an edited one): the processes named are refused
    with that one named as extra, not as one of the group to name."""
    me, other = os.getpid(), subprocess.Popen(["sleep", "60"])
    extra = subprocess.Popen(["sleep", "60"])
    three = topologies.team(3, 2, multicast=False)
    try:
        with team_of(three, work / "control", pids={0: me, 1: other.pid, 2: extra.pid}) as t:
            common = ["--checkpoint-dir", str(work / "ckpt"), "--control-dir", str(t.control_dir)]
            code, _, err = run("prepare", *common, *t.processes, "--progress", "none")
            assert (code, err) == (0, "")
            t.fakes[2].stop()  # its process runs on, no shim serves it
            given = ["--pid", str(me), "--pid", str(other.pid)]
            code, _, err = run("restore", *common, *given)
            assert code == cli.EXIT_FAILED
            assert (
                f"recorded pid {extra.pid} is not given: it runs, with no shim in "
                f"{t.control_dir}: no participant of the group, the record names it extra"
            ) in err, err
            assert f"names pid {extra.pid} extra" in err, err
            assert f"the group's processes in it are pid {me}, pid {other.pid}" in err, err
            assert "name the recorded ones, or none" not in err, err
            assert {f.phase for f in t.fakes[:2]} == {Phase.PREPARED}  # nothing was sent
    finally:
        for child in (other, extra):
            child.kill()
            child.wait()


def test_recover_without_a_record_says_so(work: Path) -> None:
    (work / "ckpt").mkdir()
    code, _, err = run("recover", "--checkpoint-dir", str(work / "ckpt"))
    assert code == cli.EXIT_FAILED
    assert f"{work / 'ckpt'} records no group" in err and "--pid PID" in err


def test_prepare_without_processes_is_a_usage_error() -> None:
    code, _, err = run("prepare", "--checkpoint-dir", "/x")
    assert code == cli.EXIT_USAGE and "give --pid PID" in err


def test_resume_takes_the_group_from_the_manifest_and_says_what_comes_next(work: Path) -> None:
    fake = running()
    with team_of(TOPOLOGY, work / "control") as t:
        common = ["--checkpoint-dir", str(work / "ckpt"), "--control-dir", str(t.control_dir)]
        pids = [w for f in t.fakes for w in ("--pid", str(f.pid))]
        code, out, err = run("suspend", *common, *pids, native=fake)
        assert (code, err) == (0, "")
        done = summary(out)
        assert (done["outcome"], done["exit_code"], done["processes"]) == ("suspended", 0, 2)
        capture = next(x for x in done["timings"] if x["phase"] == "capture")
        assert done["bytes_staged"] == capture["bytes"] > 0
        assert done["next"] == (
            f"cuinterpose resume --checkpoint-dir {work / 'ckpt'} --control-dir {t.control_dir}"
        )
        assert done["seconds"] == pytest.approx(sum(x["seconds"] for x in done["timings"]))
        assert done["gpu_memory_released"] == {
            "processes": 2,
            "all_device_memory": True,
            "tracked_bytes": 8 << 20,
            "shared_bytes": 8 << 20,
            "private_bytes": 0,
        }
        assert done["bytes_in"] == "host memory of each process"
        code, _, err = run("resume", "--checkpoint-dir", str(work / "ckpt"), "--control-dir",
                           str(t.control_dir), "--pid", "1000", native=fake)  # fmt: skip
        assert code == cli.EXIT_FAILED and "not the group recorded in" in err
        code, out, err = run(*["resume", *common], native=fake)
        assert (code, err) == (0, "")
        assert (summary(out)["outcome"], summary(out)["exit_code"]) == ("resumed", 0)
        assert {f.phase for f in t.fakes} == {Phase.ACTIVE}


def test_suspend_on_a_terminal_says_where_the_bytes_are_and_the_resume_command(work: Path) -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    fake = running()
    with team_of(TOPOLOGY, work / "control") as t:
        out, err = Terminal(), io.StringIO()
        argv = ["suspend", "--checkpoint-dir", str(work / "ckpt"), "--control-dir",
                str(t.control_dir), *t.processes]  # fmt: skip
        code = cli.main(argv, stdout=out, stderr=err, native=fake)
    text = out.getvalue()
    assert (code, err.getvalue()) == (0, ""), err.getvalue()
    assert "suspended 2 processes in" in text
    # Two allocations of 4 MiB, each shared by both processes (topologies.team).
    assert (
        "GPU memory released: 8.0 MiB (all of it shared) in 2 processes (the allocations the "
        "shims tracked; the native checkpoint released all device memory of each)"
    ) in text
    assert "where the bytes are: in the host memory of each process (8.0 MiB staged" in text
    assert f"next: cuinterpose resume --checkpoint-dir {work / 'ckpt'}" in text


def test_refusals_of_checkpointed_processes_name_resume_with_its_directory(work: Path) -> None:
    fake = running()
    with team_of(TOPOLOGY, work / "control") as t:
        ckpt = work / "ckpt"
        common = ["--control-dir", str(t.control_dir)]
        code, _, err = run("suspend", "--checkpoint-dir", str(ckpt), *common, *t.processes,
                           "--progress", "none", native=fake)  # fmt: skip
        assert (code, err) == (0, "")
        resume = f"`cuinterpose resume --checkpoint-dir {ckpt}`"
        # The directory holds the manifest of the suspend: the hint names it. (recover
        # takes natively checkpointed processes back itself: tests/shim/test_deadends.py.)
        code, _, err = run("prepare", "--checkpoint-dir", str(ckpt), *common, *t.processes,
                           "--progress", "none", native=fake)  # fmt: skip
        assert code == cli.EXIT_FAILED, err
        assert resume in err, err
        # Another directory: nothing records where they were suspended; DIR says which.
        code, _, err = run("prepare", "--checkpoint-dir", str(work / "other"), *common,
                           *t.processes, "--progress", "none", native=fake)  # fmt: skip
        assert code == cli.EXIT_FAILED
        assert (
            "`cuinterpose resume --checkpoint-dir DIR` (DIR: the directory of their suspend)" in err
        )
        code, _, err = run("suspend", "--checkpoint-dir", str(work / "again"), *common,
                           *t.processes, "--progress", "none", native=fake)  # fmt: skip
        assert code == cli.EXIT_FAILED and "CHECKPOINTED, not RUNNING" in err
        assert "comes back with `cuinterpose resume --checkpoint-dir DIR`" in err
        assert {f.phase for f in t.fakes} == {Phase.PREPARED}  # nothing was sent


def test_status_without_processes_lists_every_shim_of_the_control_directory(
    work: Path,
) -> None:
    fake = running()
    with team_of(TOPOLOGY, work / "control") as t:
        code, out, err = run("status", "--control-dir", str(t.control_dir), "--json",
                             native=fake)  # fmt: skip
        assert (code, err) == (0, "")
        rows = json.loads(out)["processes"]
        assert [r["observed_pid"] for r in rows] == [f.pid for f in t.fakes]
        assert {(r["native_state"], r["shim_phase"]) for r in rows} == {("RUNNING", "ACTIVE")}
    (work / "empty").mkdir()
    code, out, _ = run("status", "--control-dir", str(work / "empty"))
    assert code == 0 and f"no shim in {work / 'empty'}" in out


# ------------------------------------------------------------------ what is wrong, said once
def test_a_pid_that_does_not_exist_is_said_not_to_exist(work: Path) -> None:
    gone = a_gone_pid()
    (work / "control").mkdir()
    common = ["--checkpoint-dir", str(work / "ckpt"), "--control-dir", str(work / "control")]
    for argv in (
        ["prepare", *common, "--pid", str(gone)],
        ["suspend", *common, "--pid", str(gone), "--progress", "json"],
        ["suspend", *common, "--pid", str(gone), "--not-requested", "--progress", "none"],
        ["status", "--control-dir", str(work / "control"), "--pid", str(gone)],
    ):
        code, out, err = run(*argv, native=running([gone]))
        assert code == cli.EXIT_FAILED, argv
        assert f"pid {gone} does not exist" in err, (argv, err)
        assert "control socket" not in err
        if "json" in argv:
            assert (summary(out)["outcome"], summary(out)["exit_code"]) == ("refused", 1)


def test_a_process_without_the_shim_gets_a_hint(work: Path) -> None:
    (work / "control").mkdir()
    me = os.getpid()  # exists, and has no shim
    code, _, err = run("suspend", "--checkpoint-dir", str(work / "ckpt"), "--control-dir",
                       str(work / "control"), "--pid", str(me), "--progress", "none",
                       native=running([me]))  # fmt: skip
    assert code == cli.EXIT_FAILED
    assert f"pid {me} has no shim" in err
    assert "cuinterpose launch -- COMMAND" in err and "--not-requested" in err
    assert err.count("has no shim") == 1


def test_a_zombie_is_said_to_have_exited(work: Path) -> None:
    (work / "control").mkdir()
    child = subprocess.Popen(["sleep", "60"])
    child.kill()
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped
    try:
        code, _, err = run("suspend", "--checkpoint-dir", str(work / "ckpt"), "--control-dir",
                           str(work / "control"), "--pid", str(child.pid), "--progress", "none",
                           native=running([child.pid]))  # fmt: skip
    finally:
        child.wait()
    assert code == cli.EXIT_FAILED
    assert f"pid {child.pid} exited (a zombie its parent has not reaped)" in err, err
    assert "has no shim" not in err


def test_a_directory_on_the_socket_path_is_said_so(work: Path) -> None:
    (work / "control").mkdir()
    me = os.getpid()
    path = work / "control" / socket_name(me)
    path.mkdir()
    code, _, err = run("suspend", "--checkpoint-dir", str(work / "ckpt"), "--control-dir",
                       str(work / "control"), "--pid", str(me), "--progress", "none",
                       native=running([me]))  # fmt: skip
    assert code == cli.EXIT_FAILED
    assert f"pid {me} has no control socket: at its path {path} there is a directory" in err
    assert "until it is removed" in err
    assert "does not exist" not in err and "has no shim" not in err, err


def test_a_launchers_pid_names_its_child_with_the_shim(work: Path) -> None:
    """What `$!` gives after `cuinterpose launch ... &` is the launcher: its child, the
    program with the shim, is the one to name."""
    control = work / "control"
    control.mkdir()
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)  # fmt: skip
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(str(control / socket_name(child.pid)))
        code, _, err = run("prepare", "--checkpoint-dir", str(work / "ckpt"), "--control-dir",
                           str(control), "--pid", str(os.getpid()))  # fmt: skip
    finally:
        listener.close()
        assert child.stdin is not None
        child.stdin.close()
        child.wait()
    assert code == cli.EXIT_FAILED
    assert f"its child pid {child.pid} has one" in err and f"--pid {child.pid}" in err, err


def test_an_unusable_checkpoint_directory_is_a_plain_message(work: Path) -> None:
    (work / "ckpt" / "cuinterpose.lock").mkdir(parents=True)  # where the lock file goes
    with team_of(TOPOLOGY, work / "control") as t:
        code, _, err = run("prepare", "--checkpoint-dir", str(work / "ckpt"), "--control-dir",
                           str(t.control_dir), *t.processes)  # fmt: skip
        assert {f.phase for f in t.fakes} == {Phase.ACTIVE}
    assert code == cli.EXIT_FAILED
    assert err == f"cuinterpose: prepare: {work / 'ckpt' / 'cuinterpose.lock'}: Is a directory\n"


def test_every_failure_is_said_once_and_the_log_only_on_request(work: Path) -> None:
    fake = running()
    fake.fail = ("checkpoint", 1001)
    with team_of(TOPOLOGY, work / "control") as t:
        common = ["--checkpoint-dir", str(work / "ckpt"), "--control-dir", str(t.control_dir)]
        code, out, err = run("suspend", *common, *t.processes, native=fake)
        assert code == cli.EXIT_FAILED
        lines = err.splitlines()
        assert all(line.startswith("cuinterpose: ") for line in lines), err
        assert len(lines) == len(set(lines)) and "event=step" not in err
        assert "native checkpoint failed: pid 1001" in err
        ended = summary(out)
        assert ended["exit_code"] == cli.EXIT_FAILED and "the group runs as before" in (
            ended["outcome"])  # fmt: skip
        log = work / "log"
        fake.fail = None
        code, _, err = run("suspend", *common, *t.processes, "-v", "--log-file", str(log),
                           "--progress", "none", native=fake)  # fmt: skip
        assert code == 0, err
    assert "cuinterpose: INFO: cuinterpose event=step step=detect status=started" in err
    assert "Executed callback" not in err  # transitions is quieted
    text = log.read_text()
    assert "event=step step=native_checkpoint status=done" in text
    assert "Executed callback" not in text
    library = logging.getLogger("cuinterpose")
    assert [type(h) for h in library.handlers] == [logging.NullHandler]  # the CLI's are gone


def test_a_person_at_a_terminal_reads_the_log_through_rich() -> None:
    from rich.logging import RichHandler

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    for stream, kind in ((Terminal(), RichHandler), (io.StringIO(), logging.StreamHandler)):
        logs.configure(verbosity=1, stream=stream)
        try:
            installed = logging.getLogger("cuinterpose").handlers[-1]
            assert type(installed) is kind
            logging.getLogger("cuinterpose.agent").info("hello")
        finally:
            logs.reset()
        assert "hello" in stream.getvalue()
    assert "cuinterpose: INFO: hello" in stream.getvalue()  # the plain one, last


def test_sigint_is_acknowledged_at_once(work: Path) -> None:
    script = {0: {Op.SAVE_ALLOCATIONS: Fault("delay", seconds=30.0)}}
    with team_of(TOPOLOGY, work / "control", scripts=script) as t:
        proc = subprocess.Popen(
            [sys.executable, "-m", "cuinterpose", "prepare", "--checkpoint-dir",
             str(work / "ckpt"), "--control-dir", str(t.control_dir), *t.processes,
             "--skip-native-check", "--driver", "system",  # fakes: no driver knows their pids
             "--progress", "human"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        assert proc.stdout is not None and proc.stderr is not None
        for line in proc.stdout:  # the phase before SAVE_ALLOCATIONS has been reported
            if line.startswith("capture PREPARE_MULTICAST"):
                break
        while Op.SAVE_ALLOCATIONS not in t.fakes[0].received:
            assert proc.poll() is None
            time.sleep(0.01)
        proc.send_signal(signal.SIGINT)
        said = proc.stderr.readline()
        while said.startswith("cuinterpose: note: "):  # no driver here for the native check
            said = proc.stderr.readline()
        still_running = proc.poll() is None  # SAVE_ALLOCATIONS is still in its 30 s
        proc.kill()
        proc.communicate()
    assert still_running
    # What it waits for: the op in flight, named before it ends.
    assert said.startswith("cuinterpose: stopping: waiting for SAVE_ALLOCATIONS of the "
                           "capture on every process to end; then "), said  # fmt: skip
    assert "undone, and the group runs as before" in said


# ------------------------------------------------------------------ the driver
def test_the_native_calls_load_the_driver_the_shims_report(work: Path) -> None:
    with team_of(TOPOLOGY, work / "control") as t:
        for fake in t.fakes:
            fake.driver = "/opt/sim/libcuda.so.1"
        report = discovery.shim_drivers(t.endpoints)
        assert report.one() == "/opt/sim/libcuda.so.1" and report.silent == ()
        t.fakes[1].driver = "/usr/lib/libcuda.so.1"
        with pytest.raises(discovery.DriverMismatch, match="different CUDA drivers"):
            discovery.shim_drivers(t.endpoints).one()
        t.fakes[0].driver = t.fakes[1].driver = ""  # not loaded yet: no report
        assert discovery.shim_drivers(t.endpoints).one() is None


def test_a_driver_that_cannot_be_loaded_says_what_to_do(
    work: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(NativeUnavailableError, match="cannot load the CUDA driver /nowhere"):
        CudaBackend("/nowhere/libcuda.so.1").driver()
    monkeypatch.setenv("CUINTERPOSE_BUILD_DIR", str(work / "no-build"))
    with team_of(TOPOLOGY, work / "control") as t:
        code, _, err = run("suspend", "--checkpoint-dir", str(work / "ckpt"), "--control-dir",
                           str(t.control_dir), *t.processes, "--driver", "sim",
                           "--progress", "none", native=None)  # fmt: skip
        assert {f.phase for f in t.fakes} == {Phase.ACTIVE}
    assert code == cli.EXIT_FAILED
    assert "make build" in err and "cuinterpose check" in err, err


def _cli(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cuinterpose", *argv], capture_output=True,
                          text=True, env=env, timeout=120, check=False)  # fmt: skip


def test_check_on_the_simulated_driver(work: Path) -> None:
    build = REPO / "build"
    if not (build / "shim_c" / "sim" / "libcuda.so.1").is_file():
        pytest.skip("no build/: run `make build`")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LD_", "ASAN_"))}
    env.update(CUINTERPOSE_BUILD_DIR=str(build), SNAPSHOT_CONTROL_DIR=str(work / "control"))
    done = _cli("check", "--driver", "sim", "--json", env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    found = {f["name"]: f for f in json.loads(done.stdout)["findings"]}
    assert found["driver"]["verdict"] == "OK" and "simulated" in found["driver"]["detail"]
    assert found["native checkpoint API"]["verdict"] == "OK"
    assert found["control directory"]["verdict"] == "WARN"  # not there yet
    assert {f["verdict"] for f in found.values()} <= {"OK", "WARN"}
    if ctypes.util.find_library("cuda") is None:  # no driver of the machine's own
        done = _cli("check", "--driver", "system", env=env)
        assert done.returncode == 1
        assert re.search(r"^FAIL driver: .*install the NVIDIA driver", done.stdout, re.M)
        assert done.stdout.endswith("suspend cannot work here\n")


def test_check_quiet_says_nothing_but_the_errors() -> None:
    from cuinterpose.check import Finding, text_lines

    ok = Finding("pidfd", "OK", "pidfd_open works")
    warn = Finding("control directory", "WARN", "/x does not exist yet")
    fail = Finding("driver", "FAIL", "no libcuda.so.1: install the NVIDIA driver")
    assert text_lines([ok, warn], quiet=True) == []
    assert text_lines([ok, fail, warn], quiet=True) == [fail.line(), "suspend cannot work here"]
    assert text_lines([ok, warn], quiet=False) == [
        ok.line(), warn.line(), "suspend can work here"
    ]  # fmt: skip


def test_check_q_on_the_simulated_driver_prints_nothing(work: Path) -> None:
    build = REPO / "build"
    if not (build / "shim_c" / "sim" / "libcuda.so.1").is_file():
        pytest.skip("no build/: run `make build`")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LD_", "ASAN_"))}
    env.update(CUINTERPOSE_BUILD_DIR=str(build), SNAPSHOT_CONTROL_DIR=str(work / "control"))
    for argv in (("-q", "check"), ("check", "-q")):  # before the verb or after it
        done = _cli(*argv, "--driver", "sim", env=env)
        assert (done.returncode, done.stdout, done.stderr) == (0, "", ""), done
    done = _cli("check", "--driver", "sim", env=env)  # without -q: a WARN (no directory yet)
    assert "OK   driver" in done.stdout and "WARN control directory" in done.stdout, done


# ------------------------------------------------------------------ help, version, API
@pytest.mark.parametrize("verb", sorted(cli._VERBS))
def test_every_verb_has_an_example_and_its_exit_codes_in_help(
    verb: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main([verb, "--help"]) == 0
    text = capsys.readouterr().out
    assert "example:\n  " in text and "exit status" in text, text
    assert f"cuinterpose {verb}" in text.split("example:")[1] or verb in ("sim-path", "shim-path")


def test_every_option_of_every_verb_says_what_it_does() -> None:
    """Every flag has a help text, and a flag with choices names each one in it
    (``diagram --machine rollback``, ``demo --driver``)."""
    import argparse

    verbs = next(
        a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction)
    )
    silent, unnamed = [], []
    for verb, parser in verbs.choices.items():
        for action in parser._actions:
            if not action.option_strings or isinstance(action, argparse._HelpAction):
                continue
            where = f"{verb} {action.option_strings[0]}"
            if not action.help:
                silent.append(where)
            unnamed += [f"{where} {c}" for c in action.choices or () if str(c) not in action.help]
    assert not silent, f"options without a help text: {silent}"
    assert not unnamed, f"choices their option's help does not name: {unnamed}"


def test_version_is_the_package_metadata() -> None:
    done = _cli("--version")
    assert done.returncode == 0
    assert done.stdout == f"cuinterpose {importlib.metadata.version('cuinterpose')}\n"


def test_the_public_api_exports_what_the_readme_and_the_cli_use() -> None:
    readme = (REPO / "README.md").read_text()
    used = {
        name.strip()
        for group in re.findall(r"from cuinterpose\.engine import ([^\n]+)", readme)
        for name in group.split(",")
    }
    used |= {"NativeUnavailableError", "status", "Process", "ProcessStatus", "StateRefused"}
    assert used <= set(engine.__all__), used - set(engine.__all__)
    assert all(hasattr(engine, name) for name in engine.__all__)


# ------------------------------------------------------------------ launch keeps the pid
@pytest.mark.parametrize("exec_", [False, True])
def test_launch_says_and_writes_the_programs_pid(work: Path, exec_: bool) -> None:
    build = REPO / "build"
    if not (build / "shim_c" / "libcuinterpose.so").is_file():
        pytest.skip("no build/: run `make build`")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LD_", "ASAN_"))}
    env.update(CUINTERPOSE_BUILD_DIR=str(build), SNAPSHOT_CONTROL_DIR=str(work / "control"))
    pidfile = work / "app.pid"
    argv = [sys.executable, "-m", "cuinterpose", "launch", "--pidfile", str(pidfile)]
    argv += ["--exec"] if exec_ else []
    program = "import os; print(os.getpid(), flush=True)"
    launcher = subprocess.Popen(
        [*argv, "--", sys.executable, "-c", program],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out, err = launcher.communicate(timeout=120)
    assert launcher.returncode == 0, err
    pid = int(out)
    assert int(pidfile.read_text()) == pid
    if exec_:
        assert pid == launcher.pid  # the launcher became the program, and said its pid
        assert f"cuinterpose launch: pid {pid} becomes " in err and f"--pid {pid}" in err, err
    else:
        assert pid != launcher.pid
        assert f"cuinterpose launch: pid {pid} runs " in err and f"--pid {pid}" in err


def test_launch_refuses_a_control_directory_the_shim_would_refuse(work: Path) -> None:
    long = work / ("d" * 80)
    code, _, err = run("launch", "--control-dir", str(long), "--", "true")
    assert code == cli.EXIT_FAILED
    assert "over the 60 a shim accepts" in err and not long.exists()


def test_a_failed_capture_is_said_before_its_rollback(work: Path) -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    fake = running()
    script = {0: {Op.PREPARE_UNICAST: Fault("fail", message="cuMemRelease: CUDA_ERROR_X")}}
    with team_of(TOPOLOGY, work / "control", scripts=script) as t:
        out, err = Terminal(), io.StringIO()
        argv = ["suspend", "--checkpoint-dir", str(work / "ckpt"), "--control-dir",
                str(t.control_dir), *t.processes]  # fmt: skip
        code = cli.main(argv, stdout=out, stderr=err, native=fake)
        assert {f.phase for f in t.fakes} == {Phase.ACTIVE}
    # rich draws for a terminal: its control sequences are not the text
    lines = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.getvalue()).splitlines()
    # suspend's capture rolled back: the group runs as it was (exit 1, specs/recovery.md)
    assert code == cli.EXIT_FAILED, err.getvalue()
    failed = lines.index("capture: FAILED at PREPARE_UNICAST")
    rolled = next(i for i, line in enumerate(lines) if line.startswith("rollback done"))
    assert failed < rolled, lines
    assert not [line for line in lines if "FAILED after" in line], lines
    assert "CUDA_ERROR_X" in err.getvalue() and "CUDA_ERROR_X" not in out.getvalue()


def test_prepare_restore_and_recover_end_with_a_summary_like_suspend(work: Path) -> None:
    script = {0: {Op.PREPARE_UNICAST: Fault("fail", message="cuMemRelease: CUDA_ERROR_X")}}
    common = ["--checkpoint-dir", str(work / "ckpt"), "--progress", "json"]
    with team_of(TOPOLOGY, work / "control", scripts=script) as t:
        code, out, _ = run("prepare", *common, "--control-dir", str(t.control_dir), *t.processes)
        assert code == cli.EXIT_ROLLED_BACK
        ended = summary(out)
        assert (ended["command"], ended["exit_code"]) == ("prepare", cli.EXIT_ROLLED_BACK)
        assert ended["outcome"] == "failed and rolled back: the group runs as before"
    with team_of(TOPOLOGY, work / "control2") as t:
        for verb in ("prepare", "restore", "recover"):
            names = t.processes if verb == "prepare" else []
            code, out, err = run(verb, *common, "--control-dir", str(t.control_dir), *names)
            assert code == 0, err
            assert (summary(out)["outcome"], summary(out)["exit_code"]) == ("done", 0)
            if verb != "recover":  # which says what it did in its own lines
                assert summary(out)["processes"] == 2 and summary(out)["bytes_staged"] == 8 << 20
            if verb == "prepare":
                # with what a plain shell needs to find the group (issue 29)
                restore = (f"cuinterpose restore --checkpoint-dir {work / 'ckpt'} "
                           f"--control-dir {t.control_dir}")  # fmt: skip
                assert summary(out)["next"] == restore
    # A person reads the same, as suspend and resume say it.
    with team_of(TOPOLOGY, work / "control3") as t:
        common = ["--checkpoint-dir", str(work / "ckpt3"), "--control-dir", str(t.control_dir)]
        code, out, err = run("prepare", *common, *t.processes, "--progress", "human")
        assert code == 0, err
        assert "captured 2 processes in " in out and "8.0 MiB staged by the shims" in out
        code, out, err = run("restore", *common, "--progress", "human")
        assert code == 0, err
        assert out.splitlines()[-1].startswith("restored 2 processes in ")
        assert "8.0 MiB loaded back by the shims: every process runs" in out
