"""Owned memory and legacy CUDA IPC on real shims over the simulated driver.

The shim backs cuMemAlloc memory with VMM allocations it owns and hands out its own
64-byte IPC handles for it (specs/shim.md, "Owned memory"). What the driver's callers
see must not change (the H200's answers: specs/records/2026-12-01-h200-legacy-ipc.txt),
and a creator sharing that memory with an importer must go through prepare, the native
checkpoint and restore, suspend and resume, and every interrupted capture, with every
byte at its VA in both and the sharing live both ways afterwards.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
from cuinterpose.demo import Worker, pattern_digest
from cuinterpose.engine import Interrupted, OpEvent, Options, capture, endpoint_for

from tests import snippet
from tests.shim.legacy import BIG, SMALL, share_legacy, shared_both_ways
from tests.shim.workers.cycle import assert_refused, cli
from tests.simenv import Spawn

SEED = 91


def test_owned_memory_answers_as_cuMemAlloc_memory(spawn: Spawn, shim_env: dict[str, str]) -> None:
    app = spawn("app", {**shim_env, "SNAPSHOT_SHIM_OWN_SMALL": "1"})
    small = int(app.check("alloc", size=1000)["va"])
    neighbour = int(app.check("alloc", size=1000)["va"])
    big = int(app.check("alloc", size=BIG)["va"])
    # Ranges are the sizes asked for; each its own granularity, nothing packed.
    assert app.check("address_range", va=small + 100) == {"ok": True, "base": small, "size": 1000}
    assert app.check("address_range", va=big + BIG - 1)["size"] == BIG
    gran = int(app.check("granularity")["granularity"])
    assert small % gran == 0 and neighbour % gran == 0 and abs(neighbour - small) >= gran
    attrs = app(
        "names = ['RANGE_START_ADDR', 'RANGE_SIZE', 'IS_LEGACY_CUDA_IPC_CAPABLE',"
        " 'ALLOWED_HANDLE_TYPES', 'MEMORY_TYPE']\n"
        "attrs = [getattr(cu.CUpointer_attribute, 'CU_POINTER_ATTRIBUTE_' + n) for n in names]\n"
        f"vals = check(cu.cuPointerGetAttributes(len(attrs), attrs, {small + 8}))\n"
        "result = dict(zip(names, [int(v) for v in vals]))"
    )
    assert attrs == {
        "RANGE_START_ADDR": small,
        "RANGE_SIZE": 1000,
        "IS_LEGACY_CUDA_IPC_CAPABLE": 1,
        "ALLOWED_HANDLE_TYPES": 0,
        "MEMORY_TYPE": 2,  # device
    }
    # Only what cuMemAlloc returned frees; VMM calls on it fail as on cuMemAlloc memory.
    assert app.call("free", va=small + 8)["result"] == "CUDA_ERROR_INVALID_VALUE"
    assert app.call("unmap", va=big, size=BIG)["result"] == "CUDA_ERROR_INVALID_VALUE"
    assert app.call("retain", va=big)["result"] == "CUDA_ERROR_INVALID_VALUE"
    assert app.call("address_free", va=big, size=BIG)["result"] == "CUDA_ERROR_INVALID_VALUE"
    app.check("fill", va=neighbour, size=1000, seed=3)
    app.check("free", va=small)
    assert app.digest(neighbour, 1000) == pattern_digest(3, 1000)
    app.check("free", va=big)
    app.close_clean()


def test_only_what_loses_nothing_to_the_granularity_is_owned_by_default(
    spawn: Spawn, shim_env: dict[str, str]
) -> None:
    app = spawn("app", shim_env)
    gran = int(app.check("granularity")["granularity"])
    owned = int(app.check("alloc", size=gran)["va"])
    small = int(app.check("alloc", size=gran - 512)["va"])
    magic = {va: bytes.fromhex(app.check("ipc_get", va=va)["handle"])[:4] for va in (owned, small)}
    assert magic == {owned: b"CUIH", small: magic[small]} and magic[small] != b"CUIH"
    for va in (owned, small):
        app.check("fill", va=va, size=1000, seed=8)
        assert app.digest(va, 1000) == pattern_digest(8, 1000)
        app.check("free", va=va)
    app.close_clean()


def test_legacy_ipc_follows_the_driver(spawn: Spawn, shim_env: dict[str, str]) -> None:
    pair = share_legacy(spawn, shim_env, SEED)
    c, i = pair.creator, pair.importer
    interior = c.check("ipc_get", va=pair.big + 4096)["handle"]
    assert interior == c.check("ipc_get", va=pair.big)["handle"]  # the whole allocation
    assert c.call("ipc_open", handle=interior)["result"] == "CUDA_ERROR_INVALID_CONTEXT"
    # A second open returns the same pointer; each open needs its close.
    assert int(i.check("ipc_open", handle=interior)["va"]) == pair.big_in_importer
    assert i.check("address_range", va=pair.big_in_importer + 8) == {
        "ok": True,
        "base": pair.big_in_importer,
        "size": BIG,
    }
    assert i.call("ipc_close", va=pair.big_in_importer + 8)["result"] == "CUDA_ERROR_INVALID_VALUE"
    i.check("ipc_close", va=pair.big_in_importer)
    assert i.digest(pair.big_in_importer, BIG) == pattern_digest(SEED, BIG)  # one open left
    assert i.call("ipc_open", handle="00" * 64)["result"] == "CUDA_ERROR_INVALID_VALUE"
    shared_both_ways(pair, write_seed=SEED + 10)
    # Freed by the creator, the memory lives on in the importer; the handle opens no more.
    c.check("free", va=pair.big)
    assert i.digest(pair.big_in_importer, BIG) == pattern_digest(SEED + 10, BIG)
    i.check("ipc_close", va=pair.big_in_importer)
    assert i.call("ipc_open", handle=interior)["result"] == "CUDA_ERROR_INVALID_VALUE"
    c.close_clean()
    i.close_clean()


@pytest.mark.slow
def test_prepare_native_restore_keeps_legacy_ipc_sharing(
    spawn: Spawn,
    shim_env: dict[str, str],
    plain_env: dict[str, str],
    control_dir: Path,
    tmp_path: Path,
) -> None:
    from cuinterpose import native_calls

    pair = share_legacy(spawn, shim_env, SEED)
    prepared = cli("prepare", pair.pids, control_dir, tmp_path)
    assert prepared.returncode == 0, prepared.stderr
    saved = [e for e in prepared.events if e.get("phase") == "SAVE_ALLOCATIONS"]
    assert sum(int(e.get("allocation_bytes", 0)) for e in saved) >= BIG + SMALL, saved
    native_calls.run_in_subprocess("checkpoint-all", pair.pids, env=plain_env)
    native_calls.run_in_subprocess("restore-all", pair.pids, env=plain_env)
    restored = cli("restore", pair.pids, control_dir, tmp_path)
    assert restored.returncode == 0, restored.stderr
    shared_both_ways(pair, write_seed=SEED + 20)
    pair.creator.close_clean()
    pair.importer.close_clean()


@pytest.mark.slow
def test_suspend_and_resume_keep_legacy_ipc_sharing(
    spawn: Spawn,
    shim_env: dict[str, str],
    plain_env: dict[str, str],
    control_dir: Path,
    tmp_path: Path,
) -> None:
    from tests.shim.test_agent import run_cli

    pair = share_legacy(spawn, shim_env, SEED)
    common = ["--checkpoint-dir", str(tmp_path / "ckpt"), "--control-dir", str(control_dir)]
    procs = [w for p in pair.pids for w in ("--process", str(p), str(p))]
    run = run_cli(["suspend", *common, *procs, "--progress", "json"], plain_env)
    assert run.returncode == 0, run.stderr
    events = [json.loads(line) for line in run.stdout.splitlines()]
    capture_done = next(e for e in events if e.get("step") == "capture" and e["status"] == "done")
    assert capture_done["bytes"] > 0, capture_done  # the shared cudaMalloc memory was staged
    run = run_cli(["resume", *common, *procs], plain_env)
    assert run.returncode == 0, run.stderr
    shared_both_ways(pair, write_seed=SEED + 30)
    pair.creator.close_clean()
    pair.importer.close_clean()


STOP_AT = ["QUIESCE", "PREPARE_MULTICAST", "SAVE_ALLOCATIONS", "PREPARE_UNICAST"]


@pytest.mark.parametrize("phase", STOP_AT)
def test_a_capture_stopped_after_any_phase_rolls_back_legacy_sharing(
    spawn: Spawn, shim_env: dict[str, str], control_dir: Path, tmp_path: Path, phase: str
) -> None:
    pair = share_legacy(spawn, shim_env, SEED)
    stop = threading.Event()

    def on_progress(event: object) -> None:
        if isinstance(event, OpEvent) and event.phase == phase:
            stop.set()

    endpoints = [endpoint_for(p, p, control_dir=control_dir) for p in pair.pids]
    (tmp_path / "ckpt").mkdir()
    try:
        capture(endpoints, tmp_path / "ckpt", Options(30.0, on_progress=on_progress, stop=stop))
    except Interrupted as caught:
        # Stopped before anything was torn down (after QUIESCE), the gates just open.
        assert caught.rolled_back == (phase != "QUIESCE"), caught
        assert caught.rollback_error is None, caught
    else:
        pytest.fail(f"the capture was not stopped after {phase}")
    shared_both_ways(pair, write_seed=SEED + 40)
    pair.creator.close_clean()
    pair.importer.close_clean()


# --- what the shim does not own refuses the capture, before anything changes ------------

POOL_SETUP = snippet.load(__file__, "pool_setup")


def _dir(parent: Path, name: str) -> Path:
    path = parent / name
    path.mkdir(exist_ok=True)
    return path


def captures_again(pids: list[int], control_dir: Path, tmp_path: Path) -> None:
    """With the unowned sharing gone, prepare and restore go through."""
    for command in ("prepare", "restore"):
        run = cli(command, pids, control_dir, _dir(tmp_path, "again"))
        assert run.returncode == 0, (command, run.stderr)


def refused_and_running(
    app: Worker, pids: list[int], call: str, control_dir: Path, tmp_path: Path
) -> None:
    """``prepare`` refuses naming the process and the call, nothing destructive ran, and
    the application's own memory is as it was."""
    va = int(app.check("alloc", size=BIG)["va"])
    app.check("fill", va=va, size=BIG, seed=77)
    run = cli("prepare", pids, control_dir, tmp_path)
    assert_refused(run, "UNOWNED_SHARING", app.pid)
    assert call in run.stderr and "capture refused" in run.stderr, run.stderr
    assert app.digest(va, BIG) == pattern_digest(77, BIG)
    app.check("free", va=va)


