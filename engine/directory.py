"""The checkpoint directory: one coordinator at a time, and what the files in it say.

Besides the state file, a directory holds:

- ``cuinterpose.lock``: locked (``flock``) by the coordinator working on the
  directory, and holding its pid, so that a second one is refused by name; removed
  by the run that created it when it ends;
- ``cuinterpose.intent``: written durably before a capture's first destructive
  op (participants and topology, as in the state file) and removed once the
  state file is written or the group is rolled back; present, it says a
  capture was interrupted and ``cuinterpose recover`` must run;
- ``cuinterpose.restored``: written once a restore completed, naming the state
  file it restored (its ``created_at``), so that a capture refuses to overwrite
  a capture nobody has restored yet unless told to replace it.

Every file is opened without following links, and must be a regular file; the
directory itself must be trusted (:func:`checkpoint_dir_problem`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import pwd
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Final

from .errors import AgentError
from .statefile import (
    STATE_FILE_NAME,
    CheckpointState,
    StateFileError,
    fsync_directory,
    read_state,
    utc_timestamp,
    write_atomically,
    write_state,
)

LOCK_FILE_NAME: Final = "cuinterpose.lock"
INTENT_FILE_NAME: Final = "cuinterpose.intent"
RESTORED_FILE_NAME: Final = "cuinterpose.restored"
_MARKER_MAX: Final = 4096


class DirectoryBusy(Exception):
    """Another coordinator holds the checkpoint directory."""


class DirectoryUntrusted(DirectoryBusy):
    """The checkpoint directory is not one to trust: nothing is read or written there."""


def _owner(uid: int) -> str:
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def untrusted(st: os.stat_result, own: int, *, directory: bool) -> str | None:
    """Why what ``st`` (an lstat) describes is not to be trusted, as a phrase ("is a
    symbolic link ..."), or None: the one rule of the checkpoint directory, its images
    directory and every image file: no link, the kind expected, root's or ``own``'s,
    writable by nobody else."""
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link (never followed)"
    if directory and not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if not directory and not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if st.st_uid not in (0, own):
        return f"is owned by {_owner(st.st_uid)}, not by root nor {_owner(own)}"
    if stat.S_IMODE(st.st_mode) & (stat.S_IWGRP | stat.S_IWOTH):
        return "is writable by group or others"
    return None


def checkpoint_dir_problem(
    directory: Path, own_uid: int | None = None, *, what: str = "checkpoint directory"
) -> str | None:
    """Why the checkpoint directory cannot be trusted, or None (also when it is missing).

    As for the control directory: not a symbolic link (it is never followed), a real
    directory, owned by the caller (``own_uid``, default ours) or root, writable by
    nobody else (a sticky parent such as /tmp is fine for its parent, not for the
    directory itself). Otherwise its owner, or whoever may write it, could plant or
    swap the state file between a prepare and its restore. ``what`` names the directory
    in the answer (the CRIU images directory is held to the same rule)."""
    own = os.getuid() if own_uid is None else own_uid
    path = Path(directory)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"{what} {path}: {exc.strerror}"
    why = untrusted(st, own, directory=True)
    if why is None:
        return None
    mode = stat.S_IMODE(st.st_mode)
    return (
        f"{what} {path} {why} (owner {_owner(st.st_uid)}, mode {mode:04o}): "
        "not trusted; use a directory of your own, mode 0700 or 0755"
    )


def make_private(path: Path) -> None:
    """Create ``path`` mode 0700 where it is missing (its parents as ``mkdir -p`` does);
    one already there is left as it is, for the caller's trust check. Raises OSError."""
    path = Path(path)
    path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        return
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        os.fchmod(fd, 0o700)  # mkdir's mode passes the umask
    finally:
        os.close(fd)


def require_trusted(command: str, directory: Path) -> None:
    """Refuse ``command`` (an :class:`~.errors.AgentError`, nothing changed) in a
    checkpoint directory that is not one to trust."""
    problem = checkpoint_dir_problem(directory)
    if problem is not None:
        raise AgentError(f"{command} refused:", [problem, "nothing was changed"])


def _holder(fd: int) -> str:
    try:
        text = os.pread(fd, 64, 0).decode("ascii", "replace").strip()
    except OSError:
        return "another coordinator"
    return f"coordinator pid {text}" if text.isdigit() else "another coordinator"


def _open_lock(path: Path) -> tuple[int, bool]:
    """The lock file's descriptor, and whether this call created it."""
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        try:
            return os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o600), True
        except FileExistsError:
            return os.open(path, flags), False
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise DirectoryBusy(f"{path} is a symbolic link; refused") from exc
        raise


