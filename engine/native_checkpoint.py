"""The native checkpoint of a group of processes: lock all, checkpoint all; restore all,
unlock all; the state of every process checked after each step.

The driver's calls (``cuCheckpointProcessLock / Checkpoint / Restore / Unlock /
GetState``) act on another process named by its pid. They are reached through a
:class:`NativeBackend`; :class:`CudaBackend` is the real one, importing
``cuda.bindings`` on first use so that the engine imports without it. Tests and
agents inject their own backend (another driver, a helper process, injected
failures). A failed step raises :class:`NativeGroupError`, which names the step,
the process whose call failed and the state of every process; nothing here undoes
anything on its own: :func:`undo_suspend` is the way back, driven by the states.
"""

from __future__ import annotations

import enum
import importlib
import os
import struct
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Final, Protocol, runtime_checkable

import attrs

from . import _mountns
from .gpus import Gpu, uuid_bytes, uuid_text

DEFAULT_LOCK_TIMEOUT_MS: Final = 10_000


class NativeUnavailableError(RuntimeError):
    """``cuda.bindings`` is not installed, or no CUDA driver could be loaded."""


class NativeError(RuntimeError):
    """A native checkpoint call failed: which process, which call, which CUresult."""

    def __init__(self, pid: int, call: str, result: str, detail: str = "") -> None:
        super().__init__(pid, call, result, detail)
        self.pid = pid
        self.call = call
        self.result = result
        self.detail = detail

    def __str__(self) -> str:
        text = f"pid {self.pid}: {self.call} failed: {self.result}"
        return f"{text} ({self.detail})" if self.detail else text


class ProcessState(enum.IntEnum):
    """``CUprocessState``: where a process is in the native checkpoint cycle."""

    RUNNING = 0
    LOCKED = 1
    CHECKPOINTED = 2
    FAILED = 3
    CHECKPOINTING = 4
    RESTORING = 5


class NativeBackend(Protocol):
    """The driver's native checkpoint calls on one process; each raises NativeError."""

    def lock(self, pid: int, timeout_ms: int) -> None: ...
    def checkpoint(self, pid: int) -> None: ...
    def restore(self, pid: int) -> None: ...
    def unlock(self, pid: int) -> None: ...
    def state(self, pid: int) -> ProcessState: ...


@runtime_checkable
class RemappingBackend(Protocol):
    """A backend that restores onto other GPUs and says which GPUs are here."""

    def restore_onto(self, pid: int, gpu_pairs: Sequence[tuple[str, str]]) -> None: ...
    def gpus(self) -> tuple[Gpu, ...]: ...


NO_DRIVER_HINT: Final = (
    "install the NVIDIA driver, or name the libcuda.so.1 the processes run on "
    "(CudaBackend(library=PATH); on the command line --driver sim for the simulated one, "
    "which `cuinterpose launch` processes report by themselves)"
)


