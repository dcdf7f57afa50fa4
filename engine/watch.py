"""The copy watcher: the bytes SAVE/LOAD/ROLLBACK_ALLOCATIONS copied so far, while they run.

STATUS changes and binds nothing and is served while a phase op runs
(specs/protocol.md), so a second thread may ask it beside the machine's own
exchanges.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Final

from .client import Endpoint, call_all
from .events import CopyProgress
from .wire import InFlight, Op, Reply, Request, WireError

_POLL_S: Final = 0.1
_COPY_OPS: Final = frozenset({Op.SAVE_ALLOCATIONS, Op.LOAD_ALLOCATIONS, Op.ROLLBACK_ALLOCATIONS})


class CopyWatcher:
    """Asks every shim STATUS while a machine runs, and reports the bytes copied by the
    SAVE/LOAD/ROLLBACK_ALLOCATIONS in flight. Progress only: a shim that does not answer
    is left out of that sample (the machine itself reports failures)."""

    def __init__(
        self, bound: Sequence[tuple[Endpoint, str]], emit: Callable[[CopyProgress], None]
    ) -> None:
        self.bound = tuple(bound)
        self.emit = emit
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="cuinterpose-status", daemon=True)
        self.last: tuple[str, int] | None = None

    def __enter__(self) -> CopyWatcher:
        if self.bound:
            self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        if self.thread.is_alive():
            self.thread.join()

    def _run(self) -> None:
        calls = [(e, Request(Op.STATUS, participant=p), p) for e, p in self.bound]
        while not self.stop.wait(_POLL_S):
            try:
                flights = [
                    InFlight.from_stats(r.stats)
                    for r in call_all(calls, timeout=1.0)
                    if isinstance(r, Reply) and r.status == 0
                ]
            except WireError:  # a shim naming an op this engine does not know: no sample
                continue
            copying = [f for f in flights if f.op in _COPY_OPS]
            if not copying:
                continue
            op = copying[0].op
            assert op is not None
            done = sum(f.bytes_done for f in copying)
            sample = (op.name, done)
            if sample != self.last:
                self.last = sample
                self.emit(
                    CopyProgress(
                        op.name,
                        done,
                        sum(f.bytes_total for f in copying),
                        max(f.elapsed_ns for f in copying) / 1e9,
                    )
                )
