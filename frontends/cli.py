"""The ``cuinterpose`` command line.

Exit status: :data:`EXIT_TABLE` (also in ``--help`` and specs/recovery.md); stderr
names the participant, its pid, the phase and the reason. SIGINT and SIGTERM stop
``prepare`` and ``restore`` at the next phase boundary (said at once on stderr); what
was changed is then rolled back (status 3, or 4).

The processes are named with ``--pid P`` or ``--process OBSERVED NS``; ``resume``,
``restore`` and ``recover`` default to the checkpoint directory's group, ``status``
to every shim of the control directory (frontends/targets.py). The native calls
load the driver the shims report (``--driver`` overrides). Each failure is said
once on stderr (logging: frontends/logs.py); with JSON progress the last line is a
summary with the outcome and the exit code.

``suspend``, ``resume`` and ``status`` are the one-command verbs of
:mod:`cuinterpose.engine.agent` (the native checkpoint included).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import importlib.metadata
import json
import logging
import os
import shlex
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Final, NoReturn, TextIO

import attrs

from . import artifacts, drivers, logs, targets
from .arguments import (
    CHANGING_EXITS,
    CONTROL_DIR_ENV,
    DEFAULT_CONTROL_DIR,
    EXIT_FAILED,
    EXIT_NEEDS_RECOVER,
    EXIT_OK,
    EXIT_ROLLED_BACK,
    EXIT_TABLE,
    EXIT_USAGE,
    READING_EXITS,
    Formatter,
    Parser,
    UsageError,
    add_driver,
    add_early_logging,
    add_endpoints,
    add_gpu_map,
    add_phase_timeout,
    merge_logging,
    missing,
    phase_timeout,
    seconds,
    tidy_refused,
    verb_adder,
)
from .engine import agent, discovery, runner
from .engine.client import Endpoint, endpoint_for
from .engine.errors import CoordinatorError, Refused
from .engine.fsm import CAPTURE, MACHINES, RESTORE, MachineSpec, mermaid
from .engine.gpus import GpuMapRefused, uuid_pairs
from .engine.manifest import resume_hint
from .engine.native import (
    CudaBackend,
    NativeBackend,
    NativeError,
    NativeGroupError,
    NativeUnavailableError,
    ProcessState,
    run_step,
    state_names,
)
from .engine.progress import (
    Event,
    FailedEvent,
    PhaseEvent,
    ProgressCallback,
    human_line,
    json_printer,
)
from .engine.quiesce import until_quiet
from .engine.recovery import native_blockers, native_check_refusal, recover
from .engine.released import Released, released_by_suspend, size
from .engine.replay import replay
from .engine.topology import describe_record
from .engine.trace import TraceError, TraceWriter, read_trace

PROG: Final = "cuinterpose"


def _version() -> str:
    try:
        return importlib.metadata.version("cuinterpose")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"


def _add_progress(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--progress",
        choices=("auto", "human", "json", "none"),
        default="auto",
        help="how the run is told on stdout: auto, human on a terminal and JSON lines "
        "otherwise (nothing with -q); human; json, one object a line ending in a summary "
        "with the outcome and the exit code; none",
    )


def _add_machine_options(parser: argparse.ArgumentParser, *, required: bool = True) -> None:
    parser.add_argument(
        "--checkpoint-dir", type=Path, required=True, help="where the state file is kept"
    )
    add_endpoints(parser, required=required)
    _add_progress(parser)
    add_phase_timeout(parser)
    parser.add_argument("--trace", type=Path, metavar="FILE", help="record the run as JSON lines")
    parser.add_argument(
        "--no-rollback",
        action="store_true",
        help="after a failure, leave the group where it stopped (for `recover` to undo)",
    )


def _add_agent_options(parser: argparse.ArgumentParser, *, required: bool = True) -> None:
    parser.add_argument(
        "--checkpoint-dir",
        type=Path,
        required=True,
        help="where the manifest and the state file are kept",
    )
    add_endpoints(parser, required=required)
    _add_progress(parser)
    add_phase_timeout(parser)
    parser.add_argument(
        "--per-participant", action="store_true", help="add per-participant copy tables"
    )


# (name, one line, examples, exit status) of every verb, in --help's order.
_VERBS: Final = {
    "suspend": (
        "capture, then natively lock and checkpoint every process",
        "cuinterpose suspend --checkpoint-dir /var/ckpt/job --pid 4242 --pid 4243",
        CHANGING_EXITS,
    ),
    "resume": (
        "natively restore and unlock, then the coordinator restore; the processes "
        "default to the manifest's",
        "cuinterpose resume --checkpoint-dir /var/ckpt/job\n"
        "  cuinterpose resume --checkpoint-dir /var/ckpt/job --gpu-map 0=1",
        CHANGING_EXITS,
    ),
    "status": (
        "every process's native state and shim phase (changes nothing); without "
        "processes, every shim of the control directory",
        "cuinterpose status\n  cuinterpose status --pid 4242 --json",
        READING_EXITS,
    ),
    "check": (
        "can suspend work here? the driver, the native checkpoint API, cuda-bindings, "
        "the control directory, the shim, pidfd and ptrace (changes nothing)",
        "cuinterpose check\n  cuinterpose check --driver sim --json",
        "exit status:\n  0  suspend can work here\n  1  it cannot (the lines marked FAIL say why)"
        "\n  2  usage error",
    ),
    "launch": (
        "run COMMAND under the shim; prints its pid",
        "cuinterpose launch --pidfile app.pid -- python train.py &\n"
        "  cuinterpose launch --exec -- python train.py    # the launcher's pid is the program's",
        "exit status: COMMAND's own (128 + N when signal N ended it); 1 when it could not "
        "start; 2 usage error",
    ),
    "prepare": (
        "run the capture machine; writes the state file",
        "cuinterpose prepare --checkpoint-dir /var/ckpt/job --pid 4242 --pid 4243",
        CHANGING_EXITS,
    ),
    "restore": (
        "run the restore machine against the state file; the processes default to the state file's",
        "cuinterpose restore --checkpoint-dir /var/ckpt/job",
        CHANGING_EXITS,
    ),
    "recover": (
        "bring the group back to running from wherever a run left it; the processes "
        "default to the manifest's, else the state file's",
        "cuinterpose recover --checkpoint-dir /var/ckpt/job",
        CHANGING_EXITS,
    ),
    "native": (
        "one native checkpoint step on every process of a group, in the manner of "
        "`cuda-checkpoint --action`: lock, checkpoint, restore, unlock, or state; the "
        "processes default to the checkpoint directory's",
        "cuinterpose native --action lock --checkpoint-dir /var/ckpt/job\n"
        "  cuinterpose native --action state --pid 4242 --pid 4243",
        CHANGING_EXITS,
    ),
    "inspect": (
        "show the participants' topology (changes nothing)",
        "cuinterpose inspect --pid 4242 --json",
        READING_EXITS,
    ),
    "diagram": (
        "print a machine's mermaid state diagram",
        "cuinterpose diagram --machine capture",
        READING_EXITS,
    ),
    "replay": (
        "replay a trace against fake participants; report divergence",
        "cuinterpose prepare ... --trace run.jsonl; cuinterpose replay run.jsonl",
        "exit status:\n  0  replays clean\n  1  diverges, or unreadable\n  2  usage error",
    ),
    "sim-path": (
        "print the directory of the simulated libcuda.so.1",
        "LD_LIBRARY_PATH=$(cuinterpose sim-path) python app.py",
        READING_EXITS,
    ),
    "shim-path": (
        "print the path of libcuinterpose.so",
        "LD_PRELOAD=$(cuinterpose shim-path) python app.py",
        READING_EXITS,
    ),
    "criu": (
        "the round trip through CRIU: check, dump, restore, action-script",
        "cuinterpose criu check",
        # Written out here (tests/engine/test_first_day.py keeps it criu_action's): the
        # verbs' own parser loads only when a criu verb runs.
        "verbs (cuinterpose criu VERB --help: each one's example and options):\n"
        "  check          which CRIU, and does `criu check` pass\n"
        "  dump           suspend the group, then criu dump its process tree\n"
        "  restore        criu restore the tree, then resume the processes it recreated\n"
        "  action-script  write an executable for criu dump/restore --action-script\n"
        "  action         what the action script runs, per $CRTOOLS_SCRIPT_ACTION\n\n" + EXIT_TABLE,
    ),
    "job": (
        "a job across nodes through etcd: suspend, resume, recover, status",
        "cuinterpose job suspend --job J --store http://ETCD:2379 --node a --nodes a,b ...",
        EXIT_TABLE + "(cuinterpose job VERB --help: each verb's example and options)",
    ),
    "demo": (
        "run the end-to-end demo",
        "cuinterpose demo",
        "exit status:\n  0  every byte came back\n  1  it did not",
    ),
}


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog=PROG,
        description="Checkpoint/restore of CUDA processes sharing memory",
        formatter_class=Formatter,
        epilog="A first session: cuinterpose check; cuinterpose launch -- COMMAND; "
        "cuinterpose status; cuinterpose suspend --checkpoint-dir DIR --pid PID; "
        'cuinterpose resume --checkpoint-dir DIR (README.md, "Using it").\n\n' + EXIT_TABLE,
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {_version()}")
    add_early_logging(parser)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub = verb_adder(commands, _VERBS)

    suspend = sub("suspend")
    _add_agent_options(suspend)
    suspend.add_argument(
        "--not-requested",
        action="store_true",
        help="the group did not opt in: native checkpoint only, and no process may have a shim",
    )
    suspend.add_argument(
        "--lock-timeout",
        type=seconds,
        metavar="SECONDS",
        default=agent.DEFAULT_LOCK_TIMEOUT_MS / 1000,
        help="how long each native lock may wait for the process's CUDA calls to drain",
    )
    resume = sub("resume")
    _add_agent_options(resume, required=False)
    add_gpu_map(resume)
    status_cmd = sub("status")
    add_endpoints(status_cmd, required=False)
    status_cmd.add_argument("--json", action="store_true", help="print JSON instead of a table")
    status_cmd.add_argument(
        "--clear-stale",
        action="store_true",
        help="remove the control sockets of processes that are gone (nobody listens on "
        "them), then show the rest",
    )
    check = sub("check")
    check.add_argument("--control-dir", type=Path, help=f"default ${CONTROL_DIR_ENV}")
    add_driver(check)
    check.add_argument("--json", action="store_true", help="print JSON instead of lines")
    launch = sub("launch")
    launch.add_argument(
        "--driver",
        choices=("auto", "sim", "system"),
        default="auto",
        help="the CUDA driver COMMAND runs on: auto, the system's where an NVIDIA driver "
        "is installed, else the simulated one (the first line says which and why); sim, "
        "the simulated GPU of this installation; system, the libcuda.so.1 the loader finds",
    )
    launch.add_argument(
        "--control-dir",
        type=Path,
        help=f"where the shim serves its control socket (absolute; created 0700 when "
        f"missing; default ${CONTROL_DIR_ENV}, else {DEFAULT_CONTROL_DIR})",
    )
    launch.add_argument(
        "--pidfile", type=Path, metavar="FILE", help="write the program's pid to FILE"
    )
    launch.add_argument(
        "--exec",
        dest="exec_",
        action="store_true",
        help="become COMMAND (exec): the launcher's own pid is the one to name",
    )
    launch.add_argument("argv", nargs=argparse.REMAINDER, metavar="-- COMMAND...")
    prepare = sub("prepare")
    _add_machine_options(prepare)
    prepare.add_argument(
        "--replace", action="store_true", help="overwrite a capture that was never restored"
    )
    restore_cmd, recover_cmd = sub("restore"), sub("recover")
    _add_machine_options(restore_cmd, required=False)
    _add_machine_options(recover_cmd, required=False)
    add_gpu_map(restore_cmd, native=False)
    add_gpu_map(recover_cmd, native=False)
    for checked in (prepare, restore_cmd, recover_cmd):
        checked.add_argument(
            "--skip-native-check",
            action="store_true",
            help="go on when no CUDA driver can be loaded to check that every process is "
            "natively RUNNING (for those who know it is)",
        )
    native_cmd = sub("native")
    native_cmd.add_argument(
        "--action",
        choices=NATIVE_ACTIONS,
        required=True,
        help="lock (wait for the CUDA calls to drain), checkpoint (GPU state to host memory, "
        "the GPU freed), restore, unlock; state changes nothing",
    )
    native_cmd.add_argument(
        "--checkpoint-dir",
        type=Path,
        help="take the processes from here (the manifest, an interrupted capture's intent, "
        "else the state file), when none is named",
    )
    add_endpoints(native_cmd, required=False)
    native_cmd.add_argument(
        "--lock-timeout",
        type=seconds,
        metavar="SECONDS",
        default=agent.DEFAULT_LOCK_TIMEOUT_MS / 1000,
        help="--action lock: how long each lock may wait for the process's CUDA calls",
    )
    _add_progress(native_cmd)
    inspect = sub("inspect")
    add_endpoints(inspect, driver=False)
    inspect.add_argument("--json", action="store_true", help="print JSON instead of text")
    diagram = sub("diagram")
    diagram.add_argument(
        "--machine",
        choices=sorted(MACHINES),
        required=True,
        help="capture (prepare, suspend's first step) or restore (restore, resume's last)",
    )
    replay_cmd = sub("replay")
    replay_cmd.add_argument("trace", type=Path, metavar="TRACE")
    sub("sim-path")
    sub("shim-path")
    criu_cmd = sub("criu")
    criu_cmd.add_argument("argv", nargs=argparse.REMAINDER, metavar="VERB ...")
    sub("job").add_argument("argv", nargs=argparse.REMAINDER, metavar="VERB ...")
    demo = sub("demo")
    demo.add_argument("--driver", choices=("sim", "system"), default="sim")
    return parser


# -- helpers ----------------------------------------------------------------------


def _env_control_dir() -> Path:
    value = os.environ.get(CONTROL_DIR_ENV, "")
    return Path(value) if value else DEFAULT_CONTROL_DIR


def _control_dir(args: argparse.Namespace) -> Path:
    given: Path | None = getattr(args, "control_dir", None)
    return given if given is not None else _env_control_dir()


def _resolve_group(args: argparse.Namespace) -> None:
    """``args.group``: the processes named, else the ones the checkpoint directory (or,
    for status, the control directory) holds; usage errors as such."""
    try:
        given = targets.named(args.pid, args.process)
        if args.command == "status" and not given:
            args.group = targets.shims(_where(args))
        elif args.processes_required and not given:
            raise targets.TargetError(
                ["no process named: give --pid PID (or --process OBSERVED_PID NAMESPACE_PID)"],
                usage=True,
            )
        else:
            directory = None if args.processes_required else getattr(args, "checkpoint_dir", None)
            args.group = targets.resolve(given, directory, proc_root=args.proc_root)
    except targets.TargetError as error:
        if error.usage:
            text = "\n".join(f"{PROG}: error: {line}" for line in error.lines)
            raise UsageError(text) from None
        raise


def _endpoints(args: argparse.Namespace) -> list[Endpoint]:
    try:
        return [
            endpoint_for(o, n, control_dir=_control_dir(args), proc_root=args.proc_root)
            for o, n in args.group
        ]
    except ValueError as exc:
        raise UsageError(f"{PROG}: error: {exc}") from None


def _fail(lines: Sequence[str], stderr: TextIO) -> int:
    for line in lines:
        stderr.write(f"{PROG}: {line}\n")
    stderr.flush()
    return EXIT_FAILED


def output_mode(args: argparse.Namespace, stdout: TextIO) -> str:
    """How a verb tells its run on stdout: ``--progress`` (or ``--json``), ``auto`` being
    human on a terminal and JSON lines otherwise; ``-q`` keeps a person's output (and
    ``auto``'s) to nothing but the errors on stderr, while an explicit ``--progress json``
    stays JSON."""
    if getattr(args, "json", False):
        return "json"
    mode = str(getattr(args, "progress", "human"))  # a verb without --progress: its text
    if mode == "auto":
        mode = "human" if stdout.isatty() else "json"
        if getattr(args, "quiet", False):
            mode = "none"
    if mode == "human" and getattr(args, "quiet", False):
        mode = "none"
    return mode


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
    """Run ``spec``'s machine, or ``recover`` (None), and say how it ended: with JSON
    progress, a last summary line with the outcome and the exit code, as suspend's."""
    code = _machine(spec, args, stdout, stderr)
    said = _machine_summary(spec, args) if code == EXIT_OK else {}
    if args.mode == "json":
        refused = isinstance(getattr(args, "failure", None), Refused)
        said.pop("lines", None)
        _finish(args.command, args, stdout, stderr, code,
                "refused" if refused else _OUTCOMES[code], (), extra=said)  # fmt: skip
    elif said and args.mode == "human":
        with contextlib.suppress(OSError):
            for line in said["lines"]:
                stdout.write(line + "\n")
            stdout.flush()
    return code