def loaded_driver() -> str | None:
    """The path of the ``libcuda.so.1`` this process has loaded, if any (from its maps)."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                parts = line.split(maxsplit=5)
                path = parts[5].strip() if len(parts) == 6 else ""
                if path.startswith("/") and os.path.basename(path).startswith("libcuda.so"):
                    return path
    except OSError:
        pass
    return None


def _needs_asan(library: str) -> bool:
    """Whether ``library`` links the ASan runtime (a DT_NEEDED entry names libasan)."""
    try:
        needed = _elf_needed(library)
    except (OSError, ValueError, struct.error):
        return False  # not an ELF64 library we can read: the loader says what is wrong
    return any(name.startswith(b"libasan.so") for name in needed)


def _elf_needed(path: str) -> list[bytes]:
    """The DT_NEEDED names of a little-endian ELF64 file, from its dynamic segment.

    Only the headers and the dynamic strings are read: the system's libcuda is ~100 MB,
    and reading it whole to look for one name cost an H200 command 0.14 s."""
    with open(path, "rb") as f:
        ident = f.read(64)
        if ident[:4] != b"\x7fELF" or ident[4] != 2 or ident[5] != 1:
            raise ValueError(f"{path}: not a little-endian ELF64 file")
        (phoff,) = struct.unpack_from("<Q", ident, 32)
        phentsize, phnum = struct.unpack_from("<HH", ident, 54)
        f.seek(phoff)
        headers = f.read(phentsize * phnum)
        loads: list[tuple[int, int, int]] = []  # (vaddr, offset, filesz)
        dynamic = None
        for k in range(phnum):
            kind, _, offset, vaddr, _, filesz = struct.unpack_from(
                "<IIQQQQ", headers, k * phentsize
            )
            if kind == 1:  # PT_LOAD
                loads.append((vaddr, offset, filesz))
            elif kind == 2:  # PT_DYNAMIC
                dynamic = (offset, filesz)
        if dynamic is None:
            return []
        f.seek(dynamic[0])
        entries = f.read(dynamic[1])
        strtab = strsz = None
        names: list[int] = []
        for tag, value in struct.iter_unpack("<qQ", entries[: len(entries) // 16 * 16]):
            if tag == 0:  # DT_NULL
                break
            if tag == 1:  # DT_NEEDED
                names.append(value)
            elif tag == 5:  # DT_STRTAB (an address)
                strtab = value
            elif tag == 10:  # DT_STRSZ
                strsz = value
        if strtab is None or strsz is None:
            return []
        at = next((o + strtab - v for v, o, n in loads if v <= strtab < v + n), None)
        if at is None:
            raise ValueError(f"{path}: its dynamic strings lie in no loaded segment")
        f.seek(at)
        table = f.read(strsz)
    return [table[n : table.index(b"\0", n)] for n in names if n < len(table)]


def _asan_loaded() -> bool:
    try:
        with open("/proc/self/maps") as maps:
            return "libasan.so" in maps.read()
    except OSError:
        return False


class CudaBackend:
    """The calls through ``cuda.bindings.driver`` (imported, and ``cuInit(0)`` run, on
    first use), reaching ``library`` when given (the path of the ``libcuda.so.1`` the
    group's shims report, loaded first so that the bindings find it loaded), else
    whichever ``libcuda.so.1`` the loader finds. Nothing is loaded in a mount namespace
    other than the init's of this process's pid namespace, unless trusted by name
    (:mod:`._mountns`): there every path may be a pod's file."""

    def __init__(self, library: str | os.PathLike[str] | None = None) -> None:
        self._lock = threading.Lock()
        self._cu: Any = None
        self.library = None if library is None else os.fspath(library)

    def _preload(self) -> None:
        if self.library is None:
            return
        loaded = loaded_driver()
        if loaded is not None and os.path.realpath(loaded) != os.path.realpath(self.library):
            raise NativeUnavailableError(
                f"this process already runs on the CUDA driver {loaded}, "
                f"not {self.library}: one process reaches one driver"
            )
        lenient = "verify_asan_link_order=0" in os.environ.get("ASAN_OPTIONS", "")
        if not lenient and _needs_asan(self.library) and not _asan_loaded():
            # Loading it would abort this process ("ASan runtime does not come first").
            raise NativeUnavailableError(
                f"the CUDA driver {self.library} is built with AddressSanitizer and this "
                "process has no ASan runtime: LD_PRELOAD it (gcc -print-file-name=libasan.so) "
                "or set ASAN_OPTIONS=verify_asan_link_order=0, or name another driver"
            )
        import ctypes  # here: a command that only names the lock timeout loads no driver

        try:
            ctypes.CDLL(self.library, mode=os.RTLD_GLOBAL)
        except OSError as exc:
            raise NativeUnavailableError(
                f"cannot load the CUDA driver {self.library}: {exc}"
            ) from exc

    def driver(self) -> Any:
        with self._lock:
            if self._cu is not None:
                return self._cu
            foreign = _mountns.foreign()
            if foreign is not None:  # every path here may be a pod's file: load none
                raise NativeUnavailableError(f"refused to load a CUDA driver: {foreign}")
            self._preload()
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
                    f"no CUDA driver could be loaded for the native checkpoint calls ({exc}): "
                    + NO_DRIVER_HINT
                ) from exc
            err = result[0] if isinstance(result, tuple) else result
            if err != module.CUresult.CUDA_SUCCESS:
                raise NativeUnavailableError(f"cuInit(0) failed: {_result_name(module, err)}")
            self._cu = module
            return module

    def call(self, pid: int, name: str, fn: Callable[[Any], Any]) -> Any:
        """``fn(cu)``; a status other than CUDA_SUCCESS raises NativeError."""
        cu = self.driver()
        result = fn(cu)
        err = result[0] if isinstance(result, tuple) else result
        if err != cu.CUresult.CUDA_SUCCESS:
            raise NativeError(pid, name, _result_name(cu, err))
        if isinstance(result, tuple) and len(result) > 1:
            return result[1]
        return None

    def lock(self, pid: int, timeout_ms: int) -> None:
        if timeout_ms < 0:
            raise ValueError(f"lock timeout must be >= 0 ms, got {timeout_ms}")

        def go(cu: Any) -> Any:
            args = cu.CUcheckpointLockArgs()
            args.timeoutMs = timeout_ms
            return cu.cuCheckpointProcessLock(pid, args)

        self.call(pid, "cuCheckpointProcessLock", go)

    def checkpoint(self, pid: int) -> None:
        self.call(
            pid,
            "cuCheckpointProcessCheckpoint",
            lambda cu: cu.cuCheckpointProcessCheckpoint(pid, cu.CUcheckpointCheckpointArgs()),
        )

    def restore(self, pid: int) -> None:
        self.call(
            pid,
            "cuCheckpointProcessRestore",
            lambda cu: cu.cuCheckpointProcessRestore(pid, cu.CUcheckpointRestoreArgs()),
        )

    def restore_onto(self, pid: int, gpu_pairs: Sequence[tuple[str, str]]) -> None:
        """The restore with ``CUcheckpointRestoreArgs.gpuPairs`` (old UUID, new UUID)."""

        def go(cu: Any) -> Any:
            pairs = []
            for old, new in gpu_pairs:
                pair = cu.CUcheckpointGpuPair()
                pair.oldUuid = _cuuuid(cu, uuid_bytes(old))
                pair.newUuid = _cuuuid(cu, uuid_bytes(new))
                pairs.append(pair)
            args = cu.CUcheckpointRestoreArgs()
            args.gpuPairs = pairs
            args.gpuPairsCount = len(pairs)
            return cu.cuCheckpointProcessRestore(pid, args)

        self.call(pid, "cuCheckpointProcessRestore", go)

    def gpus(self) -> tuple[Gpu, ...]:
        """This node's GPUs: ordinal, UUID, name, total memory."""
        count = int(self.call(0, "cuDeviceGetCount", lambda cu: cu.cuDeviceGetCount()))
        return tuple(self._gpu(ordinal) for ordinal in range(count))

    def _gpu(self, ordinal: int) -> Gpu:
        dev = self.call(0, "cuDeviceGet", lambda cu: cu.cuDeviceGet(ordinal))
        raw = self.call(0, "cuDeviceGetUuid", lambda cu: cu.cuDeviceGetUuid(dev))
        name = self.call(0, "cuDeviceGetName", lambda cu: cu.cuDeviceGetName(64, dev))
        total = self.call(0, "cuDeviceTotalMem", lambda cu: cu.cuDeviceTotalMem(dev))
        text = bytes(name).split(b"\0", 1)[0].decode(errors="replace")
        return Gpu(ordinal, uuid_text(bytes(raw.bytes)), text, int(total))

    def unlock(self, pid: int) -> None:
        self.call(
            pid,
            "cuCheckpointProcessUnlock",
            lambda cu: cu.cuCheckpointProcessUnlock(pid, cu.CUcheckpointUnlockArgs()),
        )

    def state(self, pid: int) -> ProcessState:
        raw = self.call(
            pid, "cuCheckpointProcessGetState", lambda cu: cu.cuCheckpointProcessGetState(pid)
        )
        try:
            return ProcessState(int(raw))
        except ValueError as exc:
            raise NativeError(
                pid, "cuCheckpointProcessGetState", "CUDA_SUCCESS", f"unknown state {raw!r}"
            ) from exc

    def driver_version(self) -> int:
        """``cuDriverGetVersion``: 1000 * major + 10 * minor."""
        return int(self.call(0, "cuDriverGetVersion", lambda cu: cu.cuDriverGetVersion()))

    def restore_thread_id(self, pid: int) -> int:
        raw = self.call(
            pid,
            "cuCheckpointProcessGetRestoreThreadId",
            lambda cu: cu.cuCheckpointProcessGetRestoreThreadId(pid),
        )
        return int(raw)


