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

Every store has an identity (:func:`new_identity`), the dump's: the CRIU images are
sealed with the same one (engine/images.py). :func:`store` records it first, in
``cuinterpose.stored`` of the checkpoint directory (so that a coordinator killed
during the store leaves it for ``recover``), then hands it to every shim, which writes
it into every part and sums every stripe with it as the seed; a fetch names it again,
and the shim refuses a part of any other dump, naming both. Every part is held to the
checkpoint directory's trust rule (no link, a regular file, root's or ours, writable
by nobody else) before it is opened for a shim, and :func:`check_parts` checks what
can be known without reading the data (trust, headers, identity, sizes) before a
resume's native restore.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import stat
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Final

import attrs

from .client import Endpoint, ParticipantError, call_all
from .detection import Where
from .directory import untrusted
from .errors import AgentError
from .manifest import Manifest, Process
from .options import Options
from .statefile import StateFileError, utc_timestamp, write_atomically
from .wire import (
    ID_LEN,
    STORED_ALIGN,
    STORED_ENTRY_STRUCT,
    STORED_HEADER_STRUCT,
    STORED_MAGIC,
    STORED_STRIPE,
    STORED_SUM_STRUCT,
    STORED_VERSION,
    Op,
    Request,
    Status,
)

FILE_PREFIX: Final = "staged-"
FILE_SUFFIX: Final = ".bin"
# A part's index as the shim's files are named: decimal, no leading zero.
_INDEX: Final = re.compile(r"0|[1-9][0-9]{0,4}")
# The identity of the newest store, written before any shim is asked (engine/images.py
# seals the images with it).
IDENTITY_FILE_NAME: Final = "cuinterpose.stored"
_IDENTITY_MAX: Final = 4096
_HEX_ID: Final = re.compile(r"[0-9a-f]{32}")


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


def new_identity() -> str:
    """A dump's identity: 16 random bytes, as 32 lowercase hex digits."""
    return secrets.token_hex(ID_LEN)


def record_identity(checkpoint_dir: Path, identity: str) -> None:
    """``identity`` durably in ``cuinterpose.stored``, before any shim stores with it.
    Raises :class:`StoreFailed` (nothing stored) when it cannot be written."""
    body = {"identity": identity, "recorded_at": utc_timestamp()}
    try:
        write_atomically(Path(checkpoint_dir), IDENTITY_FILE_NAME, json.dumps(body).encode())
    except StateFileError as exc:
        raise StoreFailed("STORE_STAGED was not sent:", [str(exc)]) from None


def recorded_identity(checkpoint_dir: Path) -> str | None:
    """The identity of the newest store into ``checkpoint_dir``; None when none was
    recorded (no store, or one by a cuinterpose before the stored format's version 3).
    Raises :class:`StoreFailed` naming the file when it is a link, not a regular file
    or not a record."""
    path = Path(checkpoint_dir) / IDENTITY_FILE_NAME
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise StoreFailed(
            f"the staged bytes' identity: {path}:", [exc.strerror or str(exc)]
        ) from None
    try:
        st = os.fstat(fd)
        why = untrusted(st, os.getuid(), directory=False)
        raw = os.read(fd, _IDENTITY_MAX + 1) if why is None else b""
    finally:
        os.close(fd)
    if why is not None:
        raise StoreFailed(f"the staged bytes' identity: {path} {why}: not trusted", [])
    try:
        data = json.loads(raw) if len(raw) <= _IDENTITY_MAX else None
    except ValueError:
        data = None
    found = data.get("identity") if isinstance(data, dict) else None
    if not isinstance(found, str) or not _HEX_ID.fullmatch(found):
        raise StoreFailed(f"the staged bytes' identity: {path} is not an identity record", [])
    return found


