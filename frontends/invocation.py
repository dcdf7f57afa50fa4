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

import attrs

from . import targets
from .arguments import CONTROL_DIR_ENV, DEFAULT_CONTROL_DIR, UsageError
from .outcomes import PROG

# The engine's modules are imported where they are used: a command loads only what its
# verb needs (tests/engine/test_import_cost.py).
if TYPE_CHECKING:
    from .engine import agent
    from .engine.client import Endpoint
    from .engine.discovery import DriverReport
    from .engine.native_checkpoint import NativeBackend, NativeUnavailableError
    from .engine.suspension import DriverChoice


Pair = tuple[int, int]


@attrs.frozen
class Invocation:
    """One command: its parsed options, untouched, and what was worked out from them once:
    how it tells its run (``mode``), where the group lives (the command line's control
    directory or proc root, else the manifest's origin, else the environment's), the
    driver the manifest recorded, and the group itself."""

    options: argparse.Namespace
    mode: str
    control_dir: Path
    proc_root: Path | None
    recorded: str | None = None  # the driver the manifest says the shims reported
    group: tuple[Pair, ...] = ()
    given: NativeBackend | None = None  # the caller's native calls, instead of --driver's
    # The run's one Where (and so each process's one endpoint: with a proc root, its
    # control directory resolved once for every request of the run).
    _made: dict[str, agent.Where] = attrs.field(factory=dict, init=False, eq=False, repr=False)

    @property
    def command(self) -> str:
        return str(self.options.command)

    def where(self) -> agent.Where:
        from .engine.detection import Where

        made = self._made.get("where")
        if made is None:
            trust = getattr(self.options, "trust_uid", None)
            made = self._made["where"] = Where(self.control_dir, self.proc_root, trust)
        return made

    def endpoints(self) -> list[Endpoint]:
        from .engine.manifest import Process

        where = self.where()
        try:
            return [where.endpoint(Process(o, n)) for o, n in self.group]
        except ValueError as exc:
            raise UsageError(f"{PROG}: error: {exc}") from None

    def processes(self) -> list[agent.Process]:
        from .engine.manifest import Process

        self.endpoints()  # the same usage checks as every other command
        return [Process(observed, namespace) for observed, namespace in self.group]

    def native(self) -> NativeBackend:
        """The caller's native calls if it gave its own, else those on the driver
        ``--driver`` names, chosen at the first call (the shims are asked then, late): a
        verb that refuses first never asks."""
        if self.given is not None:
            return self.given
        from . import drivers

        return drivers.LateBackend(
            getattr(self.options, "driver", "auto"),
            self.endpoints,
            lambda: self.recorded,
            proc_root=self.proc_root,
        )

    def native_choice(self) -> NativeBackend | DriverChoice:
        """A suspend's native calls: the caller's, else those on the driver ``--driver``
        names, taken (``auto``) from what the shims said in the suspend's own STATUS
        round, so that the command sends them no round of its own; loaded at the first
        call, as :meth:`native`'s are."""
        from .engine.suspension import DriverChoice

        if self.given is not None:
            return self.given
        choice = getattr(self.options, "driver", "auto")

        def chosen(report: DriverReport) -> NativeBackend:
            from . import drivers  # ctypes: only once the shims have said which driver

            return drivers.LateBackend(choice, self.endpoints, lambda: self.recorded,
                                       proc_root=self.proc_root, report=report)  # fmt: skip

        return DriverChoice(chosen)

    def where_words(self, *, driver: bool = True) -> list[str]:
        """What a printed command needs to find the group from a plain shell (no
        ``$SNAPSHOT_CONTROL_DIR``): the control directory or proc root, the driver, when
        they are not the defaults."""
        words: list[str] = []
        if self.proc_root is not None:
            words += ["--proc-root", str(self.proc_root)]
        if self.control_dir != DEFAULT_CONTROL_DIR:
            words += ["--control-dir", str(self.control_dir)]
        if getattr(self.options, "trust_uid", None) is not None:
            words += ["--trust-uid", str(self.options.trust_uid)]
        chosen = getattr(self.options, "driver", "auto")
        if driver and chosen != "auto":
            words += ["--driver", chosen]
        return words

    def status_command(self) -> str:
        """``status`` where the group lives; with a proc root, of the group's processes by
        name (each control directory is its process's own: none to list them all)."""
        words = [PROG, "status", *self.where_words()]
        if self.proc_root is not None:
            words += self._process_words()
        return shlex.join(words)

    def _process_words(self) -> list[str]:
        words: list[str] = []
        for observed, namespace in self.group:
            words += ["--pid", str(observed)] if observed == namespace else [
                "--process", str(observed), str(namespace)]  # fmt: skip
        return words

    def recover_command(self) -> str:
        words = [PROG, "recover", "--checkpoint-dir", str(self.options.checkpoint_dir),
                 *self.where_words(), *self._process_words()]  # fmt: skip
        return shlex.join(words)


