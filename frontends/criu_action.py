"""``cuinterpose criu ...``: the round trip through CRIU from the command line.

- ``check``: which CRIU would be used, and whether ``criu check`` passes.
- ``dump``: suspend the group, then ``criu dump -t TREE`` (a failed dump resumes it).
- ``restore``: free the group's socket paths, ``criu restore -d``, then resume the
  processes CRIU recreated (found under the restored root by namespace pid).
- ``action-script --out FILE``: write an executable for ``criu dump/restore
  --action-script FILE`` that runs ``action`` with the arguments given here.
- ``action``: what that script runs, by ``$CRTOOLS_SCRIPT_ACTION``: ``pre-dump``
  suspends (and stores the staged GPU bytes beside the images), ``post-dump`` seals
  the images (``$CRTOOLS_IMAGE_DIR``) with the manifest, ``pre-restore`` checks the
  images against it and frees the socket paths, ``post-resume`` resumes the processes
  under ``$CRTOOLS_INIT_PID`` (the resume fetches the stored bytes back); every other
  action does nothing.

The same command line as the other verbs (frontends/arguments.py): ``--pid P`` or
``--process OBSERVED NS``, ``--driver auto|sim|system`` (auto: the driver the shims
report; for a restore, asked once CRIU recreated them), ``-v``/``-q``/``--log-file``,
and the one exit-status table (``EXIT_TABLE``). CRIU ignores a failed
``post-resume``: after ``criu restore --action-script``, check the manifest's
``resumed_at`` or ``cuinterpose status``. Output: lines for a person on a terminal,
JSON lines otherwise (``--progress``, ``--json``), whose last is a summary with the
outcome and the exit code.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Final, TextIO

from . import drivers, logs, targets
from .arguments import (
    CONTROL_DIR_ENV,
    DEFAULT_CONTROL_DIR,
    EXIT_FAILED,
    EXIT_NEEDS_RECOVER,
    EXIT_OK,
    EXIT_ROLLED_BACK,
    EXIT_TABLE,
    EXIT_USAGE,
    Formatter,
    Parser,
    UsageError,
    add_control_dir,
    add_driver,
    add_gpu_map,
    add_processes,
    add_step_timeout,
    missing,
    pid,
    seconds,
    step_timeout,
    tidy_refused,
    verb_adder,
)
from .engine import agent, criu
from .engine import images as criu_images
from .engine.client import Endpoint
from .engine.errors import CoordinatorError
from .engine.native_checkpoint import NativeBackend, NativeUnavailableError
from .engine.options import Options, default_stored_parts
from .engine.released import size
from .engine.serial import to_json
from .engine.statefile import StateFileError
from .engine.wire import STORED_MAX_PARTS
from .outcomes import Outcome, finish

PROG: Final = "cuinterpose criu"
ACTION_ENV: Final = "CRTOOLS_SCRIPT_ACTION"
ROOT_PID_ENV: Final = "CRTOOLS_INIT_PID"
IMAGES_ENV: Final = "CRTOOLS_IMAGE_DIR"
# Baked into an action script when set: CRIU runs it with CRIU's environment.
ALWAYS_KEPT: Final = ("PYTHONPATH", CONTROL_DIR_ENV)
__all__ = [
    "ACTION_ENV",
    "ALWAYS_KEPT",
    "EXIT_FAILED",
    "EXIT_NEEDS_RECOVER",
    "EXIT_OK",
    "EXIT_ROLLED_BACK",
    "EXIT_USAGE",
    "ROOT_PID_ENV",
    "build_parser",
    "main",
    "write_action_script",
]

_OUTCOMES: Final = {
    EXIT_OK: "done",
    EXIT_FAILED: "refused or failed: the group runs as before",
    EXIT_ROLLED_BACK: "failed and rolled back: the group runs",
    EXIT_NEEDS_RECOVER: "failed: the group does not run as before",
}
_CHECK_EXITS: Final = (
    "exit status:\n  0  CRIU is usable\n  1  it is not (stderr says why)\n  2  usage error"
)
# (one line, example, exit status) of every verb.
_VERBS: Final = {
    "check": (
        "which CRIU, and does `criu check` pass; without a usable one (4.0 or later), what "
        "to install and where the spec says more",
        "cuinterpose criu check",
        _CHECK_EXITS,
    ),
    "dump": (
        "suspend the group, then criu dump its process tree (a failed dump resumes it)",
        "cuinterpose criu dump --checkpoint-dir /var/ckpt/job --images-dir /var/img/job "
        "--tree 4242 --pid 4242 --pid 4243",
        EXIT_TABLE,
    ),
    "restore": (
        "criu restore the tree, then resume the processes it recreated (from the manifest)",
        "cuinterpose criu restore --checkpoint-dir /var/ckpt/job --images-dir /var/img/job",
        EXIT_TABLE,
    ),
    "action-script": (
        "write an executable for criu dump/restore --action-script",
        "cuinterpose criu action-script --out /var/ckpt/action --checkpoint-dir /var/ckpt/job "
        "--pid 4242\n  criu dump -t 4242 -D /var/img/job --action-script /var/ckpt/action",
        EXIT_TABLE,
    ),
    "action": (
        "what the action script runs, per $CRTOOLS_SCRIPT_ACTION (pre-dump, post-dump, "
        "pre-restore, post-resume)",
        "CRTOOLS_SCRIPT_ACTION=pre-dump cuinterpose criu action --checkpoint-dir DIR --pid 4242",
        EXIT_TABLE,
    ),
}


# ----------------------------------------------------------------------------- parser
def stored_parts(text: str) -> int:
    try:
        value = int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of files") from None
    if not 1 <= value <= STORED_MAX_PARTS:
        raise argparse.ArgumentTypeError(f"{text!r} is not 1 to {STORED_MAX_PARTS} files")
    return value


def _criu_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--criu", help=f"the criu binary (default ${criu.CRIU_ENV}, else PATH)")


def _output_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--progress",
        choices=("auto", "human", "json", "none"),
        default="auto",
        help="auto: human on a terminal, JSON lines otherwise",
    )
    parser.add_argument("--json", action="store_true", help="the same as --progress json")


def _group_options(
    parser: argparse.ArgumentParser, *, processes: bool, restores: bool = True
) -> None:
    parser.add_argument(
        "--checkpoint-dir",
        type=Path,
        required=True,
        help="where the manifest and the state file are kept",
    )
    add_control_dir(parser)
    if processes:
        add_processes(parser)
        parser.add_argument(
            "--not-requested",
            action="store_true",
            help="the group did not opt in: native checkpoint only",
        )
    add_driver(parser)
    if restores:
        parser.add_argument(
            "--before-restore-dir",
            type=Path,
            metavar="DIR",
            help="the control directory as seen here before the processes exist "
            "(default: the control directory, unless --proc-root)",
        )
    add_step_timeout(parser)
    _output_options(parser)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog=PROG,
        description="The round trip through CRIU (specs/criu.md)",
        formatter_class=Formatter,
        epilog=EXIT_TABLE,
    )
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    sub = verb_adder(verbs, _VERBS)

    check = sub("check")
    _criu_option(check)
    check.add_argument("--json", action="store_true", help="print JSON instead of a line")
    dump = sub("dump")
    _group_options(dump, processes=True, restores=False)
    dump.add_argument("--images-dir", type=Path, required=True, help="where CRIU's images go")
    dump.add_argument("--tree", type=pid, required=True, help="the root of the tree to dump")
    dump.add_argument(
        "--lock-timeout",
        type=seconds,
        metavar="SECONDS",
        default=agent.DEFAULT_LOCK_TIMEOUT_MS / 1000,
        help="how long each native lock may wait for the process's CUDA calls to drain",
    )
    dump.add_argument(
        "--bytes-in-images",
        action="store_true",
        help="leave the staged GPU bytes to CRIU's images instead of files of the "
        "checkpoint directory, written by the shims in parallel (the default)",
    )
    dump.add_argument(
        "--stored-parts",
        type=stored_parts,
        metavar="N",
        help=f"the files each process's staged GPU bytes go to, one writer thread each "
        f"(1 to {STORED_MAX_PARTS}; default min(16, CPUs): one per shim copy thread)",
    )
    restore = sub("restore")
    _group_options(restore, processes=False)
    restore.add_argument("--images-dir", type=Path, required=True, help="CRIU's images")
    add_gpu_map(restore)
    for verb in (dump, restore):
        _criu_option(verb)
        verb.add_argument(
            "--criu-timeout",
            type=seconds,
            metavar="SECONDS",
            default=criu.DEFAULT_CRIU_TIMEOUT_S,
            help="how long criu may run before it is killed (a dump's group is resumed then)",
        )
        verb.add_argument("criu_args", nargs=argparse.REMAINDER, metavar="-- CRIU_ARGS...")
    script = sub("action-script")
    _group_options(script, processes=True)
    script.add_argument("--out", type=Path, required=True, help="the script to write")
    script.add_argument(
        "--keep-env",
        action="append",
        default=[],
        metavar="NAME",
        help="bake this variable's value into the script (repeatable)",
    )
    _group_options(sub("action"), processes=True)
    return parser


# ----------------------------------------------------------------------------- helpers
def _origin(args: argparse.Namespace) -> agent.Origin | None:
    """Where a restore's manifest says the group lived (None: it says nowhere)."""
    try:
        return agent.read_manifest(args.checkpoint_dir).origin
    except agent.ManifestError:
        return None  # the verb reads it again and says what is wrong with it


