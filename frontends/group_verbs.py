"""The verbs on a whole group from the shell: ``suspend`` and ``resume`` (the one-command
verbs of :mod:`cuinterpose.engine.agent`, the native checkpoint included), ``status``,
``native`` (one native step on every process), ``inspect`` and ``replay``.
"""

from __future__ import annotations

import contextlib
import shlex
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final, NoReturn, TextIO

from . import invocation
from .arguments import (
    EXIT_FAILED,
    EXIT_NEEDS_RECOVER,
    EXIT_OK,
    EXIT_ROLLED_BACK,
    step_timeout,
)
from .outcomes import OUTCOMES, PROG, Outcome

if TYPE_CHECKING:
    from .engine import agent
    from .engine.native_checkpoint import NativeBackend, ProcessState
    from .engine.options import Options
    from .engine.suspension import DriverChoice
    from .engine.wire import Record
    from .invocation import Invocation


def agent_command(command: str, call: Invocation, stdout: TextIO, stderr: TextIO) -> Outcome:
    from . import running, summaries
    from .engine.errors import AgentError, CoordinatorError, Refused
    from .engine.native_checkpoint import NativeUnavailableError
    from .engine.options import Options

    gone = running.interrupted_capture(call)
    if gone:
        return Outcome.refused(gone)
    processes = call.processes()
    mode = call.mode
    view = None
    on_event: agent.AgentCallback | None = None
    live: contextlib.AbstractContextManager[object] = contextlib.nullcontext()
    if mode == "human":
        from . import render  # rich: only for a person's output

        view = render.HumanView(stdout, per_participant=call.options.per_participant)
        on_event, live = view, view.live()
    elif mode == "json":
        on_event = running.json_events(stdout)
    # A resume cannot undo its native restore: it stops, and its last lines say where
    # the group is (running with its bytes, or what to run), as a failed resume does.
    then = "" if command == "suspend" else (
        "before its native restore nothing is changed; after it the group is brought back "
        "running (the restore goes on, or rolls back to the bytes of the suspend)")  # fmt: skip
    where_now = running.Whereabouts(on_event, then=then)
    stop = threading.Event()
    options = Options(phase_timeout=step_timeout(call.options.step_timeout), stop=stop)
    # Each verb loads its own room (suspension or resumption), not the agent's face:
    # a native checkpoint alone runs no machine and loads none (the runner, transitions).
    # What is at each socket the engine's detection decides, once (a suspend's refusal
    # names every process and what to do); resume checks the group itself: the
    # survivors of a member lost come back.
    try:
        with running.stopping_on_signals(stop, lambda: where_now.acknowledge(stderr)), live:
            if command == "suspend":
                # The driver from the suspend's own STATUS round, not one more.
                done: agent.SuspendResult | agent.ResumeResult | Outcome = _suspend(
                    call, processes, call.native_choice(), options, where_now
                )
            else:
                done = _resume(call, processes, call.native(), options, where_now)
    except AgentError as error:
        # A resume stopped before its native restore: nothing changed, on request.
        said = "stopped on request: nothing was changed" if stop.is_set() else "refused"
        return Outcome(EXIT_FAILED, said, error.lines())
    except CoordinatorError as error:
        code = running.failure(error, call, stderr)
        # A suspend whose capture was rolled back: the group runs as it was (exit 1).
        if command == "suspend" and code == EXIT_ROLLED_BACK:
            code = EXIT_FAILED
        said = "refused" if isinstance(error, Refused) else running.outcome(error, code)
        return Outcome(code, said, failure=error)
    except NativeUnavailableError as exc:
        return Outcome(EXIT_FAILED, "refused", invocation.no_driver(command, exc))  # fmt: skip
    if isinstance(done, Outcome):  # the verb failed after it changed something
        return done
    for warning in getattr(done, "warnings", ()):
        stderr.write(f"{PROG}: note: {warning}\n")
    from .engine.serial import to_json

    summary = summaries.Summary.of(command, call, done)
    if view is not None:
        view.summary(done.timings, done.staging)
    return Outcome(EXIT_OK, summary.outcome, figures=to_json(summary), human=summary.lines())