def _same_file(fd: int, path: Path) -> bool:
    """Whether ``path`` still names the file open as ``fd`` (a holder that created the
    lock file removes it when it is done: a lock taken on the removed file is no lock)."""
    try:
        named = os.lstat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)


@contextlib.contextmanager
def locked(directory: Path) -> Iterator[None]:
    """Hold the directory's lock for the block; :class:`DirectoryBusy` when another does.

    The lock dies with its holder, so a killed coordinator leaves nothing to clean up;
    a run that created the lock file removes it when it is done (still holding the
    lock), so that a run, refused or not, leaves the directory as it found it.
    """
    path = Path(directory) / LOCK_FILE_NAME
    problem = checkpoint_dir_problem(Path(directory))
    if problem is not None:
        raise DirectoryUntrusted(problem)
    if not Path(directory).is_dir():
        yield  # nothing there to protect; the machine's own checks say what is missing
        return
    for _ in range(8):  # each retry: a holder removed the file between open and flock
        fd, created = _open_lock(path)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise DirectoryBusy(f"{path} is not a regular file")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise DirectoryBusy(
                    f"checkpoint directory {directory} is in use by {_holder(fd)}"
                ) from None
        except BaseException:
            os.close(fd)
            raise
        if _same_file(fd, path):
            break
        os.close(fd)
    else:
        raise DirectoryBusy(f"checkpoint directory {directory}: its lock file keeps changing")
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        if created:
            with contextlib.suppress(OSError):
                path.unlink()
        os.close(fd)


def in_use(directory: Path) -> str | None:
    """Who holds the directory's lock now (a coordinator's run in flight), or None: a
    look that changes nothing (no lock file is created, none is kept)."""
    path = Path(directory) / LOCK_FILE_NAME
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None  # no lock file: nobody holds it
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _holder(fd)
        return None
    finally:
        os.close(fd)  # the shared lock, if taken, goes with it


def interrupted_capture(directory: Path) -> bool:
    """Whether ``directory`` holds the intent of a capture whose coordinator is gone (no
    run holds the directory's lock)."""
    try:
        return _regular(Path(directory) / INTENT_FILE_NAME) and in_use(directory) is None
    except StateFileError:
        return False  # not a file under the name: the verbs' own checks refuse it


def unrestored_capture(directory: Path) -> bool:
    """Whether ``directory`` holds a completed capture's state file that no restore (nor
    recover) has marked done."""
    try:
        if not _regular(Path(directory) / STATE_FILE_NAME):
            return False
        held = read_state(directory)
    except (StateFileError, OSError):
        return False  # unreadable: the verbs' own reads say what is wrong
    return _restored_created_at(directory) != held.created_at