def _cuuuid(cu: Any, raw: bytes) -> Any:
    """A ``CUuuid`` holding ``raw`` (its ``bytes`` is read-only in cuda.bindings)."""
    import ctypes

    uuid = cu.CUuuid()
    ctypes.memmove(uuid.getPtr(), raw, 16)
    return uuid


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


# --------------------------------------------------------------- the group
@attrs.frozen
class StepTiming:
    """One group step (lock, checkpoint, restore or unlock of every process)."""

    step: str
    seconds: float
    calls: tuple[tuple[int, float], ...]  # (pid, seconds) in call order


# What each step calls, and the state every process must be in after it.
_STEPS: Final[dict[str, tuple[str, ProcessState]]] = {
    "lock": ("cuCheckpointProcessLock", ProcessState.LOCKED),
    "checkpoint": ("cuCheckpointProcessCheckpoint", ProcessState.CHECKPOINTED),
    "restore": ("cuCheckpointProcessRestore", ProcessState.LOCKED),
    "unlock": ("cuCheckpointProcessUnlock", ProcessState.RUNNING),
}


class NativeGroupError(RuntimeError):
    """A group step failed: on which process and why, and every process's state after."""

    def __init__(
        self, step: str, pid: int, reason: str, states: dict[int, str], done: tuple[int, ...]
    ) -> None:
        super().__init__(step, pid, reason, states, done)
        self.step = step
        self.pid = pid
        self.reason = reason
        self.states = states
        self.done = done  # the pids the step had succeeded on before it stopped

    def lines(self) -> tuple[str, ...]:
        states = ", ".join(f"pid {p} {s}" for p, s in self.states.items())
        return (f"native {self.step} failed: pid {self.pid}: {self.reason}", f"states: {states}")

    def __str__(self) -> str:
        return "; ".join(self.lines())