# --------------------------------------------------------------- the layout
# As shim_c/stored.c lays the parts out (protocol.h), to check them before a shim reads.
def _align(value: int) -> int:
    return -(-value // STORED_ALIGN) * STORED_ALIGN


@attrs.frozen
class Layout:
    """The parts of one process's store: ``count`` allocations, ``parts`` files, a
    stream of ``length`` bytes."""

    count: int
    parts: int
    length: int

    @property
    def stripes(self) -> int:
        return -(-self.length // STORED_STRIPE)

    def mine(self, k: int) -> int:
        """The stripes part k holds."""
        return (self.stripes - 1 - k) // self.parts + 1 if k < self.stripes else 0

    def sums_at(self, k: int) -> int:
        return STORED_HEADER_STRUCT.size + (self.count * STORED_ENTRY_STRUCT.size if k == 0 else 0)

    def head_end(self, k: int) -> int:
        return self.sums_at(k) + self.mine(k) * STORED_SUM_STRUCT.size

    def data_offset(self, k: int) -> int:
        return _align(self.head_end(k))

    def stripe_at(self, s: int) -> int:
        """Stripe s's first byte in its part."""
        return self.data_offset(s % self.parts) + s // self.parts * STORED_STRIPE

    def size(self, k: int) -> int:
        """What part k must measure."""
        n = self.mine(k)
        if not n:
            return self.head_end(k)
        data = n * STORED_STRIPE
        if (self.stripes - 1) % self.parts == k:
            data -= self.stripes * STORED_STRIPE - self.length
        return self.data_offset(k) + data


@attrs.frozen
class PartHeader:
    """A part's header (protocol.h's ``cuip_stored_header``), its text fields decoded."""

    magic: int
    version: int
    count: int
    part: int
    parts: int
    total: int  # the bytes of every allocation
    data_offset: int
    participant: str
    identity: str
    stripes: int

    @classmethod
    def unpack(cls, raw: bytes) -> PartHeader:
        magic, version, count, part, parts, total, offset, writer, identity, stripes = (
            STORED_HEADER_STRUCT.unpack_from(raw)
        )
        return cls(
            magic, version, count, part, parts, total, offset,
            writer.rstrip(b"\0").decode(errors="replace"), identity.hex(), stripes,
        )  # fmt: skip


def _header(raw: bytes) -> PartHeader | None:
    if len(raw) < STORED_HEADER_STRUCT.size:
        return None
    return PartHeader.unpack(raw)


def _recorded_parts(path: Path) -> int | None:
    """The part count part 0's header records; None when it is no stored file of this
    version (the shim refuses it, saying why)."""
    try:
        with path.open("rb") as handle:
            head = _header(handle.read(STORED_HEADER_STRUCT.size))
    except OSError:
        return None
    if head is None or (head.magic, head.version) != (STORED_MAGIC, STORED_VERSION):
        return None
    return head.parts


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


def _open_trusted(path: Path, flags: int) -> int | str:
    """``path`` opened for a shim, or why not: an existing part (no O_CREAT) must pass the
    checkpoint directory's rule, on its name (no link) and on what was opened (the same
    file, a regular file, root's or ours, writable by nobody else), before a byte of it
    is read."""
    if not flags & os.O_CREAT:
        try:
            named = os.lstat(path)
        except OSError as exc:
            return f"{path}: {exc.strerror}"
        if stat.S_ISLNK(named.st_mode) or not stat.S_ISREG(named.st_mode):
            why = untrusted(named, os.getuid(), directory=False)
            return f"staged part {path} {why}: not trusted, nothing of it was read"
    try:
        fd = os.open(path, flags | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, 0o600)
    except OSError as exc:
        return f"{path}: {exc.strerror}"
    st = os.fstat(fd)
    why = untrusted(st, os.getuid(), directory=False)
    if (
        why is None
        and not flags & os.O_CREAT
        and (st.st_dev, st.st_ino)
        != (
            named.st_dev,
            named.st_ino,
        )
    ):
        why = "was replaced while it was opened"
    if why is None:
        return fd
    os.close(fd)
    mode = stat.S_IMODE(st.st_mode)
    return f"staged part {path} {why} (mode {mode:04o}): not trusted, nothing of it was read"


def _open_all(op: Op, parts: list[list[Path]], flags: int) -> list[list[int]]:
    """Every part opened (the caller closes them); StoreFailed naming each that cannot be
    (or is not to be trusted), after closing those that were."""
    opened: list[list[int]] = []
    problems: list[str] = []
    for paths in parts:
        fds: list[int] = []
        for path in paths:
            got = _open_trusted(path, flags)
            if isinstance(got, int):
                fds.append(got)
            else:
                problems.append(got)
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
    where: Where | Callable[[Process], Endpoint],
    timeout: float,
    identity: str,
) -> tuple[StoredFile, ...]:
    opened = _open_all(op, parts, flags)
    dump = bytes.fromhex(identity)
    reach = where.endpoint if isinstance(where, Where) else where
    try:
        calls = [
            (reach(p), Request(op, participant=i, resource_id=dump, fds=tuple(fds)), i)
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
    identity: str | None = None,
) -> tuple[StoredFile, ...]:
    """STORE_STAGED to every process of a prepared ``manifest``, each into
    ``options.stored_parts`` new files of ``checkpoint_dir`` (an earlier dump's parts of
    the same process are removed first), with ``identity`` (default a new one), recorded
    first (:func:`record_identity`). Raises :class:`StoreFailed` naming every process
    that failed."""
    options = options or Options()
    identity = identity or new_identity()
    pairs = _pairs(manifest, manifest.processes())
    record_identity(checkpoint_dir, identity)
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
        identity,
    )


