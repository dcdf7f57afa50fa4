"""The staged GPU bytes beside the CRIU images (specs/criu.md, "Where the bytes go").

After a suspend that the CRIU verbs will dump, each shim holds its staged copies in
host memory, which ``criu dump`` would write into the images with one thread. Instead,
:func:`store` hands every shim an open file of the checkpoint directory
(``staged-<participant>.bin``) with STORE_STAGED: the shim writes its copies there with
its own threads and frees them, so the images hold host state only. After ``criu
restore`` (or a failed dump, before the group is resumed), :func:`fetch` hands the same
files back with FETCH_STAGED and the shims read them into memory, checking them first;
the resume's LOAD_ALLOCATIONS then runs as after any suspend. Only descriptors cross
the control socket: no path is shared with a process in another mount namespace.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Final

import attrs

from .client import ParticipantError, call_all
from .detection import Where
from .errors import AgentError
from .manifest import Manifest, Process
from .options import Options
from .wire import Op, Request, Status

FILE_PREFIX: Final = "staged-"
FILE_SUFFIX: Final = ".bin"


class StoreFailed(AgentError):
    """STORE_STAGED or FETCH_STAGED failed for at least one process; the lines say which
    and why. A shim whose STORE failed keeps its copies in memory; one whose FETCH
    failed has none in memory (its file is still there)."""


@attrs.frozen
class StoredFile:
    """One process's staged bytes on storage: its file, allocations and bytes moved,
    and the shim's own I/O time."""

    process: Process
    path: Path
    allocations: int
    bytes: int
    seconds: float


def staged_path(checkpoint_dir: Path, participant: str) -> Path:
    return Path(checkpoint_dir) / f"{FILE_PREFIX}{participant}{FILE_SUFFIX}"


def stored_files(checkpoint_dir: Path) -> list[Path]:
    """The staged files a checkpoint directory holds (what travels with the images)."""
    return sorted(Path(checkpoint_dir).glob(f"{FILE_PREFIX}*{FILE_SUFFIX}"))


def _pairs(manifest: Manifest, processes: Sequence[Process]) -> list[tuple[Process, str]]:
    """Each process with its participant id: all of the manifest's, in its order (their
    pids may be new: a CRIU restore), or some of them as recorded (the survivors)."""
    ids = [p.participant for p in manifest.participants]
    recorded = manifest.processes()
    if len(processes) == len(ids):
        pairs = list(zip(processes, ids, strict=True))
    else:
        index = {p: k for k, p in enumerate(recorded)}
        strangers = [p.describe() for p in processes if p not in index]
        if strangers:
            raise StoreFailed("the staged bytes: processes not in the manifest:", strangers)
        pairs = [(p, ids[index[p]]) for p in processes]
    missing = [p.describe() for p, i in pairs if i is None]
    if missing:
        raise StoreFailed("the staged bytes: processes without a shim:", missing)
    return [(p, i) for p, i in pairs if i is not None]


def _exchange(
    op: Op,
    pairs: list[tuple[Process, str]],
    paths: list[Path],
    flags: int,
    where: Where,
    timeout: float,
) -> tuple[StoredFile, ...]:
    fds: list[int] = []
    problems: list[str] = []
    try:
        for path in paths:
            try:
                fds.append(os.open(path, flags | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600))
            except OSError as exc:
                problems.append(f"{path}: {exc.strerror}")
        if problems:
            raise StoreFailed(f"{op.name}: the files cannot be opened:", problems)
        calls = [
            (where.endpoint(p), Request(op, participant=i, fd=fd), i)
            for (p, i), fd in zip(pairs, fds, strict=True)
        ]
        replies = call_all(calls, timeout=timeout)
    finally:
        for fd in fds:
            os.close(fd)
    done: list[StoredFile] = []
    for (process, _), path, reply in zip(pairs, paths, replies, strict=True):
        if isinstance(reply, ParticipantError):
            problems.append(f"{process.describe()}: {reply}")
        elif reply.status != Status.OK:
            problems.append(f"{process.describe()}: {reply.status.name}: {reply.message}")
        else:
            stats = reply.stats
            done.append(StoredFile(process, path, stats.count, stats.bytes, stats.copy_ns / 1e9))
    if problems:
        if op is Op.STORE_STAGED:  # who failed keeps its copies in memory: no file of it
            kept = {f.path for f in done}
            for path in paths:
                if path not in kept:
                    path.unlink(missing_ok=True)
        raise StoreFailed(f"{op.name} failed:", problems, changed=op is Op.STORE_STAGED)
    return tuple(done)


def store(
    checkpoint_dir: Path,
    manifest: Manifest,
    *,
    where: Where,
    options: Options | None = None,
    staged_bytes: int = 0,
) -> tuple[StoredFile, ...]:
    """STORE_STAGED to every process of a prepared ``manifest``, each into a new file of
    ``checkpoint_dir`` (an older one of the same name is replaced). Raises
    :class:`StoreFailed` naming every process that failed."""
    options = options or Options()
    pairs = _pairs(manifest, manifest.processes())
    paths = [staged_path(checkpoint_dir, i) for _, i in pairs]
    for path in paths:
        path.unlink(missing_ok=True)
    return _exchange(
        Op.STORE_STAGED,
        pairs,
        paths,
        os.O_CREAT | os.O_EXCL | os.O_RDWR,
        where,
        options.timeout_for(staged_bytes),
    )


def fetch(
    checkpoint_dir: Path,
    manifest: Manifest,
    processes: Sequence[Process],
    *,
    where: Where,
    options: Options | None = None,
    missing_ok: bool = False,
) -> tuple[StoredFile, ...]:
    """FETCH_STAGED to ``processes`` (the manifest's, in its order, with the pids they
    have now), each from its file of ``checkpoint_dir``; with ``missing_ok`` (after a
    STORE that failed for some) only to those whose file is there. Raises
    :class:`StoreFailed`."""
    options = options or Options()
    pairs = _pairs(manifest, processes)
    if missing_ok:
        pairs = [(p, i) for p, i in pairs if staged_path(checkpoint_dir, i).exists()]
    paths = [staged_path(checkpoint_dir, i) for _, i in pairs]
    size = sum(p.stat().st_size for p in paths if p.exists())
    return _exchange(Op.FETCH_STAGED, pairs, paths, os.O_RDONLY, where, options.timeout_for(size))


__all__ = ["StoreFailed", "StoredFile", "fetch", "staged_path", "store", "stored_files"]
