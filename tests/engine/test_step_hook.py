"""``Options.on_step``: the runner's call between a step's guards and its act (what a
job's barrier across nodes is, specs/multinode.md), through fake participants."""

from __future__ import annotations

from pathlib import Path

import pytest
from cuinterpose.engine import runner
from cuinterpose.engine.errors import Interrupted, PreflightRefused, Problem
from cuinterpose.engine.wire import Op, Phase
from engine_harness import short_dir, team_of
from topologies import participant, raw_import, team, with_records

TOPOLOGY = team(participants=2, allocations=1, multicast=True)
CAPTURE_STEPS = [
    "HANDSHAKE", "QUIESCE", "INSPECT", "PREPARE_MULTICAST", "SAVE_ALLOCATIONS",
    "PREPARE_UNICAST", "WRITE_STATE",
]  # fmt: skip


@pytest.fixture
def work() -> Path:  # type: ignore[misc]
    with short_dir() as path:
        (path / "ckpt").mkdir()
        yield path


def test_the_hook_sees_every_step_of_the_machine_in_order(work: Path) -> None:
    seen: list[tuple[str, str]] = []
    with team_of(TOPOLOGY, work / "control") as t:
        opts = runner.Options(5.0, on_step=lambda m, s: seen.append((m, s)))
        runner.capture(t.endpoints, work / "ckpt", opts)
    assert seen == [("capture", s) for s in CAPTURE_STEPS]


def test_the_hook_runs_after_the_steps_guards(work: Path) -> None:
    seen: list[str] = []
    tainted = with_records(TOPOLOGY, participant(1), raw_import())
    with team_of(tainted, work / "control") as t:
        opts = runner.Options(5.0, on_step=lambda m, s: seen.append(s))
        with pytest.raises(PreflightRefused):
            runner.capture(t.endpoints, work / "ckpt", opts)
    assert seen == ["HANDSHAKE", "QUIESCE", "INSPECT"]  # PREPARE_MULTICAST's guard refused


def stop_at(step: str) -> runner.StepHook:
    def hook(machine: str, at: str) -> None:
        if at == step:
            raise Interrupted(machine, at, [Problem("job aborted by node b: refused")])

    return hook


def test_a_stop_before_the_first_teardown_sends_it_to_no_one(work: Path) -> None:
    with team_of(TOPOLOGY, work / "control") as t:
        opts = runner.Options(5.0, on_step=stop_at("PREPARE_MULTICAST"))
        with pytest.raises(Interrupted) as caught:
            runner.capture(t.endpoints, work / "ckpt", opts)
        sent = [f.received for f in t.fakes]
        phases = [f.phase for f in t.fakes]
    assert not caught.value.destroyed and not caught.value.rolled_back
    assert all(Op.PREPARE_MULTICAST not in r for r in sent)
    assert phases == [Phase.ACTIVE] * 2  # their gates reopened with the lease


def test_a_stop_after_it_rolls_back_without_calling_the_hook_again(work: Path) -> None:
    seen: list[tuple[str, str]] = []
    stop = stop_at("PREPARE_UNICAST")

    def hook(machine: str, step: str) -> None:
        seen.append((machine, step))
        stop(machine, step)

    with team_of(TOPOLOGY, work / "control") as t:
        with pytest.raises(Interrupted) as caught:
            runner.capture(t.endpoints, work / "ckpt", runner.Options(5.0, on_step=hook))
        sent = [f.received for f in t.fakes]
        phases = [f.phase for f in t.fakes]
    error = caught.value
    assert error.step == "PREPARE_UNICAST" and error.destroyed and error.rolled_back
    assert all(Op.PREPARE_UNICAST not in r for r in sent)
    assert phases == [Phase.ACTIVE] * 2
    assert seen[-1] == ("capture", "PREPARE_UNICAST")  # none from the rollback
    assert {m for m, _ in seen} == {"capture"}
