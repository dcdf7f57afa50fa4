"""The shim issue's three-process test on a real NVIDIA GPU (skipped elsewhere).

Sizes: ``CUINTERPOSE_GPU_UNIT_MIB`` (default 256) gives X = 4 units shared by three
processes, Y = 2 units shared by two, P = 1 unit private. With ``CUINTERPOSE_TRACE_OUT``
set, the capture and restore traces and the measured figures land there.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from cuinterpose.demo import pattern_digest

from tests.shim.workers.cycle import (
    assert_refused,
    assert_still_active,
    cli,
    three_process_cycle,
)
from tests.simenv import Spawn

# Skipped (the ``gpu`` fixture says why) without a real GPU; minutes on one.
pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.usefixtures("gpu")]

UNIT = int(os.environ.get("CUINTERPOSE_GPU_UNIT_MIB", "256")) << 20


def test_three_processes_on_gpu(
    spawn: Spawn,
    shim_env: dict[str, str],
    plain_env: dict[str, str],
    control_dir: Path,
    tmp_path: Path,
    trace_out: Path | None,
) -> None:
    result = three_process_cycle(
        spawn,
        shim_env,
        plain_env,
        control_dir,
        tmp_path,
        unit=UNIT,
        trace_out=trace_out,
        trace_prefix="gpu-three-process",
        timeout_s=600.0,
        slack=64 << 20,
    )
    print(json.dumps({k: result[k] for k in ("device", "sizes", "gpu_used")}, indent=2))
    for machine, phase in (("prepare", "SAVE_ALLOCATIONS"), ("restore", "LOAD_ALLOCATIONS")):
        event = next(e for e in result[machine]["events"] if e.get("phase") == phase)
        print(
            f"{phase}: {event.get('allocation_bytes')} bytes, {event.get('gb_per_s')} GB/s, "
            f"copy {event.get('copy_gb_per_s')} GB/s"
        )


def test_live_raw_import_refuses_capture_on_gpu(
    spawn: Spawn,
    shim_env: dict[str, str],
    plain_env: dict[str, str],
    control_dir: Path,
    tmp_path: Path,
    trace_out: Path | None,
) -> None:
    outsider = spawn("outsider-no-shim", plain_env)
    app = spawn("app", shim_env)
    gran = int(app.check("granularity")["granularity"])
    mine, my_va = app.create_mapped(2 * gran, seed=31)
    app.check("close", fd=int(app.check("export", handle=mine)["fd"]))
    raw, _ = outsider.create_mapped(gran, seed=32)
    fd = outsider.send_fd_to(app, int(outsider.check("export", handle=raw)["fd"]), close=True)
    raw_va = app.map_at_new_va(int(app.check("import", fd=fd)["handle"]), gran)

    assert_refused(cli("prepare", [app.pid], control_dir, tmp_path), "RAW_IMPORT", app.pid)
    assert_still_active(app, mine, my_va, 2 * gran, 31)
    assert app.digest(raw_va, gran) == pattern_digest(32, gran)
    if trace_out is not None:
        trace_out.mkdir(parents=True, exist_ok=True)
        shutil.copy(tmp_path / "prepare.trace.jsonl", trace_out / "gpu-refusal-raw-import.jsonl")
    app.close_clean()
    outsider.close_clean()
