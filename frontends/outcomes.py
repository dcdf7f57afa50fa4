"""How a verb ended, said once: the lines on stderr, and with JSON output one summary line
with the command, the outcome and the exit code (specs/detection.md, "The outcome and the
next step"). ``cuinterpose`` and ``cuinterpose criu`` both end here; a verb returns an
:class:`Outcome` and its front writes it.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final, TextIO

import attrs

from .arguments import EXIT_FAILED, EXIT_NEEDS_RECOVER, EXIT_OK, EXIT_ROLLED_BACK

if TYPE_CHECKING:
    from .engine.errors import CoordinatorError

PROG: Final = "cuinterpose"

# What an exit code means to the group, where the verb says nothing of its own.
OUTCOMES: Final[Mapping[int, str]] = {
    EXIT_OK: "done",
    EXIT_FAILED: "refused or failed: the group runs as before",
    EXIT_ROLLED_BACK: "failed and rolled back: the group runs as before",
    EXIT_NEEDS_RECOVER: "failed: the group needs recover",
}


def _lines(given: Iterable[str]) -> tuple[str, ...]:
    return tuple(given)


@attrs.frozen
class Outcome:
    """A verb's end: its exit code; the outcome in words (else :data:`OUTCOMES`'); the
    lines that say why on stderr (and are the summary's reason); the summary's figures;
    the lines a person reads on stdout; the coordinator's failure, whose reason, check
    and rules the summary names when no line was given."""

    code: int
    outcome: str = ""
    lines: tuple[str, ...] = attrs.field(default=(), converter=_lines)
    figures: Mapping[str, Any] = attrs.field(factory=dict)
    human: tuple[str, ...] = attrs.field(default=(), converter=_lines)
    failure: CoordinatorError | None = None

    @classmethod
    def refused(cls, lines: Sequence[str]) -> Outcome:
        return cls(EXIT_FAILED, "refused", lines)


def say(lines: Sequence[str], stderr: TextIO, prog: str = PROG) -> int:
    """Each line on stderr, named by the program: the failure's exit code."""
    for line in lines:
        stderr.write(f"{prog}: {line}\n")
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


def finish(
    command: str,
    mode: str,
    ended: Outcome,
    stdout: TextIO,
    stderr: TextIO,
    *,
    prog: str = PROG,
    outcomes: Mapping[int, str] = OUTCOMES,
) -> int:
    """Say how ``command`` ended, once: :class:`Outcome`'s lines on stderr; in JSON mode
    one summary line; in human mode its lines for a person. The exit code."""
    if ended.lines:
        say(ended.lines, stderr, prog)
    if mode == "json":
        import json  # a person's output needs none

        document: dict[str, Any] = {"event": "summary", "command": command, **ended.figures}
        document.update(outcome=ended.outcome or outcomes[ended.code], exit_code=ended.code)
        failure = ended.failure
        if ended.lines:
            document["reason"] = list(ended.lines)
        elif failure is not None:
            document["reason"] = list(failure.lines())
        if failure is not None and failure.guard:
            document["check"] = failure.guard
            rules = sorted({p.rule for p in failure.problems if p.rule})
            document.update({"rules": rules} if rules else {})
        with contextlib.suppress(OSError):  # a closed stdout: the exit code still says it
            stdout.write(json.dumps(document, allow_nan=False) + "\n")
            stdout.flush()
    elif mode == "human" and ended.human:
        with contextlib.suppress(OSError):
            for line in ended.human:
                stdout.write(line + "\n")
            stdout.flush()
    return ended.code
