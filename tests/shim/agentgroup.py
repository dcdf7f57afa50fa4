"""A creator/importer group on the simulated driver, and native backends for the agent API.

``WorkerBackend`` makes the native checkpoint calls from a plain worker process (one that
loaded the simulated driver at start, which the test runner cannot), ``RemapBackend``
those and the restore onto other GPUs, ``FaultyBackend`` fails one chosen call. All are
:class:`cuinterpose.engine.native_checkpoint.NativeBackend`s.
"""

from __future__ import annotations

from typing import Any

import attrs
from cuinterpose.demo import Worker, pattern_digest
from cuinterpose.engine import agent
from cuinterpose.engine.client import call_all
from cuinterpose.engine.gpus import Gpu, parse_report, uuid_text
from cuinterpose.engine.native_checkpoint import NativeBackend, NativeError, ProcessState
from cuinterpose.engine.wire import Op, Request

from tests.simenv import Spawn


class WorkerBackend:
    """The driver's native checkpoint calls, run in ``worker`` (a snippet each)."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker

    def _call(self, pid: int, call: str, args: str) -> None:
        result = self.worker(f"result = err(cu.{call}({pid}, {args}))")
        if result != "CUDA_SUCCESS":
            raise NativeError(pid, call, str(result))

    def lock(self, pid: int, timeout_ms: int) -> None:
        self._call(
            pid,
            "cuCheckpointProcessLock",
            f"(lambda a: (setattr(a, 'timeoutMs', {timeout_ms}), a)[1])(cu.CUcheckpointLockArgs())",
        )

    def checkpoint(self, pid: int) -> None:
        self._call(pid, "cuCheckpointProcessCheckpoint", "cu.CUcheckpointCheckpointArgs()")

    def restore(self, pid: int) -> None:
        self._call(pid, "cuCheckpointProcessRestore", "cu.CUcheckpointRestoreArgs()")

    def unlock(self, pid: int) -> None:
        self._call(pid, "cuCheckpointProcessUnlock", "cu.CUcheckpointUnlockArgs()")

    def state(self, pid: int) -> ProcessState:
        answer = self.worker(
            f"r = cu.cuCheckpointProcessGetState({pid})\n"
            "result = [err(r), int(r[1]) if err(r) == 'CUDA_SUCCESS' else -1]"
        )
        if answer[0] != "CUDA_SUCCESS":
            raise NativeError(pid, "cuCheckpointProcessGetState", str(answer[0]))
        return ProcessState(int(answer[1]))


REMAP = """
import ctypes
def uuid_from(raw):
    u = cu.CUuuid(); ctypes.memmove(u.getPtr(), raw, 16)
    return u
def remap_restore(pid, pairs):
    ps = []
    for old, new in pairs:
        p = cu.CUcheckpointGpuPair()
        p.oldUuid = uuid_from(bytes.fromhex(old)); p.newUuid = uuid_from(bytes.fromhex(new))
        ps.append(p)
    a = cu.CUcheckpointRestoreArgs(); a.gpuPairs = ps; a.gpuPairsCount = len(ps)
    return err(cu.cuCheckpointProcessRestore(pid, a))
def gpus_here():
    out = []
    for d in range(check(cu.cuDeviceGetCount())):
        dev = check(cu.cuDeviceGet(d))
        name = bytes(check(cu.cuDeviceGetName(64, dev))).split(b"\\0", 1)[0].decode()
        out.append([d, bytes(check(cu.cuDeviceGetUuid(dev)).bytes).hex(), name,
                    int(check(cu.cuDeviceTotalMem(dev)))])
    return out
"""


class RemapBackend(WorkerBackend):
    """WorkerBackend with the remapping restore and this node's GPUs."""

    def __init__(self, worker: Worker) -> None:
        super().__init__(worker)
        worker(REMAP)

    def restore_onto(self, pid: int, gpu_pairs: object) -> None:
        pairs = [
            (old[4:].replace("-", ""), new[4:].replace("-", ""))
            for old, new in gpu_pairs  # type: ignore[attr-defined]
        ]
        result = self.worker(f"result = remap_restore({pid}, {pairs!r})")
        if result != "CUDA_SUCCESS":
            raise NativeError(pid, "cuCheckpointProcessRestore", str(result))

    def gpus(self) -> tuple[Gpu, ...]:
        found = self.worker("result = gpus_here()")
        return tuple(Gpu(d, uuid_text(bytes.fromhex(u)), n, t) for d, u, n, t in found)


