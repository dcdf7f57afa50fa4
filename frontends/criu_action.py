"""``cuinterpose criu ...``: the round trip through CRIU from the command line.

- ``check``: which CRIU would be used, and whether ``criu check`` passes.
- ``dump``: suspend the group, then ``criu dump -t TREE`` (a failed dump resumes it).
- ``restore``: free the group's socket paths, ``criu restore -d``, then resume the
  processes CRIU recreated (found under the restored root by namespace pid).
- ``action-script --out FILE``: write an executable for ``criu dump/restore
  --action-script FILE`` that runs ``action`` with the arguments given here.
- ``action``: what that script runs, by ``$CRTOOLS_SCRIPT_ACTION``: ``pre-dump``
  suspends, ``pre-restore`` frees the socket paths, ``post-resume`` resumes the
  processes under ``$CRTOOLS_INIT_PID``; every other action does nothing.

Exit status as the other verbs (frontends/cli.py): 0 done; 1 refused, or failed
with the group as it was; 2 usage; 4 failed and the group does not run (its state
is on stderr). CRIU ignores a failed ``post-resume``: after ``criu restore
--action-script``, check the manifest's ``resumed_at`` or ``cuinterpose status``.
Events are JSON lines on stdout (``--progress none``: none), then a summary line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final, TextIO

from .arguments import Parser, UsageError, pid, seconds
from .engine import agent, criu
from .engine.errors import CoordinatorError
from .engine.native import CudaBackend, NativeBackend, NativeUnavailableError
from .engine.options import DEFAULT_PHASE_TIMEOUT_S, Options

PROG: Final = "cuinterpose criu"
CONTROL_DIR_ENV: Final = "SNAPSHOT_CONTROL_DIR"
DEFAULT_CONTROL_DIR: Final = Path("/snapshot-control")
ACTION_ENV: Final = "CRTOOLS_SCRIPT_ACTION"
ROOT_PID_ENV: Final = "CRTOOLS_INIT_PID"
EXIT_OK: Final = 0
EXIT_FAILED: Final = 1
EXIT_USAGE: Final = 2
EXIT_NEEDS_RECOVER: Final = 4
# Baked into an action script when set: CRIU runs it with CRIU's environment.
ALWAYS_KEPT: Final = ("PYTHONPATH", CONTROL_DIR_ENV)


def _group_options(
    parser: argparse.ArgumentParser, *, processes: bool, restores: bool = True
) -> None:
    parser.add_argument("--checkpoint-dir", type=Path, required=True)
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--control-dir",
        type=Path,
        help=f"the shims' control directory (default ${CONTROL_DIR_ENV}, "
        f"else {DEFAULT_CONTROL_DIR})",
    )
    where.add_argument(
        "--proc-root", type=Path, help="reach each control directory through PROC_ROOT/<pid>/root"
    )
    if processes:
        parser.add_argument(
            "--process",
            nargs=2,
            action="append",
            required=True,
            type=pid,
            metavar=("OBSERVED_PID", "NAMESPACE_PID"),
        )
        parser.add_argument(
            "--not-requested",
            action="store_true",
            help="the group did not opt in: native checkpoint only",
        )
    if restores:
        parser.add_argument(
            "--before-restore-dir",
            type=Path,
            metavar="DIR",
            help="the control directory as seen here before the processes exist "
            "(default: the control directory, unless --proc-root)",
        )
    parser.add_argument("--phase-timeout", type=seconds, default=DEFAULT_PHASE_TIMEOUT_S)
    parser.add_argument("--progress", choices=("json", "none"), default="json")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog=PROG, description="The round trip through CRIU (specs/criu.md)")
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    check = verbs.add_parser("check", help="which CRIU, and does `criu check` pass")
    for sub in (check,):
        sub.add_argument("--criu", help=f"the criu binary (default ${criu.CRIU_ENV}, else PATH)")
    dump = verbs.add_parser("dump", help="suspend, then criu dump")
    _group_options(dump, processes=True, restores=False)
    dump.add_argument("--images-dir", type=Path, required=True)
    dump.add_argument("--tree", type=pid, required=True, help="the root of the tree to dump")
    dump.add_argument("--lock-timeout", type=seconds, default=agent.DEFAULT_LOCK_TIMEOUT_MS / 1000)
    restore = verbs.add_parser("restore", help="criu restore, then resume")
    _group_options(restore, processes=False)
    restore.add_argument("--images-dir", type=Path, required=True)
    for sub in (dump, restore):
        sub.add_argument("--criu", help=f"the criu binary (default ${criu.CRIU_ENV}, else PATH)")
        sub.add_argument("criu_args", nargs=argparse.REMAINDER, metavar="-- CRIU_ARGS...")
    script = verbs.add_parser("action-script", help="write an action script for criu")
    _group_options(script, processes=True)
    script.add_argument("--out", type=Path, required=True)
    script.add_argument(
        "--keep-env",
        action="append",
        default=[],
        metavar="NAME",
        help="bake this variable's value into the script (repeatable)",
    )
    action = verbs.add_parser("action", help="run by the action script, per $CRTOOLS_SCRIPT_ACTION")
    _group_options(action, processes=True)
    return parser


# ----------------------------------------------------------------------------- helpers
def _where(args: argparse.Namespace, environ: Mapping[str, str]) -> agent.Where:
    control = args.control_dir
    if control is None:
        control = Path(environ.get(CONTROL_DIR_ENV) or DEFAULT_CONTROL_DIR)
    return agent.Where(control, args.proc_root)


def _before_dir(args: argparse.Namespace, where: agent.Where) -> Path | None:
    if args.before_restore_dir is not None:
        return Path(args.before_restore_dir)
    return None if args.proc_root is not None else where.control_dir


def _processes(args: argparse.Namespace) -> list[agent.Process]:
    group = [agent.Process(o, n) for o, n in args.process]
    for p in group:
        if group.count(p) > 1:
            raise UsageError(
                f"{PROG}: error: --process {p.observed_pid} {p.namespace_pid} is given twice"
            )
    return group


def _criu_args(given: Sequence[str]) -> list[str]:
    return list(given[1:] if given[:1] == ["--"] else given)


def _events(mode: str, stream: TextIO) -> agent.AgentCallback | None:
    if mode == "none":
        return None

    def emit(event: agent.AgentEvent) -> None:
        with contextlib.suppress(OSError):  # a closed stdout must not stop a checkpoint
            stream.write(json.dumps(event.to_json(), allow_nan=False) + "\n")
            stream.flush()

    return emit


def _summary(stream: TextIO, verb: str, timings: Sequence[agent.Timing], **more: Any) -> None:
    with contextlib.suppress(OSError):
        line = {
            "event": "summary",
            "command": f"criu {verb}",
            "timings": [t.to_json() for t in timings],
            **more,
        }
        stream.write(json.dumps(line) + "\n")
        stream.flush()


def _fail(lines: Sequence[str], stderr: TextIO, status: int = EXIT_FAILED) -> int:
    for line in lines:
        stderr.write(f"{PROG}: {line}\n")
    stderr.flush()
    return status


def native_backend() -> NativeBackend:
    return CudaBackend()


def write_action_script(
    path: Path, argv: Sequence[str], environ: Mapping[str, str], keep: Sequence[str]
) -> Path:
    """An executable ``path`` running ``python -m cuinterpose.criu_action action ARGV``
    with the variables ``keep`` (and ``ALWAYS_KEPT``) as they are now: CRIU runs an
    action script with no arguments, in CRIU's own environment."""
    lines = [
        "#!/bin/sh",
        "# cuinterpose's action script for criu dump/restore --action-script (specs/criu.md):",
        "# pre-dump suspends, pre-restore frees the sockets' paths, post-resume resumes.",
    ]
    for name in dict.fromkeys([*ALWAYS_KEPT, *keep]):
        if name in environ:
            lines.append(f"export {name}={shlex.quote(environ[name])}")
    command = [sys.executable, "-m", "cuinterpose.criu_action", "action", *argv]
    lines.append(f"exec {shlex.join(command)}")
    path = Path(path)
    path.write_text("\n".join(lines) + "\n")
    path.chmod(0o755)
    return path


