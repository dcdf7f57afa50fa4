"""The ``cuinterpose`` command line.

Exit status: :data:`EXIT_TABLE` (also in ``--help`` and specs/recovery.md); stderr
names the participant, its pid, the phase and the reason. SIGINT and SIGTERM stop
``prepare`` and ``restore`` at the next phase boundary; what was changed is then
rolled back (status 3, or 4).

``suspend``, ``resume`` and ``status`` are the one-command verbs of
:mod:`cuinterpose.engine.agent` (the native checkpoint included).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import math
import os
import shlex
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Final, NoReturn, TextIO

from . import artifacts
from .engine import agent, runner
from .engine.client import Endpoint, endpoint_for
from .engine.errors import CoordinatorError
from .engine.fsm import CAPTURE, MACHINES, RESTORE, MachineSpec, mermaid
from .engine.native import CudaBackend, NativeBackend, NativeUnavailableError, ProcessState
from .engine.progress import Event, FailedEvent, ProgressCallback, human_line, json_printer
from .engine.recovery import native_blockers, native_check_refusal, recover
from .engine.replay import replay
from .engine.topology import describe_record
from .engine.trace import TraceError, TraceWriter, read_trace

CONTROL_DIR_ENV: Final = "SNAPSHOT_CONTROL_DIR"
DEFAULT_CONTROL_DIR: Final = Path("/snapshot-control")
PHASE_TIMEOUT_ENV: Final = "SNAPSHOT_PHASE_TIMEOUT_S"
PROG: Final = "cuinterpose"

EXIT_OK: Final = 0
EXIT_FAILED: Final = 1  # refused, or failed before anything changed
EXIT_USAGE: Final = 2
EXIT_ROLLED_BACK: Final = 3
EXIT_NEEDS_RECOVER: Final = 4
# One table for every verb (specs/recovery.md, "Exit status").
EXIT_TABLE: Final = """exit status (every verb):
  0  done
  1  refused, or failed and undone: the group is as it was (a suspend whose
     capture or native steps failed: running as before)
  2  usage error
  3  failed after changing the group, and rolled back: it runs (prepare,
     restore, recover: as before the run; resume: with the bytes it had at
     suspend, no longer checkpointed)
  4  failed, and the group is not back: stderr prints the command to run
     (`cuinterpose recover ...`)
"""


class _Parser(argparse.ArgumentParser):
    """argparse, but usage errors raise instead of exiting, so main() returns 2."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        raise _UsageError(f"{self.prog}: error: {message}")


class _UsageError(Exception):
    pass


def _pid(text: str) -> int:
    try:
        value = int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a pid") from None
    if not 0 < value < 2**32:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive pid")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds")
    return value


def _add_endpoints(parser: argparse.ArgumentParser) -> None:
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--control-dir",
        type=Path,
        help=f"the shims' control directory "
        f"(default ${CONTROL_DIR_ENV}, else {DEFAULT_CONTROL_DIR})",
    )
    where.add_argument(
        "--proc-root",
        type=Path,
        help="reach each process's control directory through PROC_ROOT/<observed pid>/root",
    )
    parser.add_argument(
        "--process",
        nargs=2,
        action="append",
        required=True,
        type=_pid,
        metavar=("OBSERVED_PID", "NAMESPACE_PID"),
        help="a participant: its pid as seen here and inside its pid namespace (repeatable)",
    )


def _add_phase_timeout(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--phase-timeout",
        type=_seconds,
        metavar="SECONDS",
        help=f"per-phase timeout (default ${PHASE_TIMEOUT_ENV}, else "
        f"{runner.DEFAULT_PHASE_TIMEOUT_S:g})",
    )


def _add_machine_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint-dir", type=Path, required=True)
    _add_endpoints(parser)
    parser.add_argument("--progress", choices=("human", "json", "none"), default="human")
    _add_phase_timeout(parser)
    parser.add_argument("--trace", type=Path, metavar="FILE", help="record the run as JSON lines")
    parser.add_argument(
        "--no-rollback",
        action="store_true",
        help="after a failure, leave the group where it stopped (for `recover` to undo)",
    )


