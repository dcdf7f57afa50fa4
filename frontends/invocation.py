"""The group a verb names and where it lives, worked out once from the parsed options:
the processes (named, else the checkpoint directory's, else for ``status`` every shim of
the control directory), the control directory or proc root (the manifest's origin unless
the command line says otherwise), the driver the native calls load, and the commands
printed for a person to run next from a plain shell.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
from pathlib import Path
from typing import TYPE_CHECKING

from . import targets
from .arguments import CONTROL_DIR_ENV, DEFAULT_CONTROL_DIR, UsageError
from .outcomes import PROG

# The engine's modules are imported where they are used: a command loads only what its
# verb needs (tests/engine/test_import_cost.py).
if TYPE_CHECKING:
    from .engine import agent
    from .engine.client import Endpoint
    from .engine.native import NativeBackend, NativeUnavailableError


def env_control_dir() -> Path:
    value = os.environ.get(CONTROL_DIR_ENV, "")
    return Path(value) if value else DEFAULT_CONTROL_DIR


def control_dir(args: argparse.Namespace) -> Path:
    given: Path | None = getattr(args, "control_dir", None)
    return given if given is not None else env_control_dir()


def resolve_group(args: argparse.Namespace) -> None:
    """``args.group``: the processes named, else the ones the checkpoint directory (or,
    for status, the control directory) holds; usage errors as such."""
    try:
        given = targets.named(args.pid, args.process)
        if args.command == "status" and not given:
            args.group = targets.shims(where(args))
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


def endpoints(args: argparse.Namespace) -> list[Endpoint]:
    from .engine.client import endpoint_for

    try:
        return [
            endpoint_for(o, n, control_dir=control_dir(args), proc_root=args.proc_root)
            for o, n in args.group
        ]
    except ValueError as exc:
        raise UsageError(f"{PROG}: error: {exc}") from None


def _native_backend() -> NativeBackend | None:
    """The tests' hook for a backend of their own; None: the driver (below)."""
    return None


def native(args: argparse.Namespace) -> NativeBackend:
    """The native calls on the driver ``--driver`` names, chosen at the first call (the
    shims are asked then, as the architecture says: late): a verb that refuses first
    never asks."""
    from . import drivers

    injected = _native_backend()
    if injected is not None:
        return injected
    return drivers.LateBackend(
        getattr(args, "driver", "auto"),
        lambda: endpoints(args),
        lambda: getattr(args, "recorded", None),
        proc_root=getattr(args, "proc_root", None),
    )


def no_driver(command: str, exc: NativeUnavailableError) -> list[str]:
    return [
        f"{command}: {exc}",
        f"to see what this machine offers: {PROG} check",
    ]


def where(args: argparse.Namespace) -> agent.Where:
    from .engine.detection import Where

    return Where(control_dir(args), args.proc_root)


def processes(args: argparse.Namespace) -> list[agent.Process]:
    from .engine.manifest import Process

    endpoints(args)  # the same usage checks as every other command
    return [Process(observed, namespace) for observed, namespace in args.group]


def status_command(args: argparse.Namespace) -> str:
    return shlex.join([PROG, "status", *where_words(args)])


def where_words(args: argparse.Namespace, *, driver: bool = True) -> list[str]:
    """What a printed command needs to find the group from a plain shell (no
    ``$SNAPSHOT_CONTROL_DIR``): the control directory or proc root, the driver, when
    they are not the defaults."""
    words: list[str] = []
    if getattr(args, "proc_root", None) is not None:
        words += ["--proc-root", str(args.proc_root)]
    elif control_dir(args) != DEFAULT_CONTROL_DIR:
        words += ["--control-dir", str(control_dir(args))]
    if driver and getattr(args, "driver", "auto") != "auto":
        words += ["--driver", args.driver]
    return words


def recover_command(args: argparse.Namespace) -> str:
    words = [PROG, "recover", "--checkpoint-dir", str(args.checkpoint_dir), *where_words(args)]
    for observed, namespace in args.group:
        words += ["--pid", str(observed)] if observed == namespace else [
            "--process", str(observed), str(namespace)]  # fmt: skip
    return shlex.join(words)


def take_origin(args: argparse.Namespace) -> None:
    """resume, restore and recover reach the group where its manifest says it lives (and
    load the driver its shims reported), unless --control-dir or --proc-root say
    otherwise; what is taken is said at debug level."""
    from .engine.manifest import MANIFEST_FILE_NAME, ManifestError, read_manifest

    directory = getattr(args, "checkpoint_dir", None)
    if args.command not in ("resume", "restore", "recover", "native") or directory is None:
        return
    if not (Path(directory) / MANIFEST_FILE_NAME).is_file():
        return
    try:
        origin = read_manifest(directory).origin
    except ManifestError:
        return  # the verb itself reads it again, and says what is wrong with it
    if origin is None:
        return
    args.recorded = origin.driver
    if args.control_dir is None and args.proc_root is None:
        if origin.proc_root is not None:
            args.proc_root = Path(origin.proc_root)
        args.control_dir = Path(origin.control_dir)
        logging.getLogger("cuinterpose.cli").debug(
            "the group lives where %s/manifest.json says: %s", directory, where(args)
        )
