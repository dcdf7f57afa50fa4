"""``manifest.json``: what a suspend did, for the resume (and the agent) to read.

The document (specs/detection.md, "The manifest")::

    {"version": 1,
     "cuinterpose": {"requested": bool, "prepared": bool},
     "participants": [{"observed_pid": int, "namespace_pid": int, "participant": str|null,
                       "gpus": [{"ordinal": int, "uuid": str, "name": str, "bytes": int}]}],
     "timings": [{"phase": str, "seconds": float, "bytes": int}],  # "phase": the step
     "created_at": str, "resumed_at": str (once resumed),
     "images": {"identity": str, "directory": str} (once `cuinterpose criu dump` wrote them),
     "origin": {"control_dir": str, "proc_root": str|null, "driver": str|null,
                "started": [int, ...]},  # where the group lives (absent before issue 29)
     "resumed_from_images": bool (once resumed after a restore from images)}

Written and read through the documents' converter (serial.py) over the classes below: strict in (an
integer is an integer, a boolean a boolean; every problem named by its path), the
same layout out. Unknown keys are ignored, so a newer agent's additions stay
readable.
"""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path
from typing import Any, Final

import attrs

from .errors import AgentError
from .gpus import Gpu
from .serial import converter, shape, to_json

MANIFEST_FILE_NAME: Final = "manifest.json"
MANIFEST_VERSION: Final = 1
_MANIFEST_MAX: Final = 1 << 20


class ManifestError(AgentError):
    """The manifest is missing, malformed, or contradicts the checkpoint directory."""


@attrs.frozen
class Process:
    """One process of the group: its pid as seen here and inside its pid namespace."""

    observed_pid: int
    namespace_pid: int

    def describe(self) -> str:
        return f"pid {self.observed_pid} (ns pid {self.namespace_pid})"


# The file (and the commands' JSON summaries) name the step ``phase``: version 1.
@shape(rename={"step": "phase"})
@attrs.frozen
class Timing:
    """One timed step: detect, capture, native_lock, native_checkpoint, native_restore,
    native_unlock, coordinator_restore (and the undo steps of a failed suspend)."""

    step: str
    seconds: float
    bytes: int = 0

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.bytes and self.seconds > 0 else 0.0


@attrs.frozen
class _Timed:
    """A timing as the file holds it, read back: version 1 names the step ``phase``."""

    phase: str
    seconds: float
    bytes: int = 0

    def timing(self) -> Timing:
        return Timing(self.phase, self.seconds, self.bytes)


@shape(omit=frozenset({"gpus"}))
@attrs.frozen
class Participant:
    observed_pid: int
    namespace_pid: int
    participant: str | None  # the shim's id; None for a native-only group
    # The GPUs the process used, from its shim (gpus.py); () when not known (a
    # native-only group, an older suspend): a restore onto other GPUs needs them.
    gpus: tuple[Gpu, ...] = ()


@attrs.frozen
class Origin:
    """Where the group lived at suspend, so that a resume from another shell (or an
    agent that knows only the directory) reaches it: the shims' control directory
    (through ``proc_root/<observed pid>/root`` when set), the driver the shims reported
    (None: none did), and each participant's start time in clock ticks (``/proc/PID/stat``
    field 22, in the participants' order; 0: unknown) that tells a process gone since from
    a new one with its pid."""

    control_dir: str
    proc_root: str | None = None
    driver: str | None = None
    started: tuple[int, ...] = ()
    # Each participant's pid namespace (the inode of /proc/PID/ns/pid, in the
    # participants' order; 0: unknown), and the suspending coordinator's own: its pids
    # are that namespace's (absent in an older manifest).
    pid_namespaces: tuple[int, ...] = ()
    coordinator_pid_namespace: int = 0


@attrs.frozen
class Flags:
    requested: bool
    prepared: bool


@attrs.frozen
class Images:
    """The CRIU images a dump of this group wrote (specs/criu.md, "The images"): the
    identity written into both the manifest and the images directory, and where."""

    identity: str
    directory: str


@shape(omit=frozenset({"resumed_at", "images", "origin", "resumed_from_images"}))
@attrs.frozen
class _Document:
    """The file's own layout."""

    version: int
    cuinterpose: Flags
    participants: tuple[Participant, ...]
    timings: tuple[_Timed, ...] = ()
    created_at: str = ""
    resumed_at: str = ""
    images: Images | None = None
    origin: Origin | None = None
    resumed_from_images: bool = False


def _document(manifest: Manifest) -> _Document:
    return _Document(
        MANIFEST_VERSION,
        Flags(manifest.requested, manifest.prepared),
        manifest.participants,
        tuple(_Timed(t.step, t.seconds, t.bytes) for t in manifest.timings),
        manifest.created_at,
        manifest.resumed_at,
        manifest.images,
        manifest.origin,
        manifest.resumed_from_images,
    )