def _machine_summary(spec: MachineSpec | None, args: argparse.Namespace) -> dict[str, Any]:
    """What a prepare or restore did and what comes next, as suspend and resume say it:
    the lines for a person, the figures for the JSON summary (recover says its own)."""
    result = getattr(args, "result", None)
    report = getattr(args, "recovered", None)
    if spec is None and report is not None:
        return {"action": report.action, "found": list(report.lines()), "lines": []}
    if spec is None or not isinstance(result, runner.CaptureResult | runner.RestoreResult):
        return {}
    moved = sum(p.transfer.allocation_bytes for p in result.phases if p.transfer is not None)
    n = len(args.group)
    who = f"{n} process{'es' if n != 1 else ''}"
    out: dict[str, Any] = {"seconds": result.elapsed_s, "bytes_staged": moved, "processes": n}
    if isinstance(result, runner.CaptureResult):
        restore = shlex.join(
            [PROG, "restore", "--checkpoint-dir", str(args.checkpoint_dir), *_where_words(args)]
        )
        out["next"] = restore
        out["lines"] = [
            f"captured {who} in {result.elapsed_s:.3f} s: {size(moved)} staged by the shims "
            f"into their processes' host memory and released from the GPU; the state file is "
            f"{result.state_path}",
            "next: the native lock and checkpoint of every process, later their native "
            f"restore and unlock, then: {restore}",
        ]
    else:
        out["lines"] = [
            f"restored {who} in {result.elapsed_s:.3f} s, {size(moved)} loaded back by the "
            "shims: every process runs, its sharing as before",
        ]
    return out


