"""An importer reaches only the range it was handed (issue 28, sections 1 and 5).

The driver packs small cuMemAllocs into 2 MiB pages and keeps an importer inside the
range of the handle it opened; VMM maps whole granules. So the shim owns only what
loses nothing to the granularity (at least one, each its own allocation) and leaves a
smaller request to the driver, whose legacy sharing refuses the capture; with
SNAPSHOT_SHIM_OWN_SMALL=1 a small request gets a granularity of its own. Either way an
importer never maps another allocation's bytes, a handle rewritten to another range
opens nothing, a freed allocation's handle opens nothing, shared-then-freed memory is
given back, and only living importers are recorded (specs/shim.md, "Owned memory").
Every test ends with the processes running and their bytes checked.
"""

from __future__ import annotations

from pathlib import Path

from cuinterpose.demo import Worker, pattern_digest
from cuinterpose.engine import wire

from tests.shim.test_control import Shim
from tests.shim.test_owned import _dir, captures_again, refused_and_running
from tests.shim.workers.cycle import cli
from tests.simenv import Spawn

SMALL = 4096
OWN_SMALL = {"SNAPSHOT_SHIM_OWN_SMALL": "1"}
USED = "f, t = check(cu.cuMemGetInfo()); result = int(t) - int(f)"


def _pair(spawn: Spawn, env: dict[str, str]) -> tuple[Worker, Worker, int, int]:
    """A creator with two small allocations A and B (B's bytes a secret), and an importer."""
    creator, importer = spawn("creator", env), spawn("importer", env)
    a = int(creator.check("alloc", size=SMALL)["va"])
    b = int(creator.check("alloc", size=SMALL)["va"])
    creator.check("fill", va=a, size=SMALL, seed=1)
    creator.check("fill", va=b, size=SMALL, seed=2)
    return creator, importer, a, b


def _fetches(control_dir: Path, pid: int) -> list[wire.Record]:
    shim = Shim(control_dir, pid)
    return [r for r in shim.ok(wire.Op.INSPECT).records if r.kind is wire.RecordKind.FETCH]


def _forged(handle: str, *, offset: int | None = None, size: int | None = None) -> str:
    raw = bytearray(bytes.fromhex(handle))
    if offset is not None:
        raw[52:56] = offset.to_bytes(4, "little")
    if size is not None:
        raw[56:64] = size.to_bytes(8, "little")
    return raw.hex()


def test_a_small_allocation_is_the_drivers_and_its_sharing_refuses_the_capture(
    spawn: Spawn, shim_env: dict[str, str], control_dir: Path, tmp_path: Path
) -> None:
    creator, importer, a, b = _pair(spawn, shim_env)
    handle = creator.check("ipc_get", va=a)["handle"]
    assert bytes.fromhex(handle)[:4] != b"CUIH"  # the driver's own handle
    opened = int(importer.check("ipc_open", handle=handle)["va"])
    assert importer.digest(opened, SMALL) == pattern_digest(1, SMALL)
    # Outside its range the importer reaches nothing, as under the driver.
    for va, size in ((opened + SMALL, SMALL), (opened, 2 << 20)):
        assert importer.call("digest", va=va, size=size)["result"] == "CUDA_ERROR_INVALID_VALUE"
    # The capture refuses before anything changes, naming the process, the call and
    # the setting that would own such memory.
    refused_and_running(
        creator, [creator.pid, importer.pid], "cuIpcGetMemHandle", control_dir, tmp_path
    )
    run = cli("prepare", [creator.pid, importer.pid], control_dir, _dir(tmp_path, "words"))
    assert "SNAPSHOT_SHIM_OWN_SMALL=1" in run.stderr, run.stderr
    assert creator.digest(b, SMALL) == pattern_digest(2, SMALL)
    importer.check("fill", va=opened, size=SMALL, seed=3)
    assert creator.digest(a, SMALL) == pattern_digest(3, SMALL)
    importer.check("ipc_close", va=opened)
    creator.check("free", va=a)
    captures_again([creator.pid, importer.pid], control_dir, tmp_path)
    assert creator.digest(b, SMALL) == pattern_digest(2, SMALL)
    creator.close_clean()
    importer.close_clean()


