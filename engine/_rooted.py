"""A pod's control directory, resolved once inside the process's own root.

``PROC_ROOT/<observed pid>/root/<control dir>`` is a path a pod controls: any component
of it may be a symbolic link that the kernel, walking the path for the coordinator,
follows in the coordinator's mount namespace (``/run`` -> ``/proc/<another pod's host
pid>/root/run``), and any component may be swapped between two walks. So the directory
is opened once, as an ``O_PATH`` descriptor, by ``openat2`` from a descriptor of the
process's root with ``RESOLVE_IN_ROOT`` (``..`` and absolute names stay inside it),
``RESOLVE_NO_SYMLINKS`` (no symbolic link at any component) and
``RESOLVE_NO_MAGICLINKS`` (no ``/proc/PID/...`` jump out of it); its owner and mode are
judged on that descriptor, and every request of the run connects through it
(``/proc/self/fd/N/<socket name>``). Python 3.11 has no ``os.openat2``: the system call
is made through ctypes, and a kernel without it (before Linux 5.6) is refused by name.
"""

from __future__ import annotations

import errno
import os
import weakref
from pathlib import Path
from typing import Final

# <linux/openat2.h>
_SYS_OPENAT2: Final = {"x86_64": 437, "aarch64": 437}
RESOLVE_NO_MAGICLINKS: Final = 0x02
RESOLVE_NO_SYMLINKS: Final = 0x04
RESOLVE_IN_ROOT: Final = 0x10


class RootedError(OSError):
    """The directory could not be resolved inside the root as the rule says."""


def _syscall_number() -> int:
    machine = os.uname().machine
    if machine not in _SYS_OPENAT2:
        raise RootedError(errno.ENOSYS, f"openat2 is not known on {machine}")
    return _SYS_OPENAT2[machine]


def openat2(dir_fd: int, path: str, flags: int, resolve: int) -> int:
    """``openat2(2)``: a new descriptor, or :class:`RootedError` with the errno and
    what it means here."""
    import ctypes  # only where a pod is reached (tests/engine/test_import_cost.py)

    class OpenHow(ctypes.Structure):  # struct open_how
        _fields_ = (("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64),
                    ("resolve", ctypes.c_uint64))  # fmt: skip

    libc = ctypes.CDLL(None, use_errno=True)
    how = OpenHow(flags, 0, resolve)
    fd = libc.syscall(
        ctypes.c_long(_syscall_number()), ctypes.c_int(dir_fd), ctypes.c_char_p(os.fsencode(path)),
        ctypes.byref(how), ctypes.c_size_t(ctypes.sizeof(how)),
    )  # fmt: skip
    if fd >= 0:
        return int(fd)
    code = ctypes.get_errno()
    if code == errno.ENOSYS:
        why = "this kernel has no openat2 (Linux 5.6 or later is needed to reach a pod safely)"
    elif code == errno.ELOOP:
        why = "a component is a symbolic link (or a /proc magic link): not followed"
    elif code == errno.EXDEV:
        why = "it leads out of the process's root: not followed"
    elif code == errno.EAGAIN:
        why = "the process's root changed while it was resolved (a rename raced it)"
    else:
        why = os.strerror(code)
    raise RootedError(code, why)


def open_in_root(proc_root: Path, pid: int, control_dir: Path) -> int:
    """An ``O_PATH`` descriptor of ``control_dir`` inside process ``pid``'s root (as
    ``proc_root`` shows it), resolved with no symbolic link at any component, nothing
    outside that root and no magic link."""
    root = os.open(Path(proc_root) / str(pid) / "root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        inside = str(control_dir).lstrip("/") or "."
        return openat2(root, inside, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC,
                       RESOLVE_IN_ROOT | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS)  # fmt: skip
    finally:
        os.close(root)


class RootedDir:
    """One process's control directory, resolved at first use and held for the run:
    every request to that process's shim goes through this descriptor. Shared by the
    copies of its endpoint; closed when the last of them goes."""

    def __init__(self, proc_root: Path, pid: int, control_dir: Path) -> None:
        self.proc_root = Path(proc_root)
        self.pid = pid
        self.control_dir = Path(control_dir)
        self._fd: int | None = None
        self._problem: str | None = None
        self.missing = False  # the last resolve found no directory (or no process)
        self._finalizer: object = None

    def __reduce__(self) -> tuple[object, ...]:
        # A copy (a pickled error's endpoint) holds no descriptor: it resolves anew.
        return (type(self), (self.proc_root, self.pid, self.control_dir))

    def where(self) -> str:
        return f"{self.control_dir} inside the root of pid {self.pid} ({self.proc_root})"

    def resolve(self) -> str | None:
        """Open the directory once (later calls say the same); None, or why not. A
        directory (or process) not there is looked for again at the next request: a
        shim creates its directory when it starts."""
        self.missing = False
        if self._fd is None and self._problem is None:
            try:
                self._fd = open_in_root(self.proc_root, self.pid, self.control_dir)
            except OSError as exc:
                if exc.errno == errno.ENOENT:  # openat2's own (RootedError) included
                    self.missing = True
                    return f"control directory {self.where()} does not exist"
                self._problem = f"control directory {self.where()}: {exc.strerror}"
            else:
                self._finalizer = weakref.finalize(self, os.close, self._fd)
        return self._problem

    def fd(self) -> int:
        if self.resolve() is not None or self._fd is None:
            raise RootedError(errno.ENOENT, self._problem or "not resolved")
        return self._fd

    def stat(self) -> os.stat_result:
        return os.fstat(self.fd())

    def lstat_entry(self, name: str) -> os.stat_result:
        """What ``name`` in the directory is, not followed."""
        return os.stat(name, dir_fd=self.fd(), follow_symlinks=False)

    def address(self, name: str) -> str:
        """The path a connect names ``name`` in this directory by, through the descriptor."""
        return f"/proc/self/fd/{self.fd()}/{name}"