def test_legacy_ipc_of_driver_memory_refuses(
    spawn: Spawn, shim_env: dict[str, str], control_dir: Path, tmp_path: Path
) -> None:
    app = spawn("app", {**shim_env, "SNAPSHOT_SHIM_OWN_ALLOCATIONS": "0"})
    mine = int(app.check("alloc", size=BIG)["va"])
    app.check("ipc_get", va=mine)
    refused_and_running(app, [app.pid], "cuIpcGetMemHandle", control_dir, tmp_path)
    # Freed, the handle is gone with its memory: nothing stands in the way any more.
    app.check("free", va=mine)
    captures_again([app.pid], control_dir, tmp_path)
    app.close_clean()


def test_an_import_from_a_process_without_the_shim_refuses_suspend(
    spawn: Spawn,
    shim_env: dict[str, str],
    plain_env: dict[str, str],
    control_dir: Path,
    tmp_path: Path,
) -> None:
    from tests.shim.test_agent import run_cli

    outsider = spawn("outsider-no-shim", plain_env)
    app = spawn("app", shim_env)
    theirs = int(outsider.check("alloc", size=BIG)["va"])
    outsider.check("fill", va=theirs, size=BIG, seed=5)
    opened = int(app.check("ipc_open", handle=outsider.check("ipc_get", va=theirs)["handle"])["va"])
    assert app.digest(opened, BIG) == pattern_digest(5, BIG)
    refused_and_running(app, [app.pid], "cuIpcOpenMemHandle", control_dir, tmp_path)
    # suspend says no too, before any native step: it never accepts what it cannot restore.
    common = ["--checkpoint-dir", str(_dir(tmp_path, "s")), "--control-dir", str(control_dir)]
    run = run_cli(["suspend", *common, "--process", str(app.pid), str(app.pid)], plain_env)
    assert run.returncode == 1, (run.returncode, run.stderr)
    assert "cuIpcOpenMemHandle" in run.stderr and str(app.pid) in run.stderr, run.stderr
    assert "native" not in {line.split()[0] for line in run.stdout.splitlines() if line}
    # Both run on; a closed import no longer stands in the way.
    outsider.check("fill", va=theirs, size=BIG, seed=6)
    assert app.digest(opened, BIG) == pattern_digest(6, BIG)
    app.check("ipc_close", va=opened)
    captures_again([app.pid], control_dir, tmp_path)
    app.close_clean()
    outsider.close_clean()