def _machine(
    spec: MachineSpec | None, args: argparse.Namespace, stdout: TextIO, stderr: TextIO
) -> int:
    endpoints = _endpoints(args)
    timeout = phase_timeout(args.phase_timeout)
    if spec is not None:  # recover reports and leaves out the processes that are gone
        problems = targets.problems(args.group, _where(args), shim=True)
        if problems:
            return _fail([f"{args.command} refused:", *problems], stderr)
    living = [e for e in endpoints if discovery.pid_exists(e.observed_pid, args.proc_root)]
    silent = discovery.unanswered(living, timeout=min(timeout, 10.0))
    if silent:
        listed = _status_command(args)
        way = f"give the directory its shims serve in (--control-dir); `{listed}` lists them"
        return _fail([f"{args.command} refused, nothing was changed: a shim does not answer",
                      *silent.values(), way], stderr)  # fmt: skip
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
            raise UsageError(f"{PROG}: error: cannot write trace {args.trace}: {exc}") from None
    refusal = (
        _native_check(spec, args, endpoints, stderr)
        if spec is not None
        else _recover_native_check(args, endpoints, stderr)
    )
    if refusal is not None:
        return refusal
    stop = threading.Event()
    where_now = _Whereabouts(_progress(args.mode, stdout), undone=not args.no_rollback)
    options = runner.Options(
        phase_timeout=timeout,
        on_progress=where_now,
        trace=writer,
        replace=bool(getattr(args, "replace", False)),
        stop=stop,
        rollback_on_failure=not args.no_rollback,
    )
    try:
        with _stopping_on_signals(stop, lambda: where_now.acknowledge(stderr)):
            pairs = uuid_pairs(args.gpu_map) if getattr(args, "gpu_map", None) else ()
            if spec is None:
                report = recover(endpoints, checkpoint_dir, options, gpu_pairs=pairs)
                if args.mode != "json" and not args.quiet:  # what it did: said unless -q
                    with contextlib.suppress(OSError):
                        stdout.write("".join(line + "\n" for line in report.lines()))
                args.recovered = report
                result: object = report.result
            elif spec is CAPTURE:  # started over when not quiet, as suspend's capture is
                attempt = functools.partial(runner.capture, endpoints, checkpoint_dir, options)
                result = until_quiet(attempt, options)
            elif pairs:
                result = runner.restore(endpoints, checkpoint_dir, options, gpu_pairs=pairs)
            else:
                result = runner.run_machine(spec, endpoints, checkpoint_dir, options)
            args.result = result
        for warning in getattr(result, "warnings", ()):
            stderr.write(f"{PROG}: note: {warning}\n")
    except GpuMapRefused as refused:
        return _fail(list(refused.lines()), stderr)
    except CoordinatorError as error:
        return _failure(error, args, stderr)
    except ValueError as exc:
        raise UsageError(f"{PROG}: error: {exc}") from None
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
            f"({resume_hint(args.checkpoint_dir)}, or the native restore and unlock), "
            "then prepare"
        )
    else:
        resume = shlex.join(
            [PROG, "resume", "--checkpoint-dir", str(args.checkpoint_dir), *_where_words(args)]
        )
        hint = (
            "restore runs after the native restore and unlock of every process; run them "
            f"first (`{PROG} native --action restore` and `--action unlock`, or `{resume}`)"
        )
    try:
        agent.require_states(_native(args), processes, ProcessState.RUNNING, spec.name, hint)
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
        blockers = native_blockers(_native(args), endpoints, args.checkpoint_dir)
    except NativeUnavailableError as exc:
        if not args.skip_native_check:
            return _fail(native_check_refusal("recover", exc), stderr)
        stderr.write(f"{PROG}: note: the native state was not checked (--skip-native-check): "
                     f"{exc}\n")  # fmt: skip
        return None
    if blockers:
        return _fail(["recover refused: nothing was changed", *blockers], stderr)
    return None