def _regular(path: Path) -> bool:
    """Whether ``path`` exists, refusing anything but a regular file under the name."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return False
    if not stat.S_ISREG(info.st_mode):
        raise StateFileError(path, "is not a regular file; refused")
    return True


def write_intent(directory: Path, state: CheckpointState) -> Path:
    return write_state(directory, state, INTENT_FILE_NAME)


def read_intent(directory: Path) -> CheckpointState | None:
    """The recorded intent of an interrupted capture, or None when there is none."""
    if not _regular(Path(directory) / INTENT_FILE_NAME):
        return None
    return read_state(directory, INTENT_FILE_NAME)


def promote_intent(directory: Path) -> Path:
    """Make the intent the state file: one rename, so the capture never re-encodes its record.

    The intent holds the state file's document already (participants and topology do
    not change between the first destructive op and the end of a capture); the
    rename replaces any older state file atomically and the directory fsync makes
    it durable.
    """
    directory = Path(directory)
    target = directory / STATE_FILE_NAME
    try:
        os.rename(directory / INTENT_FILE_NAME, target)
        fsync_directory(directory)
    except OSError as exc:
        raise StateFileError(target, f"not written: {exc.strerror or exc}") from exc
    return target


def clear_intent(directory: Path) -> str | None:
    """Remove the intent once the group is back; None, or why it could not be.

    Never raises: it runs after the work is done, and an intent left behind only
    makes the next ``prepare`` ask for ``recover``, which finds the group ACTIVE
    and removes it."""
    path = Path(directory) / INTENT_FILE_NAME
    try:
        path.unlink(missing_ok=True)
    except OSError as exc:
        return f"{path} could not be removed ({exc.strerror}): run `cuinterpose recover` once"
    with contextlib.suppress(OSError):  # removed; only its durability is unsure
        fsync_directory(directory)
    return None


def mark_restored(directory: Path, state: CheckpointState) -> None:
    """Record that the state file of ``state`` was restored (atomically, durably)."""
    body = json.dumps({"state_created_at": state.created_at, "restored_at": utc_timestamp()})
    write_atomically(Path(directory), RESTORED_FILE_NAME, body.encode() + b"\n")


def finish_restore(directory: Path, state: CheckpointState) -> tuple[str, ...]:
    """After a restore: record it, or when that cannot be written (a full disk, a file
    size limit), retire the state file instead, so that the directory takes a new
    capture either way. Never raises (the group runs already): what went wrong, if
    anything, one line each."""
    directory = Path(directory)
    try:
        mark_restored(directory, state)
        return ()
    except StateFileError as exc:
        if (directory / RESTORED_FILE_NAME).is_file() and exc.problem.startswith("written, but"):
            return (f"the group runs; {exc}",)
        problem = str(exc)
    target = directory / STATE_FILE_NAME
    try:
        target.unlink(missing_ok=True)
    except OSError as exc:
        return (
            f"the group runs, but {problem}, and {target} could not be removed either "
            f"({exc.strerror}): the next prepare into {directory} needs --replace",
        )
    with contextlib.suppress(OSError):
        fsync_directory(directory)
    return (
        f"the group runs, but {problem}; {target} (restored) was removed instead, so "
        f"{directory} takes a new prepare",
    )


def _restored_created_at(directory: Path) -> str | None:
    path = Path(directory) / RESTORED_FILE_NAME
    if not _regular(path):
        return None
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        raw = os.read(fd, _MARKER_MAX)
    finally:
        os.close(fd)
    try:
        value = json.loads(raw).get("state_created_at")
    except (ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


def capture_problem(directory: Path, *, replace: bool) -> str | None:
    """Why a capture must not write into ``directory``, or None when it may.

    The directory must exist and take a new file (proved by creating and removing
    one, not by ``access``), hold no interrupted capture, and, unless ``replace``,
    hold no capture that was never restored.
    """
    directory = Path(directory)
    if not directory.is_dir():
        return f"checkpoint directory {directory} does not exist"
    try:
        if _regular(directory / INTENT_FILE_NAME):
            return (
                f"checkpoint directory {directory} holds an interrupted capture "
                f"({INTENT_FILE_NAME}): run `cuinterpose recover` first"
            )
        holds_state = _regular(directory / STATE_FILE_NAME)  # refuses a non-file there
        if not replace and holds_state:
            try:
                held = read_state(directory)
            except StateFileError:
                held = None
            if held is None or _restored_created_at(directory) != held.created_at:
                return (
                    f"checkpoint directory {directory} holds a capture that was never "
                    "restored; restore it, or pass --replace to overwrite it"
                )
    except StateFileError as exc:
        return str(exc)
    probe = directory / f".cuinterpose.probe.{os.getpid()}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        os.close(fd)
        probe.unlink()
    except OSError as exc:
        return f"checkpoint directory {directory} cannot take the state file: {exc.strerror}"
    return None