def _part_problem(path: Path, k: int, n: int, participant: str, identity: str) -> str | None:
    """Why part k of ``n`` cannot be what the shim of ``participant`` stored with
    ``identity``, from its header; or None (its size is checked against the table)."""
    try:
        with path.open("rb") as handle:
            head = _header(handle.read(STORED_HEADER_STRUCT.size))
    except OSError as exc:
        return f"{path}: {exc.strerror}"
    if head is None:
        return f"{path} is shorter than a part's header ({STORED_HEADER_STRUCT.size} bytes)"
    if head.magic != STORED_MAGIC:
        return f"{path} is not a stored file (magic {head.magic:#x})"
    if head.version != STORED_VERSION:
        return (
            f"{path} is of the stored format's version {head.version}; this cuinterpose "
            f"reads version {STORED_VERSION} only (version 2 carries no identity and no "
            "sums): fetch it with the cuinterpose that stored it"
        )
    if (head.part, head.parts) != (k, n):
        return f"{path} says it is part {head.part} of {head.parts}, not part {k} of {n}"
    if head.participant != participant:
        return f"{path} was written by participant {head.participant}, not {participant}"
    if head.identity != identity:
        return (
            f"{path} is of dump {head.identity}, not of dump {identity}, the newest store "
            f"recorded in {IDENTITY_FILE_NAME} (an earlier store's part?)"
        )
    return None


def _table_layout(path: Path, n: int) -> Layout | str:
    """The layout part 0's header and table give (checked by its header first)."""
    try:
        with path.open("rb") as handle:
            head = PartHeader.unpack(handle.read(STORED_HEADER_STRUCT.size))
            want = head.count * STORED_ENTRY_STRUCT.size
            # No more than the file holds: a count that lies costs no memory.
            room = os.fstat(handle.fileno()).st_size - STORED_HEADER_STRUCT.size
            table = handle.read(min(want, max(room, 0)))
    except OSError as exc:
        return f"{path}: {exc.strerror}"
    if len(table) < want:
        return f"{path}: its table of {head.count} entries is cut short"
    length = 0
    for i in range(head.count):
        _, size, offset = STORED_ENTRY_STRUCT.unpack_from(table, i * STORED_ENTRY_STRUCT.size)
        length = max(length, offset + size)
    return Layout(head.count, n, length)