def test_a_shared_memory_pool_refuses(
    spawn: Spawn,
    shim_env: dict[str, str],
    plain_env: dict[str, str],
    control_dir: Path,
    tmp_path: Path,
) -> None:
    exporter = spawn("exporter", shim_env)
    importer = spawn("importer", shim_env)
    fd = exporter(
        POOL_SETUP + "pool = check(cu.cuMemPoolCreate(props))\n"
        "result = int(check(cu.cuMemPoolExportToShareableHandle(pool, POSIX, 0)))"
    )
    theirs = exporter.send_fd_to(importer, int(fd), close=True)
    importer(
        POOL_SETUP + f"pool = check(cu.cuMemPoolImportFromShareableHandle({theirs}, POSIX, 0))"
    )
    refused_and_running(
        exporter,
        [exporter.pid],
        "cuMemPoolExportToShareableHandle",
        control_dir,
        _dir(tmp_path, "export"),
    )
    refused_and_running(
        importer,
        [importer.pid],
        "cuMemPoolImportFromShareableHandle",
        control_dir,
        _dir(tmp_path, "import"),
    )
    # Destroyed, the pools no longer stand in the way.
    importer("check(cu.cuMemPoolDestroy(pool))")
    exporter("check(cu.cuMemPoolDestroy(pool))")
    pids = [exporter.pid, importer.pid]
    captures_again(pids, control_dir, tmp_path)
    exporter.close_clean()
    importer.close_clean()


