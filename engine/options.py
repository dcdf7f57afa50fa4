"""How a run behaves: the knobs an embedder may turn, each with a default to keep."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

import attrs

from .client import ParticipantError, call_all
from .wire import STORED_MAX_PARTS, Reply

if TYPE_CHECKING:  # annotations only: a command that only parses its options loads neither
    from .progress import ProgressCallback
    from .trace import TraceSink

# The transport: ``client.call_all``'s signature. Replay and embedders' tests inject their own.
Transport = Callable[..., list[Reply | ParticipantError]]
# ``Options.on_step``: (machine name, step trigger) -> None.
StepHook = Callable[[str, str], None]

DEFAULT_PHASE_TIMEOUT_S = 120.0
# A byte phase (SAVE, LOAD, ROLLBACK_ALLOCATIONS) may take phase_timeout plus its
# bytes at this rate: a hung copy is still caught, a large capture is not killed
# (H200 SAVE runs at 10 GB/s and more, so this is a 40x margin).
SLOWEST_TRANSFER_RATE = 256 * 2**20
# A shim that answers RETRY (out of memory, nothing kept) is sent the op again this
# many times in all, within the phase's time, after a pause that doubles from
# RETRY_PAUSE_S: memory that another participant is about to free becomes free.
RETRY_ATTEMPTS = 5
RETRY_PAUSE_S = 0.05


def default_stored_parts() -> int:
    """The files each shim's staged bytes go to beside the CRIU images (engine/stored.py):
    one per writer thread, since buffered writes to one file serialize on its inode.
    The shim's writers are its copy threads, min(16, online CPUs) by default
    (SNAPSHOT_SHIM_COPY_THREADS, shim_c/settings.c), on this same node: as many files.
    A checkpoint restored on a node of another size reads them as they are (the count
    is in every file's header)."""
    return max(1, min(16, os.cpu_count() or 1))


@attrs.frozen
class Options:
    """How a run behaves; every field has a default an embedder can keep."""

    phase_timeout: float = DEFAULT_PHASE_TIMEOUT_S
    slowest_transfer_rate: float = SLOWEST_TRANSFER_RATE  # bytes per second
    retry_attempts: int = RETRY_ATTEMPTS
    # The longest QUIESCE's rounds may take in all, seconds (None: until a shim's own
    # deadline, SNAPSHOT_SHIM_QUIESCE_TIMEOUT_S counted from its first round, ends
    # them; a shim never waits longer than its own). See engine/quiesce.py.
    quiesce_deadline: float | None = None
    on_progress: ProgressCallback | None = None
    trace: TraceSink | None = None
    content_mode: Literal["host", "native"] = "host"
    transport: Transport = call_all
    clock: Callable[[], float] = time.monotonic
    # A capture overwrites a capture that was never restored only when told to.
    replace: bool = False
    # Set from anywhere (a signal handler, another thread): the run stops at the
    # next phase boundary, and rolls back what it changed.
    stop: threading.Event | None = None
    # After a failure past the first destructive op, bring the group back to
    # ACTIVE before raising (False leaves it for ``recover``: tests, tracing).
    rollback_on_failure: bool = True
    # Called with the machine's and the step's names once the step's guards passed and
    # before it acts: it may block (a barrier across nodes, specs/multinode.md) and may
    # raise a CoordinatorError to stop the run there, which then rolls back what it
    # changed as any failure does. Rollbacks never call it: they run alone.
    on_step: StepHook | None = None
    # The files of each process's staged bytes beside the CRIU images: 1 to
    # STORED_MAX_PARTS (protocol.h); see default_stored_parts.
    stored_parts: int = attrs.field(factory=default_stored_parts)

    def __attrs_post_init__(self) -> None:
        if not self.phase_timeout > 0:
            raise ValueError(f"phase_timeout must be positive, got {self.phase_timeout}")
        if not self.slowest_transfer_rate > 0:
            raise ValueError(
                f"slowest_transfer_rate must be positive, got {self.slowest_transfer_rate}"
            )
        if self.quiesce_deadline is not None and not self.quiesce_deadline > 0:
            raise ValueError(f"quiesce_deadline must be positive, got {self.quiesce_deadline}")
        if not 1 <= self.stored_parts <= STORED_MAX_PARTS:
            raise ValueError(
                f"stored_parts must be 1 to {STORED_MAX_PARTS}, got {self.stored_parts}"
            )
        if self.retry_attempts < 1:
            raise ValueError(f"retry_attempts must be at least 1, got {self.retry_attempts}")

    def timeout_for(self, transfer_bytes: int) -> float:
        """The time a phase may take that moves ``transfer_bytes`` (0 for the others)."""
        return self.phase_timeout + transfer_bytes / self.slowest_transfer_rate
