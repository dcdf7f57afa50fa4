"""The driver's native checkpoint calls for scripts and tests, one process or a group.

``cuCheckpointProcessLock / Checkpoint / Restore / Unlock / GetState /
GetRestoreThreadId`` act on another process, named by its PID. The group
helpers follow the in-place flow of the design: lock all, then checkpoint all;
later restore all, then unlock all; each step is the engine's
(:func:`cuinterpose.engine.native_checkpoint.run_step`, which also checks every process's
state after it). Every failure raises :class:`NativeError` naming the pid, the
call and the ``CUresult`` name; nothing is retried and nothing falls back.

``cuda.bindings`` (a dependency of the package) is imported on first use, so
that the coordinator's other commands never load it; its absence is a
:class:`NativeUnavailableError` that says how to install it. The
calls reach whichever ``libcuda.so.1`` this process loads; to drive the
simulated driver from a process that did not start with it on its library
path, :func:`run_in_subprocess` runs the same calls in a child process with a
given environment (``python -m cuinterpose.native_calls``).

Everything untyped from ``cuda.bindings`` stays inside this module: the public
functions take and return plain Python values.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

import attrs

from .engine.native_checkpoint import (
    DEFAULT_LOCK_TIMEOUT_MS,
    CudaBackend,
    NativeError,
    NativeGroupError,
    NativeUnavailableError,
    ProcessState,
    StepTiming,
    check_pids,
    run_step,
    state_names,
)

__all__ = [
    "DEFAULT_LOCK_TIMEOUT_MS",
    "CallTiming",
    "GroupTimings",
    "NativeError",
    "NativeUnavailableError",
    "ProcessState",
    "checkpoint",
    "checkpoint_all",
    "get_restore_thread_id",
    "get_state",
    "lock",
    "restore",
    "restore_all",
    "run_in_subprocess",
    "states",
    "unlock",
]


@attrs.frozen
class CallTiming:
    """One native call on one process and how long it took."""

    pid: int
    call: str
    seconds: float


@attrs.frozen
class GroupTimings:
    """A group operation: checkpoint (lock all, checkpoint all) or restore (restore all,
    unlock all). ``first_s`` is the lock (or restore) step for all pids, ``second_s``
    the checkpoint (or unlock) step, ``total_s`` both; ``calls`` every call in order."""

    action: str
    pids: tuple[int, ...]
    first_s: float
    second_s: float
    total_s: float
    calls: tuple[CallTiming, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "action": self.action,
            "pids": list(self.pids),
            "first_s": self.first_s,
            "second_s": self.second_s,
            "total_s": self.total_s,
            "calls": [attrs.asdict(c) for c in self.calls],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> GroupTimings:
        return cls(
            action=str(data["action"]),
            pids=tuple(int(p) for p in data["pids"]),
            first_s=float(data["first_s"]),
            second_s=float(data["second_s"]),
            total_s=float(data["total_s"]),
            calls=tuple(
                CallTiming(int(c["pid"]), str(c["call"]), float(c["seconds"]))
                for c in data["calls"]
            ),
        )


# --------------------------------------------------------------- the boundary
# The process's one driver binding (cuda.bindings is imported on first use).
_backend = CudaBackend()


def _timed(call: Callable[[], None]) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


# --------------------------------------------------------------- one process
def lock(pid: int, *, timeout_ms: int = DEFAULT_LOCK_TIMEOUT_MS) -> float:
    """Lock ``pid`` (blocks its CUDA calls); 0 waits forever. Returns seconds."""
    return _timed(lambda: _backend.lock(pid, timeout_ms))


def checkpoint(pid: int) -> float:
    """Checkpoint a locked ``pid``: its GPU memory moves to host. Returns seconds."""
    return _timed(lambda: _backend.checkpoint(pid))


def restore(pid: int) -> float:
    """Restore a checkpointed ``pid`` (it stays locked). Returns seconds."""
    return _timed(lambda: _backend.restore(pid))


def unlock(pid: int) -> float:
    """Unlock a locked ``pid`` so that its CUDA calls run again. Returns seconds."""
    return _timed(lambda: _backend.unlock(pid))


def get_state(pid: int) -> ProcessState:
    """The native checkpoint state of ``pid``."""
    return _backend.state(pid)


def get_restore_thread_id(pid: int) -> int:
    """The thread id of the driver's restore thread in ``pid``."""
    return _backend.restore_thread_id(pid)


def states(pids: Sequence[int]) -> dict[int, str]:
    """Each pid's state name, or the error that asking for it gave (for messages)."""
    return state_names(_backend, pids)


# --------------------------------------------------------------- groups
def _with_states(exc: NativeError, pids: Sequence[int], note: str) -> NativeError:
    detail = "; ".join(part for part in (note, f"states now {states(pids)}", exc.detail) if part)
    return NativeError(exc.pid, exc.call, exc.result, detail)


def _group_error(failed: NativeGroupError, pids: Sequence[int], note: str) -> NativeError:
    """The failed call as a :class:`NativeError`, with every pid's state."""
    if isinstance(failed.__cause__, NativeError):
        return _with_states(failed.__cause__, pids, note)
    # Every call succeeded, but a process is not in the state its step leads to.
    detail = "; ".join(
        part for part in (note, failed.reason, f"states now {failed.states}") if part
    )
    return NativeError(failed.pid, failed.step, "UNEXPECTED_STATE", detail)


