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
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, TextIO

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
    acknowledged at once with what the run waits for before it stops, and a second one
    with what it is still doing (a run never stops half way: it ends at a step
    boundary and undoes what it changed)."""

    def __init__(
        self,
        inner: Callable[[Any], None] | None,
        *,
        undone: bool = True,
        then: str = "",
        machine: str = "",
    ) -> None:
        self.inner = inner
        self.undone = undone
        self.then = then  # what happens next, where "undone" is not the whole truth
        self.step = ""
        self.machine = machine  # the machine whose ops run now ("" before the first)
        self.ops_done = 0  # its wire steps done: the next one is in flight
        self.copy: agent.CopyProgress | None = None
        self.acknowledged = False

    def __call__(self, event: agent.AgentEvent) -> None:
        # The events' own module, not the agent's face: a suspend loads no resumption.
        from .engine.events import CopyProgress, StepEvent
        from .engine.progress import FailedEvent, OpEvent

        if isinstance(event, FailedEvent):
            if self.undone and event.kind != "refused" and event.machine != "rollback":
                # A machine stopped past its first change rolls back next.
                self.machine, self.ops_done, self.copy = "rollback", 0, None
        elif isinstance(event, StepEvent) and event.status == "started":
            self.step, self.copy = event.step, None
            self.machine, self.ops_done = "", 0
        elif isinstance(event, OpEvent):
            if event.machine != self.machine:
                self.machine, self.ops_done = event.machine, 0
            self.ops_done += 1
            self.copy = None
        elif isinstance(event, CopyProgress):
            self.copy = event
        if self.inner is not None:
            self.inner(event)

    def waits_for(self) -> str:
        """What is in flight, that the run lets end before it stops."""
        from .engine.released import size

        if self.copy is not None:
            return (
                f"{self.copy.op} on every process (in flight: {size(self.copy.bytes_done)} "
                f"of {size(self.copy.bytes_total)} copied)"
            )
        op = in_flight(self.machine or _machine_of(self.step), self.ops_done)
        if op:
            return f"{op} of the {self.machine or _machine_of(self.step)} on every process"
        return f"the step {self.step}" if self.step else "the first step"

    def undoing(self) -> bool:
        return self.machine == "rollback" or self.step.startswith("undo")

    def acknowledge(self, stderr: TextIO) -> None:
        then = self.then or (
            "what was changed is undone, and the group runs as before"
            if self.undone
            else "the group is left where it stops (--no-rollback)"
        )
        if not self.acknowledged:
            self.acknowledged = True
            line = f"stopping: waiting for {self.waits_for()} to end; then {then}"
        else:
            doing = "still undoing" if self.undoing() else "still stopping"
            line = (
                f"{doing}: waiting for {self.waits_for()} to end; then {then}. A run never "
                "leaves the group half done: its last lines say where the group is"
            )
        with contextlib.suppress(OSError):
            stderr.write(f"{PROG}: {line}\n")
            stderr.flush()


# The agent steps that run a machine, by the machine they run.
_STEP_MACHINES: Final = {
    "capture": "capture",
    "coordinator_restore": "restore",
    "undo_coordinator_restore": "restore",
    "coordinator_recover": "rollback",
}


def _machine_of(step: str) -> str:
    return _STEP_MACHINES.get(step, "")


def in_flight(machine: str, ops_done: int) -> str:
    """The op of ``machine`` in flight once ``ops_done`` of its wire steps are done
    ("" when the machine is not known, or has no wire step left)."""
    from .phases import MACHINES

    spec = MACHINES.get(machine)
    if spec is None:
        return ""
    ops = [step.op for step in spec.steps if step.op is not None]
    return ops[ops_done] if ops_done < len(ops) else ""


def json_events(stream: TextIO) -> agent.AgentCallback:
    def emit(event: agent.AgentEvent) -> None:
        with contextlib.suppress(OSError):  # a closed stdout must not stop a suspend
            stream.write(json.dumps(to_json(event), allow_nan=False) + "\n")
            stream.flush()

    return emit


# The signals a run stops on, at its next step boundary, undoing what it changed.
STOPPING_SIGNALS: Final = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def stopping_on_signals(
    stop: threading.Event, acknowledge: Callable[[], None] | None = None
) -> Iterator[None]:
    """SIGINT, SIGTERM and SIGHUP (a closed terminal, a dropped SSH session) set ``stop``
    (the run ends at the next phase boundary, and rolls back) for the block, and
    ``acknowledge`` says so at once."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers belong to the main thread; an embedder's thread keeps its own
        return

    def on_signal(number: int, frame: object) -> None:
        stop.set()
        if acknowledge is not None:
            acknowledge()

    previous = {n: signal.signal(n, on_signal) for n in STOPPING_SIGNALS}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def interrupted_capture(call: Invocation) -> list[str]:
    """Why ``call`` must not run on its checkpoint directory: it holds the intent of a
    capture whose coordinator is gone (killed mid-run), which only ``recover`` brings
    back; the refusal names that one command. Empty when nothing is in the way."""
    from .engine.directory import INTENT_FILE_NAME, interrupted_capture
    from .engine.manifest import recover_hint

    directory = getattr(call.options, "checkpoint_dir", None)
    if directory is None:
        return []
    hint = recover_hint(directory, call.control_dir, call.proc_root)
    if call.command == "resume" and _suspend_cut_short(directory):
        return [
            f"resume refused, nothing was changed: {directory} holds a capture and no "
            "manifest: nothing was suspended into it (a suspend stopped between its capture "
            "and its manifest, its coordinator gone, or a `prepare`)",
            f"bring the group back with `{hint}` (it takes the native states back too)",
        ]
    if not interrupted_capture(directory):
        return []
    return [
        f"{call.command} refused, nothing was changed: a capture into {directory} was "
        f"interrupted and its coordinator is gone ({INTENT_FILE_NAME} is there)",
        f"bring the group back first: `{hint}`",
    ]


def _suspend_cut_short(directory: Path) -> bool:
    """A suspend whose capture completed and whose manifest was never written: its
    coordinator died between the capture and the end of its native steps."""
    from .engine.directory import in_use, unrestored_capture
    from .engine.manifest import MANIFEST_FILE_NAME

    return (
        not (directory / MANIFEST_FILE_NAME).exists()
        and unrestored_capture(directory)
        and in_use(directory) is None
    )


def outcome(error: BaseException | None, code: int, otherwise: str = "") -> str:
    """The summary's outcome for a run that ended in ``error`` with ``code``: a run
    stopped on request (a signal, the stop event) says "stopped", not "failed"."""
    from .engine.errors import Interrupted

    if error is None or not any(isinstance(e, Interrupted) for e in (error, error.__cause__)):
        return otherwise
    if code == EXIT_NEEDS_RECOVER:
        return "stopped on request: the group needs recover"
    if code == EXIT_ROLLED_BACK and otherwise:  # a resume: running, with the bytes it had
        return f"stopped on request: {otherwise.split(': ', 1)[-1]}"
    return "stopped on request: the group runs as before"


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
