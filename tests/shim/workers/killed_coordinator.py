"""A coordinator that dies (SIGKILL, no clean-up of any kind) at a phase boundary.

    python killed_coordinator.py MACHINE PHASE OCCURRENCE CHECKPOINT_DIR CONTROL_DIR PID...

Runs the capture or restore machine in this process and kills itself right after
the OCCURRENCE-th progress event of PHASE: the op has completed on every
participant and no further op was sent (PHASE QUIESCE_ROUND: the OCCURRENCE-th
QUIESCE round that left someone not quiet). Used by tests/shim/test_faults.py; the
exit status is -9 when the kill happened, 0 when the machine ended first.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from cuinterpose.engine import OpEvent, Options, capture, endpoint_for, restore
from cuinterpose.engine.progress import Event, QuiesceRound


def main(argv: list[str]) -> int:
    machine, phase, occurrence, ckpt, control = argv[:5]
    pids = [int(p) for p in argv[5:]]
    seen = 0

    def on_progress(event: Event) -> None:
        nonlocal seen
        counted = (isinstance(event, OpEvent) and event.phase == phase) or (
            isinstance(event, QuiesceRound) and phase == "QUIESCE_ROUND"
        )
        if counted and event.machine == machine:
            seen += 1
            if seen == int(occurrence):
                os.kill(os.getpid(), signal.SIGKILL)

    endpoints = [endpoint_for(p, p, control_dir=Path(control)) for p in pids]
    run = capture if machine == "capture" else restore
    run(endpoints, Path(ckpt), Options(60.0, on_progress=on_progress))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
