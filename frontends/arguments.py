"""What the command lines (``cli``, ``criu_action``) share: a parser whose usage errors
raise (so that ``main()`` returns 2 instead of exiting), and the argument types whose
bad values are named in the error."""

from __future__ import annotations

import argparse
import math
import sys
from typing import NoReturn


class UsageError(Exception):
    """A bad command line; its text is argparse's ``PROG: error: ...``."""


class Parser(argparse.ArgumentParser):
    """argparse, but usage errors raise :class:`UsageError` instead of exiting."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        raise UsageError(f"{self.prog}: error: {message}")


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
