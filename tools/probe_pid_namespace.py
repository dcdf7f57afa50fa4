"""Probe: how the real driver's native checkpoint calls name a process that runs in a
pid namespace of its own (a pod), seen from an agent in the host's pid namespace.

Two pods, each made by ``unshare --pid --fork --mount-proc`` and each holding one CUDA
process at the same namespace pid (2: a shell is each pod's pid 1), 64 MiB of device
memory filled with the pod's own byte. From the host, the calls by the host pid and by
the namespace pid; the first pod taken through lock, checkpoint, restore and unlock by
its host pid while the second is asked for its state; then each pod checks its bytes.
``cuCheckpointProcessGetRestoreThreadId`` is asked too, and whether the id it gives is
a thread of the process in the host's numbering.

Run as root on a real GPU (never calls cuMulticastCreate). One JSON object a line,
{"case": ..., "result": ...}, as tools/probe_driver_rules.py prints; kept under
specs/records/ as the rule the simulated driver follows (shim_c/sim/checkpoint.c).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from cuda.bindings import driver as cu
from probe_driver_rules import check, ckpt, ok, out, restore, unlock  # run as tools/...

MiB = 1 << 20
SIZE = 64 * MiB


def pod_child(fill: int) -> None:
    """Inside the pod: fill device memory, say so, and check it when told to."""
    ok(cu.cuInit(0))
    ctx = ok(cu.cuDevicePrimaryCtxRetain(ok(cu.cuDeviceGet(0))))
    ok(cu.cuCtxSetCurrent(ctx))
    ptr = ok(cu.cuMemAlloc(SIZE))
    ok(cu.cuMemsetD8(ptr, fill, SIZE))
    ok(cu.cuCtxSynchronize())
    print("ready", os.getpid(), flush=True)
    sys.stdin.readline()
    host = bytearray(SIZE)
    ok(cu.cuMemcpyDtoH(host, ptr, SIZE))
    print("intact" if host.count(fill) == SIZE else "changed", flush=True)


def nspids(pid: int) -> list[int]:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("NSpid:"):
            return [int(part) for part in line.split()[1:]]
    return []


def host_pid_of(marker: str, ns_pid: int) -> int:
    """The host pid of the process whose command line holds ``marker``."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if marker.encode() in cmdline and "pod-child" in str(cmdline):
            pid = int(entry.name)
            if nspids(pid)[-1:] == [ns_pid]:
                return pid
    raise RuntimeError(f"no process holds {marker} at ns pid {ns_pid}")


class Pod:
    def __init__(self, fill: int) -> None:
        self.marker = f"pod-{fill}-{os.getpid()}"
        # The shell stays the pod's pid 1 (`; :` keeps it from exec'ing python), so the
        # CUDA process is ns pid 2 in every pod: the same namespace pid in both.
        script = f"{sys.executable} {__file__} pod-child {fill} {self.marker}; :"
        self.proc = subprocess.Popen(
            ["unshare", "--pid", "--fork", "--mount-proc", "sh", "-c", script],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        ready = self.proc.stdout.readline().split()
        if not ready or ready[0] != "ready":
            raise RuntimeError(f"pod {fill} did not start: {ready}")
        self.ns_pid = int(ready[1])
        self.host_pid = host_pid_of(self.marker, self.ns_pid)

    def verdict(self) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline().strip()
        self.proc.wait(timeout=60)
        return line


def restore_thread(pid: int) -> Any:
    err, tid = cu.cuCheckpointProcessGetRestoreThreadId(pid)
    if err != cu.CUresult.CUDA_SUCCESS:
        return str(cu.cuGetErrorName(err)[1].decode())
    return {
        "tid": int(tid),
        "a_host_thread_of_the_process": Path(f"/proc/{pid}/task/{int(tid)}").exists(),
    }


def probe() -> None:
    ok(cu.cuInit(0))
    lock = cu.CUcheckpointLockArgs()
    lock.timeoutMs = 5000
    first, second = Pod(0x5A), Pod(0xA5)
    out("same_ns_pid", first.ns_pid == second.ns_pid)
    out(
        "pids",
        {"first": [first.host_pid, first.ns_pid], "second": [second.host_pid, second.ns_pid]},
    )
    out("host_differs_from_ns", first.host_pid != first.ns_pid)
    check("state_by_host_pid", lambda: cu.cuCheckpointProcessGetState(first.host_pid))
    check("state_by_ns_pid", lambda: cu.cuCheckpointProcessGetState(first.ns_pid))
    check("lock_by_ns_pid", lambda: cu.cuCheckpointProcessLock(first.ns_pid, lock))
    check("lock_by_host_pid", lambda: cu.cuCheckpointProcessLock(first.host_pid, lock))
    check("state_locked", lambda: cu.cuCheckpointProcessGetState(first.host_pid))
    check("state_other_pod_while_locked", lambda: cu.cuCheckpointProcessGetState(second.host_pid))
    out("restore_thread_locked", restore_thread(first.host_pid))
    t = time.perf_counter()
    check("checkpoint_by_host_pid", lambda: ckpt(first.host_pid))
    out("checkpoint_s", round(time.perf_counter() - t, 4))
    check("state_checkpointed", lambda: cu.cuCheckpointProcessGetState(first.host_pid))
    check(
        "state_other_pod_while_checkpointed",
        lambda: cu.cuCheckpointProcessGetState(second.host_pid),
    )
    check("restore_by_ns_pid", lambda: restore(first.ns_pid))
    check("restore_by_host_pid", lambda: restore(first.host_pid))
    check("unlock_by_host_pid", lambda: unlock(first.host_pid))
    check("state_after_unlock", lambda: cu.cuCheckpointProcessGetState(first.host_pid))
    out("first_pod_bytes", first.verdict())
    out("second_pod_bytes", second.verdict())


if __name__ == "__main__":
    if sys.argv[1:2] == ["pod-child"]:
        pod_child(int(sys.argv[2]))
    else:
        probe()
