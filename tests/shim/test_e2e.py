"""End to end on the simulated driver: the shim, the coordinator CLI and the native
checkpoint calls together, with real processes sharing real memory.

Three processes (a creator with two exportable allocations and a private one; an
importer mapping one allocation twice; an importer of both) fill memory; then
``cuinterpose prepare``, native lock + checkpoint of all, native restore + unlock of
all, ``cuinterpose restore``. Every byte must be back at its VA, the old logical
handles must keep working, and a process arriving afterwards must be able to import
a capability exported before the checkpoint. Separately, a live raw import and an
unsupported exportable must each refuse the capture before anything destructive,
with the application still running.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from cuinterpose.engine import native
from cuinterpose.engine.demo import (
    CliRun,
    Scenario,
    Worker,
    coordinator_env,
    pattern_digest,
    run_cli,
)

Spawn = Callable[[str, dict[str, str]], Worker]
DESTRUCTIVE = {"SAVE_ALLOCATIONS", "PREPARE_UNICAST", "PREPARE_MULTICAST"}


def _cli(command: str, pids: list[int], control_dir: Path, tmp_path: Path) -> CliRun:
    ckpt = tmp_path / "checkpoint"
    ckpt.mkdir(exist_ok=True)
    return run_cli(
        command,
        pids=pids,
        checkpoint_dir=ckpt,
        control_dir=control_dir,
        env=coordinator_env(),
        trace=tmp_path / f"{command}.trace.jsonl",
        timeout_s=60,
    )


def _used(observer: Worker) -> int:
    info = observer.check("mem_info")
    return int(info["total"]) - int(info["free"])


def test_three_processes_checkpoint_and_restore(
    spawn: Spawn,
    shim_env: dict[str, str],
    plain_env: dict[str, str],
    control_dir: Path,
    tmp_path: Path,
) -> None:
    observer = spawn("observer", plain_env)
    gran = int(observer.check("granularity")["granularity"])
    scen = Scenario(
        spawn("creator", shim_env),
        spawn("importer-twice", shim_env),
        spawn("importer-both", shim_env),
        x_size=4 * gran,
        y_size=2 * gran,
        p_size=gran,
    )
    used_idle = _used(observer)
    scen.build()
    assert scen.mismatches() == []
    used_before = _used(observer)
    assert used_before - used_idle >= scen.x_size + scen.y_size + scen.p_size

    prep = _cli("prepare", scen.pids, control_dir, tmp_path)
    assert prep.returncode == 0, prep.stderr
    assert (tmp_path / "checkpoint" / "cuinterpose.state").is_file()
    save = prep.phase("SAVE_ALLOCATIONS")
    assert save.get("allocation_count") == 2, prep.events
    assert save.get("allocation_bytes") == scen.shared_bytes, prep.events
    # Prepared: the shared allocations are gone from the device, the application's
    # tracked calls are held off with NOT_READY.
    assert used_before - _used(observer) >= scen.shared_bytes
    refused = scen.creator.call("export", handle=scen.handles["creator_x"])
    assert not refused["ok"] and refused.get("result") == "CUDA_ERROR_NOT_READY", refused

    ck = native.run_in_subprocess("checkpoint-all", scen.pids, env=plain_env)
    assert set(ck["states"].values()) == {"CHECKPOINTED"}, ck
    used_ckpt = _used(observer)
    assert used_before - used_ckpt >= scen.x_size + scen.y_size + scen.p_size, (
        f"checkpointed, yet only {used_before - used_ckpt} bytes freed"
    )

    rs = native.run_in_subprocess("restore-all", scen.pids, env=plain_env)
    assert set(rs["states"].values()) == {"RUNNING"}, rs

    rest = _cli("restore", scen.pids, control_dir, tmp_path)
    assert rest.returncode == 0, rest.stderr
    load = rest.phase("LOAD_ALLOCATIONS")
    assert load.get("allocation_bytes") == scen.shared_bytes, rest.events
    assert scen.mismatches() == []
    assert _used(observer) >= used_before

    # The old logical handles keep working: remap the second map, release imports.
    twice, both, creator = scen.twice, scen.both, scen.creator
    half = scen.x_size // 2
    va_half = scen.vas["twice_x_half"]
    twice.check("unmap", va=va_half, size=scen.x_size - half)
    twice.check(
        "map", va=va_half, size=scen.x_size - half, handle=scen.handles["twice_x"], offset=half
    )
    twice.check("set_access", va=va_half, size=scen.x_size - half)
    assert twice.digest(va_half, scen.x_size - half) == pattern_digest(
        Scenario.SEED_X, scen.x_size, half, scen.x_size - half
    )
    both.check("unmap", va=scen.vas["both_y"], size=scen.y_size)
    both.check("release", handle=scen.handles["both_y"])
    retained = int(creator.check("retain", va=scen.vas["creator_x"])["handle"])
    creator.check("release", handle=retained)
    creator.check("unmap", va=scen.vas["creator_p"], size=scen.p_size)
    creator.check(
        "map", va=scen.vas["creator_p"], size=scen.p_size, handle=scen.handles["creator_p"]
    )
    creator.check("set_access", va=scen.vas["creator_p"], size=scen.p_size)
    assert creator.digest(scen.vas["creator_p"], scen.p_size) == pattern_digest(
        Scenario.SEED_P, scen.p_size
    )
    # Y is still whole in the creator after its importer let go.
    assert creator.digest(scen.vas["creator_y"], scen.y_size) == pattern_digest(
        Scenario.SEED_Y_BOTH, scen.y_size
    )

    # A fourth process imports the capability exported before the checkpoint.
    fourth = spawn("fourth", shim_env)
    fd = creator.send_fd_to(fourth, scen.late_fd, close=True)
    handle = int(fourth.check("import", fd=fd)["handle"])
    va = fourth.map_at_new_va(handle, scen.x_size)
    assert fourth.digest(va, scen.x_size) == pattern_digest(Scenario.SEED_X, scen.x_size)
    fourth.check("unmap", va=va, size=scen.x_size)
    fourth.check("release", handle=handle)

    for worker in (*scen.workers, fourth, observer):
        assert worker.close() == 0, f"{worker.name}: {worker.stderr_tail()}"


def _refused(run: CliRun, what: str, pid: int) -> None:
    assert run.returncode == 1, (run.returncode, run.stderr)
    assert what in run.stderr, run.stderr
    assert str(pid) in run.stderr, run.stderr
    sent = {e.get("phase") for e in run.events if e.get("event") == "phase"}
    assert not sent & DESTRUCTIVE, f"destructive phases ran before the refusal: {sent}"


def _still_active(app: Worker, handle: int, va: int, size: int, seed: int) -> None:
    """Nothing was torn down and the shim still serves tracked calls."""
    assert app.digest(va, size) == pattern_digest(seed, size)
    fd = int(app.check("export", handle=handle)["fd"])
    app.check("close", fd=fd)
    h2, va2 = app.create_mapped(size, seed=seed + 1)
    assert app.digest(va2, size) == pattern_digest(seed + 1, size)
    app.check("unmap", va=va2, size=size)
    app.check("release", handle=h2)


def test_live_raw_import_refuses_capture(
    spawn: Spawn,
    shim_env: dict[str, str],
    plain_env: dict[str, str],
    control_dir: Path,
    tmp_path: Path,
) -> None:
    outsider = spawn("outsider-no-shim", plain_env)
    app = spawn("app", shim_env)
    gran = int(app.check("granularity")["granularity"])
    mine, my_va = app.create_mapped(2 * gran, seed=31)
    app.check("close", fd=int(app.check("export", handle=mine)["fd"]))  # now shared
    raw, _ = outsider.create_mapped(gran, seed=32)
    raw_fd = int(outsider.check("export", handle=raw)["fd"])
    fd = outsider.send_fd_to(app, raw_fd, close=True)
    imported = int(app.check("import", fd=fd)["handle"])
    raw_va = app.map_at_new_va(imported, gran)
    assert app.digest(raw_va, gran) == pattern_digest(32, gran)

    _refused(_cli("prepare", [app.pid], control_dir, tmp_path), "RAW_IMPORT", app.pid)
    _still_active(app, mine, my_va, 2 * gran, 31)
    assert app.digest(raw_va, gran) == pattern_digest(32, gran)
    for worker in (app, outsider):
        assert worker.close() == 0, f"{worker.name}: {worker.stderr_tail()}"


def test_unsupported_exportable_refuses_capture(
    spawn: Spawn, shim_env: dict[str, str], control_dir: Path, tmp_path: Path
) -> None:
    app = spawn("app", shim_env)
    gran = int(app.check("granularity")["granularity"])
    mine, my_va = app.create_mapped(2 * gran, seed=41)
    app.check("close", fd=int(app.check("export", handle=mine)["fd"]))
    _fabric, fabric_va = app.create_mapped(gran, handle_type="fabric", seed=42)

    run = _cli("prepare", [app.pid], control_dir, tmp_path)
    _refused(run, "UNSUPPORTED_EXPORTABLE", app.pid)
    _still_active(app, mine, my_va, 2 * gran, 41)
    assert app.digest(fabric_va, gran) == pattern_digest(42, gran)
    assert app.close() == 0, app.stderr_tail()


@pytest.mark.parametrize("seed,size,offset,length", [(1, 100, 0, None), (2, 5 << 20, 7, 1000)])
def test_pattern_digest_slices(seed: int, size: int, offset: int, length: int | None) -> None:
    """The controller's expected digests are slices of the very bytes ``fill`` writes."""
    import hashlib
    import sys

    sys.path.insert(0, str(Path(__file__).parent / "workers"))
    import vmm_worker  # needs cuda.bindings importable, not a driver

    data = b"".join(vmm_worker.pattern(seed, size))
    end = size if length is None else offset + length
    assert (
        pattern_digest(seed, size, offset, length) == hashlib.sha256(data[offset:end]).hexdigest()
    )
