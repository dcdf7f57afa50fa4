"""The ``cuinterpose`` command line: exit codes, messages, progress output."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cuinterpose import cli
from cuinterpose.engine import quiesce, runner
from cuinterpose.engine.directory import DirectoryBusy, locked
from cuinterpose.engine.fsm import CAPTURE, RESTORE, mermaid
from cuinterpose.engine.statefile import STATE_FILE_NAME
from cuinterpose.engine.wire import Op, Phase, RecordKind, Status
from cuinterpose.testing import Fault
from engine_harness import ALL_RUNNING, TEARS_DOWN_OPS, Team, short_dir, team_of
from topologies import participant, replace_records, team, unsupported_exportable, with_records

TOPOLOGY = team(participants=2, allocations=2, multicast=True)
FIGURES = {"allocation_count", "allocation_bytes", "gb_per_s", "copy_gb_per_s"}


@pytest.fixture
def work() -> Iterator[Path]:
    with short_dir() as path:
        yield path


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SNAPSHOT_CONTROL_DIR", raising=False)
    monkeypatch.delenv("SNAPSHOT_PHASE_TIMEOUT_S", raising=False)


def run(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = cli.main(list(argv), stdout=out, stderr=err, native=ALL_RUNNING)
    return code, out.getvalue(), err.getvalue()


def machine_args(command: str, t: Team, work: Path, *extra: str) -> list[str]:
    # A person's output unless the test asks for another (the default, auto, is JSON
    # lines into these StringIO pipes).
    progress = [] if "--progress" in extra else ["--progress", "human"]
    return [
        command,
        "--checkpoint-dir",
        str(work / "ckpt"),
        "--control-dir",
        str(t.control_dir),
        *t.processes,
        *progress,
        *extra,
    ]


def json_lines(text: str) -> list[dict[str, object]]:
    """The progress events (the last line, the command's summary, left out)."""
    events = [json.loads(line) for line in text.splitlines()]
    assert events[-1]["event"] == "summary", events[-1]
    return events[:-1]


def test_prepare_and_restore_with_json_progress(work: Path) -> None:
    with team_of(TOPOLOGY, work / "control") as t:
        code, out, err = run(*machine_args("prepare", t, work, "--progress", "json"))
        assert (code, err) == (0, "")
        assert (work / "ckpt" / STATE_FILE_NAME).is_file()
        events = json_lines(out)
        assert [e["event"] for e in events] == ["phase"] * 6 + ["done"]
        assert [e["phase"] for e in events[:-1]] == [s.op for s in CAPTURE.steps if s.op]
        for event in events[:-1]:
            assert event["machine"] == "capture" and event["participants"] == 2
            assert isinstance(event["elapsed_s"], float)
            assert (event["phase"] == "SAVE_ALLOCATIONS") == (event.keys() >= FIGURES)

        code, out, err = run(*machine_args("restore", t, work, "--progress", "json"))
        assert (code, err) == (0, "")
        events = json_lines(out)
        assert [e["phase"] for e in events[:-1]] == [s.op for s in RESTORE.steps if s.op]
        load = next(e for e in events if e.get("phase") == "LOAD_ALLOCATIONS")
        assert load.keys() >= FIGURES and load["machine"] == "restore"
        assert events[-1]["event"] == "done"
        assert all(f.phase is Phase.ACTIVE for f in t.fakes)


def test_human_progress_is_one_line_per_phase(work: Path) -> None:
    with team_of(TOPOLOGY, work / "control") as t:
        code, out, _ = run(*machine_args("prepare", t, work))
    assert code == 0
    lines = out.splitlines()
    assert len(lines) == 9
    assert lines[-1].startswith("next: the native lock and checkpoint of every process")
    assert lines[0].startswith("capture HANDSHAKE: ") and "2 participants" in lines[0]
    assert lines[1].startswith("capture QUIESCE: ") and lines[2].startswith("capture INSPECT: ")
    assert "GB/s" in lines[4] and lines[4].startswith("capture SAVE_ALLOCATIONS")
    assert lines[-3].startswith("capture done")
    # The summary, as suspend's: what was done, then what comes next.
    assert lines[-2].startswith("captured 2 processes in ")
    assert "8.0 MiB staged by the shims into their processes' host memory" in lines[-2]


def test_progress_none_prints_nothing(work: Path) -> None:
    with team_of(TOPOLOGY, work / "control") as t:
        assert run(*machine_args("prepare", t, work, "--progress", "none")) == (0, "", "")


def test_preflight_refusal_exits_1_naming_participant_pid_phase_reason(work: Path) -> None:
    tainted = with_records(TOPOLOGY, participant(1), unsupported_exportable())
    with team_of(tainted, work / "control") as t:
        code, out, err = run(*machine_args("prepare", t, work, "--progress", "json"))
        assert all(not TEARS_DOWN_OPS & set(ops) for ops in t.received())
        pid = t.fakes[1].pid
    assert code == 1
    # The check is named, not the step it guards (PREPARE_MULTICAST was never sent),
    # and the predicate's name is left to -v and JSON.
    assert err.startswith(
        "cuinterpose: capture refused by the check for memory and sharing that cannot be "
        f"checkpointed, nothing changed: participant {participant(1)}, pid {pid}: "
        "UNSUPPORTED_EXPORTABLE"
    ), err
    assert "PREPARE_MULTICAST" not in err and "preflight" not in err and "team" not in err
    assert "create it exportable as CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR only" in err
    failed = json_lines(out)[-1]
    assert failed["event"] == "failed"
    assert (failed["phase"], failed["participant"], failed["pid"]) == (
        "PREPARE_MULTICAST",
        participant(1),
        pid,
    )
    assert (failed["check"], failed["rules"]) == (
        "preflight_clean",
        ["preflight.unsupported_exportable"],
    )
    assert "UNSUPPORTED_EXPORTABLE" in str(failed["reason"])
    done = json.loads(out.splitlines()[-1])
    assert (done["check"], done["rules"]) == (failed["check"], failed["rules"])
    assert (done["outcome"], done["exit_code"]) == ("refused", 1)
    assert done["reason"] == err.replace("cuinterpose: ", "").splitlines()


def test_verbose_names_the_step_the_guard_and_the_rules(work: Path) -> None:
    tainted = with_records(TOPOLOGY, participant(1), unsupported_exportable())
    with team_of(tainted, work / "control") as t:
        code, _, err = run(*machine_args("prepare", t, work, "--progress", "none", "-v"))
    assert code == 1
    assert (
        "cuinterpose: detail: capture stopped at step PREPARE_MULTICAST (guard preflight_clean); "
        "rules: preflight.unsupported_exportable\n"
    ) in err


def test_invalid_topology_exits_1(work: Path) -> None:
    broken = replace_records(TOPOLOGY, participant(0), kind=RecordKind.MAPPING, size=0)
    with team_of(broken, work / "control") as t:
        code, _, err = run(*machine_args("prepare", t, work))
    assert code == 1
    assert "refused by the consistency check of the shims' sharing records" in err
    assert participant(0) in err and "[mapping.empty]" not in err


def test_a_failure_after_teardown_rolls_back_and_exits_3(work: Path) -> None:
    script = {0: {Op.PREPARE_UNICAST: Fault("fail", message="cuMemRelease: CUDA_ERROR_INVALID")}}
    with team_of(TOPOLOGY, work / "control", scripts=script) as t:
        code, out, err = run(*machine_args("prepare", t, work))
        pid = t.fakes[0].pid
        phases = [f.phase for f in t.fakes]
        sent = [f.received for f in t.fakes]
    assert code == cli.EXIT_ROLLED_BACK
    assert f"capture failed at PREPARE_UNICAST: participant {participant(0)}, pid {pid}" in err
    assert "CUDA_ERROR_INVALID" in err
    assert "rolled back: every process is running as before" in err
    assert phases == [Phase.ACTIVE] * len(phases)
    assert all(r[-4:] == [Op.HANDSHAKE, Op.ROLLBACK_ALLOCATIONS, Op.ROLLBACK_IMPORTS, Op.INSPECT]
               for r in sent)  # fmt: skip
    assert "capture done" not in out and "rollback done" in out
    assert not (work / "ckpt" / "cuinterpose.intent").exists()


def test_a_failure_before_teardown_changes_nothing_and_exits_1(work: Path) -> None:
    script = {1: {Op.INSPECT: Fault("fail", message="no")}}
    with team_of(TOPOLOGY, work / "control", scripts=script) as t:
        code, _, err = run(*machine_args("prepare", t, work))
        sent = [f.received for f in t.fakes]
    assert code == cli.EXIT_FAILED
    assert not any(set(r) & TEARS_DOWN_OPS for r in sent)
    assert "recover" not in err and "rolled back" not in err


def test_a_failed_rollback_prints_the_recover_command_and_exits_4(work: Path) -> None:
    script = {
        0: {
            Op.SAVE_ALLOCATIONS: Fault("fail", message="cuMemcpyDtoH: CUDA_ERROR_X"),
            Op.ROLLBACK_ALLOCATIONS: Fault("fail", message="cuMemCreate: CUDA_ERROR_Y"),
        }
    }
    with team_of(TOPOLOGY, work / "control", scripts=script) as t:
        code, _, err = run(*machine_args("prepare", t, work))
    assert code == cli.EXIT_NEEDS_RECOVER
    assert "rollback: rollback failed at ROLLBACK_ALLOCATIONS" in err
    assert "CUDA_ERROR_Y" in err
    recover_line = next(line for line in err.splitlines() if "run: cuinterpose recover" in line)
    assert f"--checkpoint-dir {work / 'ckpt'}" in recover_line
    assert (work / "ckpt" / "cuinterpose.intent").is_file()  # the group's record stays


def test_recover_rolls_a_whole_capture_forward(work: Path) -> None:
    with team_of(TOPOLOGY, work / "control") as t:
        code, _, _ = run(*machine_args("prepare", t, work, "--no-rollback"))
        assert code == cli.EXIT_OK  # a whole capture: recover then restores it
        assert [f.phase for f in t.fakes] == [Phase.PREPARED] * len(t.fakes)
        code, out, err = run(*machine_args("recover", t, work))
        assert code == cli.EXIT_OK, err
        assert "recover: restored" in out
        assert [f.phase for f in t.fakes] == [Phase.ACTIVE] * len(t.fakes)
        code, out, _ = run(*machine_args("recover", t, work))
        assert code == cli.EXIT_OK and "recover: nothing" in out


UUID_A = "GPU-aaaaaaaa-aaaa-aaaa-aaaa-aaaaaaaaaaaa"
UUID_B = "GPU-bbbbbbbb-bbbb-bbbb-bbbb-bbbbbbbbbbbb"


def test_recover_forward_carries_the_gpu_map_by_uuid_and_refuses_ordinals(work: Path) -> None:
    """Without the native restore here, recover and restore name GPUs by UUID (each
    shim's LOAD checks them); an ordinal is refused before anything is sent."""
    with team_of(TOPOLOGY, work / "control") as t:
        code, _, _ = run(*machine_args("prepare", t, work, "--no-rollback"))
        assert code == cli.EXIT_OK
        code, _, err = run(*machine_args("recover", t, work, "--gpu-map", "0=1"))
        assert code == cli.EXIT_FAILED and "0 is an ordinal" in err, err
        assert [f.phase for f in t.fakes] == [Phase.PREPARED] * len(t.fakes)
        code, out, err = run(*machine_args("recover", t, work, "--gpu-map", f"{UUID_A}={UUID_B}"))
        assert code == cli.EXIT_OK, err
        assert "recover: restored" in out
        assert [f.gpu_maps for f in t.fakes] == [[f"{UUID_A}={UUID_B}"]] * len(t.fakes)


def test_recover_after_a_failure_left_in_place(work: Path) -> None:
    script = {1: {Op.PREPARE_UNICAST: Fault("fail", message="cuMemRelease: CUDA_ERROR_Z")}}
    with team_of(TOPOLOGY, work / "control", scripts=script) as t:
        code, _, err = run(*machine_args("prepare", t, work, "--no-rollback"))
        assert code == cli.EXIT_NEEDS_RECOVER and "(--no-rollback)" in err
        assert (work / "ckpt" / "cuinterpose.intent").is_file()
        code, out, err = run(*machine_args("prepare", t, work))
        assert code == cli.EXIT_FAILED and "refused" in err
        code, out, err = run(*machine_args("recover", t, work))
        assert code == cli.EXIT_OK, err
        assert "recover: rolled back" in out
        assert [f.phase for f in t.fakes] == [Phase.ACTIVE] * len(t.fakes)
    assert not (work / "ckpt" / "cuinterpose.intent").exists()


def test_a_capture_never_restored_is_not_overwritten_without_replace(work: Path) -> None:
    with team_of(TOPOLOGY, work / "control") as t:
        assert run(*machine_args("prepare", t, work))[0] == cli.EXIT_OK
        runner.rollback(t.endpoints, work / "ckpt")  # running again, the capture unrestored
        before = (work / "ckpt" / STATE_FILE_NAME).read_bytes()
        code, _, err = run(*machine_args("prepare", t, work))
        assert code == cli.EXIT_FAILED and "never restored" in err and "--replace" in err
        assert (work / "ckpt" / STATE_FILE_NAME).read_bytes() == before
        assert run(*machine_args("prepare", t, work, "--replace"))[0] == cli.EXIT_OK
        assert run(*machine_args("restore", t, work))[0] == cli.EXIT_OK
        assert run(*machine_args("prepare", t, work))[0] == cli.EXIT_OK  # restored: free again


def test_a_second_coordinator_on_the_directory_is_refused(work: Path) -> None:
    with team_of(TOPOLOGY, work / "control") as t:
        (work / "ckpt").mkdir()
        with locked(work / "ckpt"):
            code, _, err = run(*machine_args("prepare", t, work))
        sent = [f.received for f in t.fakes]
    assert code == cli.EXIT_FAILED
    assert f"in use by coordinator pid {os.getpid()}" in err
    assert sent == [[]] * len(sent)


def test_a_run_leaves_the_directory_as_it_found_it(work: Path) -> None:
    """The lock file goes with the run that created it, refused or not; one that was
    there stays; a lock taken on a file its holder has since removed is taken again."""
    ckpt = work / "ckpt"
    ckpt.mkdir()
    with team_of(TOPOLOGY, work / "control", phase=Phase.PREPARED) as t:  # not ACTIVE: refused
        code, _, err = run(*machine_args("prepare", t, work))
        assert code == cli.EXIT_FAILED, err
        assert list(ckpt.iterdir()) == []
    with locked(ckpt):
        assert [p.name for p in ckpt.iterdir()] == ["cuinterpose.lock"]
        busy = pytest.raises(DirectoryBusy, match=f"in use by coordinator pid {os.getpid()}")
        with busy, locked(ckpt):
            pass
    assert list(ckpt.iterdir()) == []
    (ckpt / "cuinterpose.lock").write_text("")  # left by an older version: kept
    with locked(ckpt):
        pass
    assert [p.name for p in ckpt.iterdir()] == ["cuinterpose.lock"]


def test_a_hang_is_bounded_by_the_step_timeout_option(work: Path) -> None:
    script = {1: {Op.INSPECT: Fault("hang")}}
    with team_of(TOPOLOGY, work / "control", scripts=script) as t:
        code, _, err = run(*machine_args("prepare", t, work, "--step-timeout", "0.2"))
    assert code == 1
    assert "no reply within 0.2 s" in err


def test_the_former_phase_timeout_still_works_and_says_it_is_deprecated(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = cli.build_parser().parse_args(
        ["prepare", "--checkpoint-dir", "/x", "--pid", "1", "--phase-timeout", "0.3"]
    )
    assert args.step_timeout == 0.3
    assert (
        "--phase-timeout is deprecated and will go: use --step-timeout" in capsys.readouterr().err
    )


def test_the_phase_timeout_comes_from_the_environment(
    work: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SNAPSHOT_PHASE_TIMEOUT_S", "0.25")
    script = {1: {Op.HANDSHAKE: Fault("hang")}}
    with team_of(TOPOLOGY, work / "control", scripts=script) as t:
        code, _, err = run(*machine_args("prepare", t, work))
    assert code == 1 and "no reply within 0.25 s" in err


def test_restore_without_state_file_exits_1(work: Path) -> None:
    (work / "ckpt").mkdir()
    with team_of(TOPOLOGY, work / "control", phase=Phase.PREPARED) as t:
        code, out, err = run(*machine_args("restore", t, work, "--progress", "json"))
        assert t.received() == [[], []]
    assert code == 1
    assert "restore failed at READ_STATE" in err and "missing" in err
    assert json_lines(out)[-1]["phase"] == "READ_STATE"


def test_restore_with_corrupt_state_file_exits_1(work: Path) -> None:
    (work / "ckpt").mkdir()
    (work / "ckpt" / STATE_FILE_NAME).write_text("{]")
    with team_of(TOPOLOGY, work / "control", phase=Phase.PREPARED) as t:
        code, _, err = run(*machine_args("restore", t, work))
    assert code == 1 and STATE_FILE_NAME in err


def test_control_dir_defaults_to_the_environment(
    work: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with team_of(TOPOLOGY, work / "control") as t:
        monkeypatch.setenv("SNAPSHOT_CONTROL_DIR", str(t.control_dir))
        code, _, err = run("prepare", "--checkpoint-dir", str(work / "ckpt"), *t.processes)
    assert (code, err) == (0, "")


def test_proc_root_reaches_sockets_through_each_process_root(
    work: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # <proc-root>/<observed>/root stands for the process's root: here the real "/".
    proc = work / "proc"
    # The fakes are served by this process, not by the observed pids made up here: the
    # check that a pair's socket is served by its observed pid is tests/pods' to prove.
    from cuinterpose.engine import detection

    real = detection.endpoint_for

    def unchecked(*args: Any, **kwargs: Any) -> Any:
        return real(*args, **{**kwargs, "check_peer": False})

    monkeypatch.setattr(detection, "endpoint_for", unchecked)
    with team_of(TOPOLOGY, work / "control") as t:
        monkeypatch.setenv("SNAPSHOT_CONTROL_DIR", str(t.control_dir))
        args = ["prepare", "--checkpoint-dir", str(work / "ckpt"), "--proc-root", str(proc),
                "--progress", "human"]  # fmt: skip
        for i, fake in enumerate(t.fakes):
            observed = 70000 + i
            (proc / str(observed)).mkdir(parents=True)
            (proc / str(observed) / "root").symlink_to("/")
            args += ["--process", str(observed), str(fake.pid)]
        code, out, err = run(*args)
    assert (code, err) == (0, ""), err
    assert out.splitlines()[-3].startswith("capture done")


@pytest.mark.parametrize(
    "argv",
    [
        "prepare --checkpoint-dir /tmp/x",
        "prepare --process 1 2",
        "prepare --checkpoint-dir /x --process one 2",
        "prepare --checkpoint-dir /x --process 0 2",
        "prepare --checkpoint-dir /x --process 1",
        "prepare --checkpoint-dir /x --process 1 2 --process 1 2",
        "prepare --checkpoint-dir /x --process 1 2 --step-timeout -1",
        "prepare --checkpoint-dir /x --process 1 2 --phase-timeout nan",
        "prepare --checkpoint-dir /x --process 1 2 --progress xml",
        "inspect",
        "diagram --machine teardown",
        "replay",
        "launch",
        "launch --",
        "frobnicate",
        "",
        "resume --checkpoint-dir /x --gpu-map 0",
        "restore --checkpoint-dir /x --process 1 2 --gpu-map a=b",
        "recover --checkpoint-dir /x --process 1 2 --gpu-map 0=1,",
    ],
)
def test_usage_errors_exit_2(argv: str) -> None:
    code, out, err = run(*argv.split())
    assert code == 2
    assert "error" in err and out == ""


@pytest.mark.parametrize("value", ["abc", "0", "-5", "inf"])
def test_a_bad_timeout_in_the_environment_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("SNAPSHOT_PHASE_TIMEOUT_S", value)
    code, _, err = run("prepare", "--checkpoint-dir", "/x", "--process", "1", "2")
    assert code == 2 and "SNAPSHOT_PHASE_TIMEOUT_S" in err


def test_a_relative_control_dir_with_proc_root_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SNAPSHOT_CONTROL_DIR", "relative/dir")
    code, _, err = run("inspect", "--proc-root", "/proc", "--process", "1", "2")
    assert code == 2 and "absolute" in err


def test_inspect_text_and_json(work: Path) -> None:
    with team_of(TOPOLOGY, work / "control") as t:
        args = ["inspect", "--control-dir", str(t.control_dir), *t.processes]
        code, out, _ = run(*args)
        assert code == 0
        assert f"participant {participant(0)}" in out and "MC_BINDING" in out
        code, out, _ = run(*args, "--json")
        assert t.received() == [[Op.HANDSHAKE, Op.INSPECT] * 2] * 2
    assert code == 0
    document = json.loads(out)
    assert [p["participant"] for p in document["participants"]] == [participant(0), participant(1)]
    first = document["participants"][0]
    assert first["phase"] == "ACTIVE"
    assert len(first["records"]) == len(TOPOLOGY.participants[0].records)


def test_inspect_of_a_missing_process_exits_1(work: Path) -> None:
    (work / "control").mkdir()
    code, _, err = run("inspect", "--control-dir", str(work / "control"), "--process", "9", "9")
    assert code == 1 and "pid 9" in err and "does not exist" in err


@pytest.mark.parametrize("spec", [CAPTURE, RESTORE])
def test_diagram_prints_the_generated_mermaid(spec: object) -> None:
    code, out, _ = run("diagram", "--machine", spec.name)  # type: ignore[attr-defined]
    assert code == 0
    assert out == mermaid(spec)  # type: ignore[arg-type]
    assert out.startswith("---") and "stateDiagram-v2" in out


def test_artifact_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUINTERPOSE_BUILD_DIR", str(tmp_path))
    assert run("shim-path")[0] == 1
    code, _, err = run("sim-path")
    assert code == 1 and "make build" in err
    (tmp_path / "shim_c" / "sim").mkdir(parents=True)
    (tmp_path / "shim_c" / "libcuinterpose.so").write_bytes(b"")
    (tmp_path / "shim_c" / "sim" / "libcuda.so.1").write_bytes(b"")
    assert run("shim-path") == (0, f"{tmp_path / 'shim_c' / 'libcuinterpose.so'}\n", "")
    assert run("sim-path") == (0, f"{tmp_path / 'shim_c' / 'sim'}\n", "")


def _libraries(root: Path, shim: Path, sim: Path) -> tuple[Path, Path]:
    (root / shim).parent.mkdir(parents=True, exist_ok=True)
    (root / sim).parent.mkdir(parents=True, exist_ok=True)
    (root / shim).write_bytes(b"")
    (root / sim).write_bytes(b"")
    return root / shim, (root / sim).parent


def test_artifacts_lookup_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """CUINTERPOSE_BUILD_DIR alone when set; else the installed package, then the
    checkout's build/ (where an editable install finds `make build`'s libraries)."""
    from cuinterpose.engine import artifacts

    package = tmp_path / "site-packages" / "cuinterpose" / "lib"
    checkout = tmp_path / "checkout" / "build"
    monkeypatch.setattr(artifacts, "PACKAGE_LIB_DIR", package)
    monkeypatch.setattr(artifacts, "checkout_build_dir", lambda: checkout)
    monkeypatch.delenv("CUINTERPOSE_BUILD_DIR", raising=False)
    tree = (Path("shim_c/libcuinterpose.so"), Path("shim_c/sim/libcuda.so.1"))

    with pytest.raises(artifacts.ArtifactMissingError, match="make build"):
        artifacts.shim_library()
    in_checkout = _libraries(checkout, *tree)
    assert (artifacts.shim_library(), artifacts.sim_library_dir()) == in_checkout
    installed = _libraries(package, Path("libcuinterpose.so"), Path("sim/libcuda.so.1"))
    assert (artifacts.shim_library(), artifacts.sim_library_dir()) == installed

    asan = tmp_path / "build-asan"
    monkeypatch.setenv("CUINTERPOSE_BUILD_DIR", str(asan))
    with pytest.raises(artifacts.ArtifactMissingError, match="CUINTERPOSE_BUILD_DIR"):
        artifacts.sim_library_dir()  # an override never falls back to another copy
    in_asan = _libraries(asan, *tree)
    assert (artifacts.shim_library(), artifacts.sim_library_dir()) == in_asan

    # Installed, with no checkout around it, the message says so.
    monkeypatch.delenv("CUINTERPOSE_BUILD_DIR")
    monkeypatch.setattr(artifacts, "PACKAGE_LIB_DIR", tmp_path / "empty")
    monkeypatch.setattr(artifacts, "checkout_build_dir", lambda: None)
    with pytest.raises(artifacts.ArtifactMissingError, match="reinstall cuinterpose"):
        artifacts.shim_library()


def test_launch_and_demo_delegate(monkeypatch: pytest.MonkeyPatch) -> None:
    from cuinterpose import demo, launch

    calls: list[object] = []

    def fake_launch(
        command: list[str], *, driver: str, control_dir: Path | None, **given: object
    ) -> int:
        calls.append((command, driver, control_dir, given["keep_host_copy"]))
        assert given.keys() == {"pidfile", "exec_", "announce", "keep_host_copy"}
        return 7

    def fake_demo(*, driver: str = "sim") -> int:
        calls.append(driver)
        return 0

    monkeypatch.setattr(launch, "launch", fake_launch)
    monkeypatch.setattr(demo, "run_demo", fake_demo)
    assert run("launch", "--driver", "system", "--control-dir", "/c", "--", "app", "-x")[0] == 7
    assert run("launch", "--keep-host-copy", "--driver", "sim", "--", "app")[0] == 7
    assert run("demo")[0] == 0
    assert calls == [
        (["app", "-x"], "system", Path("/c"), False), (["app"], "sim", None, True), "sim"
    ]  # fmt: skip


def test_python_dash_m_and_exit_status() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "cuinterpose", "diagram", "--machine", "restore"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0 and "RESTORE_MULTICAST_BINDINGS" in done.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "cuinterpose", "prepare"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert bad.returncode == 2 and "required" in bad.stderr


def test_a_closed_stdout_does_not_stop_a_capture(work: Path) -> None:
    class Closed(io.StringIO):
        def write(self, text: str) -> int:
            raise BrokenPipeError(32, "Broken pipe")

    with team_of(TOPOLOGY, work / "control") as t:
        err = io.StringIO()
        code = cli.main(machine_args("prepare", t, work, "--progress", "json"), stdout=Closed(),
                        stderr=err, native=ALL_RUNNING)  # fmt: skip
        assert all(f.phase is Phase.PREPARED for f in t.fakes)
    assert (code, err.getvalue()) == (0, "")
    assert (work / "ckpt" / STATE_FILE_NAME).is_file()


def test_sigint_stops_at_the_next_phase_boundary_and_rolls_back(work: Path) -> None:
    # SAVE_ALLOCATIONS stays in flight for a while, so that the signal lands inside it.
    script = {0: {Op.SAVE_ALLOCATIONS: Fault("delay", seconds=2.0)}}
    with team_of(TOPOLOGY, work / "control", scripts=script) as t:
        proc = subprocess.Popen(
            # A subprocess: fakes have no native state for its driver to check.
            [
                sys.executable,
                "-m",
                "cuinterpose",
                *machine_args("prepare", t, work),
                "--skip-native-check",
                "--driver",
                "system",  # fakes: no driver knows their pids
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        while Op.SAVE_ALLOCATIONS not in t.fakes[0].received:  # the phase has begun
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.01)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        sent = [f.received for f in t.fakes]
        phases = [f.phase for f in t.fakes]
    assert proc.returncode == cli.EXIT_ROLLED_BACK, err
    assert "stopped on request before PREPARE_UNICAST" in err
    assert "Traceback" not in err
    assert all(Op.PREPARE_UNICAST not in r for r in sent)
    assert phases == [Phase.ACTIVE] * len(phases)


def test_an_untrusted_control_dir_is_refused_before_anything_is_sent(work: Path) -> None:
    with team_of(TOPOLOGY, work / "control") as t:
        (work / "control").chmod(0o777)
        code, _, err = run(*machine_args("prepare", t, work, "--progress", "none"))
        assert t.received() == [[]] * len(t.fakes)  # nothing reached any participant
    assert code == 1
    assert f"control directory {work / 'control'} is writable by group or others" in err


NOT_QUIET = "QUIESCE: pid 1001 did not reach a quiet point within 10000 ms"


def test_prepare_refused_as_not_quiet_starts_over_as_suspend_does(work: Path) -> None:
    # engine/quiesce.py: a capture that changed nothing but found no quiet point is
    # run again, once, by every verb that captures.
    script = {1: {Op.QUIESCE: Fault("not_quiet", Status.REFUSED, NOT_QUIET, times=1)}}
    with team_of(TOPOLOGY, work / "control", scripts=script) as t:
        code, out, err = run(*machine_args("prepare", t, work, "-v"))
        received = [f.received.count(Op.QUIESCE) for f in t.fakes]
    assert code == cli.EXIT_OK, err
    assert received == [quiesce.CAPTURE_ATTEMPTS] * len(received)
    assert "WARNING: capture attempt 1 of 2 not quiet" in err and NOT_QUIET in err
    assert out.count("capture HANDSHAKE") == 2 and "capture done" in out
    assert (work / "ckpt" / STATE_FILE_NAME).is_file()


def test_prepare_refused_as_not_quiet_twice_fails_and_changes_nothing(work: Path) -> None:
    script = {1: {Op.QUIESCE: Fault("not_quiet", Status.REFUSED, NOT_QUIET)}}
    with team_of(TOPOLOGY, work / "control", scripts=script) as t:
        code, _, err = run(*machine_args("prepare", t, work))
        received = [f.received.count(Op.QUIESCE) for f in t.fakes]
        phases = {f.phase for f in t.fakes}
    assert code == cli.EXIT_FAILED
    assert "capture failed at QUIESCE" in err and "did not reach a quiet point" in err
    assert received == [quiesce.CAPTURE_ATTEMPTS] * len(received)
    assert phases == {Phase.ACTIVE}
    assert not (work / "ckpt" / STATE_FILE_NAME).exists()


def test_a_traced_prepare_is_one_run(work: Path) -> None:
    # A trace records one run, for its replay to check: a traced capture does not restart.
    script = {1: {Op.QUIESCE: Fault("not_quiet", Status.REFUSED, NOT_QUIET, times=1)}}
    trace = work / "run.jsonl"
    with team_of(TOPOLOGY, work / "control", scripts=script) as t:
        code, _, err = run(*machine_args("prepare", t, work, "--trace", str(trace)))
        received = [f.received.count(Op.QUIESCE) for f in t.fakes]
    assert code == cli.EXIT_FAILED
    assert "did not reach a quiet point" in err and "attempt" not in err
    assert received == [1] * len(received)
    starts = [line for line in trace.read_text().splitlines() if '"type": "start"' in line]
    assert len(starts) == 1