def _native_backend() -> NativeBackend | None:
    """The tests' hook for a backend of their own; None: the driver (below)."""
    return None


def _driver_library(args: argparse.Namespace) -> str | None:
    """The libcuda.so.1 the native calls load (frontends/drivers.py)."""
    return drivers.library(
        getattr(args, "driver", "auto"),
        lambda: _endpoints(args),
        getattr(args, "recorded", None),
        proc_root=getattr(args, "proc_root", None),
    )


def _native(args: argparse.Namespace) -> NativeBackend:
    injected = _native_backend()
    return injected if injected is not None else CudaBackend(_driver_library(args))


def _no_driver(command: str, exc: NativeUnavailableError) -> list[str]:
    return [
        f"{command}: {exc}",
        f"to see what this machine offers: {PROG} check",
    ]


def _where(args: argparse.Namespace) -> agent.Where:
    return agent.Where(_control_dir(args), args.proc_root)


def _agent_processes(args: argparse.Namespace) -> list[agent.Process]:
    _endpoints(args)  # the same usage checks as every other command
    return [agent.Process(observed, namespace) for observed, namespace in args.group]


def _agent_command(command: str, args: argparse.Namespace, stdout: TextIO, stderr: TextIO) -> int:
    processes = _agent_processes(args)
    mode = args.mode
    shim_needed = command == "suspend" and not args.not_requested
    # resume checks the group itself: the survivors of a member lost come back.
    problems = targets.problems(args.group, _where(args), shim=shim_needed) if (
        command == "suspend") else []  # fmt: skip
    if problems:
        return _finish(command, args, stdout, stderr, EXIT_FAILED, "refused",
                       [f"{command} refused:", *problems])  # fmt: skip
    view = None
    on_event: agent.AgentCallback | None = None
    live: contextlib.AbstractContextManager[object] = contextlib.nullcontext()
    if mode == "human":
        from . import render  # rich: only for a person's output

        view = render.HumanView(stdout, per_participant=args.per_participant)
        on_event, live = view, view.live()
    elif mode == "json":
        on_event = _json_events(stdout)
    # A resume cannot undo its native restore: it stops, and its last lines say where
    # the group is (running with its bytes, or what to run), as a failed resume does.
    then = "" if command == "suspend" else (
        "the resume goes no further; the lines that follow say where the group is")  # fmt: skip
    where_now = _Whereabouts(on_event, then=then)
    stop = threading.Event()
    options = runner.Options(phase_timeout=phase_timeout(args.phase_timeout), stop=stop)
    try:
        native = _native(args)
        with _stopping_on_signals(stop, lambda: where_now.acknowledge(stderr)), live:
            if command == "suspend":
                done: agent.SuspendResult | agent.ResumeResult = agent.suspend(
                    processes,
                    args.checkpoint_dir,
                    where=_where(args),
                    native=native,
                    requested=not args.not_requested,
                    options=options,
                    lock_timeout_ms=int(args.lock_timeout * 1000),
                    on_event=where_now,
                )
            else:
                done = agent.resume(
                    args.checkpoint_dir,
                    where=_where(args),
                    native=native,
                    processes=processes,
                    gpu_map=args.gpu_map,
                    options=options,
                    on_event=where_now,
                )
    except agent.SuspendFailed as failed:
        code = EXIT_FAILED if failed.restored else EXIT_NEEDS_RECOVER
        outcome = "failed, undone: the group runs as before" if failed.restored else (
            "failed, not undone")  # fmt: skip
        return _finish(command, args, stdout, stderr, code, outcome, failed.lines())
    except agent.ResumeFailed as failed:
        # A native step ran: never "nothing changed" (exit 1).
        if failed.running:
            outcome = _OUTCOMES[EXIT_ROLLED_BACK] if not failed.lost else (
                "a member is gone: the survivors run with the bytes they had")  # fmt: skip
            return _finish(command, args, stdout, stderr, EXIT_ROLLED_BACK, outcome,
                           failed.lines())  # fmt: skip
        way_on = f"once every process is RUNNING, run: {_recover_command(args)}"
        return _finish(command, args, stdout, stderr, EXIT_NEEDS_RECOVER,
                       _OUTCOMES[EXIT_NEEDS_RECOVER], [*failed.lines(), way_on])  # fmt: skip
    except agent.AgentError as error:
        return _finish(command, args, stdout, stderr, EXIT_FAILED, "refused", error.lines())
    except CoordinatorError as error:
        code = _failure(error, args, stderr)
        # A suspend whose capture was rolled back: the group runs as it was (exit 1).
        if command == "suspend" and code == EXIT_ROLLED_BACK:
            code = EXIT_FAILED
        outcome = "refused" if isinstance(error, Refused) else _OUTCOMES[code]
        return _finish(command, args, stdout, stderr, code, outcome, ())
    except NativeUnavailableError as exc:
        return _finish(command, args, stdout, stderr, EXIT_FAILED, "refused",
                       _no_driver(command, exc))  # fmt: skip
    for warning in getattr(done, "warnings", ()):
        stderr.write(f"{PROG}: note: {warning}\n")
    summary = _Summary.of(command, args, done)
    if view is not None:
        view.summary(done.timings, done.staging)
        with contextlib.suppress(OSError):
            for line in summary.lines():
                stdout.write(line + "\n")
            stdout.flush()
    return _finish(command, args, stdout, stderr, EXIT_OK, summary.outcome, (), summary)