def _script_argv(args: argparse.Namespace) -> list[str]:
    words = ["--checkpoint-dir", str(args.checkpoint_dir.resolve())]
    if args.control_dir is not None:
        words += ["--control-dir", str(args.control_dir)]
    if args.proc_root is not None:
        words += ["--proc-root", str(args.proc_root)]
    if args.before_restore_dir is not None:
        words += ["--before-restore-dir", str(args.before_restore_dir)]
    for observed, namespace in args.process:
        words += ["--process", str(observed), str(namespace)]
    if args.not_requested:
        words.append("--not-requested")
    words += ["--phase-timeout", str(args.phase_timeout), "--progress", args.progress]
    return words


# ----------------------------------------------------------------------------- verbs
def _check(
    args: argparse.Namespace, environ: Mapping[str, str], stdout: TextIO, stderr: TextIO
) -> int:
    try:
        found = criu.usable_criu(args.criu, environ)
    except criu.CriuUnavailable as exc:
        return _fail([str(exc)], stderr)
    stdout.write(f"{found.describe()}: `criu check` passes\n")
    return EXIT_OK


def _dump(
    args: argparse.Namespace, environ: Mapping[str, str], stdout: TextIO, stderr: TextIO
) -> int:
    processes = _processes(args)
    binary = criu.usable_criu(args.criu, environ)
    done = criu.dump(
        processes,
        args.checkpoint_dir,
        args.images_dir,
        tree=args.tree,
        criu=binary,
        where=_where(args, environ),
        native=native_backend(),
        requested=not args.not_requested,
        options=Options(phase_timeout=args.phase_timeout),
        lock_timeout_ms=int(args.lock_timeout * 1000),
        criu_args=_criu_args(args.criu_args),
        on_event=_events(args.progress, stdout),
    )
    if args.progress != "none":
        _summary(stdout, "dump", done.timings, images=done.images.to_json())
    return EXIT_OK


