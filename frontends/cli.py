"""The ``cuinterpose`` command line.

Exit status: :data:`EXIT_TABLE` (also in ``--help`` and specs/recovery.md); stderr
names the participant, its pid, the phase and the reason. SIGINT, SIGTERM and SIGHUP
stop a run at the next phase boundary (said at once on stderr, with what it waits for);
what was changed is then rolled back (status 3, or 4). A closed stdout or stderr stops
nothing (streams.py).

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
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Final, TextIO

from . import __version__, invocation, logs, streams, targets
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
    add_step_timeout,
    merge_logging,
    missing,
    seconds,
    tidy_refused,
    verb_adder,
)
from .invocation import Invocation
from .outcomes import PROG, Outcome, finish, output_mode, say

# The engine's modules are imported where a verb uses them: a command loads only what it
# needs (tests/engine/test_import_cost.py). These are for the annotations.
if TYPE_CHECKING:
    from .engine.manifest import ManifestError
    from .engine.native_checkpoint import NativeBackend

# The exit statuses, for embedders and tests that run main().
__all__ = [
    "EXIT_FAILED",
    "EXIT_NEEDS_RECOVER",
    "EXIT_OK",
    "EXIT_ROLLED_BACK",
    "EXIT_TABLE",
    "EXIT_USAGE",
    "build_parser",
    "main",
]


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
    add_step_timeout(parser)
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
    add_step_timeout(parser)
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
    "host-copy": (
        "turn the kept host copy on in running processes (their allocations pinned in "
        "host memory in the background, each suspend copying only what changed), or give "
        "every copy back (--give-back)",
        "cuinterpose host-copy --pid 4242\n  cuinterpose host-copy --pid 4242 --give-back",
        CHANGING_EXITS,
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
        "show the participants' topology (changes nothing): each record with its size, "
        "each allocation as its creator's or an importer's (naming the creator's pid); "
        "--json has every field",
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
        "cuinterpose job suspend --job J --store http://ETCD:2379 --store-credentials FILE "
        "--node a --nodes a,b ...",
        # The job's own table is job_action.JOB_EXITS (loaded only when a job verb runs).
        "exit status (each node's):\n  0  done\n  1  refused, nothing changed on the node\n"
        "  2  usage error\n  3  the job aborted: rolled back, the node's group runs as before\n"
        "  4  not back: run `cuinterpose job recover` on that node\n"
        "(cuinterpose job VERB --help: each verb's example, options and exit statuses; "
        "docs/multinode.md: how to run a job)",
    ),
    "demo": (
        "run the end-to-end demo: three processes sharing GPU memory suspended and resumed, "
        "every byte checked; the GPU memory it shows (cuMemGetInfo on every device the "
        "processes use, once they hold all they share) is what the suspend saved, what it "
        "freed, and what is used again after the resume",
        "cuinterpose demo",
        "exit status:\n  0  every byte came back\n  1  it did not",
    ),
}


def _lock_timeout(parser: argparse.ArgumentParser, text: str) -> None:
    from .engine.native_checkpoint import DEFAULT_LOCK_TIMEOUT_MS

    parser.add_argument(
        "--lock-timeout",
        type=seconds,
        metavar="SECONDS",
        default=DEFAULT_LOCK_TIMEOUT_MS / 1000,
        help=text,
    )


def _suspend_options(suspend: argparse.ArgumentParser) -> None:
    _add_agent_options(suspend)
    suspend.add_argument(
        "--not-requested",
        action="store_true",
        help="the group did not opt in: native checkpoint only, and no process may have a shim",
    )
    _lock_timeout(
        suspend, "how long each native lock may wait for the process's CUDA calls to drain"
    )


def _resume_options(resume: argparse.ArgumentParser) -> None:
    _add_agent_options(resume, required=False)
    add_gpu_map(resume)


def _status_options(status_cmd: argparse.ArgumentParser) -> None:
    add_endpoints(status_cmd, required=False)
    status_cmd.add_argument("--json", action="store_true", help="print JSON instead of a table")
    status_cmd.add_argument(
        "--checkpoint-dir",
        type=Path,
        help="the checkpoint directory of the group's last run: status then names the "
        "command that brings the group back or on (resume, recover)",
    )
    status_cmd.add_argument(
        "--clear-stale",
        action="store_true",
        help="remove the control sockets of processes that exited (gone, or a zombie its "
        "parent has not reaped; nobody listens on them), then show the rest; without it "
        "such a process is shown as exited, its socket stale",
    )


def _host_copy_options(host: argparse.ArgumentParser) -> None:
    add_endpoints(host, required=True, driver=False)
    host.add_argument(
        "--give-back",
        action="store_true",
        help="free every kept host copy and turn the mode off (default: turn it on)",
    )
    host.add_argument("--json", action="store_true", help="print JSON instead of lines")


def _check_options(check: argparse.ArgumentParser) -> None:
    check.add_argument("--control-dir", type=Path, help=f"default ${CONTROL_DIR_ENV}")
    add_driver(check)
    check.add_argument("--json", action="store_true", help="print JSON instead of lines")


def _launch_options(launch: argparse.ArgumentParser) -> None:
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
        help="become COMMAND (exec): the launcher's own pid is the one to name (its pid "
        "line, on stderr, says so before the exec)",
    )
    launch.add_argument(
        "--keep-host-copy",
        action="store_true",
        help="SNAPSHOT_SHIM_KEEP_HOST_COPY=1: the shim pins a host copy of every allocation "
        "while COMMAND runs and keeps it across suspends, so that each suspend copies only "
        "what changed (costs host memory the size of the allocations: specs/shim.md)",
    )
    launch.add_argument("argv", nargs=argparse.REMAINDER, metavar="-- COMMAND...")


def _skip_native_check(checked: argparse.ArgumentParser) -> None:
    checked.add_argument(
        "--skip-native-check",
        action="store_true",
        help="go on when no CUDA driver can be loaded to check that every process is "
        "natively RUNNING (for those who know it is)",
    )


def _prepare_options(prepare: argparse.ArgumentParser) -> None:
    _add_machine_options(prepare)
    prepare.add_argument(
        "--replace", action="store_true", help="overwrite a capture that was never restored"
    )
    _skip_native_check(prepare)


def _restore_options(parser: argparse.ArgumentParser) -> None:
    _add_machine_options(parser, required=False)
    add_gpu_map(parser, native=False)
    _skip_native_check(parser)


def _native_options(native_cmd: argparse.ArgumentParser) -> None:
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
    _lock_timeout(
        native_cmd, "--action lock: how long each lock may wait for the process's CUDA calls"
    )
    _add_progress(native_cmd)


def _inspect_options(inspect: argparse.ArgumentParser) -> None:
    add_endpoints(inspect, driver=False)
    inspect.add_argument("--json", action="store_true", help="print JSON instead of text")


def _diagram_options(diagram: argparse.ArgumentParser) -> None:
    from .phases import MACHINES

    diagram.add_argument(
        "--machine",
        choices=sorted(MACHINES),
        required=True,
        help="capture (prepare, suspend's first step), restore (restore, resume's last) or "
        "rollback (back to running: recover's way back, and what undoes a failed capture "
        "or restore)",
    )


def _replay_options(replay_cmd: argparse.ArgumentParser) -> None:
    replay_cmd.add_argument("trace", type=Path, metavar="TRACE")


def _no_options(parser: argparse.ArgumentParser) -> None:
    pass


def _verbs_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("argv", nargs=argparse.REMAINDER, metavar="VERB ...")


def _demo_options(demo: argparse.ArgumentParser) -> None:
    demo.add_argument(
        "--driver",
        choices=("sim", "system"),
        default="sim",
        help="sim (the default): the simulated driver, no GPU needed; system: the machine's "
        "NVIDIA driver and GPU (the multicast team is then left out: it runs on the "
        "simulated driver only)",
    )


# A verb: what it said itself (an exit code), or its Outcome for main to say.
Run = Callable[[Invocation, TextIO, TextIO], "int | Outcome"]


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """Every verb, or (``only``) every verb's help line but one verb's options: a command
    builds the options of its own verb alone (main)."""
    parser = Parser(
        prog=PROG,
        description="Checkpoint/restore of CUDA processes sharing memory",
        formatter_class=Formatter,
        epilog="A first session: cuinterpose check; cuinterpose launch -- COMMAND; "
        "cuinterpose status; cuinterpose suspend --checkpoint-dir DIR --pid PID; "
        'cuinterpose resume --checkpoint-dir DIR (README.md, "Using it").\n\n' + EXIT_TABLE,
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    add_early_logging(parser)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub = verb_adder(commands, _VERBS)
    for name, (options, run) in _COMMANDS.items():
        chosen = only is None or only == name
        verb = sub(name, bare=not chosen)
        if chosen:
            options(verb)
            verb.set_defaults(func=run)
    return parser


NATIVE_ACTIONS: Final = ("lock", "checkpoint", "restore", "unlock", "state")
# build_parser's ``only`` naming no verb: every verb's help line, no verb's options.
_NO_VERB: Final = ""


def _artifact(which: str, stdout: TextIO, stderr: TextIO) -> int:
    from .engine import artifacts  # only the verbs that print a library's path

    find: Callable[[], Path] = getattr(artifacts, which)
    try:
        stdout.write(f"{find()}\n")
    except artifacts.ArtifactMissingError as exc:
        return say([str(exc)], stderr)
    return EXIT_OK


def _launch(args: argparse.Namespace, stderr: TextIO) -> int:
    from . import drivers

    command = list(args.argv)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        raise UsageError(f"{PROG} launch: error: no COMMAND given after --")
    from . import launch  # process management the coordinator itself never needs

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
            launch.launch(
                command,
                driver=driver,
                control_dir=args.control_dir,
                pidfile=args.pidfile,
                exec_=args.exec_,
                announce=None if args.quiet else stderr,
                keep_host_copy=args.keep_host_copy,
            )
        )
    except launch.LaunchError as exc:
        return say([f"launch: {exc}"], stderr)


def _demo(args: argparse.Namespace, stderr: TextIO) -> int:
    from . import demo

    return int(demo.run_demo(driver=args.driver))


def _parse(given: list[str]) -> argparse.Namespace:
    """Build the options of the verb named alone (most of a small command's own cost);
    where the first verb-like word was some option's value, every verb's; with no verb
    named (``--help``, ``--version``, a usage error), none's: the help lines are the
    verbs' own, and no verb can parse."""
    verb = next((word for word in given if word in _COMMANDS), None)
    if verb is None:
        return build_parser(_NO_VERB).parse_args(given)
    with contextlib.suppress(UsageError):
        args = build_parser(verb).parse_args(given)
        if args.command == verb:
            return args
    return build_parser().parse_args(given)


def main(
    argv: Sequence[str] | None = None,
    *,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
    native: NativeBackend | None = None,
) -> int:
    """Run one command line; ``native``: the native calls to make instead of those on
    the driver ``--driver`` names (an embedder's backend, a test's fake)."""
    # A closed pipe or a hung-up terminal must never stop a run half way (streams.py).
    out = streams.sturdy(stdout if stdout is not None else sys.stdout)
    err = streams.sturdy(stderr if stderr is not None else sys.stderr)
    given = list(sys.argv[1:] if argv is None else argv)
    try:
        try:
            args = _parse(given)
        except SystemExit as exit_:  # --help, or argparse's own exit
            return int(exit_.code or 0) if isinstance(exit_.code, int | None) else EXIT_USAGE
        merge_logging(args)
        command: str = args.command
        mode = output_mode(args, out)
        try:
            logs.configure(
                verbosity=getattr(args, "verbose", 0),
                quiet=getattr(args, "quiet", False),
                log_file=getattr(args, "log_file", None),
                stream=err,
            )
            run: Run = args.func
            ended = run(invocation.of(args, mode, native=native), out, err)
        except targets.TargetError as error:
            ended = Outcome.refused(error.lines)
        except _manifest_error() as error:
            ended = Outcome.refused(error.lines())
        except OSError as exc:
            # The checkpoint directory (or a file named on the command line) is not
            # what the command needs: a plain message, never a traceback.
            where = f"{exc.filename}: " if exc.filename else ""
            ended = Outcome.refused([f"{command}: {where}{exc.strerror or exc}"])
        finally:
            logs.reset()
        return ended if isinstance(ended, int) else finish(command, mode, ended, out, err)
    except UsageError as exc:
        err.write(f"{exc}\n")
        return EXIT_USAGE


def _manifest_error() -> type[ManifestError]:
    """The class main catches a manifest's refusal by, loaded when an exception reaches
    that clause (its class is evaluated then, not at ``try``): a verb that reads no
    manifest loads none."""
    from .engine.manifest import ManifestError

    return ManifestError


def _early_logging_to(args: argparse.Namespace) -> list[str]:
    """``cuinterpose -v criu dump ...``: the logging options given before ``criu``, passed
    on after its verb (where its own parser takes them)."""
    argv = list(args.argv)
    early = ["-v"] * args.early_verbose + (["-q"] if args.early_quiet else [])
    if args.early_log_file is not None:
        early += ["--log-file", str(args.early_log_file)]
    return [*argv[:1], *early, *argv[1:]] if argv and early else argv


def _suspend(call: Invocation, out: TextIO, err: TextIO) -> Outcome:
    from . import group_verbs

    created = missing(call.options.checkpoint_dir)
    ended = group_verbs.agent_command("suspend", call, out, err)
    tidy_refused(created, ended.code)
    return ended


def _resume(call: Invocation, out: TextIO, err: TextIO) -> Outcome:
    from . import group_verbs

    return group_verbs.agent_command("resume", call, out, err)


def _status(call: Invocation, out: TextIO, err: TextIO) -> Outcome:
    from . import group_verbs

    return group_verbs.status(call, out, err)


def _host_copy(call: Invocation, out: TextIO, err: TextIO) -> Outcome:
    from . import group_verbs

    return group_verbs.host_copy(call, out, err)


def _native(call: Invocation, out: TextIO, err: TextIO) -> Outcome:
    from . import group_verbs

    return group_verbs.native_action(call, out, err)


def _inspect(call: Invocation, out: TextIO, err: TextIO) -> Outcome:
    from . import group_verbs

    return group_verbs.inspect(call, out, err)


def _replay(call: Invocation, out: TextIO, err: TextIO) -> Outcome:
    from . import group_verbs

    return group_verbs.replay(call, out, err)


def _prepare(call: Invocation, out: TextIO, err: TextIO) -> Outcome:
    from . import machine_verbs
    from .phases import CAPTURE

    created = missing(call.options.checkpoint_dir)
    ended = machine_verbs.run_machine(CAPTURE, call, out, err)
    tidy_refused(created, ended.code)
    return ended


def _restore(call: Invocation, out: TextIO, err: TextIO) -> Outcome:
    from . import machine_verbs
    from .phases import RESTORE

    return machine_verbs.run_machine(RESTORE, call, out, err)


def _recover(call: Invocation, out: TextIO, err: TextIO) -> Outcome:
    from . import machine_verbs

    return machine_verbs.run_machine(None, call, out, err)


def _diagram(call: Invocation, out: TextIO, err: TextIO) -> int:
    from .engine.fsm import mermaid  # transitions: only here
    from .phases import MACHINES

    out.write(mermaid(MACHINES[call.options.machine]))
    return EXIT_OK


def _sim_path(call: Invocation, out: TextIO, err: TextIO) -> int:
    return _artifact("sim_library_dir", out, err)


def _shim_path(call: Invocation, out: TextIO, err: TextIO) -> int:
    return _artifact("shim_library", out, err)


def _criu(call: Invocation, out: TextIO, err: TextIO) -> int:
    from . import criu_action  # its verbs' own parser

    return criu_action.main(
        _early_logging_to(call.options), stdout=out, stderr=err, native=call.given
    )


def _job(call: Invocation, out: TextIO, err: TextIO) -> int:
    from . import job_action  # its verbs' own parser

    return job_action.main(
        _early_logging_to(call.options), stdout=out, stderr=err, native=call.given
    )


def _check(call: Invocation, out: TextIO, err: TextIO) -> int:
    from . import check

    return check.run(
        control_dir=call.control_dir, driver=call.options.driver, as_json=call.options.json,
        out=out, quiet=call.options.quiet,
    )  # fmt: skip


# Each verb: the options it adds to its parser, and what runs it (set_defaults(func=...)).
_COMMANDS: Final[dict[str, tuple[Callable[[argparse.ArgumentParser], None], Run]]] = {
    "suspend": (_suspend_options, _suspend),
    "resume": (_resume_options, _resume),
    "status": (_status_options, _status),
    "host-copy": (_host_copy_options, _host_copy),
    "check": (_check_options, _check),
    "launch": (_launch_options, lambda c, o, e: _launch(c.options, e)),
    "prepare": (_prepare_options, _prepare),
    "restore": (_restore_options, _restore),
    "recover": (_restore_options, _recover),
    "native": (_native_options, _native),
    "inspect": (_inspect_options, _inspect),
    "diagram": (_diagram_options, _diagram),
    "replay": (_replay_options, _replay),
    "sim-path": (_no_options, _sim_path),
    "shim-path": (_no_options, _shim_path),
    "criu": (_verbs_options, _criu),
    "job": (_verbs_options, _job),
    "demo": (_demo_options, lambda c, o, e: _demo(c.options, e)),
}
