"""QUIESCE in rounds (engine/quiesce.py, specs/quiesce.md) against fake shims: a busy
participant keeps its gate closed and is asked again, the quiet ones advance, and the
rounds end quiet, refused, or out of the embedder's time."""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path

import pytest
import topologies
from cuinterpose.engine import Options, StepFailed, capture
from cuinterpose.engine.errors import not_quiet
from cuinterpose.engine.progress import Event, QuiesceRound, human_line, json_line
from cuinterpose.engine.quiesce import FIRST_ROUND_S, LONGEST_ROUND_S, round_length
from cuinterpose.engine.wire import Op, Phase, Stats, Status
from cuinterpose.testing import Fault
from engine_harness import short_dir, team_of

TOPOLOGY = topologies.team(3, 2, multicast=False)
BUSY = "QUIESCE: pid 1001 not quiet yet after 20 ms with synchronizing calls held: device work"


def test_rounds_grow_from_the_first_to_the_longest() -> None:
    lengths = [round_length(i) for i in range(8)]
    assert lengths[0] == FIRST_ROUND_S
    assert all(b == min(2 * a, LONGEST_ROUND_S) for a, b in pairwise(lengths))
    assert lengths[-1] == LONGEST_ROUND_S


def test_a_busy_participant_is_asked_again_while_the_quiet_ones_advance(tmp_path: Path) -> None:
    script = {1: {Op.QUIESCE: Fault("pending", message=BUSY, times=2)}}
    events: list[Event] = []
    with short_dir() as work, team_of(TOPOLOGY, work / "control", scripts=script) as team:
        result = capture(team.endpoints, tmp_path, Options(5.0, on_progress=events.append))
        received = [f.received.count(Op.QUIESCE) for f in team.fakes]
        advances = [f.advances for f in team.fakes]
        deadlines = team.fakes[0].quiesce_deadlines
    assert result.state.topology == TOPOLOGY
    # Three rounds for everyone; the busy one never advanced (it was not quiet), the
    # others advanced in rounds 2 and 3.
    assert received == [3, 3, 3]
    assert advances == [2, 0, 2]
    assert deadlines == [round(round_length(i) * 1e9) for i in range(3)]
    rounds = [e for e in events if isinstance(e, QuiesceRound)]
    assert [r.round for r in rounds] == [1, 2]  # round 3 was quiet: the phase event says so
    busy = rounds[0].pending
    assert [(p.participant, p.pid, p.message) for p in busy] == [
        (TOPOLOGY.participants[1].participant, TOPOLOGY.participants[1].pid, BUSY)
    ]
    assert len(rounds[0].quiet) == 2
    assert json_line(rounds[0]).startswith('{"event": "quiesce_round"')
    assert "QUIESCE round 1: 2 quiet, 1 not yet" in human_line(rounds[0])


def test_rounds_stay_short_while_a_quiet_participant_can_advance(tmp_path: Path) -> None:
    """A quiet participant with threads held at its gate can be advanced: the next
    round does not grow (only rounds in which nobody can advance do)."""
    script = {1: {Op.QUIESCE: Fault("pending", message=BUSY, times=3)}}
    with short_dir() as work, team_of(TOPOLOGY, work / "control", scripts=script) as team:
        team.fakes[0].stats[Op.QUIESCE] = Stats(count=1)  # one thread held at a sync
        capture(team.endpoints, tmp_path, Options(5.0))
        deadlines = team.fakes[0].quiesce_deadlines
    assert deadlines == [round(FIRST_ROUND_S * 1e9)] * 4


def test_rounds_end_when_the_embedders_deadline_is_spent(tmp_path: Path) -> None:
    script = {2: {Op.QUIESCE: Fault("pending", message=BUSY)}}
    with short_dir() as work, team_of(TOPOLOGY, work / "control", scripts=script) as team:
        with pytest.raises(StepFailed) as caught:
            capture(team.endpoints, tmp_path, Options(5.0, quiesce_deadline=0.1))
        # Nothing torn down: the run's RELEASE left every fake ACTIVE (the gates open).
        assert {f.phase for f in team.fakes} == {Phase.ACTIVE}
        assert all(f.releases == 1 for f in team.fakes)
    error = caught.value
    assert error.step == "QUIESCE" and not error.destroyed and not_quiet(error)
    (problem,) = error.problems
    assert problem.pid == TOPOLOGY.participants[2].pid
    assert "QUIESCE: did not reach a quiet point within" in problem.reason
    assert problem.reason.endswith(f"its last answer: {BUSY}")


def test_a_refusal_ends_the_rounds_for_everyone(tmp_path: Path) -> None:
    refused = "QUIESCE: pid 1002 did not reach a quiet point within 10000 ms"
    script = {
        0: {Op.QUIESCE: Fault("pending", message=BUSY)},
        2: {Op.QUIESCE: Fault("not_quiet", Status.REFUSED, refused)},
    }
    with short_dir() as work, team_of(TOPOLOGY, work / "control", scripts=script) as team:
        with pytest.raises(StepFailed) as caught:
            capture(team.endpoints, tmp_path, Options(5.0))
        received = [f.received.count(Op.QUIESCE) for f in team.fakes]
    assert received == [1, 1, 1]
    reasons = sorted(p.reason for p in caught.value.problems)
    assert reasons[0].startswith("QUIESCE: did not reach a quiet point")  # the pending one
    assert reasons[1] == f"REFUSED in phase ACTIVE: {refused}"
    assert not_quiet(caught.value)
