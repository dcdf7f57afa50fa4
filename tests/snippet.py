"""Python snippets for the demo worker's ``exec`` command, kept as files that ruff reads.

A snippet file (``tests/sim/snippets/``, ``tests/shim/snippets/``) is sent as it is:
``load(__file__, "name")`` is the text of ``snippets/name.py`` beside the calling test.
It runs in the worker's namespace (``frontends/demo/worker.py``, ``Snippets``), which
holds the names below; names that an earlier snippet or the test defines there are
declared in the file's ``if TYPE_CHECKING:`` block, which the worker never runs.
"""

from __future__ import annotations

from pathlib import Path

from cuda.bindings import driver as cu  # type: ignore[import-untyped]
from cuinterpose.demo.worker import Snippets

__all__ = ["DEV", "SIM", "check", "cu", "err", "load", "recv_fd", "send_fd"]

check = Snippets.check
err = Snippets.err
DEV = 0  # the worker's device (spawn() defines it before a setup snippet)
SIM = True  # tests/sim: whether the driver is the simulated one (its conftest sets it)


def send_fd(fd: int) -> None:
    """Sends ``fd`` over the worker's channel (the worker's own does)."""
    raise NotImplementedError("only inside a worker")


def recv_fd() -> int:
    """Receives a file descriptor over the worker's channel (the worker's own does)."""
    raise NotImplementedError("only inside a worker")


def load(test_file: str | Path, name: str) -> str:
    """The snippet ``snippets/<name>.py`` beside ``test_file`` (a test's ``__file__``)."""
    path = Path(test_file).resolve().parent / "snippets" / f"{name}.py"
    return path.read_text()