def of(args: argparse.Namespace, mode: str, *, native: NativeBackend | None = None) -> Invocation:
    """The command's :class:`Invocation`: resume, restore, recover and native reach the
    group where its manifest says it lives (and load the driver its shims reported),
    unless --control-dir or --proc-root say otherwise (what is taken is said at debug
    level); then the group, for the verbs that name one. ``native``: the caller's own
    native calls (an embedder's, a test's), used instead of the driver's."""
    given_dir: Path | None = getattr(args, "control_dir", None)
    control_dir = given_dir or env_control_dir()
    call = Invocation(args, mode, control_dir, getattr(args, "proc_root", None), given=native)
    origin = _origin(args)
    if origin is not None:
        call = attrs.evolve(call, recorded=origin.driver)
        if given_dir is None:  # --proc-root alone still takes the recorded directory
            proc_root = None if origin.proc_root is None else Path(origin.proc_root)
            call = attrs.evolve(call, control_dir=Path(origin.control_dir),
                                proc_root=call.proc_root or proc_root)  # fmt: skip
            logging.getLogger("cuinterpose.cli").debug(
                "the group lives where %s/manifest.json says: %s",
                args.checkpoint_dir,
                call.where(),
            )
    if hasattr(args, "processes_required"):
        call = attrs.evolve(call, group=tuple(_group(call)))
    return call


def _origin(args: argparse.Namespace) -> agent.Origin | None:
    directory = getattr(args, "checkpoint_dir", None)
    if args.command not in ("resume", "restore", "recover", "native") or directory is None:
        return None
    from .engine.manifest import MANIFEST_FILE_NAME, ManifestError, read_manifest

    if not (Path(directory) / MANIFEST_FILE_NAME).is_file():
        return None
    try:
        return read_manifest(directory).origin
    except ManifestError:
        return None  # the verb itself reads it again, and says what is wrong with it


def _group(call: Invocation) -> list[Pair]:
    """The processes named, else the ones the checkpoint directory (or, for status, the
    control directory) holds; usage errors as such."""
    args = call.options
    try:
        given = targets.named(args.pid, args.process)
        if args.command == "status" and not given:
            return targets.shims(call.control_dir, call.proc_root)
        if args.processes_required and not given:
            raise targets.TargetError(
                ["no process named: give --pid PID (or --process OBSERVED_PID NAMESPACE_PID)"],
                usage=True,
            )
        directory = None if args.processes_required else getattr(args, "checkpoint_dir", None)
        return targets.resolve(given, directory, proc_root=call.proc_root,
                               control_dir=call.control_dir)  # fmt: skip
    except targets.TargetError as error:
        if error.usage:
            text = "\n".join(f"{PROG}: error: {line}" for line in error.lines)
            raise UsageError(text) from None
        raise


def env_control_dir() -> Path:
    value = os.environ.get(CONTROL_DIR_ENV, "")
    return Path(value) if value else DEFAULT_CONTROL_DIR


def no_driver(command: str, exc: NativeUnavailableError) -> list[str]:
    return [
        f"{command}: {exc}",
        f"to see what this machine offers: {PROG} check",
    ]
