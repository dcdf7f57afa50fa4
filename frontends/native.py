"""The driver's native checkpoint calls, through ``cuda.bindings.driver``.

``cuCheckpointProcessLock / Checkpoint / Restore / Unlock / GetState /
GetRestoreThreadId`` act on another process, named by its PID. The group
helpers follow the in-place flow of the design: lock all, then checkpoint all;
later restore all, then unlock all. Every failure raises :class:`NativeError`
naming the pid, the call and the ``CUresult`` name; nothing is retried and
nothing falls back.

``cuda.bindings`` (a dependency of the package) is imported on first use, so
that the coordinator's other commands never load it; its absence is a
:class:`NativeUnavailableError` that says how to install it. The
calls reach whichever ``libcuda.so.1`` this process loads; to drive the
simulated driver from a process that did not start with it on its library
path, :func:`run_in_subprocess` runs the same calls in a child process with a
given environment (``python -m cuinterpose.native``).

Everything untyped from ``cuda.bindings`` stays inside this module: the public
functions take and return plain Python values.
"""

from __future__ import annotations

import argparse
import enum
import importlib
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

import attrs

DEFAULT_LOCK_TIMEOUT_MS: Final = 10_000


class NativeUnavailableError(RuntimeError):
    """``cuda.bindings`` is not installed, or no CUDA driver could be loaded."""


class NativeError(RuntimeError):
    """A native checkpoint call failed: which process, which call, which CUresult."""

    def __init__(self, pid: int, call: str, result: str, detail: str = "") -> None:
        self.pid = pid
        self.call = call
        self.result = result
        self.detail = detail
        text = f"pid {pid}: {call} failed: {result}"
        super().__init__(f"{text} ({detail})" if detail else text)


class ProcessState(enum.IntEnum):
    """``CUprocessState``: where a process is in the native checkpoint cycle."""

    RUNNING = 0
    LOCKED = 1
    CHECKPOINTED = 2
    FAILED = 3
    CHECKPOINTING = 4
    RESTORING = 5


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
_lock = threading.Lock()
_cu: Any = None


def _driver() -> Any:
    """``cuda.bindings.driver``, imported and initialized (``cuInit(0)``) once."""
    global _cu
    with _lock:
        if _cu is not None:
            return _cu
        try:
            module: Any = importlib.import_module("cuda.bindings.driver")
        except ImportError as exc:
            raise NativeUnavailableError(
                "the native checkpoint calls need cuda.bindings: "
                "pip install 'cuda-bindings>=13.0,<14'"
            ) from exc
        try:
            result = module.cuInit(0)
        except Exception as exc:  # the loader's own errors (library not found)
            raise NativeUnavailableError(
                f"no CUDA driver could be loaded for the native checkpoint calls: {exc}"
            ) from exc
        err = result[0] if isinstance(result, tuple) else result
        if err != module.CUresult.CUDA_SUCCESS:
            raise NativeUnavailableError(f"cuInit(0) failed: {_result_name(module, err)}")
        _cu = module
        return module


def _result_name(cu: Any, err: Any) -> str:
    name = getattr(err, "name", None)
    if isinstance(name, str):
        return name
    try:
        status, text = cu.cuGetErrorName(err)
        if status == cu.CUresult.CUDA_SUCCESS and text:
            return text.decode() if isinstance(text, bytes) else str(text)
    except Exception:  # only used to build a message
        pass
    return f"CUresult {int(err)}"


def _call(pid: int, name: str, fn: Callable[[Any], Any]) -> Any:
    """Call ``fn(cu)``; a status other than CUDA_SUCCESS raises NativeError."""
    cu = _driver()
    result = fn(cu)
    err = result[0] if isinstance(result, tuple) else result
    if err != cu.CUresult.CUDA_SUCCESS:
        raise NativeError(pid, name, _result_name(cu, err))
    if isinstance(result, tuple) and len(result) > 1:
        return result[1]
    return None


def _timed(pid: int, name: str, fn: Callable[[Any], Any]) -> float:
    start = time.perf_counter()
    _call(pid, name, fn)
    return time.perf_counter() - start


# --------------------------------------------------------------- one process
def lock(pid: int, *, timeout_ms: int = DEFAULT_LOCK_TIMEOUT_MS) -> float:
    """Lock ``pid`` (blocks its CUDA calls); 0 waits forever. Returns seconds."""
    if timeout_ms < 0:
        raise ValueError(f"lock timeout must be >= 0 ms, got {timeout_ms}")

    def go(cu: Any) -> Any:
        args = cu.CUcheckpointLockArgs()
        args.timeoutMs = timeout_ms
        return cu.cuCheckpointProcessLock(pid, args)

    return _timed(pid, "cuCheckpointProcessLock", go)


def checkpoint(pid: int) -> float:
    """Checkpoint a locked ``pid``: its GPU memory moves to host. Returns seconds."""
    return _timed(
        pid,
        "cuCheckpointProcessCheckpoint",
        lambda cu: cu.cuCheckpointProcessCheckpoint(pid, cu.CUcheckpointCheckpointArgs()),
    )