def _suspend(
    call: Invocation,
    processes: Sequence[agent.Process],
    native: NativeBackend | DriverChoice,
    options: Options,
    on_event: agent.AgentCallback,
) -> agent.SuspendResult | Outcome:
    from .engine.detection import Group
    from .engine.suspension import SuspendFailed, suspend

    try:
        return suspend(
            # The group's one value (targets.named refused a repeat already): the
            # suspend passes it down, checked no more.
            Group(processes),
            call.options.checkpoint_dir,
            where=call.where(),
            native=native,
            requested=not call.options.not_requested,
            options=options,
            lock_timeout_ms=int(call.options.lock_timeout * 1000),
            on_event=on_event,
        )
    except SuspendFailed as failed:
        code = EXIT_FAILED if failed.restored else EXIT_NEEDS_RECOVER
        outcome = "failed, undone: the group runs as before" if failed.restored else (
            "failed, not undone")  # fmt: skip
        if failed.stopped:
            outcome = outcome.replace("failed", "stopped on request", 1)
        return Outcome(code, outcome, failed.lines())


def _resume(
    call: Invocation,
    processes: Sequence[agent.Process],
    native: NativeBackend,
    options: Options,
    on_event: agent.AgentCallback,
) -> agent.ResumeResult | Outcome:
    from . import running
    from .engine.resumption import ResumeFailed, resume

    try:
        return resume(
            call.options.checkpoint_dir,
            where=call.where(),
            native=native,
            processes=processes,
            gpu_map=call.options.gpu_map,
            options=options,
            on_event=on_event,
        )
    except ResumeFailed as failed:
        # A native step ran: never "nothing changed" (exit 1).
        if failed.running:
            outcome = OUTCOMES[EXIT_ROLLED_BACK] if not failed.lost else (
                "a member is gone: the survivors run with the bytes they had")  # fmt: skip
            outcome = running.outcome(failed, EXIT_ROLLED_BACK, outcome) or outcome
            return Outcome(EXIT_ROLLED_BACK, outcome, failed.lines())  # fmt: skip
        way_on = f"once every process is RUNNING, run: {call.recover_command()}"
        said = running.outcome(failed, EXIT_NEEDS_RECOVER)
        return Outcome(EXIT_NEEDS_RECOVER, said, [*failed.lines(), way_on])  # fmt: skip


class _NoDriver:
    """The native calls when no driver could be loaded: each fails, saying so."""

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def _none(self, pid: int, call: str) -> NoReturn:
        from .engine.native_checkpoint import NativeError

        raise NativeError(pid, call, "no driver", self.reason)

    def lock(self, pid: int, timeout_ms: int) -> None:
        self._none(pid, "cuCheckpointProcessLock")

    def checkpoint(self, pid: int) -> None:
        self._none(pid, "cuCheckpointProcessCheckpoint")

    def restore(self, pid: int) -> None:
        self._none(pid, "cuCheckpointProcessRestore")

    def unlock(self, pid: int) -> None:
        self._none(pid, "cuCheckpointProcessUnlock")

    def state(self, pid: int) -> ProcessState:
        self._none(pid, "cuCheckpointProcessGetState")


