"""What a checkpoint directory records of a group, read back by the command line: pairs
and start times (no pods needed: the processes here are this test's own)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from cuinterpose.engine import discovery
from cuinterpose.targets import TargetError, resolve


def _manifest(directory: Path, pairs: list[tuple[int, int]], started: list[int]) -> None:
    directory.mkdir(exist_ok=True)
    document = {
        "version": 1,
        "cuinterpose": {"requested": False, "prepared": False},
        "participants": [
            {"observed_pid": o, "namespace_pid": n, "participant": None} for o, n in pairs
        ],
        "created_at": "2026-12-07T23:00:00.000Z",
        "origin": {"control_dir": "/snapshot-control", "started": started},
    }
    (directory / "manifest.json").write_text(json.dumps(document))


def test_a_recorded_pid_that_names_a_process_started_since_counts_as_gone(
    tmp_path: Path,
) -> None:
    """The survivors alone may be named once the others are gone: a recorded pid now
    naming another process (another start time) is gone, and said so when refused."""
    other = subprocess.Popen(["sleep", "60"])
    try:
        me, it = os.getpid(), other.pid
        ticks = discovery.start_ticks(it)
        _manifest(tmp_path, [(me, me), (it, it)], [discovery.start_ticks(me), ticks + 1])
        assert resolve([(me, me)], tmp_path, proc_root=None) == [(me, me)]
        _manifest(tmp_path, [(me, me), (it, it)], [discovery.start_ticks(me), ticks])
        with pytest.raises(TargetError) as refused:
            resolve([(me, me)], tmp_path, proc_root=None)
        assert f"recorded pid {it} is not given: it runs" in refused.value.lines
    finally:
        other.kill()
        other.wait()
