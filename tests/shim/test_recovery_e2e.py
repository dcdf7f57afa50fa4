"""Recovery through the coordinator, on real shims over the simulated driver.

A creator and an importer share an allocation. A capture stopped at a phase
boundary rolls back by itself; a completed capture that nobody restored is
brought back by ``cuinterpose recover``. Afterwards every byte is at its
address in both processes, and a write through one is seen by the other.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from cuinterpose.engine import Interrupted, Options, PhaseEvent, capture, endpoint_for

from tests.shim.pair import running_as_before, share
from tests.shim.workers.cycle import cli
from tests.simenv import Spawn

SEED = 71


def test_a_capture_stopped_at_a_boundary_rolls_back_by_itself(
    spawn: Spawn, shim_env: dict[str, str], control_dir: Path, tmp_path: Path
) -> None:
    pair = share(spawn, shim_env, SEED)
    creator, importer = pair.creator, pair.importer
    stop = threading.Event()

    def on_progress(event: object) -> None:
        if isinstance(event, PhaseEvent) and event.phase == "SAVE_ALLOCATIONS":
            stop.set()  # the bytes are staged; teardown would come next

    endpoints = [endpoint_for(w.pid, w.pid, control_dir=control_dir) for w in (creator, importer)]
    (tmp_path / "ckpt").mkdir()
    with pytest.raises(Interrupted) as caught:
        capture(endpoints, tmp_path / "ckpt", Options(30.0, on_progress=on_progress, stop=stop))
    assert caught.value.rolled_back and caught.value.rollback_error is None
    running_as_before(pair, write_seed=SEED + 5)


@pytest.mark.slow
def test_recover_brings_back_a_group_left_prepared(
    spawn: Spawn, shim_env: dict[str, str], control_dir: Path, tmp_path: Path
) -> None:
    pair = share(spawn, shim_env, SEED)
    pids = pair.pids
    prepared = cli("prepare", pids, control_dir, tmp_path)
    assert prepared.returncode == 0, prepared.stderr
    # Torn down: the importer's tracked calls wait for the restore.
    recovered = cli("recover", pids, control_dir, tmp_path)
    assert recovered.returncode == 0, recovered.stderr
    running_as_before(pair, write_seed=SEED + 5)
