"""Owned memory answers where the H200's driver was seen to differ from the shim
(issue 28, specs/records/2026-12-01-h200-fidelity.jsonl), on real shims over the simulated
driver: the devices an IPC open reaches, the ids a pointer keeps over suspend and resume,
a freed or never handed-out pointer of owned memory, a pitch too wide."""

from __future__ import annotations

from pathlib import Path

from cuinterpose.demo import Worker, pattern_digest

from tests import snippet
from tests.simenv import Spawn

DEVICES = snippet.load(__file__, "devices")
MiB = 1 << 20
SIZE = 4 * MiB
LAZY = 1  # CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
# Small requests owned too, each in a granularity of its own (by default they are the
# driver's, and its answers are the driver's).
OWN_SMALL = {"SNAPSHOT_SHIM_OWN_SMALL": "1"}


def _open(importer: Worker, handle: str, flags: int) -> list[object]:
    return list(importer(f"result = ipc_open({handle!r}, {flags})"))


def _reads(importer: Worker, va: int) -> dict[int, object]:
    """What a read of the first byte gives from each device's context."""
    return {dev: importer(f"result = read_from({dev}, {va})") for dev in (0, 1)}


def _ids(worker: Worker, va: int) -> list[int]:
    return list(worker(f"result = ids({va})"))


def test_an_open_reaches_the_allocations_device_and_the_opener_only_if_asked(
    spawn: Spawn, shim_env: dict[str, str], plain_env: dict[str, str], tmp_path: Path,
    control_dir: Path,
) -> None:  # fmt: skip
    from tests.shim.test_agent import run_cli

    creator = spawn("creator", shim_env, device=1)
    importer = spawn("importer", shim_env)
    importer(DEVICES)
    creator(DEVICES)
    plain, lazy = (int(creator.check("alloc", size=SIZE)["va"]) for _ in range(2))
    creator.check("fill", va=plain, size=SIZE, seed=1)
    creator.check("fill", va=lazy, size=SIZE, seed=2)
    handles = {va: creator.check("ipc_get", va=va)["handle"] for va in (plain, lazy)}
    assert _open(importer, handles[plain], 4)[0] == "CUDA_ERROR_INVALID_VALUE"  # unknown flag
    code, at_plain = _open(importer, handles[plain], 0)
    assert code == "CUDA_SUCCESS"
    code, at_lazy = _open(importer, handles[lazy], LAZY)
    assert code == "CUDA_SUCCESS"
    byte = {at_plain: creator(f"result = first_byte({plain})"),
            at_lazy: creator(f"result = first_byte({lazy})")}  # fmt: skip

    def reachable() -> None:
        # Device 1 (the allocation's) always; device 0 (the importer's) only when asked.
        assert _reads(importer, at_plain) == {
            0: ["CUDA_ERROR_INVALID_VALUE", None],
            1: ["CUDA_SUCCESS", byte[at_plain]],
        }
        assert _reads(importer, at_lazy) == {
            0: ["CUDA_SUCCESS", byte[at_lazy]],
            1: ["CUDA_SUCCESS", byte[at_lazy]],
        }

    reachable()
    ids = {va: _ids(creator, va) for va in (plain, lazy)}
    opened_ids = {va: _ids(importer, va) for va in (at_plain, at_lazy)}
    common = ["--checkpoint-dir", str(tmp_path / "ckpt"), "--control-dir", str(control_dir)]
    procs = [w for p in (creator.pid, importer.pid) for w in ("--process", str(p), str(p))]
    for verb in ("suspend", "resume"):
        run = run_cli([verb, *common, *procs], plain_env)
        assert run.returncode == 0, run.stderr
    reachable()  # rebuilt with the access it had
    # The ids the application saw are kept, as the native checkpoint keeps them.
    assert {va: _ids(creator, va) for va in (plain, lazy)} == ids
    assert {va: _ids(importer, va) for va in (at_plain, at_lazy)} == opened_ids
    assert all(i != 0 for pair in ids.values() for i in pair), ids
    assert creator.digest(plain, SIZE) == pattern_digest(1, SIZE)
    assert importer.digest(at_lazy, SIZE) == pattern_digest(2, SIZE)
    for va in (at_plain, at_lazy):
        importer.check("ipc_close", va=va)
    creator.close_clean()
    importer.close_clean()


def test_a_pointer_the_driver_never_gave_is_unknown(spawn: Spawn, shim_env: dict[str, str]) -> None:
    creator = spawn("creator", {**shim_env, **OWN_SMALL})
    importer = spawn("importer", {**shim_env, **OWN_SMALL})
    creator(DEVICES)
    importer(DEVICES)
    freed = int(creator.check("alloc", size=1000)["va"])
    kept = int(creator.check("alloc", size=1000)["va"])
    creator.check("fill", va=kept, size=1000, seed=3)
    creator.check("free", va=freed)
    never = kept + 64 * 1024  # in kept's granule, never handed out
    for va in (freed, freed + 8, never):
        assert creator(f"result = unknown({va})") == {
            "range": "CUDA_ERROR_NOT_FOUND",
            "attribute": "CUDA_ERROR_INVALID_VALUE",
            "attributes": ["CUDA_SUCCESS", [0, 0, 0, 0, 0]],
        }, hex(va)
    # The neighbour is as cuMemAlloc gave it.
    assert creator.check("address_range", va=kept + 8) == {"ok": True, "base": kept, "size": 1000}
    assert creator.digest(kept, 1000) == pattern_digest(3, 1000)
    # An importer knows only the range it opened, not the rest of the granule it maps.
    handle = creator.check("ipc_get", va=kept)["handle"]
    opened = int(importer.check("ipc_open", handle=handle)["va"])
    assert importer.check("address_range", va=opened)["size"] == 1000
    assert importer(f"result = unknown({opened + 4096})")["range"] == "CUDA_ERROR_NOT_FOUND"
    importer.check("ipc_close", va=opened)
    creator.close_clean()
    importer.close_clean()