@shape(via=_document)
@attrs.frozen
class Manifest:
    """What a suspend did: the group's opt-in (``requested``), whether capture completed
    and the state file was written (``prepared``), the group, the timings."""

    requested: bool
    prepared: bool
    participants: tuple[Participant, ...]
    timings: tuple[Timing, ...] = ()
    created_at: str = ""
    resumed_at: str = ""  # set once a resume completed: the directory may be reused
    images: Images | None = None  # set once `criu dump` wrote the group's images
    origin: Origin | None = None  # where the group lives (a manifest of before issue 29: None)
    # That resume followed a restore from images (CRIU): the images are still the
    # group's checkpoint, restorable again once that group is gone (specs/criu.md).
    resumed_from_images: bool = False

    @classmethod
    def from_json(cls, data: Any, path: Path) -> Manifest:
        def bad(*why: str) -> ManifestError:
            return _error(f"manifest {path} refused:", why)

        if not isinstance(data, dict) or data.get("version") != MANIFEST_VERSION:
            raise bad(f"not a version {MANIFEST_VERSION} manifest")
        try:
            document = converter().structure(data, _Document)
        except Exception as exc:  # cattrs' ClassValidationError: every problem by path
            from cattrs import transform_error

            raise bad(*transform_error(exc, path="$")) from None
        flags = document.cuinterpose
        if flags.prepared and not flags.requested:
            raise bad("prepared, yet cuinterpose was not requested")
        if not document.participants:
            raise bad("no participants")
        origin = document.origin
        if (
            origin is not None
            and origin.started
            and len(origin.started) != len(document.participants)
        ):
            raise bad("origin.started does not have one start time per participant")
        return cls(
            flags.requested,
            flags.prepared,
            document.participants,
            tuple(t.timing() for t in document.timings),
            document.created_at,
            document.resumed_at,
            document.images,
            origin,
            document.resumed_from_images,
        )

    def processes(self) -> tuple[Process, ...]:
        return tuple(Process(p.observed_pid, p.namespace_pid) for p in self.participants)


def _error(what: str, lines: tuple[str, ...]) -> ManifestError:
    return ManifestError(what, lines)


def write_manifest(checkpoint_dir: Path, manifest: Manifest) -> Path:
    body = json.dumps(to_json(manifest), indent=2).encode() + b"\n"
    from .statefile import write_atomically

    write_atomically(Path(checkpoint_dir), MANIFEST_FILE_NAME, body)
    return Path(checkpoint_dir) / MANIFEST_FILE_NAME


def read_manifest(checkpoint_dir: Path) -> Manifest:
    path = Path(checkpoint_dir) / MANIFEST_FILE_NAME
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise _error(
            f"no manifest at {path}:", ("nothing was suspended into this directory",)
        ) from None
    except OSError as exc:
        raise _error(f"manifest {path} unreadable:", (str(exc.strerror),)) from None
    try:
        raw = os.read(fd, _MANIFEST_MAX + 1)
    finally:
        os.close(fd)
    if len(raw) > _MANIFEST_MAX:
        raise _error(f"manifest {path} refused:", (f"larger than {_MANIFEST_MAX} bytes",))
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise _error(f"manifest {path} refused:", (f"not JSON: {exc}",)) from None
    return Manifest.from_json(data, path)


def restore_plan(manifest: Manifest, checkpoint_dir: Path) -> bool:
    """Whether the coordinator restore runs after the native restore. Prepared without a
    state file is an error, never a silent native-only restore."""
    from .statefile import STATE_FILE_NAME

    if manifest.prepared and not (Path(checkpoint_dir) / STATE_FILE_NAME).is_file():
        raise _error(
            f"manifest in {checkpoint_dir} says prepared, but there is no {STATE_FILE_NAME}:",
            ("refusing a native-only restore of a group whose sharing was torn down",),
        )
    return manifest.prepared


def resume_hint(checkpoint_dir: Path | None) -> str:
    """The command that brings natively checkpointed processes back: ``cuinterpose resume``
    with ``checkpoint_dir`` when it holds a manifest never resumed, else with the
    directory of their suspend, which nothing here records."""
    if checkpoint_dir is not None:
        try:
            held = read_manifest(checkpoint_dir)
        except ManifestError:
            held = None
        if held is not None and not held.resumed_at:
            return f"`cuinterpose resume --checkpoint-dir {shlex.quote(str(checkpoint_dir))}`"
    return "`cuinterpose resume --checkpoint-dir DIR` (DIR: the directory of their suspend)"


def recover_hint(
    checkpoint_dir: Path, control_dir: Path | None = None, proc_root: Path | None = None
) -> str:
    """The one command that brings back a group whose run stopped midway (its
    coordinator killed, a resume stopped after its native restore): ``cuinterpose
    recover`` on the run's directory, where the group lives; every verb that sees such
    a group says this same line."""
    words = ["cuinterpose", "recover", "--checkpoint-dir", str(checkpoint_dir)]
    if proc_root is not None:
        words += ["--proc-root", str(proc_root)]
    elif control_dir is not None:
        words += ["--control-dir", str(control_dir)]
    return shlex.join(words)