def _where(args: argparse.Namespace, environ: Mapping[str, str]) -> agent.Where:
    """--control-dir or --proc-root, else (restore) where the manifest says the group
    lived, else $SNAPSHOT_CONTROL_DIR, else the default."""
    if args.control_dir is None and args.verb == "restore":
        origin = _origin(args)
        if origin is not None:
            root = None if origin.proc_root is None else Path(origin.proc_root)
            return agent.Where(origin.control_dir, args.proc_root or root, args.trust_uid)
    control = args.control_dir
    if control is None:
        control = Path(environ.get(CONTROL_DIR_ENV) or DEFAULT_CONTROL_DIR)
    return agent.Where(control, args.proc_root, args.trust_uid)


def _native(
    args: argparse.Namespace,
    where: agent.Where,
    processes: Callable[[], Sequence[agent.Process]],
    given: NativeBackend | None,
) -> NativeBackend:
    """The caller's native calls if it gave its own, else those on the driver ``--driver``
    names; ``auto`` asks the shims of ``processes`` at the first call (a restore's exist
    only once CRIU recreated them)."""
    if given is not None:
        return given

    def recorded() -> str | None:
        origin = _origin(args) if args.verb == "restore" else None
        return None if origin is None else origin.driver

    def endpoints() -> list[Endpoint]:
        return [where.endpoint(p) for p in processes()]

    return drivers.LateBackend(args.driver, endpoints, recorded, proc_root=args.proc_root)


