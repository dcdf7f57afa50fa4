"""The command line's logging, configured once per command.

The library only logs (``cuinterpose`` carries a ``NullHandler``); the command
decides what reaches the terminal. By default a person sees each failure once, in
the command's own words on stderr: the library's records of the events the command
already shows (those carrying ``extra={"cuinterpose": ...}``) and its warnings are
held back, and ``transitions`` (the machines' library) logs nothing below a
warning. ``-v`` shows the library's INFO records (and the events), ``-vv`` DEBUG and
``transitions`` too; ``-q`` only errors. On a terminal the records go through rich's
logging handler. ``--log-file FILE`` receives every record at DEBUG, whatever the
terminal shows.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Final, TextIO

LIBRARY_LOGGER: Final = "cuinterpose"
QUIETED: Final = ("transitions",)
FORMAT: Final = "%(asctime)s %(levelname)s %(name)s: %(message)s"

_installed: list[tuple[logging.Logger, logging.Handler]] = []


class _EventsAbove(logging.Filter):
    """Drops records of events the command prints itself, unless verbose."""

    def __init__(self, verbose: bool) -> None:
        super().__init__()
        self.verbose = verbose

    def filter(self, record: logging.LogRecord) -> bool:
        if self.verbose:
            return True
        return not hasattr(record, "cuinterpose") and record.levelno >= logging.ERROR


def configure(
    *, verbosity: int = 0, quiet: bool = False, log_file: Path | None = None, stream: TextIO
) -> None:
    """Replace whatever an earlier call installed (``main`` may run several times in a
    process, as the tests do), then install the terminal handler and the file's."""
    reset()
    root = logging.getLogger(LIBRARY_LOGGER)
    terminal = _terminal_handler(stream)
    if quiet:
        terminal.setLevel(logging.ERROR)
    elif verbosity >= 2:
        terminal.setLevel(logging.DEBUG)
    elif verbosity == 1:
        terminal.setLevel(logging.INFO)
    else:
        terminal.setLevel(logging.ERROR)
    terminal.addFilter(_EventsAbove(verbosity >= 1 and not quiet))
    handlers: list[logging.Handler] = [terminal]
    if log_file is not None:
        to_file = logging.FileHandler(log_file, encoding="utf-8")
        to_file.setLevel(logging.DEBUG)
        to_file.setFormatter(logging.Formatter(FORMAT))
        handlers.append(to_file)
    root.setLevel(logging.DEBUG if (verbosity >= 2 or log_file is not None) else logging.INFO)
    for handler in handlers:
        root.addHandler(handler)
        _installed.append((root, handler))
    for name in QUIETED:
        logger = logging.getLogger(name)
        logger.setLevel(logging.DEBUG if verbosity >= 2 else logging.WARNING)
        if verbosity >= 2 or log_file is not None:
            for handler in handlers:
                logger.addHandler(handler)
                _installed.append((logger, handler))


def _terminal_handler(stream: TextIO) -> logging.Handler:
    """rich's handler for a person at a terminal (levels in colour, long lines wrapped);
    plain lines, one per record, for anything else (a pipe, a file, a test)."""
    try:
        person = stream.isatty()
    except (OSError, ValueError):
        person = False
    if person:
        from rich.console import Console
        from rich.logging import RichHandler

        handler: logging.Handler = RichHandler(
            console=Console(file=stream, highlight=False),
            show_time=False,
            show_path=False,
            markup=False,
        )
        handler.setFormatter(logging.Formatter("%(message)s"))
        return handler
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("cuinterpose: %(levelname)s: %(message)s"))
    return handler


def reset() -> None:
    """Remove the handlers :func:`configure` installed (closing the log file)."""
    while _installed:
        logger, handler = _installed.pop()
        logger.removeHandler(handler)
        handler.close()