_OUTCOMES: Final = {
    EXIT_OK: "done",
    EXIT_FAILED: "refused or failed: the group runs as before",
    EXIT_ROLLED_BACK: "failed and rolled back: the group runs as before",
    EXIT_NEEDS_RECOVER: "failed: the group needs recover",
}


def _finish(
    command: str,
    args: argparse.Namespace,
    stdout: TextIO,
    stderr: TextIO,
    code: int,
    outcome: str,
    lines: Sequence[str],
    summary: _Summary | None = None,
    extra: Mapping[str, Any] | None = None,
) -> int:
    """Say how the command ended once: the lines on stderr, and in JSON mode one
    summary line with the outcome and the exit code."""
    if lines:
        _fail(lines, stderr)
    if getattr(args, "mode", None) == "json":
        document: dict[str, Any] = {"event": "summary", "command": command}
        document.update(summary.to_json() if summary is not None else {})
        document.update(extra or {})
        document.update(outcome=outcome, exit_code=code)
        failure: CoordinatorError | None = getattr(args, "failure", None)
        if lines:
            document["reason"] = list(lines)
        elif failure is not None:
            document["reason"] = list(failure.lines())
        if failure is not None and failure.guard:
            document["check"] = failure.guard
            rules = sorted({p.rule for p in failure.problems if p.rule})
            document.update({"rules": rules} if rules else {})
        with contextlib.suppress(OSError):
            stdout.write(json.dumps(document, allow_nan=False) + "\n")
            stdout.flush()
    return code