def _before_dir(args: argparse.Namespace, where: agent.Where) -> Path | None:
    if args.before_restore_dir is not None:
        return Path(args.before_restore_dir)
    return None if args.proc_root is not None else where.control_dir


def _processes(args: argparse.Namespace) -> list[agent.Process]:
    try:
        pairs = targets.named(args.pid, args.process)
    except targets.TargetError as error:
        raise UsageError("\n".join(f"{PROG}: error: {line}" for line in error.lines)) from None
    if not pairs:
        raise UsageError(
            f"{PROG}: error: no process named: give --pid PID (or --process OBSERVED_PID "
            "NAMESPACE_PID)"
        )
    return [agent.Process(o, n) for o, n in pairs]


def _criu_args(given: Sequence[str]) -> list[str]:
    return list(given[1:] if given[:1] == ["--"] else given)


def _mode(args: argparse.Namespace, stream: TextIO) -> str:
    if args.json:
        return "json"
    if args.progress == "auto":
        return "human" if stream.isatty() else "json"
    return str(args.progress)


@contextlib.contextmanager
def _events(mode: str, stream: TextIO) -> Iterator[agent.AgentCallback | None]:
    """The callback of the run's events: JSON lines, a person's view (rich), or none."""
    if mode == "json":

        def emit(event: agent.AgentEvent) -> None:
            with contextlib.suppress(OSError):  # a closed stdout must not stop a checkpoint
                stream.write(json.dumps(to_json(event), allow_nan=False) + "\n")
                stream.flush()

        yield emit
    elif mode == "human":
        from . import render  # rich: only for a person's output

        view = render.HumanView(stream)
        with view.live():
            yield view
    else:
        yield None


