"""What ``suspend``, ``resume`` and ``status`` show a person, through ``rich``.

A progress bar with bytes and rate while SAVE/LOAD copy, a line per agent step, then
a summary table (phase, seconds, bytes, GB/s; per participant on request); the
status table at a terminal (to a pipe or a file it is plain text: group_verbs). JSON
output (the CLI's own) never imports this module.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import TextIO

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TransferSpeedColumn,
)
from rich.table import Table

# The events' and the manifest's own modules, not the agent's face (which loads both
# verbs' rooms and the machines): a status rendered for a person loads no machine.
from .engine.events import AgentEvent, CopyProgress, StepEvent
from .engine.manifest import Timing
from .engine.progress import DoneEvent, FailedEvent, OpEvent, StagingSummary, human_line


class HumanView:
    """A rich console on ``stream``: step lines, copy progress bars, the summary."""

    def __init__(self, stream: TextIO, *, per_participant: bool = False) -> None:
        self.console = Console(file=stream, highlight=False, soft_wrap=True)
        self.per_participant = per_participant
        self.progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            DownloadColumn(binary_units=True),
            TransferSpeedColumn(),
            TimeElapsedColumn(),
            console=self.console,
            transient=False,
        )
        self.tasks: dict[str, TaskID] = {}
        self.machine_failed = False  # the step's machine said FAILED already
        self.machine_stopped = False  # ... or that it stopped on request
        self.phases: list[OpEvent] = []

    @contextlib.contextmanager
    def live(self) -> Iterator[HumanView]:
        with self.progress:
            yield self

    def __call__(self, event: AgentEvent) -> None:
        with contextlib.suppress(OSError):
            self._show(event)

    def _show(self, event: AgentEvent) -> None:
        if isinstance(event, CopyProgress):
            task = self.tasks.get(event.op)
            if task is None:
                task = self.progress.add_task(event.op, total=event.bytes_total or None)
                self.tasks[event.op] = task
            self.progress.update(task, completed=event.bytes_done, total=event.bytes_total)
        elif isinstance(event, StepEvent):
            if event.status == "done":
                self.console.print(f"{event.step}: done in {event.seconds:.3f} s")
            elif event.status == "failed" and self.machine_stopped:
                self.console.print(f"{event.step}: stopped after {event.seconds:.3f} s")
            elif event.status == "failed" and not self.machine_failed:
                self.console.print(f"{event.step}: FAILED after {event.seconds:.3f} s")
            self.machine_failed = self.machine_stopped = False
        elif isinstance(event, OpEvent):
            self.phases.append(event)
            task = self.tasks.get(event.phase)
            if task is not None and event.transfer is not None:
                nbytes = event.transfer.allocation_bytes
                self.progress.update(task, completed=nbytes, total=nbytes)
        elif isinstance(event, FailedEvent):
            # Said when it happens, before the rollback's own lines; stderr has it in full.
            self.machine_failed = True
            self.machine_stopped = event.kind == "stopped"  # on request: nothing failed
            if event.kind == "refused":
                self.console.print(f"{event.headline()}: nothing was changed")
            elif self.machine_stopped:
                self.console.print(f"{event.machine}: stopped on request before {event.phase}")
            else:
                self.console.print(f"{event.machine}: FAILED at {event.phase}")
        elif not (isinstance(event, DoneEvent) and event.machine != "rollback"):
            # A capture's or restore's end is said by its step's own "done" line.
            self.console.print(human_line(event))

    def summary(self, timings: Sequence[Timing], staging: StagingSummary | None = None) -> None:
        table = Table(title="cuinterpose")
        for column in ("step", "seconds", "bytes", "GB/s"):
            table.add_column(column, justify="left" if column == "step" else "right")
        for t in timings:
            rate = f"{t.gb_per_s:.2f}" if t.bytes else ""
            table.add_row(t.step, f"{t.seconds:.3f}", f"{t.bytes:,}" if t.bytes else "", rate)
        self.console.print(table)
        if staging is not None:
            self.console.print(staging.human())
        if not self.per_participant:
            return
        for phase in self.phases:
            if phase.transfer is None:
                continue
            detail = Table(title=f"{phase.machine} {phase.phase} per participant")
            detail.add_column("participant", no_wrap=True, min_width=32)
            for column in ("pid", "allocations", "bytes", "copy s", "GB/s"):
                detail.add_column(column, justify="right")
            for p in phase.transfer.per_participant:
                detail.add_row(
                    p.participant,
                    str(p.pid),
                    str(p.allocation_count),
                    f"{p.allocation_bytes:,}",
                    f"{p.copy_s:.3f}",
                    f"{p.copy_gb_per_s:.2f}",
                )
            self.console.print(detail)


def table(
    stream: TextIO, title: str, columns: Sequence[str], rows: Sequence[Sequence[str]]
) -> None:
    """A table for a person at a terminal (``status``'s)."""
    shown = Table(title=title)
    for column in columns:
        shown.add_column(column)
    for row in rows:
        shown.add_row(*row)
    Console(file=stream, highlight=False, soft_wrap=True, width=160).print(shown)