@attrs.frozen
class _Summary:
    """What a suspend or resume did and what comes next."""

    command: str
    outcome: str
    seconds: float
    bytes_staged: int
    processes: int
    timings: tuple[agent.Timing, ...]
    next_command: str
    checkpoint_dir: Path
    staging: dict[str, Any] | None = None  # the shims' staging figures (engine/agent.py)
    released: Released | None = None  # suspend: the GPU memory it released

    @classmethod
    def of(
        cls, command: str, args: argparse.Namespace, done: agent.SuspendResult | agent.ResumeResult
    ) -> _Summary:
        staged = sum(t.bytes for t in done.timings if t.step in ("capture", "coordinator_restore"))
        words = [PROG, "resume" if command == "suspend" else "suspend",
                 "--checkpoint-dir", str(args.checkpoint_dir), *_where_words(args)]  # fmt: skip
        if command == "resume":  # a new suspend names the processes, here the manifest's
            for o, n in args.group:
                words += ["--pid", str(o)] if o == n else ["--process", str(o), str(n)]
        freed = None
        if isinstance(done, agent.SuspendResult):
            freed = released_by_suspend(
                args.checkpoint_dir, done.staging, len(args.group), prepared=done.manifest.prepared
            )
        return cls(
            command,
            "suspended" if command == "suspend" else "resumed",
            sum(t.seconds for t in done.timings),
            staged,
            len(args.group),
            done.timings,
            shlex.join(words),
            args.checkpoint_dir,
            done.staging.to_json() if done.staging is not None else None,
            freed,
        )

    def lines(self) -> list[str]:
        who = f"{self.processes} process{'es' if self.processes != 1 else ''}"
        if self.command == "suspend":
            staged = (
                f"{size(self.bytes_staged)} staged by the shims, the rest kept by the native "
                "checkpoint"
                if self.bytes_staged
                else "kept by the native checkpoint"
            )
            lines = [f"suspended {who} in {self.seconds:.3f} s"]
            if self.released is not None:
                lines.append(self.released.human())
            return [
                *lines,
                f"where the bytes are: in the host memory of each process ({staged}); they "
                f"end with the process unless it is dumped (`{PROG} criu dump`); "
                f"{self.checkpoint_dir} holds only the manifest and the state file",
                "every process is CHECKPOINTED until the resume",
                f"next: {self.next_command}",
            ]
        loaded = f", {size(self.bytes_staged)} loaded back by the shims" if (
            self.bytes_staged) else ""  # fmt: skip
        return [
            f"resumed {who} in {self.seconds:.3f} s{loaded}: every process is RUNNING, "
            "its sharing as before",
        ]

    def to_json(self) -> dict[str, Any]:
        out = {
            "seconds": self.seconds,
            "bytes_staged": self.bytes_staged,
            "processes": self.processes,
            "timings": [t.to_json() for t in self.timings],
            "next": self.next_command,
            **({"staging": self.staging} if self.staging is not None else {}),
        }
        if self.released is not None:
            out["gpu_memory_released"] = self.released.to_json()
            out["bytes_in"] = "host memory of each process"
        return out