def check_parts(checkpoint_dir: Path, participants: Sequence[str]) -> list[str]:
    """What can be known of the stored parts of ``participants`` without reading their
    data, one line per problem (none: a fetch may go ahead): the identity recorded, and
    for each participant that has parts, every part there, trusted (no link, a regular
    file, root's or ours, writable by nobody else), a part of this dump by this
    participant in its place, and of the size its table gives. The shim checks all of it
    again, and every stripe's sum as it reads."""
    try:
        identity = recorded_identity(checkpoint_dir)
        found = [(i, parts_of(checkpoint_dir, i)) for i in participants]
    except StoreFailed as failure:
        return list(failure.lines())
    found = [(i, paths) for i, paths in found if paths]
    if found and identity is None:
        return [
            f"{checkpoint_dir} holds staged parts but no {IDENTITY_FILE_NAME}: they were "
            f"stored by a cuinterpose before the stored format's version {STORED_VERSION} "
            "(fetch them with that one), or the record was removed"
        ]
    problems: list[str] = []
    for participant, paths in found:
        assert identity is not None
        own: list[str] = []  # this participant's: the layout is read only from good parts
        for k, path in enumerate(paths):
            got = _open_trusted(path, os.O_RDONLY)
            if isinstance(got, str):
                own.append(got)
                continue
            os.close(got)
            why = _part_problem(path, k, len(paths), participant, identity)
            if why is not None:
                own.append(why)
        problems += own
        if own:
            continue
        layout = _table_layout(paths[0], len(paths))
        if isinstance(layout, str):
            problems.append(layout)
            continue
        for k, path in enumerate(paths):
            size, want = path.stat().st_size, layout.size(k)
            if size != want:
                problems.append(f"{path} has {size} bytes, its table says {want}")
    return problems


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
    many, or one :func:`check_parts` refuses."""
    return fetch_pairs(
        checkpoint_dir,
        _pairs(manifest, processes),
        where=where,
        options=options,
        missing_ok=missing_ok,
    )


def fetch_pairs(
    checkpoint_dir: Path,
    pairs: Sequence[tuple[Process, str]],
    *,
    where: Where | Callable[[Process], Endpoint],
    options: Options | None = None,
    missing_ok: bool = False,
    precheck: bool = True,
) -> tuple[StoredFile, ...]:
    """:func:`fetch` to processes named with their participant ids (a ``recover`` knows
    them from the shims, where no manifest was written), reached through ``where`` (or,
    given a function, its endpoint for each process). Without ``precheck`` the parts are
    not looked into first (:func:`check_parts`): only opened as trusted and handed over,
    for a shim that may still hold its bytes in memory (a coordinator killed between
    making the files and its STORE_STAGED) reads none of them, and one that stored
    checks every field and sum as it reads."""
    options = options or Options()
    pairs = list(pairs)
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
    if not pairs:
        return ()
    problems = check_parts(checkpoint_dir, [i for _, i in pairs]) if precheck else []
    if problems:
        raise StoreFailed("FETCH_STAGED refused: the staged parts are not the ones stored:",
                          problems)  # fmt: skip
    identity = recorded_identity(checkpoint_dir)
    if identity is None:  # check_parts refuses parts without one
        raise StoreFailed(
            f"FETCH_STAGED refused: {checkpoint_dir} holds staged parts but no "
            f"{IDENTITY_FILE_NAME} (the identity every part was stored with)",
            [],
        )
    size = sum(p.stat().st_size for paths in found for p in paths)
    return _exchange(
        Op.FETCH_STAGED, pairs, found, os.O_RDONLY, where, options.timeout_for(size), identity
    )


__all__ = [
    "IDENTITY_FILE_NAME",
    "Layout",
    "PartHeader",
    "StoreFailed",
    "StoredFile",
    "check_parts",
    "fetch",
    "fetch_pairs",
    "new_identity",
    "part_path",
    "parts_of",
    "recorded_identity",
    "remove_parts",
    "store",
    "stored_files",
]