def _finish(
    args: argparse.Namespace,
    stdout: TextIO,
    stderr: TextIO,
    code: int,
    lines: Sequence[str] = (),
    **summary: Any,
) -> int:
    """Say how the verb ended once (frontends/outcomes.py): the lines on stderr, and with
    JSON output one summary line with the outcome and the exit code; ``outcome`` and
    ``human`` (the lines a person reads) are the summary's own keywords."""
    outcome = str(summary.pop("outcome", ""))
    human = summary.pop("human", ())
    ended = Outcome(code, outcome, lines, summary, human)
    mode = str(getattr(args, "mode", ""))
    return finish(f"criu {args.verb}", mode, ended, stdout, stderr, prog=PROG, outcomes=_OUTCOMES)


def _seconds(timings: Sequence[agent.Timing]) -> float:
    return sum(t.seconds for t in timings)


def write_action_script(
    path: Path, argv: Sequence[str], environ: Mapping[str, str], keep: Sequence[str]
) -> Path:
    """An executable ``path`` running ``python -m cuinterpose.criu_action action ARGV``
    with the variables ``keep`` (and ``ALWAYS_KEPT``) as they are now: CRIU runs an
    action script with no arguments, in CRIU's own environment."""
    lines = [
        "#!/bin/sh",
        "# cuinterpose's action script for criu dump/restore --action-script (specs/criu.md):",
        "# pre-dump suspends, post-dump seals the images, pre-restore checks them and frees",
        "# the sockets' paths, post-resume resumes.",
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


def _where_words(args: argparse.Namespace, where: agent.Where) -> list[str]:
    """What a printed command needs to find the group from a plain shell: the control
    directory or proc root, the driver, when they are not the defaults."""
    words: list[str] = []
    if where.proc_root is not None:
        words += ["--proc-root", str(where.proc_root)]
    if where.control_dir != DEFAULT_CONTROL_DIR:
        words += ["--control-dir", str(where.control_dir)]
    if args.trust_uid is not None:
        words += ["--trust-uid", str(args.trust_uid)]
    if args.driver != "auto":
        words += ["--driver", args.driver]
    return words


def _script_argv(args: argparse.Namespace, processes: Sequence[agent.Process]) -> list[str]:
    words = ["--checkpoint-dir", str(args.checkpoint_dir.resolve())]
    if args.control_dir is not None:
        words += ["--control-dir", str(args.control_dir)]
    if args.proc_root is not None:
        words += ["--proc-root", str(args.proc_root)]
    if args.trust_uid is not None:
        words += ["--trust-uid", str(args.trust_uid)]
    if args.before_restore_dir is not None:
        words += ["--before-restore-dir", str(args.before_restore_dir)]
    for p in processes:
        words += ["--process", str(p.observed_pid), str(p.namespace_pid)]
    if args.not_requested:
        words.append("--not-requested")
    words += ["--driver", args.driver, "--progress", "json" if args.json else args.progress]
    if args.step_timeout is not None:
        words += ["--step-timeout", str(args.step_timeout)]
    words += ["-v"] * args.verbose + (["-q"] if args.quiet else [])
    if args.log_file is not None:
        words += ["--log-file", str(args.log_file.resolve())]
    return words


# ----------------------------------------------------------------------------- verbs
def _check(
    args: argparse.Namespace,
    environ: Mapping[str, str],
    stdout: TextIO,
    stderr: TextIO,
    native: NativeBackend | None,
) -> int:
    try:
        found = criu.usable_criu(args.criu, environ)
    except criu.CriuUnavailable as exc:
        if args.json:  # one line, the summary, as every verb's JSON ends
            document = {"event": "summary", "command": "criu check", "usable": False,
                        "reason": str(exc), "outcome": "refused",
                        "exit_code": EXIT_FAILED}  # fmt: skip
            stdout.write(json.dumps(document) + "\n")
        stderr.write(f"{PROG}: {exc}\n")
        return EXIT_FAILED
    if args.json:
        version = ".".join(str(n) for n in found.version)
        document = {"event": "summary", "command": "criu check", "usable": True,
                    "criu": str(found.path), "version": version, "outcome": "done",
                    "exit_code": EXIT_OK}  # fmt: skip
        stdout.write(json.dumps(document) + "\n")
    else:
        stdout.write(f"{found.describe()}: `criu check` passes\n")
    return EXIT_OK


def _dump(
    args: argparse.Namespace,
    environ: Mapping[str, str],
    stdout: TextIO,
    stderr: TextIO,
    native: NativeBackend | None,
) -> int:
    processes = _processes(args)
    binary = criu.usable_criu(args.criu, environ)
    where = _where(args, environ)
    with _events(args.mode, stdout) as on_event:
        done = criu.dump(
            processes,
            args.checkpoint_dir,
            args.images_dir,
            tree=args.tree,
            criu=binary,
            where=where,
            native=_native(args, where, lambda: processes, native),
            requested=not args.not_requested,
            options=Options(
                phase_timeout=step_timeout(args.step_timeout, environ),
                stored_parts=args.stored_parts or default_stored_parts(),
            ),
            lock_timeout_ms=int(args.lock_timeout * 1000),
            criu_args=_criu_args(args.criu_args),
            on_event=on_event,
            criu_timeout_s=args.criu_timeout,
            bytes_beside=not args.bytes_in_images,
        )
    restore = shlex.join(
        [
            "cuinterpose", "criu", "restore", "--checkpoint-dir", str(args.checkpoint_dir),
            "--images-dir", str(args.images_dir), *_where_words(args, where),
        ]
    )  # fmt: skip
    who = f"{len(processes)} process{'es' if len(processes) != 1 else ''}"
    human = [
        f"dumped {who} (the tree of pid {args.tree}) in {_seconds(done.timings):.3f} s: "
        f"{args.images_dir} holds {size(done.images.total)} of images "
        f"({size(done.images.pages)} of memory pages"
        f"{', the GPU memory among them' if args.bytes_in_images else ''}), "
        f"{args.checkpoint_dir} the manifest, the state file"
        f"{'' if args.bytes_in_images else ' and the GPU memory (staged-*.bin)'}",
        f"next: {restore}",
    ]
    return _finish(args, stdout, stderr, EXIT_OK, outcome="dumped",
                   timings=[to_json(t) for t in done.timings],
                   images=to_json(done.images), next=restore, human=human)  # fmt: skip


def _restore(
    args: argparse.Namespace,
    environ: Mapping[str, str],
    stdout: TextIO,
    stderr: TextIO,
    native: NativeBackend | None,
) -> int:
    binary = criu.usable_criu(args.criu, environ)
    where = _where(args, environ)

    def recorded() -> Sequence[agent.Process]:
        return agent.read_manifest(args.checkpoint_dir).processes()

    with _events(args.mode, stdout) as on_event:
        done = criu.restore(
            args.checkpoint_dir,
            args.images_dir,
            criu=binary,
            where=where,
            native=_native(args, where, recorded, native),
            control_dir=_before_dir(args, where),
            options=Options(phase_timeout=step_timeout(args.step_timeout, environ)),
            criu_args=_criu_args(args.criu_args),
            gpu_map=args.gpu_map,
            on_event=on_event,
            criu_timeout_s=args.criu_timeout,
        )
    restored = [
        {"observed_pid": p.observed_pid, "namespace_pid": p.namespace_pid} for p in done.processes
    ]
    pids = ", ".join(p.describe() for p in done.processes)
    human = [
        f"restored {len(done.processes)} process{'es' if len(done.processes) != 1 else ''} "
        f"from {args.images_dir} in {_seconds(done.timings):.3f} s: every process is RUNNING, "
        f"its GPU memory and sharing as before ({pids})",
        *(f"onto other GPUs: {m.describe()}" for m in done.resumed.moved),
    ]
    moved = {"gpus_moved": [to_json(m) for m in done.resumed.moved]} if args.gpu_map else {}
    return _finish(args, stdout, stderr, EXIT_OK, outcome="restored",
                   timings=[to_json(t) for t in done.timings], images=to_json(done.images),
                   processes=restored, removed=[str(p) for p in done.removed],
                   human=human, **moved)  # fmt: skip


def _action_script(
    args: argparse.Namespace,
    environ: Mapping[str, str],
    stdout: TextIO,
    stderr: TextIO,
    native: NativeBackend | None,
) -> int:
    processes = _processes(args)
    path = write_action_script(args.out, _script_argv(args, processes), environ, args.keep_env)
    stdout.write(f"{path}\n")
    return EXIT_OK


def _action(
    args: argparse.Namespace,
    environ: Mapping[str, str],
    stdout: TextIO,
    stderr: TextIO,
    native: NativeBackend | None,
) -> int:
    step = environ.get(ACTION_ENV, "")
    where = _where(args, environ)
    options = Options(phase_timeout=step_timeout(args.step_timeout, environ))
    processes = _processes(args)
    if step == "pre-dump":
        named = environ.get(IMAGES_ENV)
        images = Path(os.path.realpath(named)) if named else None
        criu_images.private_directory(args.checkpoint_dir, "pre-dump", "checkpoint directory")
        if images is not None:  # CRIU made it: it must be trusted, and holds no old seal
            criu_images.private_directory(images, "pre-dump", "images directory")
            criu_images.forget(images)
        with _events(args.mode, stdout) as on_event:
            agent.suspend(
                processes,
                args.checkpoint_dir,
                where=where,
                native=_native(args, where, lambda: processes, native),
                requested=not args.not_requested,
                options=options,
                on_event=on_event,
                store_beside=True,
            )
        return _finish(args, stdout, stderr, EXIT_OK, outcome="suspended", step=step)
    if step == "post-dump":
        # CRIU names its images directory by its own descriptor: /proc/<criu>/fd/<n>.
        images = Path(os.path.realpath(environ[IMAGES_ENV])) if environ.get(IMAGES_ENV) else None
        if images is None:
            unsealed = f"post-dump: ${IMAGES_ENV} is not set: the images are not sealed"
            return _finish(args, stdout, stderr, EXIT_FAILED, [unsealed])
        try:
            criu_images.seal(images, args.checkpoint_dir)
        except (OSError, StateFileError) as exc:
            resume = shlex.join(["cuinterpose", "resume", "--checkpoint-dir",
                                 str(args.checkpoint_dir)])  # fmt: skip
            return _finish(args, stdout, stderr, EXIT_FAILED, [
                f"post-dump: the images in {images} could not be sealed: {exc}",
                f"criu leaves the tree running, suspended: {resume}"])  # fmt: skip
        return _finish(args, stdout, stderr, EXIT_OK, step=step, images=str(images))
    if step == "pre-restore":
        named = environ.get(IMAGES_ENV)
        images = Path(os.path.realpath(named)) if named else None
        done = criu.before_restore(args.checkpoint_dir, _before_dir(args, where), images)
        for path in done.removed:
            stderr.write(f"{PROG}: removed the stale socket {path}\n")
        return _finish(args, stdout, stderr, EXIT_OK, step=step,
                       removed=[str(p) for p in done.removed])  # fmt: skip
    if step == "post-resume":
        root = environ.get(ROOT_PID_ENV, "")
        if not root.isdigit():
            return _finish(args, stdout, stderr, EXIT_FAILED,
                           [f"post-resume: ${ROOT_PID_ENV} is {root!r}, not a pid"])  # fmt: skip
        manifest = agent.read_manifest(args.checkpoint_dir)
        located = criu.locate(manifest.processes(), int(root))
        with _events(args.mode, stdout) as on_event:
            agent.resume(
                args.checkpoint_dir,
                where=where,
                native=_native(args, where, lambda: located, native),
                processes=located,
                restored=True,
                options=options,
                on_event=on_event,
            )
        return _finish(args, stdout, stderr, EXIT_OK, outcome="resumed", step=step)
    return EXIT_OK  # another action of CRIU's: nothing to do


_RUN: Final = {
    "check": _check,
    "dump": _dump,
    "restore": _restore,
    "action-script": _action_script,
    "action": _action,
}


def main(
    argv: Sequence[str] | None = None,
    *,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
    environ: Mapping[str, str] | None = None,
    native: NativeBackend | None = None,
) -> int:
    """Run one ``criu`` command line; ``native``: the native calls to make instead of
    those on the driver ``--driver`` names (an embedder's backend, a test's fake)."""
    out = stdout if stdout is not None else sys.stdout
    err = stderr if stderr is not None else sys.stderr
    env = os.environ if environ is None else environ
    try:
        try:
            args = build_parser().parse_args(argv)
        except SystemExit as exit_:  # --help
            return int(exit_.code or 0) if isinstance(exit_.code, int | None) else EXIT_USAGE
        if hasattr(args, "progress"):
            args.mode = _mode(args, out)
        logs.configure(verbosity=args.verbose, quiet=args.quiet, log_file=args.log_file,
                       stream=err)  # fmt: skip
        created = missing(args.checkpoint_dir, args.images_dir) if args.verb == "dump" else []
        try:
            code = _ended(args, env, out, err, native)
            tidy_refused(created, code)
            return code
        finally:
            logs.reset()
    except UsageError as exc:
        err.write(f"{exc}\n")
        return EXIT_USAGE


def _ended(
    args: argparse.Namespace,
    env: Mapping[str, str],
    out: TextIO,
    err: TextIO,
    native: NativeBackend | None,
) -> int:
    """Run the verb; every failure is said once, with the exit status of EXIT_TABLE."""
    try:
        return _RUN[args.verb](args, env, out, err, native)
    except criu.CriuUnavailable as exc:
        return _finish(args, out, err, EXIT_FAILED, [str(exc)], outcome="refused")
    except (criu.CriuDumpFailed, agent.SuspendFailed) as failed:
        code = EXIT_FAILED if failed.restored else EXIT_NEEDS_RECOVER
        return _finish(args, out, err, code, failed.lines())
    except agent.ResumeFailed as failed:
        code = EXIT_ROLLED_BACK if failed.running else EXIT_NEEDS_RECOVER
        return _finish(args, out, err, code, failed.lines())
    except agent.AgentError as error:
        code = EXIT_NEEDS_RECOVER if error.changed else EXIT_FAILED
        return _finish(args, out, err, code, error.lines())
    except CoordinatorError as error:
        lines = list(error.lines())
        if args.verbose:
            lines += [f"detail: {line}" for line in error.details()]
        if error.destroyed and not error.rolled_back:
            return _finish(args, out, err, EXIT_NEEDS_RECOVER, lines)
        # A capture rolled back (or refused) inside a suspend: the group runs as it was.
        return _finish(args, out, err, EXIT_FAILED, lines)
    except NativeUnavailableError as exc:
        lines = [str(exc), "to see what this machine offers: cuinterpose check"]
        return _finish(args, out, err, EXIT_FAILED, lines, outcome="refused")
    except OSError as exc:
        where = f"{exc.filename}: " if exc.filename else ""
        return _finish(args, out, err, EXIT_FAILED, [f"{args.verb}: {where}{exc.strerror or exc}"])


if __name__ == "__main__":
    sys.exit(main())