PEERS = snippet.load(__file__, "peers")


def test_peer_access_reaches_owned_memory(spawn: Spawn, shim_env: dict[str, str]) -> None:
    app = spawn("app", {**shim_env, "SNAPSHOT_SHIM_OWN_SMALL": "1"})
    app(PEERS)
    assert app("result = read_from_1(a)") == ["CUDA_ERROR_INVALID_VALUE", 0]
    app("check(cu.cuCtxSetCurrent(ctx1)); check(cu.cuCtxEnablePeerAccess(ctx0, 0))")
    assert app("result = err(cu.cuCtxEnablePeerAccess(ctx0, 0))") == (
        "CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED"
    )
    app("check(cu.cuCtxSetCurrent(ctx0))")
    assert app("result = read_from_1(a)") == ["CUDA_SUCCESS", 7]
    # Made after peer access was enabled: reachable from device 1 at once.
    app("b = int(check(cu.cuMemAlloc(4 << 20))); check(cu.cuMemsetD8(b, 9, 4 << 20))")
    assert app("result = read_from_1(b)") == ["CUDA_SUCCESS", 9]
    app("check(cu.cuCtxSetCurrent(ctx1)); check(cu.cuCtxDisablePeerAccess(ctx0))")
    app("check(cu.cuCtxSetCurrent(ctx0))")
    assert app("result = read_from_1(a)")[0] == "CUDA_ERROR_INVALID_VALUE"
    assert app("result = read_from_1(b)")[0] == "CUDA_ERROR_INVALID_VALUE"
    app.close_clean()


