"""The coordinator's side of the lease (specs/recovery.md): every request of a run carries
the run's token, a rollback after a failure carries the same one, and every run ends by
sending RELEASE with it to every process, whatever its outcome."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from cuinterpose.engine import runner
from cuinterpose.engine.client import Endpoint, ParticipantError, call_all
from cuinterpose.engine.errors import StepFailed
from cuinterpose.engine.options import Options
from cuinterpose.engine.wire import ZERO_ID, Op, Reply, Request, Status
from cuinterpose.testing import Fault
from engine_harness import short_dir, team_of
from topologies import team

TOPOLOGY = team(participants=2, allocations=1, multicast=False)


class Recording:
    """A transport that sends through the real client and keeps every request."""

    def __init__(self) -> None:
        self.sent: list[Request] = []

    def __call__(
        self, calls: Sequence[tuple[Endpoint, Request, str | None]], *, timeout: float
    ) -> list[Reply | ParticipantError]:
        self.sent.extend(request for _, request, _ in calls)
        return call_all(calls, timeout=timeout)

    def tokens(self) -> list[bytes]:
        return [r.authorization for r in self.sent]


@pytest.fixture
def work() -> Iterator[Path]:
    with short_dir() as path:
        (path / "ckpt").mkdir()
        yield path


def test_a_run_carries_one_token_and_releases_it(work: Path) -> None:
    recording = Recording()
    with team_of(TOPOLOGY, work / "control") as t:
        runner.capture(t.endpoints, work / "ckpt", Options(5.0, transport=recording))
        capture_tokens = set(recording.tokens())
        assert len(capture_tokens) == 1 and ZERO_ID not in capture_tokens
        assert [r.op for r in recording.sent[-2:]] == [Op.RELEASE, Op.RELEASE]
        assert [f.releases for f in t.fakes] == [1, 1]
        recording.sent.clear()
        runner.restore(t.endpoints, work / "ckpt", Options(5.0, transport=recording))
        restore_tokens = set(recording.tokens())
        assert len(restore_tokens) == 1 and restore_tokens != capture_tokens  # a new run
        assert [f.releases for f in t.fakes] == [2, 2]


def test_a_refused_run_releases_too(work: Path) -> None:
    recording = Recording()
    script = {Op.HANDSHAKE: Fault("fail", status=Status.REFUSED, message="held elsewhere")}
    with team_of(TOPOLOGY, work / "control", scripts={1: script}) as t:
        with pytest.raises(StepFailed, match="held elsewhere"):
            runner.capture(t.endpoints, work / "ckpt", Options(5.0, transport=recording))
        assert [r.op for r in recording.sent] == [Op.HANDSHAKE] * 2 + [Op.RELEASE] * 2
        assert [f.releases for f in t.fakes] == [1, 1]


def test_the_rollback_after_a_failure_keeps_the_runs_token(work: Path) -> None:
    recording = Recording()
    script = {Op.PREPARE_UNICAST: Fault("fail", message="torn")}
    with team_of(TOPOLOGY, work / "control", scripts={0: script}) as t:
        with pytest.raises(StepFailed, match="torn") as caught:
            runner.capture(t.endpoints, work / "ckpt", Options(5.0, transport=recording))
        assert caught.value.rolled_back
        ops = [r.op for r in recording.sent]
        assert Op.ROLLBACK_IMPORTS in ops and ops[-2:] == [Op.RELEASE, Op.RELEASE]
        assert len(set(recording.tokens())) == 1
        assert [f.releases for f in t.fakes] == [1, 1]
