"""Recovery through the coordinator, on real shims over the simulated driver.

A creator and an importer share an allocation. A capture stopped at a phase
boundary rolls back by itself; a completed capture that nobody restored is
brought back by ``cuinterpose recover``. Afterwards every byte is at its
address in both processes, and a write through one is seen by the other.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
from cuinterpose.engine import Interrupted, OpEvent, Options, capture, endpoint_for
from cuinterpose.engine.directory import INTENT_FILE_NAME
from cuinterpose.engine.wire import Op, Request, Status

from tests.shim import shimenv
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
        if isinstance(event, OpEvent) and event.phase == "SAVE_ALLOCATIONS":
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


def test_a_recover_refused_by_another_coordinator_leaves_the_directory_as_it_found_it(
    spawn: Spawn, shim_env: dict[str, str], control_dir: Path, tmp_path: Path
) -> None:
    """Two recovers of a capture interrupted past its first destructive op, one at the
    capture's directory and one at an empty one: while the other holds the lease, the
    first is refused, leaving the intent as it found it and saying so; once the other
    has rolled the group back, a recover at the capture's directory removes the intent
    and a prepare there goes through."""
    # The other coordinator's lease is a HANDSHAKE of this process: held for the test.
    pair = share(spawn, {**shim_env, "SNAPSHOT_LEASE_HANDSHAKE_S": "600"}, SEED)
    stop = threading.Event()

    def on_progress(event: object) -> None:
        if isinstance(event, OpEvent) and event.phase == "SAVE_ALLOCATIONS":
            stop.set()  # torn down past the first destructive op

    endpoints = [endpoint_for(w.pid, w.pid, control_dir=control_dir) for w in
                 (pair.creator, pair.importer)]  # fmt: skip
    real, empty = tmp_path / "real", tmp_path / "empty"
    (real / "checkpoint").mkdir(parents=True)
    empty.mkdir()
    options = Options(30.0, on_progress=on_progress, stop=stop, rollback_on_failure=False)
    with pytest.raises(Interrupted) as caught:
        capture(endpoints, real / "checkpoint", options)
    assert not caught.value.rolled_back
    found = {p.name: p.read_bytes() for p in (real / "checkpoint").iterdir()}
    assert INTENT_FILE_NAME in found, found

    token = os.urandom(16)
    for endpoint in endpoints:
        held, _ = shimenv.request(endpoint.path, Request(Op.HANDSHAKE, authorization=token))
        assert held.status is Status.OK
    refused = cli("recover", pair.pids, control_dir, real)
    assert refused.returncode == 1, refused.stderr
    assert f"another coordinator holds this process (pid {os.getpid()}" in refused.stderr
    left = f"{real / 'checkpoint' / INTENT_FILE_NAME} (the interrupted capture) is left as it"
    assert left in refused.stderr, refused.stderr
    assert {p.name: p.read_bytes() for p in (real / "checkpoint").iterdir()} == found

    for endpoint in endpoints:  # the other coordinator's run: at the empty directory
        released, _ = shimenv.request(endpoint.path, Request(Op.RELEASE, authorization=token))
        assert released.status is Status.OK
    other = cli("recover", pair.pids, control_dir, empty)
    assert other.returncode == 0, other.stderr  # rolled the group back
    again = cli("recover", pair.pids, control_dir, real)
    assert again.returncode == 0, again.stderr
    assert list((real / "checkpoint").iterdir()) == []  # the stale intent removed
    assert cli("prepare", pair.pids, control_dir, real).returncode == 0
    assert cli("restore", pair.pids, control_dir, real).returncode == 0
    running_as_before(pair, write_seed=SEED + 5)
