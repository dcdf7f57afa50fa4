"""A run in flight as the command shows it: its progress events on stdout, SIGINT and
SIGTERM stopping it at the next step boundary (acknowledged at once with what is in
flight), and a coordinator failure said on stderr with its exit code.
"""

from __future__ import annotations

import contextlib
import json
import signal
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TextIO

from .arguments import EXIT_FAILED, EXIT_NEEDS_RECOVER, EXIT_ROLLED_BACK
from .engine.serial import to_json
from .outcomes import PROG, say

if TYPE_CHECKING:
    from .engine import agent
    from .engine.errors import CoordinatorError
    from .engine.progress import Event, ProgressCallback
    from .invocation import Invocation


def progress(mode: str, stdout: TextIO) -> ProgressCallback | None:
    from .engine.progress import FailedEvent, human_line, json_printer

    if mode == "none":
        return None
    printer = json_printer(stdout)

    def human(event: Event) -> None:
        # A failure is reported on stderr, in full, by the command itself.
        if not isinstance(event, FailedEvent):
            stdout.write(human_line(event) + "\n")
            stdout.flush()

    emit = printer if mode == "json" else human

    def guarded(event: Event) -> None:
        # A closed stdout must not stop a checkpoint half way: the outcome still
        # reaches stderr and the exit status.
        with contextlib.suppress(OSError):
            emit(event)

    return guarded


class Whereabouts:
    """Passes every event on, remembering where the run is, so that a Ctrl-C can be
    acknowledged at once with what is in flight."""

    def __init__(
        self, inner: Callable[[Any], None] | None, *, undone: bool = True, then: str = ""
    ) -> None:
        self.inner = inner
        self.undone = undone
        self.then = then  # what happens next, where "undone" is not the whole truth
        self.step = ""
        self.phase = ""
        self.copy: agent.CopyProgress | None = None
        self.acknowledged = False

    def __call__(self, event: agent.AgentEvent) -> None:
        # The events' own module, not the agent's face: a suspend loads no resumption.
        from .engine.events import CopyProgress, StepEvent
        from .engine.progress import OpEvent

        if isinstance(event, StepEvent) and event.status == "started":
            self.step, self.phase, self.copy = event.step, "", None
        elif isinstance(event, OpEvent):
            self.phase, self.copy = event.phase, None
        elif isinstance(event, CopyProgress):
            self.copy = event
        if self.inner is not None:
            self.inner(event)

    def acknowledge(self, stderr: TextIO) -> None:
        from .engine.released import size

        if self.acknowledged:
            return
        self.acknowledged = True
        at = self.step or "the first step"
        if self.copy is not None:
            at = (
                f"{self.copy.op} (in flight: {size(self.copy.bytes_done)} of "
                f"{size(self.copy.bytes_total)} copied)"
            )
        elif self.phase:
            at = f"{self.phase} of the {self.step}" if self.step else self.phase
        with contextlib.suppress(OSError):
            then = self.then or (
                "what was changed is undone, the group runs as before"
                if self.undone
                else "the group is left where it stops (--no-rollback)"
            )
            stderr.write(f"{PROG}: stopping after {at}: {then}\n")
            stderr.flush()


def json_events(stream: TextIO) -> agent.AgentCallback:
    def emit(event: agent.AgentEvent) -> None:
        with contextlib.suppress(OSError):  # a closed stdout must not stop a suspend
            stream.write(json.dumps(to_json(event), allow_nan=False) + "\n")
            stream.flush()

    return emit


@contextlib.contextmanager
def stopping_on_signals(
    stop: threading.Event, acknowledge: Callable[[], None] | None = None
) -> Iterator[None]:
    """SIGINT/SIGTERM set ``stop`` (the run ends at the next phase boundary) for the
    block, and ``acknowledge`` says so at once."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers belong to the main thread; an embedder's thread keeps its own
        return

    def on_signal(number: int, frame: object) -> None:
        stop.set()
        if acknowledge is not None:
            acknowledge()

    previous = {n: signal.signal(n, on_signal) for n in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def failure(error: CoordinatorError, call: Invocation, stderr: TextIO) -> int:
    lines = list(error.lines())
    if getattr(call.options, "verbose", 0):
        lines += [f"detail: {line}" for line in error.details()]
    if not error.destroyed:
        say(lines, stderr)
        return EXIT_FAILED
    if error.rolled_back:
        if error.rollback_lost:
            lines += [f"lost: {line}" for line in error.rollback_lost]
            lines.append("rolled back: every surviving process runs, without what is lost")
        else:
            lines.append("rolled back: every process is running as before the run")
        say(lines, stderr)
        return EXIT_ROLLED_BACK
    if error.rollback_error is not None:
        lines += [f"rollback: {line}" for line in error.rollback_error.lines()]
    elif call.options.no_rollback:
        lines.append("left where it stopped (--no-rollback)")
    lines.append(f"the group is not running as before; run: {call.recover_command()}")
    say(lines, stderr)
    return EXIT_NEEDS_RECOVER