def status(call: Invocation, stdout: TextIO, stderr: TextIO) -> Outcome:
    if not call.group:  # a control directory without shims: nothing to look at or ask
        return _no_shim(call, stdout)
    from .engine.detection import Group, look, remove_stale_sockets

    processes = call.processes()
    where = call.where()
    named = bool(call.options.pid or call.options.process)
    # A process that exited (gone, or a zombie its parent has not reaped) with its
    # socket left behind, nobody serving it.
    stale = _stale(processes, where)
    if stale and call.options.clear_stale:
        for path in remove_stale_sockets(stale, where):
            stderr.write(f"{PROG}: removed the stale socket {path}\n")
        if not named:
            processes = [p for p in processes if p not in stale]
        stale = []
    if not processes:
        return _no_shim(call, stdout)
    # heal: a status right after a socket was removed shows the shim that re-creates it.
    seen = look(Group(processes), where, heal=True)
    gone = [line for s in seen if (line := s.gone(where)) is not None]
    clear = f"{call.status_command()} --clear-stale"
    ended = {p: f"{_ended(p, where)}: its socket {where.endpoint(p).path} is stale "
                f"(`{clear}` removes it)" for p in stale}  # fmt: skip
    if (gone or ended) and named:
        return Outcome(EXIT_FAILED, "refused", [*gone, *ended.values()])
    for line in ended.values():
        stderr.write(f"{PROG}: note: {line}\n")
    from .engine.group_status import status as asked  # a shim to ask: the verb's room, now
    from .engine.native_checkpoint import NativeUnavailableError

    living = [p for p in processes if p not in ended]
    seen = tuple(s for s in seen if s.process not in ended)
    try:
        rows = asked(living, where, call.native(), seen=seen) if living else ()
    except NativeUnavailableError as exc:
        stderr.write(f"{PROG}: note: native states unknown: {exc}\n")
        rows = asked(living, where, _NoDriver("no CUDA driver loaded"), seen=seen)
    from .engine.group_status import ProcessStatus

    said = {r.process: r for r in rows}
    exited = {p: ProcessStatus(p, _ended_state(p, where), "stale socket") for p in ended}
    rows = tuple(said.get(p) or exited[p] for p in processes)
    way_on = _way_on(call, rows)
    if way_on:
        stderr.write(f"{PROG}: note: {way_on[0]}\n")
    if call.options.json:
        from .engine.serial import to_json

        # One line, the summary itself: JSON lines like every verb's, and one document.
        document: dict[str, Any] = {"processes": [to_json(r) for r in rows]}
        if way_on and way_on[1]:
            document["next"] = way_on[1]
        return Outcome(EXIT_OK, "done", (), figures=document)
    cells = [_status_cells(row) for row in rows]
    if _terminal(stdout):
        from . import render  # rich: only for a person at a terminal

        render.table(stdout, "cuinterpose status", STATUS_COLUMNS, cells)
    else:
        _plain_table(stdout, "cuinterpose status", STATUS_COLUMNS, cells)
    return Outcome(EXIT_OK)


def host_copy(call: Invocation, stdout: TextIO, stderr: TextIO) -> Outcome:
    """HOST_COPY to every named process (engine/host_copy.py): one line each; refused
    (exit 1) when any did not do it, naming it and why."""
    from .engine.host_copy import host_copy as ask

    give_back = bool(call.options.give_back)
    answers = ask(call.processes(), call.where(), give_back=give_back)
    failed = [a.describe(give_back) for a in answers if a.problem]
    if call.options.json:
        from .engine.serial import to_json

        document = {"processes": [to_json(a) for a in answers]}
        return Outcome(EXIT_FAILED if failed else EXIT_OK, "refused" if failed else "done",
                       tuple(failed), figures=document)  # fmt: skip
    if failed:
        return Outcome(EXIT_FAILED, "refused", tuple(failed))
    for a in answers:
        stdout.write(a.describe(give_back) + "\n")
    return Outcome(EXIT_OK)


# Shim phases a group rests in between runs: anything else is a run under way, or one
# whose coordinator is gone.
_AT_REST: Final = frozenset({"ACTIVE", "PREPARED", "not answering", None})


def _way_on(call: Invocation, rows: Sequence[agent.ProcessStatus]) -> tuple[str, str] | None:
    """What the person looking at a group stuck midway runs next, in a line, and the
    command alone ("" where the checkpoint directory is not known): ``recover`` on the
    run's directory for a run stopped midway, ``resume`` for a suspended group."""
    from .engine.directory import in_use, interrupted_capture, unrestored_capture
    from .engine.manifest import MANIFEST_FILE_NAME, ManifestError, read_manifest, recover_hint

    directory = call.options.checkpoint_dir
    midway = [r for r in rows if r.shim_phase not in _AT_REST or r.native_state == "LOCKED"]
    if directory is None:
        if not midway:
            return None
        where = shlex.join(["--control-dir", str(call.control_dir)])
        return (
            f"{', '.join(r.process.describe() for r in midway)}: a run stopped midway; unless "
            f"one is under way, bring the group back with `cuinterpose recover "
            f"--checkpoint-dir DIR {where}` (DIR: that run's checkpoint directory; "
            f"`{call.status_command()} --checkpoint-dir DIR` names the command)",
            "",
        )
    hint = recover_hint(directory, call.control_dir, call.proc_root)
    if interrupted_capture(directory):
        return f"a capture into {directory} was interrupted: run `{hint}`", hint
    try:
        manifest = read_manifest(directory) if (directory / MANIFEST_FILE_NAME).is_file() else None
    except ManifestError:
        manifest = None
    if manifest is None and unrestored_capture(directory) and in_use(directory) is None:
        return (f"{directory} holds a capture not restored and no manifest (a prepare, or a "
                f"suspend cut short): run `{hint}`", hint)  # fmt: skip
    if manifest is None or manifest.resumed_at:
        return (f"a run stopped midway: run `{hint}`", hint) if midway else None
    checkpointed = all(r.native_state == "CHECKPOINTED" for r in rows)
    if checkpointed and not midway:
        resume = shlex.join([PROG, "resume", "--checkpoint-dir", str(directory)])
        return f"suspended into {directory}: run `{resume}`", resume
    return f"the resume from {directory} stopped midway: run `{hint}`", hint


