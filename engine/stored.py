"""The staged GPU bytes beside the CRIU images (specs/criu.md, "Where the bytes go").

After a suspend that the CRIU verbs will dump, each shim holds its staged copies in
host memory, which ``criu dump`` would write into the images with one thread. Instead,
:func:`store` hands every shim open files of the checkpoint directory, its *parts*
``staged-<participant>.<k>.bin`` (k from 0; ``Options.stored_parts`` of them), with
STORE_STAGED: the shim writes its copies there with its own threads, one writer per
file (buffered writes to one file serialize on its inode), and frees them, so the images
hold host state only. After ``criu restore`` (or a failed dump, before the group is
resumed), :func:`fetch` finds every part again and hands them back, in order, with
FETCH_STAGED; the shims read them into memory, checking every part first; the resume's
LOAD_ALLOCATIONS then runs as after any suspend. Only descriptors cross the control
socket: no path is shared with a process in another mount namespace.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Final

import attrs

from .client import ParticipantError, call_all
from .detection import Where
from .errors import AgentError
from .manifest import Manifest, Process
from .options import Options
from .wire import STORED_HEADER_STRUCT, STORED_MAGIC, STORED_VERSION, Op, Request, Status

FILE_PREFIX: Final = "staged-"
FILE_SUFFIX: Final = ".bin"
# A part's index as the shim's files are named: decimal, no leading zero.
_INDEX: Final = re.compile(r"0|[1-9][0-9]{0,4}")


class StoreFailed(AgentError):
    """STORE_STAGED or FETCH_STAGED failed for at least one process, or its parts are
    not all there; the lines say which and why. A shim whose STORE failed keeps its
    copies in memory; one whose FETCH failed has none in memory (its files are still
    there)."""


@attrs.frozen
class StoredFile:
    """One process's staged bytes on storage: its parts (part k the k-th), allocations
    and bytes moved, and the shim's own I/O time."""

    process: Process
    paths: tuple[Path, ...]
    allocations: int
    bytes: int
    seconds: float


def part_path(checkpoint_dir: Path, participant: str, part: int) -> Path:
    return Path(checkpoint_dir) / f"{FILE_PREFIX}{participant}.{part}{FILE_SUFFIX}"


def stored_files(checkpoint_dir: Path) -> list[Path]:
    """The staged files a checkpoint directory holds, every part of every process (what
    travels with the images)."""
    return sorted(Path(checkpoint_dir).glob(f"{FILE_PREFIX}*{FILE_SUFFIX}"))


def _named_parts(checkpoint_dir: Path, participant: str) -> dict[int, Path]:
    """Every file named as a part of ``participant``'s, by index."""
    stem = f"{FILE_PREFIX}{participant}."
    found: dict[int, Path] = {}
    for path in Path(checkpoint_dir).glob(f"{stem}*{FILE_SUFFIX}"):
        index = path.name[len(stem) : -len(FILE_SUFFIX)]
        if _INDEX.fullmatch(index):
            found[int(index)] = path
    return found


def remove_parts(checkpoint_dir: Path, participant: str) -> None:
    """Every part of ``participant``'s staged bytes gone (those of an earlier dump too)."""
    for path in _named_parts(checkpoint_dir, participant).values():
        path.unlink(missing_ok=True)


def _recorded_parts(path: Path) -> int | None:
    """The part count part 0's header records; None when it is no stored file of this
    version (the shim refuses it, saying why)."""
    try:
        with path.open("rb") as handle:
            raw = handle.read(STORED_HEADER_STRUCT.size)
    except OSError:
        return None
    if len(raw) < STORED_HEADER_STRUCT.size:
        return None
    magic, version, _, _, parts, _, _, _ = STORED_HEADER_STRUCT.unpack(raw)
    return int(parts) if (magic, version) == (STORED_MAGIC, STORED_VERSION) else None


def parts_of(checkpoint_dir: Path, participant: str) -> list[Path]:
    """``participant``'s parts, part k the k-th; [] when it has none. Raises
    :class:`StoreFailed` naming the file when one is missing (a gap, or fewer than
    part 0's header records) or one too many."""
    found = _named_parts(checkpoint_dir, participant)
    if not found:
        return []
    expected = _recorded_parts(found[0]) if 0 in found else None
    count = max(found) + 1 if expected is None else max(expected, max(found) + 1)
    missing = [part_path(checkpoint_dir, participant, k) for k in range(count) if k not in found]
    extra = [found[k] for k in sorted(found) if expected is not None and k >= expected]
    problems = [f"{p} is missing" for p in missing[:3]]
    problems += [f"{p} is one part too many" for p in extra[:3]]
    if problems:
        told = f"part 0 records {expected} parts" if expected is not None else "by their names"
        raise StoreFailed(
            f"the staged bytes of participant {participant} are not all there ({told}):",
            problems,
        )
    return [found[k] for k in range(count)]


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


