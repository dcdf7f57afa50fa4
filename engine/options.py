"""How a run behaves: the knobs an embedder may turn, each with a default to keep."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Literal

import attrs

from .client import ParticipantError, call_all
from .progress import ProgressCallback
from .trace import TraceSink
from .wire import Reply

# The transport: ``client.call_all``'s signature. Replay and embedders' tests inject their own.
Transport = Callable[..., list[Reply | ParticipantError]]

DEFAULT_PHASE_TIMEOUT_S = 120.0


@attrs.frozen
class Options:
    """How a run behaves; every field has a default an embedder can keep."""

    phase_timeout: float = DEFAULT_PHASE_TIMEOUT_S
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

    def __attrs_post_init__(self) -> None:
        if not self.phase_timeout > 0:
            raise ValueError(f"phase_timeout must be positive, got {self.phase_timeout}")