RESTORE_STOP_AT = ["LOAD_ALLOCATIONS", "RESTORE_UNICAST"]


@pytest.mark.parametrize("phase", RESTORE_STOP_AT)
def test_a_restore_stopped_after_any_phase_rolls_back_legacy_sharing(
    spawn: Spawn, shim_env: dict[str, str], control_dir: Path, tmp_path: Path, phase: str
) -> None:
    from cuinterpose.engine import restore

    pair = share_legacy(spawn, shim_env, SEED)
    endpoints = [endpoint_for(p, p, control_dir=control_dir) for p in pair.pids]
    ckpt = _dir(tmp_path, "ckpt")
    capture(endpoints, ckpt, Options(30.0))
    stop = threading.Event()

    def on_progress(event: object) -> None:
        if isinstance(event, OpEvent) and event.phase == phase:
            stop.set()

    with pytest.raises(Interrupted) as caught:
        restore(endpoints, ckpt, Options(30.0, on_progress=on_progress, stop=stop))
    assert caught.value.rolled_back and caught.value.rollback_error is None, caught.value
    shared_both_ways(pair, write_seed=SEED + 50)
    pair.creator.close_clean()
    pair.importer.close_clean()


def test_a_reset_or_destroyed_context_takes_its_owned_memory_along(
    spawn: Spawn, shim_env: dict[str, str]
) -> None:
    app = spawn("app", {**shim_env, "SNAPSHOT_SHIM_OWN_SMALL": "1"})
    used = "f, t = check(cu.cuMemGetInfo()); result = int(t) - int(f)"
    before = app(used)
    small = int(app.check("alloc", size=1000)["va"])
    big = int(app.check("alloc", size=BIG)["va"])
    assert app(used) > before
    # A destroy the driver refuses (a primary context) frees nothing.
    app.check("fill", va=big, size=BIG, seed=12)
    assert app(
        "dev = check(cu.cuDeviceGet(0)); p = check(cu.cuDevicePrimaryCtxRetain(dev))\n"
        "result = err(cu.cuCtxDestroy(p)); check(cu.cuDevicePrimaryCtxRelease(dev))"
    ) == "CUDA_ERROR_INVALID_CONTEXT"
    assert app.digest(big, BIG) == pattern_digest(12, BIG)
    app("check(cu.cuDevicePrimaryCtxReset(check(cu.cuDeviceGet(0))))")
    assert app(used) == before
    app(
        "ctx = check(cu.cuDevicePrimaryCtxRetain(check(cu.cuDeviceGet(0))))\n"
        "check(cu.cuCtxSetCurrent(ctx))"
    )
    for va in (small, big):
        assert app.call("address_range", va=va)["result"] == "CUDA_ERROR_NOT_FOUND"
    # A context of the application's own: its memory goes with it.
    app(
        "own = check(cu.cuCtxCreate(None, 0, check(cu.cuDeviceGet(0))))\n"
        "mine = int(check(cu.cuMemAlloc(1 << 20)))"
    )
    assert app(used) > before
    app("check(cu.cuCtxDestroy(own)); check(cu.cuCtxSetCurrent(ctx))")
    assert app(used) == before
    assert app.call("alloc", size=1000)["ok"]  # the primary context allocates again
    app.close_clean()
