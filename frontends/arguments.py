"""What the command lines (``cli``, ``criu_action``) share: a parser whose usage errors
raise (so that ``main()`` returns 2 instead of exiting), the argument types whose
bad values are named in the error, the one exit-status table, and the option groups
every verb that acts on processes takes (``--pid``/``--process``, the control
directory, ``--driver``, ``-v``/``-q``/``--log-file``)."""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, NoReturn

# The engine's modules where an option needs them: a verb that takes no --gpu-map or
# --step-timeout loads neither (tests/engine/test_import_cost.py).
if TYPE_CHECKING:
    from .engine.gpus import GpuMap

CONTROL_DIR_ENV: Final = "SNAPSHOT_CONTROL_DIR"
DEFAULT_CONTROL_DIR: Final = Path("/snapshot-control")

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
# The verbs that change a group answer with the one table.
CHANGING_EXITS: Final = EXIT_TABLE
READING_EXITS: Final = """exit status:
  0  done
  1  failed (stderr says why)
  2  usage error"""


class UsageError(Exception):
    """A bad command line; its text is argparse's ``PROG: error: ...``."""


class Parser(argparse.ArgumentParser):
    """argparse, but usage errors raise :class:`UsageError` instead of exiting, and an
    abbreviated option is refused (``--check`` is not ``--checkpoint-dir``: a later
    option starting the same would silently change what it means)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        raise UsageError(f"{self.prog}: error: {message}")


class Formatter(argparse.RawDescriptionHelpFormatter):
    """The epilogs keep their lines; an option's default is shown where it says
    something (not for flags, counts, or options whose help names it)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (
            "default" in text
            or default in (None, False, 0, argparse.SUPPRESS)
            or not action.option_strings
        ):
            return text
        return f"{text} (default: %(default)s)"


def pid(text: str) -> int:
    try:
        value = int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a pid") from None
    if not 0 < value < 2**32:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive pid")
    return value


def seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds")
    return value


def add_control_dir(parser: argparse.ArgumentParser) -> None:
    """``--control-dir`` and ``--proc-root``: where the shims' sockets are (the control
    directory, inside each process's root when the proc root is given)."""
    parser.add_argument(
        "--control-dir",
        type=Path,
        help=f"the shims' control directory, with --proc-root the path inside each "
        f"process's root (default ${CONTROL_DIR_ENV}, else {DEFAULT_CONTROL_DIR})",
    )
    parser.add_argument(
        "--proc-root",
        type=Path,
        help="reach each process's control directory inside its own root, "
        "PROC_ROOT/<observed pid>/root (a coordinator outside the pods: /proc)",
    )
    parser.add_argument(
        "--trust-uid",
        type=_uid,
        metavar="UID",
        help="also trust control directories owned, and shims run, by this uid (a pod's "
        "non-root user, or a user-namespaced pod's root as the host sees it); by default "
        "only root and the coordinator's own uid are trusted",
    )


def _uid(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a numeric uid") from None
    if not 0 <= value < 2**32 - 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a uid (0 to 4294967294)")
    return value


def add_processes(parser: argparse.ArgumentParser, *, required: bool = True) -> None:
    """``--pid P`` and ``--process OBSERVED NS`` (frontends/targets.py reads them);
    ``processes_required``: whether none named is a usage error."""
    named = "(repeatable)" if required else "(repeatable; default: see the description)"
    parser.add_argument(
        "--pid",
        action="append",
        type=pid,
        metavar="PID",
        help=f"a participant whose pid is the same here and in its pid namespace {named}",
    )
    parser.add_argument(
        "--process",
        nargs=2,
        action="append",
        type=pid,
        metavar=("OBSERVED_PID", "NAMESPACE_PID"),
        help=f"a participant: its pid as seen here and inside its pid namespace {named}",
    )
    parser.set_defaults(processes_required=required)


def add_endpoints(
    parser: argparse.ArgumentParser, *, required: bool = True, driver: bool = True
) -> None:
    add_control_dir(parser)
    add_processes(parser, required=required)
    if driver:
        add_driver(parser)


def gpu_map(text: str) -> GpuMap:
    from .engine.gpus import GpuMap, GpuMapError

    try:
        return GpuMap.parse(text)
    except GpuMapError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_gpu_map(parser: argparse.ArgumentParser, *, native: bool = True) -> None:
    """``--gpu-map``, for every verb that restores: resume and criu restore (``native``:
    they make the native restore), restore and recover (after a native restore made
    elsewhere: UUIDs only)."""
    named = (
        "each GPU the group used (an ordinal of the checkpointed node, or a GPU-... UUID) "
        "onto one here (an ordinal here, or a UUID)"
        if native
        else "each GPU the group used onto the one the native restore put it on, by GPU-... UUID"
    )
    parser.add_argument(
        "--gpu-map",
        type=gpu_map,
        metavar="OLD=NEW[,OLD=NEW...]",
        help=f"restore onto other GPUs: {named}; every GPU the group used must be named"
        + ("; resume then says which GPU each process left and which it runs on (its JSON "
           "summary: gpus_moved)" if native else ""),
    )  # fmt: skip


def add_driver(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--driver",
        choices=("auto", "sim", "system"),
        default="auto",
        help="the CUDA driver of the native checkpoint calls: auto, the one the processes' "
        "shims report (else the one the manifest recorded, else launch's choice: the "
        "system's where an NVIDIA driver is installed, the simulated one otherwise); sim, "
        "the simulated one; system, the libcuda.so.1 the loader finds",
    )


def logging_options() -> Parser:
    """A parent parser: ``-v``/``-q`` and ``--log-file`` (frontends/logs.py)."""
    common = Parser(add_help=False)
    group = common.add_argument_group("messages")
    loud = group.add_mutually_exclusive_group()  # argparse lists these under options
    loud.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=0,
        help="also show the library's log (-vv: debug, the state machines' too)",
    )
    loud.add_argument("-q", "--quiet", action="store_true", help="only errors")
    group.add_argument(
        "--log-file", type=Path, metavar="FILE", help="append the full log (debug) to FILE"
    )
    return common


