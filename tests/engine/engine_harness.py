"""Shared set-up for the driver, CLI, trace and progress tests: teams of fake participants.

Sockets live in a short directory under /tmp: pytest's tmp_path can outgrow
sun_path's 108 bytes with a long test name.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import attrs
from cuinterpose.engine.client import Endpoint
from cuinterpose.engine.native_checkpoint import ProcessState
from cuinterpose.engine.topology import Topology
from cuinterpose.engine.wire import VERSION, Op, Phase, Record, Stats, socket_name
from cuinterpose.phases import PHASE_OPS, TEARS_DOWN
from cuinterpose.testing import FakeParticipant, Fault

SAVE_STATS = Stats(count=1, bytes=4 << 20, elapsed_ns=2_000_000, copy_ns=1_000_000)
LOAD_STATS = Stats(count=1, bytes=4 << 20, elapsed_ns=3_000_000, copy_ns=2_000_000)
# The capture and restore ops that tear something down (the op table's tears_down:
# not QUIESCE, which only holds the application at its gate until the run's lease
# ends). A run refused or failed early may still be sent the rollback's ops.
TEARS_DOWN_OPS = frozenset(Op[p.op] for p in PHASE_OPS if p.op in TEARS_DOWN)


@contextlib.contextmanager
def short_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="cuip-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@attrs.frozen
class Team:
    control_dir: Path
    fakes: tuple[FakeParticipant, ...]

    @property
    def endpoints(self) -> list[Endpoint]:
        return [f.endpoint for f in self.fakes]

    @property
    def processes(self) -> list[str]:
        """``--process OBSERVED NAMESPACE`` arguments for the CLI."""
        args: list[str] = []
        for fake in self.fakes:
            args += ["--process", str(fake.pid), str(fake.pid)]
        return args

    def received(self) -> list[list[Op]]:
        return [f.received for f in self.fakes]


@contextlib.contextmanager
def team_of(
    topology: Topology,
    control_dir: Path,
    *,
    phase: Phase = Phase.ACTIVE,
    scripts: Mapping[int, Mapping[Op, Fault]] | None = None,
    restored: Mapping[int, Sequence[Record]] | None = None,
    barrier: bool = False,
    barrier_timeout: float = 10.0,
    pids: Mapping[int, int] | None = None,
    versions: Mapping[int, int] | None = None,
) -> Iterator[Team]:
    """One started fake per participant of ``topology``, serving its records.

    ``scripts``/``restored``/``pids``/``versions`` (the protocol version a fake
    speaks) are keyed by the participant's index.
    With ``barrier``, no fake answers an op until every fake has received it.
    """
    control_dir.mkdir(parents=True, exist_ok=True)
    count = len(topology.participants)
    arrival = threading.Barrier(count, timeout=barrier_timeout) if barrier else None
    fakes = []
    for i, member in enumerate(topology.participants):
        pid = (pids or {}).get(i, member.pid)
        fakes.append(
            FakeParticipant(
                control_dir / socket_name(pid),
                participant=member.participant,
                pid=pid,
                phase=phase,
                records=member.records,
                restored_records=(restored or {}).get(i),
                stats={Op.SAVE_ALLOCATIONS: SAVE_STATS, Op.LOAD_ALLOCATIONS: LOAD_STATS},
                script=(scripts or {}).get(i),
                arrival=arrival,
                version=(versions or {}).get(i, VERSION),
            )
        )
    with contextlib.ExitStack() as stack:
        for fake in fakes:
            stack.enter_context(fake)
        yield Team(control_dir, tuple(fakes))


class AllRunning:
    """The native state of a fake participant's process: RUNNING (it has no driver). The
    CLI tests pass it as ``main(..., native=ALL_RUNNING)``: prepare and restore check
    every process's native state first (tests/engine/test_agent.py drives the states)."""

    def state(self, pid: int) -> ProcessState:
        return ProcessState.RUNNING


ALL_RUNNING = AllRunning()