def devices_of(worker: Any, where: agent.Where) -> list[str]:
    """The UUIDs of the GPUs a process's shim says it uses."""
    endpoint = where.endpoint(agent.Process(worker.pid, worker.pid))
    (reply,) = call_all([(endpoint, Request(Op.STATUS, ask_devices=True), None)], timeout=10)
    return [g.uuid for g in parse_report(reply.message)]  # type: ignore[union-attr]


@attrs.define
class FaultyBackend:
    """``inner``, except that ``step`` on ``pid`` fails as the driver would."""

    inner: NativeBackend
    step: str
    pid: int
    calls: list[tuple[str, int]] = attrs.field(factory=list)

    def _maybe_fail(self, step: str, pid: int, call: str) -> None:
        self.calls.append((step, pid))
        if (step, pid) == (self.step, self.pid):
            raise NativeError(pid, call, "CUDA_ERROR_INJECTED")

    def lock(self, pid: int, timeout_ms: int) -> None:
        self._maybe_fail("lock", pid, "cuCheckpointProcessLock")
        self.inner.lock(pid, timeout_ms)

    def checkpoint(self, pid: int) -> None:
        self._maybe_fail("checkpoint", pid, "cuCheckpointProcessCheckpoint")
        self.inner.checkpoint(pid)

    def restore(self, pid: int) -> None:
        self._maybe_fail("restore", pid, "cuCheckpointProcessRestore")
        self.inner.restore(pid)

    def unlock(self, pid: int) -> None:
        self._maybe_fail("unlock", pid, "cuCheckpointProcessUnlock")
        self.inner.unlock(pid)

    def state(self, pid: int) -> ProcessState:
        return self.inner.state(pid)


@attrs.define
class Group:
    """A creator (X exportable, P private) and an importer mapping X; all filled."""

    creator: Worker
    importer: Worker
    observer: Worker  # plain: sees device-wide memory use, makes the native calls
    size: int
    vas: dict[str, int] = attrs.field(factory=dict)

    SEED_X = 71
    SEED_P = 72

    @property
    def pids(self) -> list[int]:
        return [self.creator.pid, self.importer.pid]

    @property
    def processes(self) -> list[tuple[int, int]]:
        return [(p, p) for p in self.pids]

    def used(self) -> int:
        info = self.observer.check("mem_info")
        return int(info["total"]) - int(info["free"])

    def mismatches(self) -> list[str]:
        expect_x = pattern_digest(self.SEED_X, self.size)
        expect_p = pattern_digest(self.SEED_P, self.size)
        checks = [
            (self.creator, "creator_x", expect_x),
            (self.creator, "creator_p", expect_p),
            (self.importer, "importer_x", expect_x),
        ]
        bad = []
        for worker, label, expect in checks:
            reply = worker.call("digest", va=self.vas[label], size=self.size)
            if not reply.get("ok") or reply.get("digest") != expect:
                bad.append(f"{label} in pid {worker.pid}: {reply}")
        return bad

    def close(self) -> None:
        for worker in (self.creator, self.importer, self.observer):
            worker.close_clean()


def build_group(spawn: Spawn, shim_env: dict[str, str], plain_env: dict[str, str]) -> Group:
    observer = spawn("observer", plain_env, wait=False)
    creator = spawn("creator", shim_env, wait=False)
    importer = spawn("importer", shim_env, wait=False)
    for w in (observer, creator, importer):
        w.wait_ready()
    size = 2 * int(observer.check("granularity")["granularity"])
    group = Group(creator, importer, observer, size)
    handle, group.vas["creator_x"] = creator.create_mapped(size, seed=Group.SEED_X)
    _, group.vas["creator_p"] = creator.create_mapped(size, handle_type="none", seed=Group.SEED_P)
    fd = creator.send_fd_to(importer, int(creator.check("export", handle=handle)["fd"]), close=True)
    imported = int(importer.check("import", fd=fd)["handle"])
    group.vas["importer_x"] = importer.map_at_new_va(imported, size)
    assert group.mismatches() == []
    return group