# What a run creates in a directory that did not exist before it (the lock coordinators
# take turns by), removed again when the run is refused: a refusal leaves nothing behind.
_LEFT_BY_A_REFUSAL: Final = ("cuinterpose.lock",)


def missing(*paths: Path | None) -> list[Path]:
    """The directories among ``paths`` that do not exist (yet): a refused run removes
    them again (:func:`tidy_refused`)."""
    return [Path(p) for p in paths if p is not None and not os.path.lexists(p)]


def tidy_refused(created: Sequence[Path], code: int) -> None:
    """After a refused run (exit 1), remove the directories it created, when they hold
    nothing but what the run itself left (its lock file): never anything else."""
    if code != EXIT_FAILED:
        return
    for directory in created:
        try:
            for name in _LEFT_BY_A_REFUSAL:
                (directory / name).unlink(missing_ok=True)
            directory.rmdir()
        except OSError:
            pass  # not created by us after all, or holds something: left as it is


def add_early_logging(parser: argparse.ArgumentParser) -> None:
    """``-v``/``-q``/``--log-file`` before the verb too (``cuinterpose -v status``): kept
    apart (a verb's own defaults would overwrite them) and merged by :func:`merge_logging`."""
    parser.add_argument("-v", "--verbose", dest="early_verbose", action="count", default=0,
                        help="as each verb's -v")  # fmt: skip
    parser.add_argument("-q", "--quiet", dest="early_quiet", action="store_true",
                        help="as each verb's -q")  # fmt: skip
    parser.add_argument("--log-file", dest="early_log_file", type=Path, metavar="FILE",
                        help="as each verb's --log-file")  # fmt: skip


def merge_logging(args: argparse.Namespace) -> None:
    """The logging options given before the verb, added to those given after it."""
    verbose = getattr(args, "verbose", 0) + getattr(args, "early_verbose", 0)
    quiet = getattr(args, "quiet", False) or getattr(args, "early_quiet", False)
    if verbose and quiet:
        raise UsageError("cuinterpose: error: -v and -q cannot be given together")
    args.verbose, args.quiet = verbose, quiet
    if getattr(args, "log_file", None) is None:
        args.log_file = getattr(args, "early_log_file", None)


# A verb's help: what it does, an example, and the exit statuses it can give.
VerbHelp = tuple[str, str, str]


def verb_adder(
    verbs: argparse._SubParsersAction[Any], helps: Mapping[str, VerbHelp]
) -> Callable[..., argparse.ArgumentParser]:
    """Adds each verb the same way, in ``cuinterpose`` and ``cuinterpose criu`` alike: its
    help, an example and its exit statuses in ``--help``, the logging options."""
    common = logging_options()

    def add(name: str, *, bare: bool = False) -> argparse.ArgumentParser:
        text, example, exits = helps[name]
        if bare:  # listed in the top-level help only: a command builds its own verb alone
            listed: argparse.ArgumentParser = verbs.add_parser(name, help=text)
            return listed
        parser: argparse.ArgumentParser = verbs.add_parser(
            name,
            help=text,
            description=text,
            epilog=f"example:\n  {example}\n\n{exits}",
            formatter_class=Formatter,
            parents=[common],
        )
        return parser

    return add


PHASE_TIMEOUT_ENV: Final = "SNAPSHOT_PHASE_TIMEOUT_S"


class _DeprecatedAlias(argparse.Action):
    """An option's former name: it still works, and says once on stderr what to use."""

    def __init__(self, *args: Any, instead: str, **kwargs: Any) -> None:
        self.instead = instead
        super().__init__(*args, **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        sys.stderr.write(
            f"{parser.prog}: note: {option_string} is deprecated and will go: use {self.instead}\n"
        )
        setattr(namespace, self.dest, values)


def add_step_timeout(parser: argparse.ArgumentParser) -> None:
    """``--step-timeout``: each step's deadline for every shim's reply (``--phase-timeout``,
    its former name, kept as a deprecated alias while the version is 0.x)."""
    from .engine.options import DEFAULT_PHASE_TIMEOUT_S

    parser.add_argument(
        "--step-timeout",
        type=seconds,
        metavar="SECONDS",
        help=f"each step's deadline for every shim's reply (default ${PHASE_TIMEOUT_ENV}, "
        f"else {DEFAULT_PHASE_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--phase-timeout",
        dest="step_timeout",
        type=seconds,
        metavar="SECONDS",
        action=_DeprecatedAlias,
        instead="--step-timeout",
        help="deprecated: --step-timeout",
    )


def step_timeout(given: float | None, environ: Mapping[str, str] | None = None) -> float:
    """``--step-timeout``'s value, else ``$SNAPSHOT_PHASE_TIMEOUT_S``, else the default."""
    from .engine.options import DEFAULT_PHASE_TIMEOUT_S

    if given is not None:
        return given
    value = (os.environ if environ is None else environ).get(PHASE_TIMEOUT_ENV, "")
    if not value:
        return DEFAULT_PHASE_TIMEOUT_S
    try:
        return seconds(value)
    except argparse.ArgumentTypeError as exc:
        raise UsageError(f"cuinterpose: error: ${PHASE_TIMEOUT_ENV}: {exc}") from None