def _timings(action: str, group: tuple[int, ...], *steps: StepTiming) -> GroupTimings:
    first, second = steps
    calls = tuple(CallTiming(pid, s.step, secs) for s in steps for pid, secs in s.calls)
    total = first.seconds + second.seconds
    return GroupTimings(action, group, first.seconds, second.seconds, total, calls)


def checkpoint_all(
    pids: Sequence[int], *, timeout_ms: int = DEFAULT_LOCK_TIMEOUT_MS
) -> GroupTimings:
    """Lock every pid, then checkpoint every pid.

    If a lock fails, the pids this call already locked are unlocked again (nothing
    was checkpointed yet) and the error says so. If a checkpoint fails, nothing is
    undone; the error carries every pid's state.
    """
    group = check_pids(pids)
    try:
        locked = run_step(_backend, "lock", group, lock_timeout_ms=timeout_ms)
    except NativeGroupError as failed:
        undone: list[str] = []
        for other in reversed(failed.done):
            try:
                unlock(other)
                undone.append(str(other))
            except NativeError as again:
                undone.append(f"{other} (unlock failed: {again.result})")
        note = f"unlocked again: {', '.join(undone)}" if undone else ""
        raise _group_error(failed, group, note) from failed
    try:
        checkpointed = run_step(_backend, "checkpoint", group)
    except NativeGroupError as failed:
        raise _group_error(failed, group, "") from failed
    return _timings("checkpoint", group, locked, checkpointed)


def restore_all(pids: Sequence[int]) -> GroupTimings:
    """Restore every pid, then unlock every pid. A failure undoes nothing."""
    group = check_pids(pids)
    try:
        restored = run_step(_backend, "restore", group)
        unlocked = run_step(_backend, "unlock", group)
    except NativeGroupError as failed:
        raise _group_error(failed, group, "") from failed
    return _timings("restore", group, restored, unlocked)


# --------------------------------------------------------------- in a child process
ACTIONS: Final = ("checkpoint-all", "restore-all", "state", "restore-thread-id")


def run_in_subprocess(
    action: str,
    pids: Sequence[int],
    *,
    env: Mapping[str, str],
    timeout_ms: int = DEFAULT_LOCK_TIMEOUT_MS,
    timeout_s: float = 300.0,
    python: str | None = None,
) -> dict[str, Any]:
    """Run one native action in ``python -m cuinterpose.native_calls`` with ``env``.

    Use it when this process cannot load the driver the targets use (the simulated
    driver must be on the library path when a process starts). Returns the child's
    JSON answer; a failed call in the child raises the same :class:`NativeError`.
    """
    if action not in ACTIONS:
        raise ValueError(f"unknown native action {action!r}; one of {', '.join(ACTIONS)}")
    group = check_pids(pids)
    argv = [
        python or sys.executable,
        "-m",
        "cuinterpose.native_calls",
        action,
        "--timeout-ms",
        str(timeout_ms),
        *(str(p) for p in group),
    ]
    try:
        proc = subprocess.run(
            argv, env=dict(env), capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except subprocess.TimeoutExpired as exc:
        raise NativeError(group[0], action, "TIMEOUT", f"no answer in {timeout_s} s") from exc
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    try:
        answer: dict[str, Any] = json.loads(lines[-1]) if lines else {}
    except json.JSONDecodeError:
        answer = {}
    if proc.returncode == 0 and answer.get("ok") is True:
        return answer
    if "call" in answer and "pid" in answer:
        raise NativeError(
            int(answer["pid"]), str(answer["call"]), str(answer["result"]), str(answer["detail"])
        )
    raise NativeUnavailableError(
        f"native {action} helper exited {proc.returncode}: "
        f"{(answer.get('error') or proc.stderr.strip() or proc.stdout.strip())[-2000:]}"
    )


def _main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m cuinterpose.native_calls",
        description="native CUDA checkpoint calls on other processes, answering one JSON line",
    )
    parser.add_argument("action", choices=ACTIONS)
    parser.add_argument("pids", type=int, nargs="+")
    parser.add_argument("--timeout-ms", type=int, default=DEFAULT_LOCK_TIMEOUT_MS)
    args = parser.parse_args(argv)
    pids: list[int] = args.pids
    out: dict[str, Any] = {"ok": True}
    try:
        if args.action == "checkpoint-all":
            out["timings"] = checkpoint_all(pids, timeout_ms=args.timeout_ms).to_json()
            out["states"] = {str(k): v for k, v in states(pids).items()}
        elif args.action == "restore-all":
            out["timings"] = restore_all(pids).to_json()
            out["states"] = {str(k): v for k, v in states(pids).items()}
        elif args.action == "state":
            out["states"] = {str(p): get_state(p).name for p in pids}
        else:
            out["restore_thread_ids"] = {str(p): get_restore_thread_id(p) for p in pids}
    except NativeError as exc:
        out = {"ok": False, "pid": exc.pid, "call": exc.call, "result": exc.result}
        out["detail"] = exc.detail
        print(json.dumps(out), flush=True)
        return 1
    except (NativeUnavailableError, ValueError) as exc:
        print(json.dumps({"ok": False, "error": str(exc)}), flush=True)
        return 1
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_main())
