"""A command's stdout and stderr that can never stop its run: a pipe closed by its
reader (``| head -1``), a terminal hung up, a full disk. A checkpoint half done is
worse than a line lost; the exit status still says where the group is.
"""

from __future__ import annotations

import contextlib
import os
from typing import IO, Any, TextIO, cast


class Sturdy:
    """``stream``, whose writes and flushes never raise: the first one that fails points
    the stream's descriptor at /dev/null (so that the interpreter's own last flush, and
    every later line, go nowhere quietly) and drops what was not written. Everything
    else (``isatty``, ``fileno``, ``encoding``...) is the stream's own."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self.broken = False

    def write(self, text: str) -> int:
        if not self.broken:
            try:
                return self._stream.write(text)
            except (OSError, ValueError):
                self._give_up()
        return len(text)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        if not self.broken:
            try:
                self._stream.flush()
            except (OSError, ValueError):
                self._give_up()

    def isatty(self) -> bool:
        if self.broken:
            return False
        try:
            return self._stream.isatty()
        except (OSError, ValueError):
            return False

    def _give_up(self) -> None:
        self.broken = True
        with contextlib.suppress(OSError, ValueError, AttributeError):
            fd = self._stream.fileno()
            null = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(null, fd)
            finally:
                os.close(null)
            # What the failed write left in the buffer now goes to /dev/null.
            with contextlib.suppress(OSError, ValueError):
                self._stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def sturdy(stream: TextIO | IO[str]) -> TextIO:
    """``stream`` as a :class:`Sturdy` (one already sturdy as it is)."""
    if isinstance(stream, Sturdy):
        return cast(TextIO, stream)
    return cast(TextIO, Sturdy(cast(TextIO, stream)))