def restore(pid: int) -> float:
    """Restore a checkpointed ``pid`` (it stays locked). Returns seconds."""
    return _timed(
        pid,
        "cuCheckpointProcessRestore",
        lambda cu: cu.cuCheckpointProcessRestore(pid, cu.CUcheckpointRestoreArgs()),
    )


def unlock(pid: int) -> float:
    """Unlock a locked ``pid`` so that its CUDA calls run again. Returns seconds."""
    return _timed(
        pid,
        "cuCheckpointProcessUnlock",
        lambda cu: cu.cuCheckpointProcessUnlock(pid, cu.CUcheckpointUnlockArgs()),
    )


def get_state(pid: int) -> ProcessState:
    """The native checkpoint state of ``pid``."""
    raw = _call(pid, "cuCheckpointProcessGetState", lambda cu: cu.cuCheckpointProcessGetState(pid))
    try:
        return ProcessState(int(raw))
    except ValueError as exc:
        raise NativeError(
            pid, "cuCheckpointProcessGetState", "CUDA_SUCCESS", f"unknown state {raw!r}"
        ) from exc


def get_restore_thread_id(pid: int) -> int:
    """The thread id of the driver's restore thread in ``pid``."""
    raw = _call(
        pid,
        "cuCheckpointProcessGetRestoreThreadId",
        lambda cu: cu.cuCheckpointProcessGetRestoreThreadId(pid),
    )
    return int(raw)


def states(pids: Sequence[int]) -> dict[int, str]:
    """Each pid's state name, or the error that asking for it gave (for messages)."""
    out: dict[int, str] = {}
    for pid in pids:
        try:
            out[pid] = get_state(pid).name
        except NativeError as exc:
            out[pid] = f"unknown ({exc.result})"
    return out


# --------------------------------------------------------------- groups
def _check_pids(pids: Sequence[int]) -> tuple[int, ...]:
    group = tuple(pids)
    if not group:
        raise ValueError("no pids given")
    if len(set(group)) != len(group):
        raise ValueError(f"pids repeat: {list(group)}")
    if any(p <= 0 for p in group):
        raise ValueError(f"pids must be positive: {list(group)}")
    return group


def _with_states(exc: NativeError, pids: Sequence[int], note: str) -> NativeError:
    detail = "; ".join(part for part in (note, f"states now {states(pids)}", exc.detail) if part)
    return NativeError(exc.pid, exc.call, exc.result, detail)


def checkpoint_all(
    pids: Sequence[int], *, timeout_ms: int = DEFAULT_LOCK_TIMEOUT_MS
) -> GroupTimings:
    """Lock every pid, then checkpoint every pid.

    If a lock fails, the pids this call already locked are unlocked again (nothing
    was checkpointed yet) and the error says so. If a checkpoint fails, nothing is
    undone; the error carries every pid's state.
    """
    group = _check_pids(pids)
    calls: list[CallTiming] = []
    start = time.perf_counter()
    locked: list[int] = []
    for pid in group:
        try:
            calls.append(CallTiming(pid, "lock", lock(pid, timeout_ms=timeout_ms)))
        except NativeError as exc:
            undone: list[str] = []
            for other in reversed(locked):
                try:
                    unlock(other)
                    undone.append(str(other))
                except NativeError as again:
                    undone.append(f"{other} (unlock failed: {again.result})")
            note = f"unlocked again: {', '.join(undone)}" if undone else ""
            raise _with_states(exc, group, note) from exc
        locked.append(pid)
    mid = time.perf_counter()
    for pid in group:
        try:
            calls.append(CallTiming(pid, "checkpoint", checkpoint(pid)))
        except NativeError as exc:
            raise _with_states(exc, group, "") from exc
    end = time.perf_counter()
    return GroupTimings("checkpoint", group, mid - start, end - mid, end - start, tuple(calls))


def restore_all(pids: Sequence[int]) -> GroupTimings:
    """Restore every pid, then unlock every pid. A failure undoes nothing."""
    group = _check_pids(pids)
    calls: list[CallTiming] = []
    start = time.perf_counter()
    for pid in group:
        try:
            calls.append(CallTiming(pid, "restore", restore(pid)))
        except NativeError as exc:
            raise _with_states(exc, group, "") from exc
    mid = time.perf_counter()
    for pid in group:
        try:
            calls.append(CallTiming(pid, "unlock", unlock(pid)))
        except NativeError as exc:
            raise _with_states(exc, group, "") from exc
    end = time.perf_counter()
    return GroupTimings("restore", group, mid - start, end - mid, end - start, tuple(calls))


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
    """Run one native action in ``python -m cuinterpose.native`` with ``env``.

    Use it when this process cannot load the driver the targets use (the simulated
    driver must be on the library path when a process starts). Returns the child's
    JSON answer; a failed call in the child raises the same :class:`NativeError`.
    """
    if action not in ACTIONS:
        raise ValueError(f"unknown native action {action!r}; one of {', '.join(ACTIONS)}")
    group = _check_pids(pids)
    argv = [
        python or sys.executable,
        "-m",
        "cuinterpose.native",
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
        prog="python -m cuinterpose.native",
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