def check_pids(pids: Sequence[int]) -> tuple[int, ...]:
    group = tuple(pids)
    if not group:
        raise ValueError("no pids given")
    if len(set(group)) != len(group):
        raise ValueError(f"pids repeat: {list(group)}")
    if any(p <= 0 for p in group):
        raise ValueError(f"pids must be positive: {list(group)}")
    return group


def state_names(backend: NativeBackend, pids: Sequence[int]) -> dict[int, str]:
    """Each pid's state name, or why asking for it failed (for reports). A stopped
    process is not asked (the call may block while it stays stopped): its state is
    unknown, and says why."""
    from .stopped import run_state

    out: dict[int, str] = {}
    for pid in pids:
        letter = run_state(pid)
        if letter in ("T", "t"):
            out[pid] = f"unknown (stopped: state {letter})"
            continue
        try:
            out[pid] = backend.state(pid).name
        except NativeError as exc:
            out[pid] = f"unknown ({exc.result})"
    return out


def run_step(
    backend: NativeBackend,
    step: str,
    pids: Sequence[int],
    *,
    lock_timeout_ms: int = DEFAULT_LOCK_TIMEOUT_MS,
    gpu_pairs: Sequence[tuple[str, str]] = (),
    clock: Callable[[], float] = time.perf_counter,
) -> StepTiming:
    """Run ``step`` (lock, checkpoint, restore, unlock) on every pid in order, then check
    that every pid reached the step's state. Stops at the first failure. A restore with
    ``gpu_pairs`` passes them as gpuPairs (a :class:`RemappingBackend` only)."""
    if step not in _STEPS:
        raise ValueError(f"unknown native step {step!r}; one of {', '.join(_STEPS)}")
    if gpu_pairs and (step != "restore" or not isinstance(backend, RemappingBackend)):
        raise ValueError(f"GPU pairs for a native {step} on {type(backend).__name__}")
    group = check_pids(pids)
    _, expected = _STEPS[step]
    calls: list[tuple[int, float]] = []
    started = clock()
    for pid in group:
        began = clock()
        try:
            if step == "lock":
                backend.lock(pid, lock_timeout_ms)
            elif gpu_pairs:
                assert isinstance(backend, RemappingBackend)
                backend.restore_onto(pid, gpu_pairs)
            else:
                getattr(backend, step)(pid)
        except NativeError as exc:
            reason = f"{exc.call} failed: {exc.result}"
            if exc.detail:
                reason += f" ({exc.detail})"
            raise NativeGroupError(
                step, pid, reason, state_names(backend, group), tuple(p for p, _ in calls)
            ) from exc
        calls.append((pid, clock() - began))
    states = state_names(backend, group)
    wrong = [p for p in group if states[p] != expected.name]
    if wrong:
        raise NativeGroupError(
            step,
            wrong[0],
            f"is {states[wrong[0]]} after the {step}, expected {expected.name}",
            states,
            tuple(p for p, _ in calls),
        )
    return StepTiming(step, clock() - started, tuple(calls))


def undo_suspend(backend: NativeBackend, pids: Sequence[int]) -> tuple[str, ...]:
    """Bring every process back to RUNNING from where a failed suspend left it: restore
    the CHECKPOINTED ones, then unlock the LOCKED ones. Returns one line per action or
    failure; a process in any other state is named and left alone."""
    lines: list[str] = []
    group = check_pids(pids)
    for pid in group:
        try:
            if backend.state(pid) is ProcessState.CHECKPOINTED:
                backend.restore(pid)
                lines.append(f"pid {pid}: native restore done")
        except NativeError as exc:
            lines.append(f"pid {pid}: native restore failed: {exc}")
    for pid in group:
        try:
            state = backend.state(pid)
            if state is ProcessState.LOCKED:
                backend.unlock(pid)
                lines.append(f"pid {pid}: native unlock done")
            elif state is not ProcessState.RUNNING:
                lines.append(f"pid {pid}: left {state.name}")
        except NativeError as exc:
            lines.append(f"pid {pid}: native unlock failed: {exc}")
    return tuple(lines)
