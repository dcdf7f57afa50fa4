"""CRIU's images of a group: trusted as the checkpoint directory is, and bound to it.

The images hold the group's GPU bytes (staged in host memory when CRIU dumped the
processes) and ``criu restore`` writes them back into every process as root: who
may write them decides what the group runs with, who may read them sees its data
(specs/criu.md, "The images: trust and identity").

- :func:`private_directory`: a directory a verb creates is 0700; one that exists
  must pass the checkpoint directory's rule (:func:`~.directory.checkpoint_dir_problem`).
- :func:`images_problem`: that rule for the images directory, and for every file in
  it: a regular file (no link), owned by us or root, writable by nobody else.
- :func:`intend`: before CRIU runs, the dump's identity (the staged parts' beside
  them, engine/stored.py, else a new one) written into the images directory
  (``cuinterpose.images``, not yet sealed) and into the manifest, so that a dump CRIU
  completes after its coordinator died is the group's all the same;
- :func:`seal`: after a dump, the files made private (CRIU's pages follow the umask)
  and the identity record marked sealed; :func:`check_identity` refuses a restore
  whose images are not the ones the manifest records (an older dump into the same
  checkpoint directory, another group's), naming both, and images whose dump was
  never sealed unless CRIU's own log says it finished (its last line), before CRIU
  runs.
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
import stat
from pathlib import Path
from typing import Final

import attrs

from .directory import checkpoint_dir_problem, make_private, untrusted
from .errors import AgentError
from .manifest import Images, Manifest, ManifestError, read_manifest, write_manifest
from .statefile import write_atomically

IDENTITY_FILE_NAME: Final = "cuinterpose.images"
# CRIU's log of the dump (``-o``), in the images directory: its last line says whether
# the dump finished (CRIU's cr_dump_finish).
DUMP_LOG: Final = "dump.log"
DUMP_DONE: Final = "Dumping finished successfully"
_LOG_TAIL: Final = 4096
_IDENTITY_MAX: Final = 4096
_WHAT: Final = "images directory"


def private_directory(path: Path, command: str, what: str) -> None:
    """Create ``path`` mode 0700 where it is missing (its parents as ``mkdir -p`` does);
    refuse ``command`` (nothing changed) when what is there is not to be trusted."""
    path = Path(path)
    try:
        make_private(path)
    except OSError as exc:
        raise AgentError(
            f"{command} refused: cannot create the {what} {path}:", [str(exc)]
        ) from None
    problem = checkpoint_dir_problem(path, what=what)
    if problem is not None:
        raise AgentError(f"{command} refused:", [problem, "nothing was changed"])


def _file_problem(path: Path, own: int) -> str | None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None  # gone meanwhile (a log rotated): nothing of it is read
    except OSError as exc:
        return f"{path}: {exc.strerror}"
    why = untrusted(st, own, directory=False)
    if why is None:
        return None
    return f"image file {path} {why} (mode {stat.S_IMODE(st.st_mode):04o}): not trusted"


def images_problem(images_dir: Path) -> str | None:
    """Why the images in ``images_dir`` cannot be trusted, or None: the directory as the
    checkpoint directory (not a link, ours or root's, writable by nobody else), and
    every file in it a regular file of ours or root's that nobody else may write."""
    directory = Path(images_dir)
    problem = checkpoint_dir_problem(directory, what=_WHAT)
    if problem is not None:
        return problem
    if not directory.is_dir():
        return f"{_WHAT} {directory} does not exist"
    own = os.getuid()
    try:
        names = sorted(os.listdir(directory))
    except OSError as exc:
        return f"{_WHAT} {directory}: {exc.strerror}"
    for name in names:
        problem = _file_problem(directory / name, own)
        if problem is not None:
            return problem
    return None


def _make_private(images_dir: Path) -> None:
    """Every file of the images readable and writable by its owner alone."""
    for name in os.listdir(images_dir):
        try:
            fd = os.open(Path(images_dir) / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue  # a link or a special file: images_problem refuses it at restore
        try:
            st = os.fstat(fd)
            if stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) & 0o077:
                os.fchmod(fd, stat.S_IMODE(st.st_mode) & 0o700)
        finally:
            os.close(fd)


def forget(images_dir: Path) -> None:
    """Remove the identity of an earlier dump: the images about to be written are not it."""
    (Path(images_dir) / IDENTITY_FILE_NAME).unlink(missing_ok=True)


def _dump_identity(checkpoint_dir: Path, manifest: Manifest, images: Path) -> str:
    """The identity this dump's images take: the one the manifest recorded for them
    (:func:`intend`), else the staged parts' beside them, else a new one."""
    from .stored import new_identity, recorded_identity, stored_files

    if manifest.images is not None and manifest.images.directory == str(images):
        return manifest.images.identity
    if stored_files(checkpoint_dir):
        recorded = recorded_identity(checkpoint_dir)
        if recorded is not None:
            return recorded
    return new_identity()


def _record(images: Path, identity: str, directory: Path, manifest: Manifest, sealed: bool) -> None:
    body = {
        "identity": identity,
        "checkpoint_dir": str(directory.resolve()),
        "created_at": manifest.created_at,
        "sealed": sealed,
    }
    write_atomically(images, IDENTITY_FILE_NAME, json.dumps(body).encode() + b"\n")


def intend(images_dir: Path, checkpoint_dir: Path) -> Manifest:
    """Before ``criu dump`` runs: the dump's identity (the staged parts' where they were
    stored, else new) written into the images directory, not yet sealed, then into the
    manifest of ``checkpoint_dir`` (returned), and an earlier dump's log removed: a dump
    CRIU then completes is restorable whoever dies before :func:`seal` (its log says it
    finished); one it does not complete is refused."""
    images = Path(images_dir).resolve()
    directory = Path(checkpoint_dir)
    manifest = attrs.evolve(read_manifest(directory), images=None)
    identity = _dump_identity(directory, manifest, images)
    _record(images, identity, directory, manifest, sealed=False)
    (images / DUMP_LOG).unlink(missing_ok=True)
    intended = attrs.evolve(manifest, images=Images(identity, str(images)))
    write_manifest(directory, intended)
    return intended


def withdraw(images_dir: Path, checkpoint_dir: Path) -> None:
    """A dump that failed while its coordinator lives: what :func:`intend` wrote undone
    (the manifest records no images, the images directory no identity)."""
    images = Path(images_dir).resolve()
    directory = Path(checkpoint_dir)
    manifest = read_manifest(directory)
    if manifest.images is not None and manifest.images.directory == str(images):
        write_manifest(directory, attrs.evolve(manifest, images=None))
    forget(images)


def seal(images_dir: Path, checkpoint_dir: Path) -> Manifest:
    """After a dump: the images made private, and the dump's identity (the one
    :func:`intend` recorded, else the staged parts', else new) sealed into them and
    written into the manifest of ``checkpoint_dir`` (returned)."""
    images = Path(images_dir).resolve()
    directory = Path(checkpoint_dir)
    manifest = read_manifest(directory)
    _make_private(images)
    identity = _dump_identity(directory, manifest, images)
    _record(images, identity, directory, manifest, sealed=True)
    sealed = attrs.evolve(manifest, images=Images(identity, str(images)))
    write_manifest(directory, sealed)
    return sealed


def _dump_finished(images: Path) -> str | None:
    """None when CRIU's log of the dump in ``images`` ends saying it finished; else why
    not (no log, or its last line)."""
    path = images / DUMP_LOG
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        return f"there is no CRIU log of it ({path}: {exc.strerror})"
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return f"its CRIU log {path} is not a regular file"
        tail = os.pread(fd, _LOG_TAIL, max(0, st.st_size - _LOG_TAIL))
    except OSError as exc:
        return f"its CRIU log {path} cannot be read ({exc.strerror})"
    finally:
        os.close(fd)
    lines = [line.strip() for line in tail.decode(errors="replace").splitlines() if line.strip()]
    last = lines[-1] if lines else ""
    if last.endswith(DUMP_DONE):
        return None
    return f"CRIU's log {path} ends with {last[-200:]!r}, not {DUMP_DONE!r}"


def _read_identity(images_dir: Path) -> dict[str, str] | str:
    """The images' identity record, or why there is none to read."""
    path = Path(images_dir) / IDENTITY_FILE_NAME
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return (
            f"{images_dir} holds no {IDENTITY_FILE_NAME}: these are not the images of a "
            "completed `cuinterpose criu dump` (nor of `criu dump --action-script`)"
        )
    except OSError as exc:
        return f"{path}: {exc.strerror}"
    try:
        raw = os.read(fd, _IDENTITY_MAX + 1)
    finally:
        os.close(fd)
    try:
        data = json.loads(raw) if len(raw) <= _IDENTITY_MAX else None
    except ValueError:
        data = None
    keys = ("identity", "checkpoint_dir", "created_at")
    if (
        not isinstance(data, dict)
        or not all(isinstance(data.get(k), str) for k in keys)
        or not isinstance(data.get("sealed", True), bool)
    ):
        return f"{path} is not an identity record (malformed, or larger than {_IDENTITY_MAX} B)"
    # A record without "sealed" is of a cuinterpose that wrote it after the dump only.
    return {**{k: data[k] for k in keys}, "sealed": "yes" if data.get("sealed", True) else ""}


def check_identity(images_dir: Path, checkpoint_dir: Path, manifest: Manifest) -> None:
    """Refuse (:class:`~.manifest.ManifestError`, nothing changed) images that are not to
    be trusted or not the ones the manifest of ``checkpoint_dir`` records."""
    images = Path(images_dir)
    directory = Path(checkpoint_dir)
    refused = f"restore refused: the images in {images} are not the group's of {directory}:"
    problem = images_problem(images)
    if problem is not None:
        raise ManifestError("restore refused:", [problem, "nothing was changed"])
    found = _read_identity(images)
    if manifest.images is None:
        raise ManifestError(
            refused,
            [
                f"the manifest of {directory} records no images: its suspend was never "
                "followed by a completed dump",
                "nothing was changed",
            ],
        )
    if isinstance(found, str):
        raise ManifestError(refused, [found, "nothing was changed"])
    if secrets.compare_digest(found["identity"], manifest.images.identity):
        unfinished = None if found["sealed"] else _dump_finished(images)
        if unfinished is None:
            return
        resume = shlex.join(["cuinterpose", "resume", "--checkpoint-dir", str(directory)])
        raise ManifestError(
            refused,
            [
                f"the dump into {images} (identity {found['identity']}) was begun but never "
                f"sealed, and did not finish: {unfinished}",
                "criu dump failed or was killed, and left the tree running (suspended): "
                f"bring the group back with {resume}, then dump it again",
                "nothing was changed",
            ],
        )
    theirs = Path(found["checkpoint_dir"])
    recorded = manifest.images.directory
    lines = [
        f"{images} holds the images dumped at {found['created_at'] or '?'} with the "
        f"checkpoint directory {theirs} (identity {found['identity']})",
        f"the manifest of {directory} records the images dumped to {recorded} "
        f"(identity {manifest.images.identity})",
    ]
    if theirs != directory.resolve():
        lines.append(
            f"they are another group's: restore them with --checkpoint-dir {theirs}, or "
            f"this group with --images-dir {recorded}"
        )
    else:
        lines.append(f"they are an older dump of this group: its newest images are in {recorded}")
    raise ManifestError(refused, [*lines, "nothing was changed"])


__all__ = [
    "DUMP_DONE",
    "DUMP_LOG",
    "IDENTITY_FILE_NAME",
    "check_identity",
    "forget",
    "images_problem",
    "intend",
    "private_directory",
    "seal",
    "withdraw",
]