class _Whereabouts:
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
        if isinstance(event, agent.StepEvent) and event.status == "started":
            self.step, self.phase, self.copy = event.step, "", None
        elif isinstance(event, PhaseEvent):
            self.phase, self.copy = event.phase, None
        elif isinstance(event, agent.CopyProgress):
            self.copy = event
        if self.inner is not None:
            self.inner(event)

    def acknowledge(self, stderr: TextIO) -> None:
        if self.acknowledged:
            return
        self.acknowledged = True
        at = self.step or "the first step"
        if self.copy is not None:
            at = (
                f"{self.copy.phase} (in flight: {size(self.copy.bytes_done)} of "
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


def _json_events(stream: TextIO) -> agent.AgentCallback:
    def emit(event: agent.AgentEvent) -> None:
        with contextlib.suppress(OSError):  # a closed stdout must not stop a suspend
            stream.write(json.dumps(event.to_json(), allow_nan=False) + "\n")
            stream.flush()

    return emit


class _NoDriver:
    """The native calls when no driver could be loaded: each fails, saying so."""

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def _none(self, pid: int, call: str) -> NoReturn:
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


def _status(args: argparse.Namespace, stdout: TextIO, stderr: TextIO) -> int:
    processes = _agent_processes(args)
    where = _where(args)
    named = bool(args.pid or args.process)
    stale = [] if named else _stale(processes, where)
    if stale and args.clear_stale:
        for path in agent.remove_stale_sockets(stale, where):
            stderr.write(f"{PROG}: removed the stale socket {path}\n")
        processes = [p for p in processes if p not in stale]
        args.group = [(p.observed_pid, p.namespace_pid) for p in processes]
        stale = []
    if not processes:
        if args.json:
            empty = {"processes": [], "control_dir": str(where.control_dir)}
            return _finish("status", args, stdout, stderr, EXIT_OK, "done", (), extra=empty)
        else:
            stdout.write(f"no shim in {where.control_dir} (start a program with `{PROG} launch`)\n")
        return EXIT_OK
    gone = targets.problems(args.group, where, shim=False)
    if gone and named:
        return _finish("status", args, stdout, stderr, EXIT_FAILED, "refused", gone)
    for process in stale:
        path = where.endpoint(process).path
        clear = f"{_status_command(args)} --clear-stale"
        stderr.write(
            f"{PROG}: note: pid {process.observed_pid} is gone: its socket {path} is stale "
            f"(`{clear}` removes it)\n"
        )
    try:
        rows = agent.status(processes, where, _native(args))
    except NativeUnavailableError as exc:
        stderr.write(f"{PROG}: note: native states unknown: {exc}\n")
        rows = agent.status(processes, where, _NoDriver("no CUDA driver loaded"))
    if args.json:
        # One line, the summary itself: JSON lines like every verb's, and one document.
        document = {"processes": [r.to_json() for r in rows]}
        return _finish("status", args, stdout, stderr, EXIT_OK, "done", (), extra=document)
    else:
        from . import render  # rich: only for a person's output

        render.status_table(stdout, rows)
    return EXIT_OK


def _stale(processes: Sequence[agent.Process], where: agent.Where) -> list[agent.Process]:
    """The processes listed by their sockets that are gone: no such pid, and nobody
    serves the socket."""
    return [
        p
        for p in processes
        if not discovery.pid_exists(p.observed_pid, where.proc_root)
        and not discovery.serves(where.endpoint(p).path)
    ]


def _status_command(args: argparse.Namespace) -> str:
    return shlex.join([PROG, "status", *_where_words(args)])


@contextlib.contextmanager
def _stopping_on_signals(
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


def _where_words(args: argparse.Namespace, *, driver: bool = True) -> list[str]:
    """What a printed command needs to find the group from a plain shell (no
    ``$SNAPSHOT_CONTROL_DIR``): the control directory or proc root, the driver, when
    they are not the defaults."""
    words: list[str] = []
    if getattr(args, "proc_root", None) is not None:
        words += ["--proc-root", str(args.proc_root)]
    elif _control_dir(args) != DEFAULT_CONTROL_DIR:
        words += ["--control-dir", str(_control_dir(args))]
    if driver and getattr(args, "driver", "auto") != "auto":
        words += ["--driver", args.driver]
    return words


def _recover_command(args: argparse.Namespace) -> str:
    words = [PROG, "recover", "--checkpoint-dir", str(args.checkpoint_dir), *_where_words(args)]
    for observed, namespace in args.group:
        words += ["--pid", str(observed)] if observed == namespace else [
            "--process", str(observed), str(namespace)]  # fmt: skip
    return shlex.join(words)


def _failure(error: CoordinatorError, args: argparse.Namespace, stderr: TextIO) -> int:
    args.failure = error  # for the JSON summary's reason (_finish)
    lines = list(error.lines())
    if getattr(args, "verbose", 0):
        lines += [f"detail: {line}" for line in error.details()]
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


NATIVE_ACTIONS: Final = ("lock", "checkpoint", "restore", "unlock", "state")
_UNDO_ACTION: Final = {"lock": "unlock", "checkpoint": "restore", "restore": "checkpoint",
                       "unlock": "lock"}  # fmt: skip


def _native_action(args: argparse.Namespace, stdout: TextIO, stderr: TextIO) -> int:
    """One native step on every process (frontends/native.py's group helpers, from the
    shell): each process's state after it, and on a failure every state and what to do."""
    processes = _agent_processes(args)
    pids = [p.observed_pid for p in processes]
    action: str = args.action
    try:
        native = _native(args)
        if action != "state":
            run_step(native, action, pids, lock_timeout_ms=int(args.lock_timeout * 1000))
        states = state_names(native, pids)
    except NativeUnavailableError as exc:
        return _finish("native", args, stdout, stderr, EXIT_FAILED, "refused",
                       _no_driver("native", exc))  # fmt: skip
    except NativeGroupError as failure:
        code = EXIT_FAILED if not failure.done else EXIT_NEEDS_RECOVER
        lines = list(failure.lines())
        if failure.done:  # some processes took the step: undo it on them, or go on
            named = [w for pid in failure.done for w in ("--pid", str(pid))]
            back = [PROG, "native", "--action", _UNDO_ACTION[action], *_where_words(args)]
            lines.append(f"the step ran on pid(s) {', '.join(map(str, failure.done))}: undo it "
                         f"there with `{shlex.join([*back, *named])}`, or fix the failed one "
                         "and run the step again")  # fmt: skip
        return _finish("native", args, stdout, stderr, code, _OUTCOMES[code], lines)
    if args.mode == "human":
        with contextlib.suppress(OSError):
            for p in processes:
                stdout.write(f"{p.describe()}: {states[p.observed_pid]}\n")
    extra = {"action": action, "states": {str(pid): state for pid, state in states.items()}}
    return _finish("native", args, stdout, stderr, EXIT_OK, "done", (), extra=extra)


def _inspect(args: argparse.Namespace, stdout: TextIO, stderr: TextIO) -> int:
    from .engine.statefile import make_converter

    endpoints = _endpoints(args)
    try:
        bound, topology = runner.inspect(endpoints, timeout=phase_timeout(None))
    except CoordinatorError as error:
        return _finish("inspect", args, stdout, stderr, EXIT_FAILED, "refused", error.lines())
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
        return _finish("inspect", args, stdout, stderr, EXIT_OK, "done", (), extra=document)
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
        raise UsageError(f"{PROG} launch: error: no COMMAND given after --")
    module = _delegate("launch", stderr)
    if module is None:
        return EXIT_FAILED
    driver = args.driver
    if driver == "auto":
        chosen = drivers.installed()
        driver, said = chosen.kind, chosen.line()
    else:
        said = drivers.Installed(driver, f"--driver {driver}").line()
    if not args.quiet:  # -q: nothing but the errors
        with contextlib.suppress(OSError):
            stderr.write(f"{PROG} launch: {said}\n")
            stderr.flush()
    try:
        return int(
            module.launch(
                command,
                driver=driver,
                control_dir=args.control_dir,
                pidfile=args.pidfile,
                exec_=args.exec_,
                announce=None if args.quiet else stderr,
            )
        )
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
        merge_logging(args)
        command: str = args.command
        args.mode = output_mode(args, out)
        try:
            logs.configure(
                verbosity=getattr(args, "verbose", 0),
                quiet=getattr(args, "quiet", False),
                log_file=getattr(args, "log_file", None),
                stream=err,
            )
            return _dispatch(command, args, out, err)
        except targets.TargetError as error:
            return _finish(command, args, out, err, EXIT_FAILED, "refused", error.lines)
        except agent.ManifestError as error:
            return _finish(command, args, out, err, EXIT_FAILED, "refused", error.lines())
        except OSError as exc:
            # The checkpoint directory (or a file named on the command line) is not
            # what the command needs: a plain message, never a traceback.
            where = f"{exc.filename}: " if exc.filename else ""
            lines = [f"{command}: {where}{exc.strerror or exc}"]
            return _finish(command, args, out, err, EXIT_FAILED, "refused", lines)
        finally:
            logs.reset()
    except UsageError as exc:
        err.write(f"{exc}\n")
        return EXIT_USAGE


def _take_origin(args: argparse.Namespace) -> None:
    """resume, restore and recover reach the group where its manifest says it lives (and
    load the driver its shims reported), unless --control-dir or --proc-root say
    otherwise; what is taken is said at debug level."""
    directory = getattr(args, "checkpoint_dir", None)
    if args.command not in ("resume", "restore", "recover", "native") or directory is None:
        return
    if not (Path(directory) / agent.MANIFEST_FILE_NAME).is_file():
        return
    try:
        origin = agent.read_manifest(directory).origin
    except agent.ManifestError:
        return  # the verb itself reads it again, and says what is wrong with it
    if origin is None:
        return
    args.recorded = origin.driver
    if args.control_dir is None and args.proc_root is None:
        if origin.proc_root is not None:
            args.proc_root = Path(origin.proc_root)
        args.control_dir = Path(origin.control_dir)
        logging.getLogger("cuinterpose.cli").debug(
            "the group lives where %s/manifest.json says: %s", directory, _where(args)
        )


def _early_logging_to(args: argparse.Namespace) -> list[str]:
    """``cuinterpose -v criu dump ...``: the logging options given before ``criu``, passed
    on after its verb (where its own parser takes them)."""
    argv = list(args.argv)
    early = ["-v"] * args.early_verbose + (["-q"] if args.early_quiet else [])
    if args.early_log_file is not None:
        early += ["--log-file", str(args.early_log_file)]
    return [*argv[:1], *early, *argv[1:]] if argv and early else argv


def _dispatch(command: str, args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    _take_origin(args)
    if hasattr(args, "processes_required"):
        _resolve_group(args)
    if command in ("prepare", "suspend"):
        created = missing(args.checkpoint_dir)
        if command == "prepare":
            code = _run_machine(CAPTURE, args, out, err)
        else:
            code = _agent_command(command, args, out, err)
        tidy_refused(created, code)
        return code
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
    if command == "native":
        return _native_action(args, out, err)
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
    if command in ("criu", "job"):  # their verbs' parsers: frontends/{criu,job}_action.py
        module = _delegate(f"{command}_action", err)
        if module is None:
            return EXIT_FAILED
        return int(module.main(_early_logging_to(args), stdout=out, stderr=err))
    if command == "check":
        from . import check

        return check.run(
            control_dir=_control_dir(args), driver=args.driver, as_json=args.json, out=out
        )
    raise AssertionError(f"unhandled command {command}")