def _open_all(op: Op, parts: list[list[Path]], flags: int) -> list[list[int]]:
    """Every part opened (the caller closes them); StoreFailed naming each that cannot be,
    after closing those that were."""
    opened: list[list[int]] = []
    problems: list[str] = []
    for paths in parts:
        fds: list[int] = []
        for path in paths:
            try:
                fds.append(os.open(path, flags | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600))
            except OSError as exc:
                problems.append(f"{path}: {exc.strerror}")
        opened.append(fds)
    if problems:
        _close_all(opened)
        raise StoreFailed(f"{op.name}: the files cannot be opened:", problems)
    return opened


def _close_all(opened: list[list[int]]) -> None:
    for fds in opened:
        for fd in fds:
            os.close(fd)


def _where(paths: Sequence[Path]) -> str:
    """The files of one process, so that the shim's "part k" names one of them."""
    return f"part k = {paths[0].parent}/{paths[0].name.rsplit('.', 2)[0]}.<k>.bin"


def _exchange(
    op: Op,
    pairs: list[tuple[Process, str]],
    parts: list[list[Path]],
    flags: int,
    where: Where,
    timeout: float,
) -> tuple[StoredFile, ...]:
    opened = _open_all(op, parts, flags)
    try:
        calls = [
            (where.endpoint(p), Request(op, participant=i, fds=tuple(fds)), i)
            for (p, i), fds in zip(pairs, opened, strict=True)
        ]
        replies = call_all(calls, timeout=timeout)
    finally:
        _close_all(opened)
    done: list[StoredFile] = []
    problems: list[str] = []
    for (process, _), paths, reply in zip(pairs, parts, replies, strict=True):
        if isinstance(reply, ParticipantError):
            problems.append(f"{process.describe()}: {reply}")
        elif reply.status != Status.OK:
            problems.append(
                f"{process.describe()} ({_where(paths)}): {reply.status.name}: {reply.message}"
            )
        else:
            s = reply.stats
            done.append(StoredFile(process, tuple(paths), s.count, s.bytes, s.copy_ns / 1e9))
    if problems:
        if op is Op.STORE_STAGED:  # who failed keeps its copies in memory: no file of it
            kept = {f.paths for f in done}
            for paths in parts:
                if tuple(paths) not in kept:
                    for path in paths:
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
    """STORE_STAGED to every process of a prepared ``manifest``, each into
    ``options.stored_parts`` new files of ``checkpoint_dir`` (an earlier dump's parts of
    the same process are removed first). Raises :class:`StoreFailed` naming every
    process that failed."""
    options = options or Options()
    pairs = _pairs(manifest, manifest.processes())
    for _, i in pairs:
        remove_parts(checkpoint_dir, i)
    parts = [
        [part_path(checkpoint_dir, i, k) for k in range(options.stored_parts)] for _, i in pairs
    ]
    return _exchange(
        Op.STORE_STAGED,
        pairs,
        parts,
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
    have now), each from its parts in ``checkpoint_dir``; with ``missing_ok`` (after a
    STORE that failed for some) only to those that have parts. Raises
    :class:`StoreFailed`, naming a process without parts, or a part missing or too
    many."""
    options = options or Options()
    pairs = _pairs(manifest, processes)
    found = [parts_of(checkpoint_dir, i) for _, i in pairs]
    if missing_ok:
        kept = [(pair, f) for pair, f in zip(pairs, found, strict=True) if f]
        pairs, found = [pair for pair, _ in kept], [f for _, f in kept]
    absent = [
        f"{p.describe()}: {part_path(checkpoint_dir, i, 0)} is missing"
        for (p, i), f in zip(pairs, found, strict=True)
        if not f
    ]
    if absent:
        raise StoreFailed("FETCH_STAGED: processes whose staged bytes are not there:", absent)
    size = sum(p.stat().st_size for paths in found for p in paths if p.exists())
    return _exchange(Op.FETCH_STAGED, pairs, found, os.O_RDONLY, where, options.timeout_for(size))


__all__ = [
    "StoreFailed",
    "StoredFile",
    "fetch",
    "part_path",
    "parts_of",
    "remove_parts",
    "store",
    "stored_files",
]
