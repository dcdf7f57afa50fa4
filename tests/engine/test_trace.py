"""Traces: recording, reading, replaying, divergence; the committed traces replay clean.

Regenerate the committed traces (after a deliberate change of behaviour) with
``CUINTERPOSE_REGENERATE_TRACES=1 .venv/bin/pytest tests/engine/test_trace.py -k regenerate``.
Most come from fake participants; ``shim-sim-*`` were recorded from the real shim
on the simulated driver (the three-process demo), which needs ``make build``.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from cuinterpose import cli
from cuinterpose.engine import runner
from cuinterpose.engine.errors import CoordinatorError
from cuinterpose.engine.replay import machine_mismatch, replay
from cuinterpose.engine.statefile import STATE_FILE_NAME
from cuinterpose.engine.trace import TraceError, TraceRecorder, TraceWriter, read_trace
from cuinterpose.engine.wire import Op, Phase, RecordKind
from cuinterpose.testing import Fault
from engine_harness import ALL_RUNNING, short_dir, team_of
from topologies import (
    allocation_id,
    participant,
    raw_import,
    replace_records,
    team,
    with_records,
)

TRACES = Path(__file__).resolve().parent.parent / "traces"
TOPOLOGY = team(participants=2, allocations=1, multicast=True)


@pytest.fixture
def work() -> Iterator[Path]:
    with short_dir() as path:
        (path / "ckpt").mkdir()
        yield path


def record(
    work: Path,
    *,
    machine: str = "capture",
    topology: Any = TOPOLOGY,
    timeout: float = 2.0,
    **team_kwargs: Any,
) -> list[dict[str, Any]]:
    """Run ``machine`` against a fresh team (restore: after a clean capture) and trace it."""
    recorder = TraceRecorder()
    with team_of(topology, work / "control", **team_kwargs) as t:
        if machine == "restore":
            runner.capture(t.endpoints, work / "ckpt", runner.Options(phase_timeout=timeout))
        options = runner.Options(phase_timeout=timeout, trace=recorder, rollback_on_failure=False)
        with contextlib.suppress(CoordinatorError):
            runner.run_machine(
                runner.CAPTURE if machine == "capture" else runner.RESTORE,
                t.endpoints,
                work / "ckpt",
                options,
            )
    return recorder.entries


# -- scenarios (the committed traces are these) ---------------------------------------


def _happy_capture(work: Path) -> list[dict[str, Any]]:
    return record(work)


def _happy_restore(work: Path) -> list[dict[str, Any]]:
    return record(work, machine="restore")


def _refused_topology(work: Path) -> list[dict[str, Any]]:
    broken = replace_records(TOPOLOGY, participant(1), kind=RecordKind.MAPPING, size=0)
    return record(work, topology=broken)


def _refused_preflight(work: Path) -> list[dict[str, Any]]:
    return record(work, topology=with_records(TOPOLOGY, participant(0), raw_import()))


def _refused_not_active(work: Path) -> list[dict[str, Any]]:
    return record(work, phase=Phase.PREPARED)


def _refused_checkpoint_dir(work: Path) -> list[dict[str, Any]]:
    (work / "ckpt").rmdir()
    return record(work)


def _refused_participants(work: Path) -> list[dict[str, Any]]:
    # The state file names participants 0 and 1; participant 2 answers too.
    recorder = TraceRecorder()
    with team_of(TOPOLOGY, work / "control") as t:
        runner.capture(t.endpoints, work / "ckpt", runner.Options(phase_timeout=2.0))
    bigger = team(participants=3, allocations=1, multicast=True)
    with (
        team_of(bigger, work / "control3", phase=Phase.PREPARED) as t,
        pytest.raises(CoordinatorError),
    ):
        runner.restore(t.endpoints, work / "ckpt", _no_rollback(recorder))
    return recorder.entries


def _refused_not_prepared(work: Path) -> list[dict[str, Any]]:
    recorder = TraceRecorder()
    with team_of(TOPOLOGY, work / "control") as t:
        runner.capture(t.endpoints, work / "ckpt", runner.Options(phase_timeout=2.0))
    with team_of(TOPOLOGY, work / "control2") as t, pytest.raises(CoordinatorError):
        runner.restore(t.endpoints, work / "ckpt", _no_rollback(recorder))
    return recorder.entries


def _missing_state(work: Path) -> list[dict[str, Any]]:
    recorder = TraceRecorder()
    with (
        team_of(TOPOLOGY, work / "control", phase=Phase.PREPARED) as t,
        pytest.raises(CoordinatorError),
    ):
        runner.restore(t.endpoints, work / "ckpt", _no_rollback(recorder))
    return recorder.entries


def _corrupt_state(work: Path) -> list[dict[str, Any]]:
    (work / "ckpt" / STATE_FILE_NAME).write_bytes(b'{"format": "cuinterpose.state", \xff')
    return _missing_state(work)


def _failed_participant(work: Path) -> list[dict[str, Any]]:
    script = {1: {Op.SAVE_ALLOCATIONS: Fault("fail", message="cuMemcpyDtoH: CUDA_ERROR_X")}}
    return record(work, scripts=script)


def _failed_hangup(work: Path) -> list[dict[str, Any]]:
    return record(work, machine="restore", scripts={0: {Op.RESTORE_UNICAST: Fault("hangup")}})


def _failed_timeout(work: Path) -> list[dict[str, Any]]:
    return record(work, timeout=0.2, scripts={1: {Op.PREPARE_UNICAST: Fault("hang")}})


def _failed_wrong_participant(work: Path) -> list[dict[str, Any]]:
    return record(work, scripts={0: {Op.INSPECT: Fault("wrong_participant")}})


def _failed_mismatch(work: Path) -> list[dict[str, Any]]:
    changed = replace_records(
        TOPOLOGY, participant(0), kind=RecordKind.ALLOCATION, id=allocation_id(0), handle_count=3
    )
    restored = {0: changed.records_by_participant()[participant(0)]}
    return record(work, machine="restore", restored=restored)


SCENARIOS: dict[str, Callable[[Path], list[dict[str, Any]]]] = {
    "capture-happy": _happy_capture,
    "restore-happy": _happy_restore,
    "capture-refused-topology": _refused_topology,
    "capture-refused-preflight": _refused_preflight,
    "capture-refused-not-active": _refused_not_active,
    "capture-refused-checkpoint-dir": _refused_checkpoint_dir,
    "restore-refused-participants": _refused_participants,
    "restore-refused-not-prepared": _refused_not_prepared,
    "restore-failed-missing-state": _missing_state,
    "restore-failed-corrupt-state": _corrupt_state,
    "capture-failed-participant": _failed_participant,
    "capture-failed-timeout": _failed_timeout,
    "capture-failed-wrong-participant": _failed_wrong_participant,
    "restore-failed-hangup": _failed_hangup,
    "restore-failed-mismatch": _failed_mismatch,
}
# Recorded by the demo (real shim, simulated driver): see test_regenerate_shim_traces.
SHIM_TRACES = {"shim-sim-capture": "prepare", "shim-sim-restore": "restore"}
EXPECTED_OUTCOMES = {name: name.split("-")[1] for name in SCENARIOS}
EXPECTED_OUTCOMES.update({"capture-happy": "done", "restore-happy": "done"})
EXPECTED_OUTCOMES.update(dict.fromkeys(SHIM_TRACES, "done"))
# Recorded on a real H200 (driver 580.159.04) by tests/gpu/run_h200.sh: never regenerated
# here, replayed so that CI checks the engine against real runs.
H200_TRACES = {
    "h200-three-process-capture": "done",
    "h200-three-process-restore": "done",
    "h200-refusal-raw-import": "refused",
}
EXPECTED_OUTCOMES.update(H200_TRACES)


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_each_scenario_records_and_replays_clean(work: Path, name: str) -> None:
    entries = SCENARIOS[name](work)
    assert entries[0]["type"] == "start" and entries[-1]["type"] == "end"
    assert entries[-1]["outcome"] == EXPECTED_OUTCOMES[name]
    report = replay(entries)
    assert report.clean, "\n".join(str(d) for d in report.divergences)
    assert report.outcome == EXPECTED_OUTCOMES[name]


def test_the_committed_traces_are_the_expected_ones() -> None:
    paths = sorted(TRACES.glob("*.jsonl"))
    expected = set(SCENARIOS) | set(SHIM_TRACES) | set(H200_TRACES)
    assert {p.stem for p in paths} == expected, "regenerate the traces"


@pytest.mark.parametrize("name", sorted(EXPECTED_OUTCOMES))
def test_committed_traces_replay_clean(name: str) -> None:
    path = TRACES / f"{name}.jsonl"
    entries = read_trace(path)
    assert entries[-1]["outcome"] == EXPECTED_OUTCOMES[name], path
    mismatch = machine_mismatch(entries)
    again = (
        "on an H200: tests/gpu/run_h200.sh" if name in H200_TRACES else ("regenerate the traces")
    )
    assert mismatch is None, f"{name}: {mismatch}; {again}"
    report = replay(entries)
    assert report.clean, f"{path}:\n" + "\n".join(str(d) for d in report.divergences)


def test_a_trace_of_another_machine_is_refused_by_name(work: Path) -> None:
    entries = record(work)
    entries[0]["steps"] = [s for s in entries[0]["steps"] if s != "QUIESCE"]
    assert "steps HANDSHAKE, INSPECT, PREPARE_MULTICAST" in str(machine_mismatch(entries))
    with pytest.raises(TraceError, match="record it again"):
        replay(entries)
    # An older trace without the list is judged by the steps it went through.
    del entries[0]["steps"]
    for entry in entries:
        if entry.get("trigger") == "QUIESCE":
            entry["trigger"] = "SOMETHING_ELSE"
    assert "this engine's are HANDSHAKE, QUIESCE, INSPECT" in str(machine_mismatch(entries))


@pytest.mark.skipif(
    os.environ.get("CUINTERPOSE_REGENERATE_TRACES") != "1",
    reason="set CUINTERPOSE_REGENERATE_TRACES=1 to rewrite tests/traces",
)
def test_regenerate_committed_traces() -> None:
    TRACES.mkdir(exist_ok=True)
    for name, scenario in SCENARIOS.items():
        with short_dir() as work:
            (work / "ckpt").mkdir()
            entries = scenario(work)
        with TraceWriter(TRACES / f"{name}.jsonl") as writer:
            for entry in entries:
                writer.write(entry)


@pytest.mark.skipif(
    os.environ.get("CUINTERPOSE_REGENERATE_TRACES") != "1",
    reason="set CUINTERPOSE_REGENERATE_TRACES=1 (after make build) to rewrite the shim traces",
)
def test_regenerate_shim_traces(monkeypatch: pytest.MonkeyPatch) -> None:
    from cuinterpose import demo, native_calls
    from cuinterpose.demo import scenario

    original = scenario.run_cli

    def traced(command: str, **kwargs: Any) -> Any:
        # The demo suspends and resumes (which trace nothing): the same as the
        # coordinator's traced runs with the native calls around them.
        pids, env = kwargs["pids"], kwargs.get("env")
        if command == "suspend":
            run = original("prepare", trace=TRACES / "shim-sim-capture.jsonl", **kwargs)
            native_calls.run_in_subprocess("checkpoint-all", pids, env=env)
            return run
        if command == "resume":
            native_calls.run_in_subprocess("restore-all", pids, env=env)
            return original("restore", trace=TRACES / "shim-sim-restore.jsonl", **kwargs)
        return original(command, **kwargs)

    monkeypatch.setattr(scenario, "run_cli", traced)  # where run_demo looks it up
    assert demo.run_demo(out=lambda _: None) == 0


# -- what a trace holds -----------------------------------------------------------------


def test_every_transition_is_recorded_with_requests_and_replies(work: Path) -> None:
    entries = record(work)
    transitions = [e for e in entries if e["type"] == "transition"]
    assert [(e["trigger"], e["from"], e["to"]) for e in transitions] == [
        (s.trigger, s.source, s.dest) for s in runner.CAPTURE.steps
    ]
    inspect = transitions[2]  # after HANDSHAKE and QUIESCE
    assert inspect["machine"] == "capture" and inspect["outcome"] == "ok"
    assert inspect["elapsed_s"] >= 0 and inspect["started_s"] >= 0
    assert [x["request"] for x in inspect["exchanges"]] == [
        {"op": "INSPECT", "participant": participant(i)} for i in range(2)
    ]
    reply = inspect["exchanges"][0]["reply"]
    assert (reply["status"], reply["phase"], reply["participant"]) == (
        "OK",
        "QUIESCED",
        participant(0),
    )
    assert len(reply["records"]) == len(TOPOLOGY.participants[0].records)
    assert transitions[-1]["trigger"] == "WRITE_STATE" and "state_path" in transitions[-1]


def test_a_refusal_records_the_guard_and_the_refuse_transition(work: Path) -> None:
    entries = _refused_preflight(work)
    attempt, refuse, end = entries[-3:]
    assert (attempt["trigger"], attempt["outcome"], attempt["to"]) == (
        "PREPARE_MULTICAST",
        "refused",
        "inspected",
    )
    assert attempt["guards"]["preflight_clean"][0]["participant"] == participant(0)
    assert (refuse["trigger"], refuse["to"]) == ("REFUSE", "refused")
    assert end["outcome"] == "refused" and end["phase"] == "PREPARE_MULTICAST"


# -- divergence -------------------------------------------------------------------------


def _tamper(entries: list[dict[str, Any]], edit: Callable[[dict[str, Any]], None]) -> None:
    edit(next(e for e in entries if e.get("trigger") == "SAVE_ALLOCATIONS"))


def test_a_changed_reply_is_reported_as_divergence(work: Path) -> None:
    entries = record(work)

    def fail_reply(entry: dict[str, Any]) -> None:
        reply = entry["exchanges"][1]["reply"]
        reply.update(status="CUDA_FAILED", message="tampered", phase="FAILED")

    _tamper(entries, fail_reply)
    report = replay(entries)
    assert not report.clean and report.outcome == "failed"
    first = report.divergences[0]
    assert "SAVE_ALLOCATIONS" in first.what and "outcome" in first.what
    assert "tampered" in first.replayed


def test_a_changed_transition_is_reported(work: Path) -> None:
    entries = record(work)
    _tamper(entries, lambda e: e.update(to="somewhere_else"))
    report = replay(entries)
    assert [d.what for d in report.divergences] == ["SAVE_ALLOCATIONS multicast_detached -> "
                                                    "somewhere_else: to differ"]  # fmt: skip


def test_requests_the_trace_does_not_have_are_reported(work: Path) -> None:
    entries = record(work)
    # Drop the recorded PREPARE_UNICAST exchanges: the participants cannot answer it.
    for entry in entries:
        if entry.get("trigger") == "PREPARE_UNICAST":
            del entry["exchanges"]
    report = replay(entries)
    assert any("received PREPARE_UNICAST, the trace has nothing next" in d.replayed
               for d in report.divergences)  # fmt: skip


def test_a_shorter_replay_is_reported(work: Path) -> None:
    entries = record(work)
    extra = dict(entries[-2], trigger="EXTRA")
    entries.insert(-1, extra)
    report = replay(entries)
    assert any(d.what == "missing from the replay" for d in report.divergences)


# -- reading ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "begins with a start entry"),
        ("not json\n", "not JSON"),
        ('{"type": "other"}\n', "not a trace entry"),
        ('{"type": "start", "format": 1, "machine": "capture"}\n', "no end entry"),
        ('{"type": "start", "format": 9, "machine": "capture"}\n{"type": "end"}\n', "format 9"),
        ('{"type": "start", "format": 1, "machine": "x"}\n{"type": "end"}\n', "unknown machine"),
        ('{"type": "end"}\n', "begins with a start entry"),
        ('{"type": "start", "format": 1, "machine": "restore"}\n{"type": "end"}\n', "lacks"),
    ],
)
def test_malformed_traces_are_refused(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(text)
    with pytest.raises(TraceError, match=message):
        read_trace(path)


def test_replay_refuses_entries_that_are_not_a_trace() -> None:
    with pytest.raises(TraceError, match="begins with a start entry"):
        replay([])
    with pytest.raises(TraceError, match="no end entry"):
        replay([{"type": "start", "format": 1, "machine": "capture"}])


def test_a_missing_trace_is_refused(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="cannot read"):
        read_trace(tmp_path / "nope.jsonl")


def test_cli_records_and_replays_a_trace(work: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = work / "run.jsonl"
    with team_of(TOPOLOGY, work / "control") as t:
        code = cli.main(
            ["prepare", "--checkpoint-dir", str(work / "ckpt"), "--control-dir",
             str(t.control_dir), *t.processes, "--progress", "none", "--trace", str(trace)],
            native=ALL_RUNNING,
        )  # fmt: skip
    assert code == 0
    assert cli.main(["replay", str(trace)]) == 0
    assert "replays clean (outcome done)" in capsys.readouterr().out
    lines = trace.read_text().splitlines()
    tampered = [json.loads(line) for line in lines]
    tampered[-1]["outcome"] = "refused"
    trace.write_text("".join(json.dumps(e) + "\n" for e in tampered))
    assert cli.main(["replay", str(trace)]) == 1
    assert "diverges" in capsys.readouterr().out
    trace.write_text("garbage\n")
    assert cli.main(["replay", str(trace)]) == 1


def _no_rollback(recorder: TraceRecorder) -> runner.Options:
    """The machine alone: the scenarios record fail-stop runs."""
    return runner.Options(2.0, trace=recorder, rollback_on_failure=False)