def _restore(
    args: argparse.Namespace, environ: Mapping[str, str], stdout: TextIO, stderr: TextIO
) -> int:
    binary = criu.usable_criu(args.criu, environ)
    where = _where(args, environ)
    done = criu.restore(
        args.checkpoint_dir,
        args.images_dir,
        criu=binary,
        where=where,
        native=native_backend(),
        control_dir=_before_dir(args, where),
        options=Options(phase_timeout=args.phase_timeout),
        criu_args=_criu_args(args.criu_args),
        on_event=_events(args.progress, stdout),
    )
    if args.progress != "none":
        restored = [
            {"observed_pid": p.observed_pid, "namespace_pid": p.namespace_pid}
            for p in done.processes
        ]
        _summary(
            stdout,
            "restore",
            done.timings,
            images=done.images.to_json(),
            processes=restored,
            removed=[str(p) for p in done.removed],
        )
    return EXIT_OK


def _action(
    args: argparse.Namespace, environ: Mapping[str, str], stdout: TextIO, stderr: TextIO
) -> int:
    step = environ.get(ACTION_ENV, "")
    where = _where(args, environ)
    on_event = _events(args.progress, stdout)
    options = Options(phase_timeout=args.phase_timeout)
    if step == "pre-dump":
        agent.suspend(
            _processes(args),
            args.checkpoint_dir,
            where=where,
            native=native_backend(),
            requested=not args.not_requested,
            options=options,
            on_event=on_event,
        )
    elif step == "pre-restore":
        done = criu.before_restore(args.checkpoint_dir, _before_dir(args, where))
        for path in done.removed:
            stderr.write(f"{PROG}: removed the stale socket {path}\n")
    elif step == "post-resume":
        root = environ.get(ROOT_PID_ENV, "")
        if not root.isdigit():
            return _fail([f"post-resume: ${ROOT_PID_ENV} is {root!r}, not a pid"], stderr)
        manifest = agent.read_manifest(args.checkpoint_dir)
        located = criu.locate(manifest.processes(), int(root))
        agent.resume(
            args.checkpoint_dir,
            where=where,
            native=native_backend(),
            processes=located,
            restored=True,
            options=options,
            on_event=on_event,
        )
    return EXIT_OK


def main(
    argv: Sequence[str] | None = None,
    *,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
    environ: Mapping[str, str] | None = None,
) -> int:
    out = stdout if stdout is not None else sys.stdout
    err = stderr if stderr is not None else sys.stderr
    env = os.environ if environ is None else environ
    try:
        try:
            args = build_parser().parse_args(argv)
        except SystemExit as exit_:  # --help
            return int(exit_.code or 0) if isinstance(exit_.code, int | None) else EXIT_USAGE
        if args.verb == "check":
            return _check(args, env, out, err)
        if args.verb == "action-script":
            _processes(args)
            path = write_action_script(args.out, _script_argv(args), env, args.keep_env)
            out.write(f"{path}\n")
            return EXIT_OK
        verbs = {"dump": _dump, "restore": _restore, "action": _action}
        return verbs[args.verb](args, env, out, err)
    except UsageError as exc:
        err.write(f"{exc}\n")
        return EXIT_USAGE
    except criu.CriuUnavailable as exc:
        return _fail([str(exc)], err)
    except (criu.CriuDumpFailed, agent.SuspendFailed) as failed:
        return _fail(failed.lines(), err, EXIT_FAILED if failed.restored else EXIT_NEEDS_RECOVER)
    except agent.ResumeFailed as failed:
        return _fail(failed.lines(), err, EXIT_NEEDS_RECOVER)
    except agent.AgentError as error:
        return _fail(error.lines(), err)
    except CoordinatorError as error:
        status = EXIT_NEEDS_RECOVER if error.destroyed and not error.rolled_back else EXIT_FAILED
        return _fail(list(error.lines()), err, status)
    except NativeUnavailableError as exc:
        return _fail([str(exc)], err)


if __name__ == "__main__":
    sys.exit(main())