STATUS_COLUMNS: Final = ("pid", "ns pid", "native state", "shim phase", "participant",
                         "in flight", "kept host copy")  # fmt: skip


def _status_cells(row: agent.ProcessStatus) -> tuple[str, ...]:
    flight = ""
    f = row.in_flight
    if f is not None and f.op is not None:
        flight = f"{f.op.name} {f.bytes_done:,}/{f.bytes_total:,} B"
    return (
        str(row.process.observed_pid),
        str(row.process.namespace_pid),
        row.native_state,
        row.shim_phase or "(no socket)",
        row.participant or "",
        flight or row.problem,
        _kept_cell(row),
    )


def _kept_cell(row: agent.ProcessStatus) -> str:
    """The host memory the kept host copies hold (pinned), and their hash tables."""
    h = row.host_copy
    if h is None:
        return ""
    return f"{h.bytes / (1 << 30):.2f} GiB pinned in {h.count} (+{h.overhead:,} B of hashes)"


def _terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (OSError, ValueError):
        return False


def _plain_table(
    stream: TextIO, title: str, columns: Sequence[str], rows: Sequence[Sequence[str]]
) -> None:
    """The table for a pipe or a file: its title, then one line a row, the columns
    aligned by spaces (``--json`` is the form to parse)."""
    widths = [max(len(cell) for cell in column) for column in zip(columns, *rows, strict=True)]
    lines = [title] + [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in (columns, *rows)
    ]
    stream.write("".join(f"{line}\n" for line in lines))


def _no_shim(call: Invocation, stdout: TextIO) -> Outcome:
    if call.options.json:
        empty = {"processes": [], "control_dir": str(call.control_dir)}
        return Outcome(EXIT_OK, "done", (), figures=empty)
    stdout.write(f"no shim in {call.control_dir} (start a program with `{PROG} launch`)\n")
    return Outcome(EXIT_OK)


def _stale(processes: Sequence[agent.Process], where: agent.Where) -> list[agent.Process]:
    """The processes whose socket is left behind: the process exited (no such pid, or a
    zombie its parent has not reaped), a socket is at its path, and nobody serves it."""
    from .engine import discovery

    return [
        p
        for p in processes
        if not discovery.is_running(p.observed_pid, where.proc_root)
        and discovery.is_socket(where.endpoint(p).path)
        and not discovery.serves(where.endpoint(p).path)
    ]


def _ended_state(process: agent.Process, where: agent.Where) -> str:
    """How a process that takes no part any more ended, as the native state column says it."""
    from .engine import discovery

    if discovery.pid_exists(process.observed_pid, where.proc_root):
        return "exited (a zombie its parent has not reaped)"
    return "gone (no such process)"


def _ended(process: agent.Process, where: agent.Where) -> str:
    o, n = process.observed_pid, process.namespace_pid
    name = f"pid {o}" if o == n else process.describe()
    state = _ended_state(process, where)
    return f"{name} {state}" if state.startswith("exited") else f"{name} is {state}"


_UNDO_ACTION: Final = {"lock": "unlock", "checkpoint": "restore", "restore": "checkpoint",
                       "unlock": "lock"}  # fmt: skip