def _add_agent_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint-dir", type=Path, required=True)
    _add_endpoints(parser)
    parser.add_argument(
        "--progress",
        choices=("auto", "human", "json", "none"),
        default="auto",
        help="auto (the default): human on a terminal, JSON lines otherwise",
    )
    _add_phase_timeout(parser)
    parser.add_argument(
        "--per-participant", action="store_true", help="add per-participant copy tables"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        description="Checkpoint/restore of CUDA processes sharing memory",
        epilog=EXIT_TABLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def sub(name: str, text: str) -> argparse.ArgumentParser:
        return commands.add_parser(
            name,
            help=text,
            description=text,
            epilog=EXIT_TABLE,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )

    prepare = sub("prepare", "run the capture machine; writes the state file")
    _add_machine_options(prepare)
    prepare.add_argument(
        "--replace", action="store_true", help="overwrite a capture that was never restored"
    )
    restore_cmd = sub("restore", "run the restore machine against the state file")
    _add_machine_options(restore_cmd)
    recover_cmd = sub("recover", "bring the group back to running from wherever a run left it")
    _add_machine_options(recover_cmd)
    for checked in (prepare, restore_cmd, recover_cmd):
        checked.add_argument(
            "--skip-native-check",
            action="store_true",
            help="go on when no CUDA driver can be loaded to check that every process is "
            "natively RUNNING (for those who know it is)",
        )
    suspend = sub("suspend", "capture, then natively lock and checkpoint every process")
    _add_agent_options(suspend)
    suspend.add_argument(
        "--not-requested",
        action="store_true",
        help="the group did not opt in: native checkpoint only, and no process may have a shim",
    )
    suspend.add_argument(
        "--lock-timeout",
        type=_seconds,
        metavar="SECONDS",
        default=agent.DEFAULT_LOCK_TIMEOUT_MS / 1000,
        help="how long each native lock may wait for the process's CUDA calls to drain",
    )
    _add_agent_options(sub("resume", "natively restore and unlock, then the coordinator restore"))
    status_cmd = sub("status", "every process's native state and shim phase (changes nothing)")
    _add_endpoints(status_cmd)
    status_cmd.add_argument("--json", action="store_true", help="print JSON instead of a table")
    inspect = sub("inspect", "show the participants' topology (changes nothing)")
    _add_endpoints(inspect)
    inspect.add_argument("--json", action="store_true", help="print JSON instead of text")
    diagram = sub("diagram", "print a machine's mermaid state diagram")
    diagram.add_argument("--machine", choices=sorted(MACHINES), required=True)
    replay_cmd = sub("replay", "replay a trace against fake participants; report divergence")
    replay_cmd.add_argument("trace", type=Path, metavar="TRACE")
    sub("sim-path", "print the directory of the simulated libcuda.so.1")
    sub("shim-path", "print the path of libcuinterpose.so")
    launch = sub("launch", "run COMMAND under the shim")
    launch.add_argument("--driver", choices=("sim", "system"), default="sim")
    launch.add_argument("--control-dir", type=Path)
    launch.add_argument("argv", nargs=argparse.REMAINDER, metavar="-- COMMAND...")
    criu_cmd = sub("criu", "the round trip through CRIU: check, dump, restore, action-script")
    criu_cmd.add_argument("argv", nargs=argparse.REMAINDER, metavar="VERB ...")
    demo = sub("demo", "run the end-to-end demo")
    demo.add_argument("--driver", choices=("sim", "system"), default="sim")
    return parser


# -- helpers ----------------------------------------------------------------------


def _env_control_dir() -> Path:
    value = os.environ.get(CONTROL_DIR_ENV, "")
    return Path(value) if value else DEFAULT_CONTROL_DIR


def _phase_timeout(given: float | None) -> float:
    if given is not None:
        return given
    value = os.environ.get(PHASE_TIMEOUT_ENV, "")
    if not value:
        return runner.DEFAULT_PHASE_TIMEOUT_S
    try:
        return _seconds(value)
    except argparse.ArgumentTypeError as exc:
        raise _UsageError(f"{PROG}: error: ${PHASE_TIMEOUT_ENV}: {exc}") from None


def _endpoints(args: argparse.Namespace) -> list[Endpoint]:
    control_dir = args.control_dir if args.control_dir is not None else _env_control_dir()
    pairs = [tuple(p) for p in args.process]
    for pair in pairs:
        if pairs.count(pair) > 1:
            raise _UsageError(f"{PROG}: error: --process {pair[0]} {pair[1]} is given twice")
    try:
        return [
            endpoint_for(observed, namespace, control_dir=control_dir, proc_root=args.proc_root)
            for observed, namespace in pairs
        ]
    except ValueError as exc:
        raise _UsageError(f"{PROG}: error: {exc}") from None


def _fail(lines: Sequence[str], stderr: TextIO) -> int:
    for line in lines:
        stderr.write(f"{PROG}: {line}\n")
    stderr.flush()
    return EXIT_FAILED


def _progress(mode: str, stdout: TextIO) -> ProgressCallback | None:
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


# -- commands -----------------------------------------------------------------------


def _run_machine(
    spec: MachineSpec | None, args: argparse.Namespace, stdout: TextIO, stderr: TextIO
) -> int:
    """Run ``spec``'s machine, or ``recover`` (None), and say how it ended."""
    endpoints = _endpoints(args)
    timeout = _phase_timeout(args.phase_timeout)
    checkpoint_dir: Path = args.checkpoint_dir
    if spec is CAPTURE:
        try:
            checkpoint_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            return _fail([f"cannot create checkpoint directory {checkpoint_dir}: {exc}"], stderr)
    writer = None
    if args.trace is not None:
        try:
            writer = TraceWriter(args.trace)
        except OSError as exc:
            raise _UsageError(f"{PROG}: error: cannot write trace {args.trace}: {exc}") from None
    refusal = (
        _native_check(spec, args, endpoints, stderr)
        if spec is not None
        else _recover_native_check(args, endpoints, stderr)
    )
    if refusal is not None:
        return refusal
    stop = threading.Event()
    options = runner.Options(
        phase_timeout=timeout,
        on_progress=_progress(args.progress, stdout),
        trace=writer,
        replace=bool(getattr(args, "replace", False)),
        stop=stop,
        rollback_on_failure=not args.no_rollback,
    )
    try:
        with _stopping_on_signals(stop):
            if spec is None:
                report = recover(endpoints, checkpoint_dir, options)
                for line in report.lines():
                    stdout.write(line + "\n")
                result: object = report.result
            else:
                result = runner.run_machine(spec, endpoints, checkpoint_dir, options)
        for warning in getattr(result, "warnings", ()):
            stderr.write(f"{PROG}: note: {warning}\n")
    except CoordinatorError as error:
        return _failure(error, args, stderr)
    except ValueError as exc:
        raise _UsageError(f"{PROG}: error: {exc}") from None
    finally:
        if writer is not None:
            writer.close()
    return EXIT_OK


def _native_check(
    spec: MachineSpec, args: argparse.Namespace, endpoints: Sequence[Endpoint], stderr: TextIO
) -> int | None:
    """prepare and restore need every process natively RUNNING: a locked or
    checkpointed one is refused (exit 1, nothing changed) with what to run."""
    processes = [agent.Process(e.observed_pid, e.namespace_pid) for e in endpoints]
    if spec is CAPTURE:
        hint = (
            "a process is natively locked or checkpointed; bring it back first "
            f"(`{PROG} resume`, or the native restore and unlock), then prepare"
        )
    else:
        hint = (
            "restore runs after the native restore and unlock of every process; run them "
            f"first (or `{PROG} resume --checkpoint-dir {args.checkpoint_dir} ...`)"
        )
    try:
        agent.require_states(_native_backend(), processes, ProcessState.RUNNING, spec.name, hint)
    except NativeUnavailableError as exc:
        if not args.skip_native_check:
            return _fail(native_check_refusal(args.command, exc), stderr)
        stderr.write(f"{PROG}: note: the native state was not checked (--skip-native-check): "
                     f"{exc}\n")  # fmt: skip
    except agent.StateRefused as refused:
        return _fail(refused.lines(), stderr)
    return None


def _recover_native_check(
    args: argparse.Namespace, endpoints: Sequence[Endpoint], stderr: TextIO
) -> int | None:
    """recover refuses a process natively LOCKED or CHECKPOINTED, and fails closed."""
    try:
        blockers = native_blockers(_native_backend(), endpoints)
    except NativeUnavailableError as exc:
        if not args.skip_native_check:
            return _fail(native_check_refusal("recover", exc), stderr)
        stderr.write(f"{PROG}: note: the native state was not checked (--skip-native-check): "
                     f"{exc}\n")  # fmt: skip
        return None
    if blockers:
        return _fail(["recover refused: nothing was changed", *blockers], stderr)
    return None


def _native_backend() -> NativeBackend:
    return CudaBackend()


def _where(args: argparse.Namespace) -> agent.Where:
    control_dir = args.control_dir if args.control_dir is not None else _env_control_dir()
    return agent.Where(control_dir, args.proc_root)


def _agent_processes(args: argparse.Namespace) -> list[agent.Process]:
    _endpoints(args)  # the same usage checks as every other command
    return [agent.Process(observed, namespace) for observed, namespace in args.process]


def _agent_command(command: str, args: argparse.Namespace, stdout: TextIO, stderr: TextIO) -> int:
    processes = _agent_processes(args)
    mode = args.progress
    if mode == "auto":
        mode = "human" if stdout.isatty() else "json"
    view = None
    on_event: agent.AgentCallback | None = None
    live: contextlib.AbstractContextManager[object] = contextlib.nullcontext()
    if mode == "human":
        from . import render  # rich: only for a person's output

        view = render.HumanView(stdout, per_participant=args.per_participant)
        on_event, live = view, view.live()
    elif mode == "json":
        on_event = _json_events(stdout)
    stop = threading.Event()
    options = runner.Options(phase_timeout=_phase_timeout(args.phase_timeout), stop=stop)
    native = _native_backend()
    try:
        with _stopping_on_signals(stop), live:
            if command == "suspend":
                done: agent.SuspendResult | agent.ResumeResult = agent.suspend(
                    processes,
                    args.checkpoint_dir,
                    where=_where(args),
                    native=native,
                    requested=not args.not_requested,
                    options=options,
                    lock_timeout_ms=int(args.lock_timeout * 1000),
                    on_event=on_event,
                )
            else:
                done = agent.resume(
                    args.checkpoint_dir,
                    where=_where(args),
                    native=native,
                    processes=processes,
                    options=options,
                    on_event=on_event,
                )
    except agent.SuspendFailed as failed:
        _fail(failed.lines(), stderr)
        return EXIT_FAILED if failed.restored else EXIT_NEEDS_RECOVER
    except agent.ResumeFailed as failed:
        # A native step ran: never "nothing changed" (exit 1).
        if failed.running:
            _fail(failed.lines(), stderr)
            return EXIT_ROLLED_BACK
        _fail([*failed.lines(), f"once every process is RUNNING, run: {_recover_command(args)}"],
              stderr)  # fmt: skip
        return EXIT_NEEDS_RECOVER
    except agent.AgentError as error:
        return _fail(error.lines(), stderr)
    except CoordinatorError as error:
        code = _failure(error, args, stderr)
        # A suspend whose capture was rolled back: the group runs as it was (exit 1).
        return EXIT_FAILED if command == "suspend" and code == EXIT_ROLLED_BACK else code
    except NativeUnavailableError as exc:
        return _fail([f"{command}: {exc}"], stderr)
    for warning in getattr(done, "warnings", ()):
        stderr.write(f"{PROG}: note: {warning}\n")
    if view is not None:
        view.summary(done.timings, done.staging)
    elif mode == "json":
        with contextlib.suppress(OSError):
            summary: dict[str, object] = {
                "event": "summary",
                "command": command,
                "timings": [t.to_json() for t in done.timings],
            }
            if done.staging is not None:
                summary["staging"] = done.staging.to_json()
            stdout.write(json.dumps(summary) + "\n")
            stdout.flush()
    return EXIT_OK


def _json_events(stream: TextIO) -> agent.AgentCallback:
    def emit(event: agent.AgentEvent) -> None:
        with contextlib.suppress(OSError):  # a closed stdout must not stop a suspend
            stream.write(json.dumps(event.to_json(), allow_nan=False) + "\n")
            stream.flush()

    return emit


def _status(args: argparse.Namespace, stdout: TextIO, stderr: TextIO) -> int:
    processes = _agent_processes(args)
    try:
        rows = agent.status(processes, _where(args), _native_backend())
    except NativeUnavailableError as exc:
        return _fail([f"status: {exc}"], stderr)
    if args.json:
        document = {"processes": [r.to_json() for r in rows]}
        stdout.write(json.dumps(document, indent=2) + "\n")
    else:
        from . import render  # rich: only for a person's output

        render.status_table(stdout, rows)
    return EXIT_OK


@contextlib.contextmanager
def _stopping_on_signals(stop: threading.Event) -> Iterator[None]:
    """SIGINT/SIGTERM set ``stop`` (the run ends at the next phase boundary) for the block."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers belong to the main thread; an embedder's thread keeps its own
        return

    def on_signal(number: int, frame: object) -> None:
        stop.set()

    previous = {n: signal.signal(n, on_signal) for n in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def _recover_command(args: argparse.Namespace) -> str:
    words = [PROG, "recover", "--checkpoint-dir", str(args.checkpoint_dir)]
    if args.control_dir is not None:
        words += ["--control-dir", str(args.control_dir)]
    if args.proc_root is not None:
        words += ["--proc-root", str(args.proc_root)]
    for observed, namespace in args.process:
        words += ["--process", str(observed), str(namespace)]
    return shlex.join(words)


def _failure(error: CoordinatorError, args: argparse.Namespace, stderr: TextIO) -> int:
    lines = list(error.lines())
    if not error.destroyed:
        _fail(lines, stderr)
        return EXIT_FAILED
    if error.rolled_back:
        if error.rollback_lost:
            lines += [f"lost: {line}" for line in error.rollback_lost]
            lines.append("rolled back: every surviving process runs, without what is lost")
        else:
            lines.append("rolled back: every process is running as before the run")
        _fail(lines, stderr)
        return EXIT_ROLLED_BACK
    if error.rollback_error is not None:
        lines += [f"rollback: {line}" for line in error.rollback_error.lines()]
    elif args.no_rollback:
        lines.append("left where it stopped (--no-rollback)")
    lines.append(f"the group is not running as before; run: {_recover_command(args)}")
    _fail(lines, stderr)
    return EXIT_NEEDS_RECOVER


def _inspect(args: argparse.Namespace, stdout: TextIO, stderr: TextIO) -> int:
    from .engine.statefile import make_converter

    endpoints = _endpoints(args)
    try:
        bound, topology = runner.inspect(endpoints, timeout=_phase_timeout(None))
    except CoordinatorError as error:
        return _fail(error.lines(), stderr)
    records = topology.records_by_participant()
    if args.json:
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
        stdout.write(json.dumps(document, indent=2) + "\n")
        return EXIT_OK
    for b in bound:
        mine = records[b.participant]
        stdout.write(
            f"participant {b.participant} pid {b.endpoint.observed_pid} "
            f"(ns pid {b.pid}) phase {b.phase.name}: {len(mine)} records\n"
        )
        for record in mine:
            stdout.write(f"  {describe_record(record)}\n")
    return EXIT_OK


def _replay(args: argparse.Namespace, stdout: TextIO, stderr: TextIO) -> int:
    try:
        report = replay(read_trace(args.trace))
    except TraceError as exc:
        return _fail([str(exc)], stderr)
    if report.clean:
        stdout.write(
            f"{args.trace}: {report.machine} trace of {report.entries} entries replays clean "
            f"(outcome {report.outcome})\n"
        )
        return EXIT_OK
    stdout.write(
        f"{args.trace}: {report.machine} replay diverges in {len(report.divergences)} place(s)\n"
    )
    for divergence in report.divergences:
        stdout.write(f"{divergence}\n")
    return EXIT_FAILED


def _artifact(find: Callable[[], Path], stdout: TextIO, stderr: TextIO) -> int:
    try:
        stdout.write(f"{find()}\n")
    except artifacts.ArtifactMissingError as exc:
        return _fail([str(exc)], stderr)
    return EXIT_OK


def _delegate(module: str, stderr: TextIO) -> Any | None:
    # launch and demo pull in process management the coordinator itself never needs.
    try:
        return importlib.import_module(f"{__package__}.{module}")
    except ImportError as exc:
        _fail([f"{module} is not available in this installation: {exc}"], stderr)
        return None


def _launch(args: argparse.Namespace, stderr: TextIO) -> int:
    command = list(args.argv)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        raise _UsageError(f"{PROG} launch: error: no COMMAND given after --")
    module = _delegate("launch", stderr)
    if module is None:
        return EXIT_FAILED
    try:
        return int(module.launch(command, driver=args.driver, control_dir=args.control_dir))
    except module.LaunchError as exc:
        return _fail([f"launch: {exc}"], stderr)


def _demo(args: argparse.Namespace, stderr: TextIO) -> int:
    module = _delegate("demo", stderr)
    if module is None:
        return EXIT_FAILED
    return int(module.run_demo(driver=args.driver))


def main(
    argv: Sequence[str] | None = None, *, stdout: TextIO | None = None, stderr: TextIO | None = None
) -> int:
    out = stdout if stdout is not None else sys.stdout
    err = stderr if stderr is not None else sys.stderr
    parser = build_parser()
    try:
        try:
            args = parser.parse_args(argv)
        except SystemExit as exit_:  # --help, or argparse's own exit
            return int(exit_.code or 0) if isinstance(exit_.code, int | None) else EXIT_USAGE
        command: str = args.command
        if command == "prepare":
            return _run_machine(CAPTURE, args, out, err)
        if command == "restore":
            return _run_machine(RESTORE, args, out, err)
        if command == "recover":
            return _run_machine(None, args, out, err)
        if command in ("suspend", "resume"):
            return _agent_command(command, args, out, err)
        if command == "status":
            return _status(args, out, err)
        if command == "inspect":
            return _inspect(args, out, err)
        if command == "diagram":
            out.write(mermaid(MACHINES[args.machine]))
            return EXIT_OK
        if command == "replay":
            return _replay(args, out, err)
        if command == "sim-path":
            return _artifact(artifacts.sim_library_dir, out, err)
        if command == "shim-path":
            return _artifact(artifacts.shim_library, out, err)
        if command == "launch":
            return _launch(args, err)
        if command == "demo":
            return _demo(args, err)
        if command == "criu":  # its own parser: frontends/criu_action.py
            module = _delegate("criu_action", err)
            if module is None:
                return EXIT_FAILED
            return int(module.main(args.argv, stdout=out, stderr=err))
        raise AssertionError(f"unhandled command {command}")
    except _UsageError as exc:
        err.write(f"{exc}\n")
        return EXIT_USAGE
