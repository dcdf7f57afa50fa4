"""What the agent's verbs report: the timed steps, the bytes copied, and where they go.

Every step of a suspend or resume is timed (:class:`~.manifest.Timing`), and every
event (the machines' progress, the bytes copied while SAVE/LOAD run, each agent step)
goes to the caller's callback and to the ``cuinterpose.agent`` logger with the
event's fields in ``extra={"cuinterpose": {...}}``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Final, Literal

import attrs

from .manifest import Timing
from .progress import Event, OpEvent
from .serial import shape, to_json

LOGGER_NAME: Final = "cuinterpose.agent"


@shape(tag={"event": "step"}, omit=frozenset({"detail"}))
@attrs.frozen
class StepEvent:
    """An agent step started, ended or failed."""

    step: str
    status: Literal["started", "done", "failed"]
    seconds: float = 0.0
    bytes: int = 0
    detail: str = ""


# The JSON lines keep the key they always had: "phase".
@shape(tag={"event": "copy"}, rename={"op": "phase"})
@attrs.frozen
class CopyProgress:
    """Bytes copied so far by the op in flight, summed over the participants (from the
    shims' STATUS replies while SAVE/LOAD/ROLLBACK_ALLOCATIONS run)."""

    op: str
    bytes_done: int
    bytes_total: int
    elapsed_s: float


AgentEvent = Event | StepEvent | CopyProgress
AgentCallback = Callable[[AgentEvent], None]


@attrs.define
class Reporter:
    """Delivers every event to the callback and the logger; collects the timings.

    The copy watcher's thread emits too: deliveries are serialized, so a callback
    never runs twice at once.
    """

    callback: AgentCallback | None
    logger: logging.Logger
    clock: Callable[[], float] = time.perf_counter
    timings: list[Timing] = attrs.field(factory=list)
    lock: threading.Lock = attrs.field(factory=threading.Lock)

    def emit(self, event: AgentEvent) -> None:
        fields = to_json(event)
        failed = fields.get("event") == "failed" or fields.get("status") == "failed"
        level = logging.WARNING if failed else logging.INFO
        with self.lock:
            self.logger.log(
                level, "cuinterpose %s", _summary(fields), extra={"cuinterpose": fields}
            )
            if self.callback is not None:
                self.callback(event)

    @contextmanager
    def step(self, name: str) -> Iterator[list[int]]:
        """Time the block as step ``name``; the block may append bytes moved."""
        moved: list[int] = []
        self.emit(StepEvent(name, "started"))
        began = self.clock()
        try:
            yield moved
        except BaseException as exc:
            self.emit(StepEvent(name, "failed", self.clock() - began, sum(moved), str(exc)))
            raise
        seconds = self.clock() - began
        self.timings.append(Timing(name, seconds, sum(moved)))
        self.emit(StepEvent(name, "done", seconds, sum(moved)))


def reporter(callback: AgentCallback | None, logger: logging.Logger | None) -> Reporter:
    """A reporter for one verb: the caller's logger, else ``cuinterpose.agent``."""
    return Reporter(callback, logger or logging.getLogger(LOGGER_NAME))


def bytes_moved(phases: Sequence[OpEvent]) -> int:
    """The allocation bytes a machine's transfer phases copied."""
    return sum(p.transfer.allocation_bytes for p in phases if p.transfer is not None)


def _summary(fields: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in fields.items() if not isinstance(v, list | dict))