def native_action(call: Invocation, stdout: TextIO, stderr: TextIO) -> Outcome:
    """One native step on every process (frontends/native_calls.py's group helpers, from the
    shell): each process's state after it, and on a failure every state and what to do."""
    from .engine.native_checkpoint import (
        NativeGroupError,
        NativeUnavailableError,
        run_step,
        state_names,
    )

    processes = call.processes()
    pids = [p.observed_pid for p in processes]
    action: str = call.options.action
    try:
        native = call.native()
        if action != "state":
            run_step(native, action, pids, lock_timeout_ms=int(call.options.lock_timeout * 1000))
        states = state_names(native, pids)
    except NativeUnavailableError as exc:
        return Outcome(EXIT_FAILED, "refused", invocation.no_driver("native", exc))  # fmt: skip
    except NativeGroupError as failure:
        code = EXIT_FAILED if not failure.done else EXIT_NEEDS_RECOVER
        lines = list(failure.lines())
        if failure.done:  # some processes took the step: undo it on them, or go on
            named = [w for pid in failure.done for w in ("--pid", str(pid))]
            back = [PROG, "native", "--action", _UNDO_ACTION[action], *call.where_words()]
            lines.append(f"the step ran on pid(s) {', '.join(map(str, failure.done))}: undo it "
                         f"there with `{shlex.join([*back, *named])}`, or fix the failed one "
                         "and run the step again")  # fmt: skip
        return Outcome(code, "", lines)
    if call.mode == "human":
        with contextlib.suppress(OSError):
            for p in processes:
                stdout.write(f"{p.describe()}: {states[p.observed_pid]}\n")
    extra = {"action": action, "states": {str(pid): state for pid, state in states.items()}}
    return Outcome(EXIT_OK, "done", (), figures=extra)


def inspect(call: Invocation, stdout: TextIO, stderr: TextIO) -> Outcome:
    from .engine import runner
    from .engine.errors import CoordinatorError
    from .engine.statefile import make_converter
    from .engine.topology import describe_record

    endpoints = call.endpoints()
    try:
        bound, topology = runner.inspect(endpoints, timeout=step_timeout(None))
    except CoordinatorError as error:
        return Outcome(EXIT_FAILED, "refused", error.lines())
    records = topology.records_by_participant()
    if call.options.json:
        converter = make_converter()
        document: dict[str, Any] = {
            "participants": [
                {
                    "participant": b.participant,
                    "pid": b.pid,
                    "observed_pid": b.endpoint.observed_pid,
                    "phase": b.phase.name,
                    "records": [converter.unstructure(r) for r in records[b.participant]],
                }
                for b in bound
            ]
        }
        return Outcome(EXIT_OK, "done", (), figures=document)
    pids = {b.participant: b.endpoint.observed_pid for b in bound}
    for b in bound:
        mine = records[b.participant]
        stdout.write(
            f"participant {b.participant} pid {b.endpoint.observed_pid} "
            f"(ns pid {b.pid}) phase {b.phase.name}: {len(mine)} records\n"
        )
        for record in mine:
            stdout.write(f"  {', '.join([describe_record(record), *_facts(record, pids)])}\n")
    return Outcome(EXIT_OK)


def _facts(record: Record, pids: Mapping[str, int]) -> list[str]:
    """What inspect's text adds to a record's identity (its JSON has every field): the
    size, and an allocation's role: created here, or imported from its creator."""
    from .engine.released import size
    from .engine.wire import RecordFlag, RecordKind

    facts = [f"{size(record.size)} ({record.size:,} B)"] if record.size else []
    if record.kind in (RecordKind.ALLOCATION, RecordKind.MC_OBJECT):
        if RecordFlag.CREATOR in record.flags:
            facts.append("creator")
        elif record.creator in pids:
            facts.append(f"importer (created by pid {pids[record.creator]})")
        else:
            facts.append(f"importer (created by participant {record.creator or '?'}, "
                         "not of this group)")  # fmt: skip
    return facts


def replay(call: Invocation, stdout: TextIO, stderr: TextIO) -> Outcome:
    from .engine.replay import replay as replayed
    from .engine.trace import TraceError, read_trace

    try:
        report = replayed(read_trace(call.options.trace))
    except TraceError as exc:
        return Outcome(EXIT_FAILED, lines=[str(exc)])
    trace = call.options.trace
    if report.clean:
        stdout.write(
            f"{trace}: {report.machine} trace of {report.entries} entries replays clean "
            f"(outcome {report.outcome})\n"
        )
        return Outcome(EXIT_OK)
    stdout.write(
        f"{trace}: {report.machine} replay diverges in {len(report.divergences)} place(s)\n"
    )
    for divergence in report.divergences:
        stdout.write(f"{divergence}\n")
    return Outcome(EXIT_FAILED)