def test_owned_small_allocations_are_isolated_and_a_forged_handle_opens_nothing(
    spawn: Spawn, shim_env: dict[str, str], control_dir: Path
) -> None:
    env = {**shim_env, **OWN_SMALL}
    creator, importer, a, b = _pair(spawn, env)
    gran = int(creator.check("granularity")["granularity"])
    assert abs(b - a) >= gran  # each its own granularity: nothing packed
    handle = creator.check("ipc_get", va=a)["handle"]
    assert bytes.fromhex(handle)[:4] == b"CUIH"
    opened = int(importer.check("ipc_open", handle=handle)["va"])
    assert importer.digest(opened, SMALL) == pattern_digest(1, SMALL)
    # What lies past the range in its granularity is padding nobody else uses; past
    # the granularity nothing is mapped.
    assert importer.call("digest", va=opened + SMALL, size=SMALL)["ok"]
    assert importer.digest(opened + SMALL, SMALL) != pattern_digest(2, SMALL)
    assert importer.call("digest", va=opened, size=2 * gran)["result"] == "CUDA_ERROR_INVALID_VALUE"
    # The handle rewritten to another offset or size, opened in a third process: refused,
    # and the creator recorded no fetch for it.
    third = spawn("third", env)
    for forged in (
        _forged(handle, offset=SMALL),
        _forged(handle, size=gran),
        _forged(handle, size=2 * SMALL),
    ):
        assert third.call("ipc_open", handle=forged)["result"] == "CUDA_ERROR_INVALID_VALUE"
    assert {r.pid for r in _fetches(control_dir, creator.pid)} == {importer.pid}
    # A freed allocation's handle opens no more (the driver's INVALID_VALUE), while the
    # open import keeps its bytes.
    creator.check("free", va=a)
    assert third.call("ipc_open", handle=handle)["result"] == "CUDA_ERROR_INVALID_VALUE"
    assert importer.digest(opened, SMALL) == pattern_digest(1, SMALL)
    importer.check("ipc_close", va=opened)
    assert creator.digest(b, SMALL) == pattern_digest(2, SMALL)
    shared = creator.check("ipc_get", va=b)["handle"]
    theirs = int(third.check("ipc_open", handle=shared)["va"])
    assert third.digest(theirs, SMALL) == pattern_digest(2, SMALL)
    third.check("ipc_close", va=theirs)
    for w in (creator, importer, third):
        w.close_clean()


def test_shared_then_freed_memory_is_given_back(spawn: Spawn, shim_env: dict[str, str]) -> None:
    env = {**shim_env, **OWN_SMALL}
    creator, importer = spawn("creator", env), spawn("importer", env)
    keep = int(creator.check("alloc", size=SMALL)["va"])
    creator.check("fill", va=keep, size=SMALL, seed=4)
    before = (int(creator(USED)), int(importer(USED)))
    for k in range(40):
        va = int(creator.check("alloc", size=64 << 10)["va"])
        opened = int(
            importer.check("ipc_open", handle=creator.check("ipc_get", va=va)["handle"])["va"]
        )
        if k % 2:  # the creator frees first, or the importer closes first
            creator.check("free", va=va)
            importer.check("ipc_close", va=opened)
        else:
            importer.check("ipc_close", va=opened)
            creator.check("free", va=va)
    assert (int(creator(USED)), int(importer(USED))) == before
    assert creator.digest(keep, SMALL) == pattern_digest(4, SMALL)
    creator.close_clean()
    importer.close_clean()


def test_dead_fetchers_and_failed_opens_leave_no_fetch_record(
    spawn: Spawn, shim_env: dict[str, str], control_dir: Path, tmp_path: Path
) -> None:
    env = {**shim_env, **OWN_SMALL}
    creator = spawn("creator", env)
    va = int(creator.check("alloc", size=SMALL)["va"])
    creator.check("fill", va=va, size=SMALL, seed=5)
    handle = creator.check("ipc_get", va=va)["handle"]
    for k in range(3):  # short-lived consumers: each opens, reads and is killed
        consumer = spawn(f"consumer-{k}", env)
        opened = int(consumer.check("ipc_open", handle=handle)["va"])
        assert consumer.digest(opened, SMALL) == pattern_digest(5, SMALL)
        consumer.kill()
    assert _fetches(control_dir, creator.pid) == []
    # A live process whose open was refused after it reached the creator is no importer.
    bystander = spawn("bystander", env)
    assert bystander.call("ipc_open", handle=_forged(handle, size=2 * SMALL))["result"] == (
        "CUDA_ERROR_INVALID_VALUE"
    )
    assert _fetches(control_dir, creator.pid) == []
    # So the creator alone goes through a capture and back.
    for command in ("prepare", "restore"):
        run = cli(command, [creator.pid], control_dir, _dir(tmp_path, "alone"))
        assert run.returncode == 0, (command, run.stderr)
    assert creator.digest(va, SMALL) == pattern_digest(5, SMALL)
    opened = int(bystander.check("ipc_open", handle=handle)["va"])
    assert bystander.digest(opened, SMALL) == pattern_digest(5, SMALL)
    bystander.check("ipc_close", va=opened)
    creator.close_clean()
    bystander.close_clean()