def test_a_pitch_whose_size_does_not_fit_is_invalid_value(
    spawn: Spawn, shim_env: dict[str, str]
) -> None:
    app = spawn("app", shim_env)
    assert app("result = err(cu.cuMemAllocPitch(1 << 62, 8, 4))") == "CUDA_ERROR_INVALID_VALUE"
    # The H200 takes a row of 2^31 bytes (specs/records/2026-12-01-h200-fidelity.jsonl).
    wide = "d, p = check(cu.cuMemAllocPitch(1 << 31, 8, 4)); result = err(cu.cuMemFree(d))"
    assert app(wide) == "CUDA_SUCCESS"
    assert app("result = err(cu.cuMemAllocPitch(1, 8, 3))") == "CUDA_ERROR_INVALID_VALUE"
    ptr, pitch = app("d, p = check(cu.cuMemAllocPitch(1000, 8, 4)); result = [int(d), int(p)]")
    assert pitch == 1024
    assert app.check("address_range", va=ptr)["size"] == 8 * 1024
    app.check("free", va=ptr)
    app.close_clean()


def test_a_pitch_whose_rows_overflow_answers_as_the_driver(
    spawn: Spawn, shim_env: dict[str, str], plain_env: dict[str, str]
) -> None:
    """513 bytes a row (1024 pitched) by 2^60 rows: a size past size_t. The shim owns
    rows of that width, and answers what the driver answers for it (INVALID_VALUE, as
    for a row of 2^62 bytes on the H200), never an out-of-memory of its own."""
    overflow = "result = err(cu.cuMemAllocPitch(513, 1 << 60, 8)[0])"
    bare = spawn("bare", plain_env)
    assert bare(overflow) == "CUDA_ERROR_INVALID_VALUE"
    app = spawn("app", shim_env)
    assert app(overflow) == bare(overflow)
    # A width it owns, on a count of rows that fits, is still owned (pitched by the shim).
    ptr, pitch = app("d, p = check(cu.cuMemAllocPitch(513, 8, 8)); result = [int(d), int(p)]")
    assert pitch == 1024 and app.check("address_range", va=ptr)["size"] == 8 * 1024
    app.check("free", va=ptr)
    bare.close_clean()
    app.close_clean()


def test_the_fidelity_probe_answers_as_the_h200_under_the_shim(shim_env: dict[str, str]) -> None:
    from tests.sim.test_fidelity_pointers import differences

    found = differences(shim_env)
    assert not found, "under the shim, owned memory differs from the H200:\n" + "\n".join(found)


def test_imports_whose_creator_is_gone_are_refused_once_saying_to_close_them(
    spawn: Spawn, shim_env: dict[str, str], control_dir: Path, tmp_path: Path
) -> None:
    from tests.shim.test_owned import captures_again
    from tests.shim.workers.cycle import assert_refused, cli

    creator = spawn("creator", {**shim_env, **OWN_SMALL})
    importer = spawn("importer", shim_env)
    mine = int(importer.check("alloc", size=SIZE)["va"])
    importer.check("fill", va=mine, size=SIZE, seed=4)
    opened, handle = [], ""
    for k, size in enumerate((1000, 2000, 3 * MiB)):  # an allocation each
        va = int(creator.check("alloc", size=size)["va"])
        creator.check("fill", va=va, size=size, seed=10 + k)
        handle = creator.check("ipc_get", va=va)["handle"]
        opened.append((int(importer.check("ipc_open", handle=handle)["va"]), size, 10 + k))
    gone = bytes.fromhex(handle)[8:24].hex()  # the creator's participant id (protocol.h)
    creator.close_clean()
    run = cli("prepare", [importer.pid], control_dir, tmp_path)
    assert_refused(run, f"imports 3 allocations whose creator, participant {gone}", importer.pid)
    assert run.stderr.count("refused") == 1, run.stderr  # once, not per allocation and rule
    assert "Close the imports in this process" in run.stderr
    # Nothing changed: the imports still read the creator's bytes; closed, capture works.
    for va, size, seed in opened:
        assert importer.digest(va, size) == pattern_digest(seed, size)
        importer.check("ipc_close", va=va)
    captures_again([importer.pid], control_dir, tmp_path)
    assert importer.digest(mine, SIZE) == pattern_digest(4, SIZE)
    importer.close_clean()
