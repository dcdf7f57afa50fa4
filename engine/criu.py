"""The round trip through CRIU: suspend, ``criu dump``, ``criu restore``, resume.

For a checkpoint agent whose process checkpoint is CRIU (specs/criu.md):

- :func:`usable_criu`: the CRIU binary (named, ``$CUINTERPOSE_CRIU``, else ``criu`` on
  PATH), at least 4.0, whose ``criu check`` passes; else :class:`CriuUnavailable`
  with the reason.
- :func:`before_restore`: what must hold before ``criu restore`` recreates the group:
  the manifest says it was suspended (and, when prepared, the state file is there),
  the control directory exists and is trusted, and the sockets of the processes about
  to be recreated (their published names and the names CRIU binds again) are free.
- :func:`locate`: the restored processes, found under the tree's root by their
  namespace pids (``NSpid``), with the pids they have now.
- :func:`dump` and :func:`restore`: the whole way each direction: suspend then
  ``criu dump`` (a failed dump resumes the group); ``criu restore`` then resume of the
  processes it recreated. By default the staged GPU bytes go to files beside the
  images (stored while the native checkpoint runs, :mod:`.stored`), so that the images
  hold host state only; every resume fetches them back first (engine/resumption.py).

CRIU is run without ``LD_PRELOAD``: neither the shim nor a sanitizer runtime may load
into it.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import socket
import stat
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Final, NoReturn

import attrs

from .agent import (
    AgentCallback,
    AgentError,
    GpuMap,
    Manifest,
    ManifestError,
    Process,
    ResumeResult,
    StepEvent,
    Timing,
    Where,
    gpu_pairs,
    read_manifest,
    remove_stale_sockets,
    restore_plan,
    resume,
    suspend,
)
from .client import control_dir_problem
from .directory import make_private, require_trusted
from .errors import CoordinatorError
from .images import DUMP_LOG, check_identity, intend, private_directory, seal, withdraw
from .native_checkpoint import DEFAULT_LOCK_TIMEOUT_MS, NativeBackend
from .options import Options
from .serial import shape
from .statefile import StateFileError
from .stored import IDENTITY_FILE_NAME as STORED_IDENTITY
from .stored import StoreFailed, remove_parts

CRIU_ENV: Final = "CUINTERPOSE_CRIU"
MIN_VERSION: Final = (4, 0)
RESTORE_LOG: Final = "restore.log"
RESTORED_PIDFILE: Final = "criu-restored.pid"
# The shim binds its listener under this name, then renames it to the published one
# (shim_c/lifecycle.c): CRIU binds a restored listener under the name it was bound to.
_BIND_NAME: Final = re.compile(r"\.cuinterpose-(\d+)\.[0-9a-f]+\.tmp")
_CHECK_TIMEOUT_S: Final = 120.0

# Always given to ``criu dump``: a file the job unlinked while keeping it open
# (torch.multiprocessing's POSIX semaphores in /dev/shm) is dumped as a link remap,
# which ``criu restore`` puts back; without it the dump fails ("Can't create link
# remap"), as it did on the H200.
DUMP_ARGS: Final = ("--link-remap",)


class CriuUnavailable(RuntimeError):
    """No usable CRIU: missing, too old, or its ``criu check`` fails (the reason says)."""


class CriuFailed(AgentError):
    """A ``criu`` command failed; its log's last errors are in the lines."""


class CriuDumpFailed(AgentError):
    """``criu dump`` failed after the suspend; ``restored``: the group was resumed."""

    def __init__(self, what: str, lines: Sequence[str], *, restored: bool) -> None:
        super().__init__(what, lines, changed=not restored)
        self.restored = restored


# --------------------------------------------------------------- the binary
# What to install, for a user of the package (who has no checkout and its tools/).
INSTALL_HINT: Final = (
    "install CRIU 4.0 or later, from the distribution where it packages 4.x (Debian 13 "
    "and later: apt install criu), else built from its source (https://criu.org/Installation), "
    f"and name it with --criu PATH or ${CRIU_ENV} where it is not on PATH; see "
    "https://github.com/cuinterpose/cuinterpose/blob/main/specs/criu.md#criu-on-a-machine"
)


@attrs.frozen
class Criu:
    path: Path
    version: tuple[int, ...]

    def describe(self) -> str:
        return f"{self.path} (CRIU {'.'.join(map(str, self.version))})"


def criu_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment CRIU runs in: ours without ``LD_PRELOAD``."""
    env = dict(os.environ if environ is None else environ)
    env.pop("LD_PRELOAD", None)
    return env


def find_criu(named: str | Path | None = None, environ: Mapping[str, str] | None = None) -> Path:
    """``named``, else ``$CUINTERPOSE_CRIU``, else ``criu`` on PATH (CRIU installs in sbin)."""
    env = os.environ if environ is None else environ
    wanted = str(named) if named else env.get(CRIU_ENV, "")
    if wanted:
        path = Path(wanted) if "/" in wanted else None
        found = str(path) if path is not None else shutil.which(wanted, path=env.get("PATH"))
        if not found or not os.access(found, os.X_OK) or not Path(found).is_file():
            source = "named" if named else f"${CRIU_ENV}"
            raise CriuUnavailable(f"CRIU {wanted!r} ({source}) is not an executable file")
        return Path(found)
    search = os.pathsep.join([env.get("PATH", ""), "/usr/local/sbin", "/usr/sbin", "/sbin"])
    found = shutil.which("criu", path=search)
    if found is None:
        raise CriuUnavailable(
            f"no criu on PATH (nor in /usr/local/sbin, /usr/sbin, /sbin) and ${CRIU_ENV} is "
            f"unset: {INSTALL_HINT}"
        )
    return Path(found)


def _version(text: str) -> tuple[int, ...] | None:
    match = re.search(r"Version:\s*(\d+)\.(\d+)(?:\.(\d+))?", text)
    if match is None:
        return None
    return tuple(int(part) for part in match.groups() if part is not None)


def usable_criu(named: str | Path | None = None, environ: Mapping[str, str] | None = None) -> Criu:
    """The CRIU to use, proven by ``criu --version`` (at least 4.0) and ``criu check``."""
    path = find_criu(named, environ)
    env = criu_env(environ)

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        try:
            return subprocess.run(
                [str(path), *args],
                env=env,
                capture_output=True,
                text=True,
                timeout=_CHECK_TIMEOUT_S,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise CriuUnavailable(f"{path} {' '.join(args)}: {exc}") from None

    answer = run("--version")
    version = _version(answer.stdout)
    if answer.returncode != 0 or version is None:
        tail = (answer.stderr or answer.stdout).strip()[-300:]
        raise CriuUnavailable(f"{path} --version exited {answer.returncode}: {tail}")
    if version[:2] < MIN_VERSION:
        raise CriuUnavailable(
            f"{path} is CRIU {'.'.join(map(str, version))}: at least 4.0 is needed (3.x "
            "cannot restore a vDSO on recent kernels: `vdso: Unexpected rt vDSO area bounds`): "
            + INSTALL_HINT
        )
    checked = run("check")
    if checked.returncode != 0:
        tail = (checked.stderr or checked.stdout).strip()[-500:]
        raise CriuUnavailable(f"`{path} check` exited {checked.returncode}: {tail}")
    return Criu(path, version)


# --------------------------------------------------------------- images
@shape(rename={"total": "total_bytes", "pages": "pages_bytes"})
@attrs.frozen
class ImageSize:
    """What a dump wrote: every image file, and of them the memory pages."""

    total: int
    pages: int
    files: int


def image_size(images_dir: Path) -> ImageSize:
    images = [p for p in Path(images_dir).iterdir() if p.suffix == ".img" and p.is_file()]
    sizes = {p.name: p.stat().st_size for p in images}
    pages = sum(n for name, n in sizes.items() if name.startswith("pages-"))
    return ImageSize(sum(sizes.values()), pages, len(sizes))


def _log_errors(log: Path, limit: int = 12) -> list[str]:
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError as exc:
        return [f"(no log {log}: {exc.strerror})"]
    errors = [line.strip() for line in lines if "Error" in line or "Warn" in line]
    return [*(errors[-limit:] or lines[-limit:]), f"(the whole log: {log})"]


class CriuTimedOut(CriuFailed):
    """A ``criu`` command ran past its time limit and was killed."""


def run_criu(
    criu: Criu,
    args: Sequence[str],
    log: Path,
    *,
    timeout_s: float | None = None,
    environ: Mapping[str, str] | None = None,
    own_session: bool = False,
) -> float:
    """Run ``criu ARGS -o LOG``; its seconds, or :class:`CriuFailed` with its errors.

    CRIU runs with umask 077, so that what it writes (the memory pages among them) is
    its owner's alone. Past ``timeout_s`` it is killed (:class:`CriuTimedOut`): its
    output goes to files, not pipes, so that a process it left holding them cannot
    keep this call waiting. ``own_session``: CRIU in a session of its own, out of reach
    of what is sent to this command's process group (a closed terminal's SIGHUP, a
    Ctrl-C, a ``kill`` of the group), so that a dump it began is finished whoever
    dies; this call still kills it at its time limit."""
    # LOG absolute: CRIU resolves ``-o`` against its work directory (``-D``).
    argv = [str(criu.path), *args, "-o", os.path.abspath(log), "-v4"]
    began = time.perf_counter()
    with tempfile.TemporaryFile() as err:
        try:
            child = subprocess.Popen(
                argv,
                env=criu_env(environ),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=err,
                umask=0o077,
                start_new_session=own_session,
            )
        except OSError as exc:
            raise CriuFailed(f"`{' '.join(argv)}` failed:", [str(exc)]) from None
        try:
            code = child.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
            raise CriuTimedOut(
                f"`{' '.join(argv)}` ran past its time limit of {timeout_s:g} s and was killed:",
                [*_log_errors(log, limit=4)],
            ) from None
        err.seek(0)
        stderr = err.read().decode(errors="replace")
    seconds = time.perf_counter() - began
    if code != 0:
        errors = _log_errors(log)
        hints = [*_pid_holders(errors), *_remaps_in_the_way(errors)]
        lines = [f"exit status {code}", *errors, *hints]
        if stderr.strip():
            lines.insert(1, stderr.strip()[-500:])
        raise CriuFailed(f"`{' '.join(argv)}` failed:", lines)
    return seconds


_TAKEN_PID: Final = re.compile(r"Can't fork for (\d+): File exists")
_REMAP_TAKEN: Final = re.compile(r"Can't link\s+-> \.(/\S*link_remap\.\d+)")


def _remaps_in_the_way(errors: Sequence[str]) -> list[str]:
    """For a dump that found a link-remap name taken: CRIU names the hard links it makes
    for open files that lost their name (``--link-remap``) by their id in the image, and
    the restore removes them. One left by a dump whose restore failed or never ran
    blocks a later dump of a process with the same files (multiprocessing's semaphores
    in /dev/shm)."""
    found = dict.fromkeys(m[1] for line in errors for m in _REMAP_TAKEN.finditer(line))
    return [
        f"{path} is left from an earlier dump (CRIU removes it when that dump is "
        "restored): restore that dump first, or remove the file if it is abandoned"
        for path in found
    ]


def _stats(proc: Path) -> Iterator[tuple[int, list[str]]]:
    """Every process's pid and the fields of its stat after the command (state first),
    skipping those that end while read."""
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            text = (entry / "stat").read_text()
        except OSError:
            continue
        _, closed, after = text.rpartition(")")
        if closed:
            yield int(entry.name), after.split()


def _command(pid: int | str, proc: Path) -> str:
    raw = (proc / str(pid) / "cmdline").read_bytes()
    return " ".join(part.decode(errors="replace") for part in raw.split(b"\0") if part)


def _id_users(pid: int, proc: Path) -> list[str]:
    """The processes whose process group or session is ``pid``: the kernel keeps a pid
    taken while any process (a zombie too) still uses it as such, though /proc no longer
    lists it. A dumped tree started in a session of its own leaves that session's id
    taken until every process of it, a helper the tree forked among them, is reaped."""
    users = []
    for other, fields in _stats(proc):
        state, group, session = fields[0], int(fields[2]), int(fields[3])
        role = "session" if session == pid else "process group" if group == pid else None
        if role is None:
            continue
        try:
            command = _command(other, proc) or "(no command line)"
        except OSError:
            continue  # gone meanwhile
        dead = ", a zombie its parent has not reaped" if state == "Z" else ""
        users.append(f"{role} id of pid {other} ({command}{dead})")
    return users


def _pid_holders(errors: Sequence[str], proc: Path = Path("/proc")) -> list[str]:
    """For a restore that found a pid of the tree taken: which process holds it now."""
    held = []
    for pid in dict.fromkeys(int(m[1]) for line in errors for m in _TAKEN_PID.finditer(line)):
        try:
            who = _command(pid, proc) or "(no command line)"
        except OSError as exc:
            users = _id_users(pid, proc)
            who = (
                "no process, but it is still the " + "; the ".join(users)
                if users
                else f"gone by now ({exc.strerror})"
            )
        held.append(f"pid {pid} of the tree is taken by: {who}")
    return held


# --------------------------------------------------------------- before the restore
def _trusted_control_dir(path: Path) -> None:
    """Create the control directory (0700) where it is missing, as the shim would; refuse
    one that it would not trust (CRIU binds the shims' listeners in it again)."""
    try:
        make_private(path)
    except OSError as exc:
        raise AgentError(f"cannot create control directory {path}:", [str(exc)]) from None
    problem = control_dir_problem(path)
    if problem is not None:
        raise AgentError("restore refused:", [problem])


def _listened(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(str(path))
        except OSError:
            return False
    return True


def _stale_bind_names(control_dir: Path, namespace_pids: set[int]) -> list[Path]:
    """The temporary names the processes bound their listeners to (CRIU binds them there
    again: a leftover of an earlier restore would make ``criu restore`` fail)."""
    found: list[Path] = []
    try:
        names = os.listdir(control_dir)
    except OSError:
        return found
    for name in names:
        match = _BIND_NAME.fullmatch(name)
        path = control_dir / name
        if match is None or int(match[1]) not in namespace_pids:
            continue
        if stat.S_ISSOCK(os.lstat(path).st_mode) and not _listened(path):
            found.append(path)
    return found


@attrs.frozen
class Prepared:
    """What :func:`before_restore` found and did."""

    manifest: Manifest
    removed: tuple[Path, ...]


def before_restore(
    checkpoint_dir: Path, control_dir: Path | None, images_dir: Path | None = None
) -> Prepared:
    """Check that ``criu restore`` may recreate the group of ``checkpoint_dir``, and free
    its sockets' paths in ``control_dir`` (the shims' control directory as seen here;
    None when it cannot be seen before the processes exist, e.g. a tmpfs of their mount
    namespace: then nothing is removed, and the shims re-publish their sockets).

    ``images_dir``: the images about to be restored, which must be trusted and be the
    ones the manifest records (:func:`~.images.check_identity`); checked first."""
    directory = Path(checkpoint_dir)
    require_trusted("restore", directory)
    manifest = read_manifest(directory)
    if manifest.resumed_at and not manifest.resumed_from_images:
        raise ManifestError(
            f"restore refused: the group in {directory} was resumed at {manifest.resumed_at}:",
            ["its images are older than the group that ran since; suspend and dump it again"],
        )
    if images_dir is not None:
        check_identity(Path(images_dir), directory, manifest)
    restore_plan(manifest, directory)
    if control_dir is None or not manifest.requested:
        return Prepared(manifest, ())
    control = Path(control_dir)
    _trusted_control_dir(control)
    processes = manifest.processes()
    removed = list(remove_stale_sockets(processes, Where(control)))
    for path in _stale_bind_names(control, {p.namespace_pid for p in processes}):
        path.unlink(missing_ok=True)
        removed.append(path)
    return Prepared(manifest, tuple(removed))


# --------------------------------------------------------------- after the restore
def _descendants(root: int, proc: Path) -> list[int]:
    children: dict[int, list[int]] = {}
    for pid, fields in _stats(proc):
        children.setdefault(int(fields[1]), []).append(pid)
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, ()))
    return out


def _namespace_pid(pid: int, proc: Path) -> int | None:
    """The pid in its own (innermost) pid namespace: the last ``NSpid`` field."""
    try:
        for line in (proc / str(pid) / "status").read_text().splitlines():
            if line.startswith("NSpid:"):
                return int(line.split()[-1])
    except (OSError, ValueError):
        return None
    return None


def locate(
    recorded: Sequence[Process], root: int, proc: Path = Path("/proc")
) -> tuple[Process, ...]:
    """The recorded processes as a restore recreated them under ``root`` (the tree's root
    as seen here): matched by namespace pid, with their pids here now."""
    if not (proc / str(root)).is_dir():
        raise AgentError(f"the restored tree's root, pid {root}, does not exist", [])
    found: dict[int, list[int]] = {}
    for pid in _descendants(root, proc):
        inner = _namespace_pid(pid, proc)
        if inner is not None:
            found.setdefault(inner, []).append(pid)
    problems, located = [], []
    for process in recorded:
        pids = found.get(process.namespace_pid, [])
        if len(pids) != 1:
            how = "no process" if not pids else f"processes {sorted(pids)}"
            problems.append(
                f"{process.describe()}: {how} with namespace pid {process.namespace_pid} "
                f"under the restored root pid {root}"
            )
            continue
        located.append(Process(pids[0], process.namespace_pid))
    if problems:
        raise AgentError("the restored processes cannot be told apart or are missing:", problems)
    return tuple(located)


# --------------------------------------------------------------- the verbs
DEFAULT_CRIU_TIMEOUT_S: Final = 600.0
# Where the processes a dump's --tree must hold are looked up (tests point it elsewhere).
PROC: Path = Path("/proc")


def _after_expiry(directory: Path, images: Path, pidfile: Path) -> list[str]:
    """What a restore killed half way may have left, and how to try again."""
    try:
        root = pidfile.read_text().strip()
    except OSError:
        root = ""
    left = (
        f"CRIU had restored the tree (root pid {root}, its pid file {pidfile}): its "
        "processes may be left stopped or natively CHECKPOINTED"
        if root.isdigit()
        else "CRIU wrote no pid file: the processes it had begun to recreate (if any) are "
        "left stopped, none of them running the program"
    )
    again = shlex.join(
        ["cuinterpose", "criu", "restore", "--checkpoint-dir", str(directory),
         "--images-dir", str(images)]
    )  # fmt: skip
    return [
        left,
        "the images and the manifest are untouched: end what it left (`ps` by the "
        f"group's command lines), then run again: {again} (a larger --criu-timeout if "
        "the images are large)",
    ]


@attrs.frozen
class DumpResult:
    manifest: Manifest
    images: ImageSize
    timings: tuple[Timing, ...]


@attrs.frozen
class RestoreResult:
    processes: tuple[Process, ...]
    removed: tuple[Path, ...]
    images: ImageSize
    resumed: ResumeResult
    timings: tuple[Timing, ...]


def _timed(
    name: str,
    on_event: AgentCallback | None,
    run: Callable[[], float],
    size: Callable[[], int] = lambda: 0,
) -> Timing:
    if on_event is not None:
        on_event(StepEvent(name, "started"))
    began = time.perf_counter()
    try:
        seconds = run()
    except BaseException as exc:
        if on_event is not None:
            on_event(StepEvent(name, "failed", time.perf_counter() - began, detail=str(exc)))
        raise
    timing = Timing(name, seconds, size())
    if on_event is not None:
        on_event(StepEvent(name, "done", timing.seconds, timing.bytes))
    return timing


def tree_problems(tree: int, processes: Sequence[Process], proc: Path | None = None) -> list[str]:
    """Why ``criu dump -t TREE`` would not dump every one of ``processes`` (by their pids
    here), one line each; none: it would. CRIU dumps the tree it is given, the group or
    not: a tree that leaves one out would be killed while the group stays suspended."""
    where = PROC if proc is None else proc
    if not (where / str(tree)).is_dir():
        return [f"the tree's root, pid {tree}, does not exist"]
    inside = set(_descendants(tree, where))
    return [
        f"{p.describe()} is not in the tree of pid {tree}: give --tree the root of a tree "
        "that holds every process of the group (their common ancestor)"
        for p in processes
        if p.observed_pid not in inside
    ]


def dump(
    processes: Sequence[Process | tuple[int, int]],
    checkpoint_dir: Path,
    images_dir: Path,
    *,
    tree: int,
    criu: Criu,
    where: Where,
    native: NativeBackend,
    requested: bool = True,
    options: Options | None = None,
    lock_timeout_ms: int = DEFAULT_LOCK_TIMEOUT_MS,
    criu_args: Sequence[str] = (),
    on_event: AgentCallback | None = None,
    criu_timeout_s: float = DEFAULT_CRIU_TIMEOUT_S,
    proc: Path | None = None,
    bytes_beside: bool = True,
) -> DumpResult:
    """Suspend the group, then ``criu dump -t TREE`` into ``images_dir`` (which kills the
    tree unless ``criu_args`` say ``--leave-running``). A failed dump, or one that ran
    past ``criu_timeout_s`` (CRIU is killed), leaves the tree running: the group is
    resumed (:class:`CriuDumpFailed` says whether that worked).

    Refused before anything changes: a ``tree`` that does not hold every process (its
    pids as seen in ``proc``, default /proc), and a checkpoint or images directory not
    to be trusted; both are created 0700 where missing. Before CRIU runs, the dump's
    identity (the staged parts') goes into the images directory and the manifest
    (:func:`~.images.intend`): a dump CRIU completes is restorable though this call dies
    (its log says it finished); once dumped, the images are made private and sealed
    (:func:`~.images.seal`). A dump that failed withdraws that identity.

    ``bytes_beside``: the staged GPU bytes go to files of ``checkpoint_dir`` before the
    dump, stored while the native checkpoint runs (:func:`~.suspension.suspend`'s
    ``store_beside``; the resume of a failed dump fetches them back); False leaves them
    to the images."""
    group = [p if isinstance(p, Process) else Process(*p) for p in processes]
    images = Path(os.path.abspath(images_dir))  # CRIU resolves paths against -D
    outside = tree_problems(tree, group, proc)
    if outside:
        raise AgentError("criu dump refused: nothing was changed", outside)
    private_directory(Path(checkpoint_dir), "criu dump", "checkpoint directory")
    private_directory(images, "criu dump", "images directory")

    def undone(failure: AgentError | OSError) -> NoReturn:
        """The dump failed after the suspend: resume the group (which fetches what the
        shims stored: engine/resumption.py) and say so."""
        lines = list(failure.lines()) if isinstance(failure, AgentError) else [str(failure)]
        try:
            resume(checkpoint_dir, where=where, native=native, options=options, on_event=on_event)
        except (AgentError, CoordinatorError) as error:
            lines += [f"resume: {line}" for line in error.lines()]
            raise CriuDumpFailed(
                "criu dump failed, and the group is not resumed:", lines, restored=False
            ) from failure
        lines.append("resumed: the group runs as before the suspend")
        raise CriuDumpFailed("criu dump failed:", lines, restored=True) from failure

    try:
        done = suspend(
            group,
            checkpoint_dir,
            where=where,
            native=native,
            requested=requested,
            options=options,
            lock_timeout_ms=lock_timeout_ms,
            on_event=on_event,
            store_beside=bytes_beside,
        )
    except StoreFailed as failure:  # suspended, its manifest written; the store failed
        undone(failure)
    args = ["dump", "-t", str(tree), "-D", str(images), *DUMP_ARGS, *criu_args]
    try:
        if not bytes_beside:  # an earlier dump's files would be taken for this one's at restore
            for p in done.manifest.participants:
                if p.participant:
                    remove_parts(checkpoint_dir, p.participant)
            (Path(checkpoint_dir) / STORED_IDENTITY).unlink(missing_ok=True)
        # The dump's identity in the images and the manifest before CRIU runs: a dump it
        # completes is restorable whoever dies first (engine/images.py).
        intend(images, Path(checkpoint_dir))
        timing = _timed(
            "criu_dump",
            on_event,
            lambda: run_criu(
                criu, args, images / DUMP_LOG, timeout_s=criu_timeout_s, own_session=True
            ),
            lambda: image_size(images).total,
        )
    except (AgentError, OSError, StateFileError) as failure:  # criu dump failed
        with contextlib.suppress(OSError, StateFileError, AgentError):
            withdraw(images, Path(checkpoint_dir))  # a restore refuses them all the same
        undone(failure if not isinstance(failure, StateFileError) else OSError(str(failure)))
    try:
        manifest = seal(images, Path(checkpoint_dir))
    except (OSError, StateFileError, AgentError) as exc:
        raise AgentError(
            f"criu dump wrote the images to {images}, but they could not be sealed:",
            [str(exc), "`cuinterpose criu restore` refuses them; dump the group again"],
            changed=True,
        ) from None
    steps = (*done.timings, timing)
    return DumpResult(manifest, image_size(images), steps)


def restore(
    checkpoint_dir: Path,
    images_dir: Path,
    *,
    criu: Criu,
    where: Where,
    native: NativeBackend,
    control_dir: Path | None,
    options: Options | None = None,
    criu_args: Sequence[str] = (),
    gpu_map: GpuMap | None = None,
    on_event: AgentCallback | None = None,
    criu_timeout_s: float = DEFAULT_CRIU_TIMEOUT_S,
) -> RestoreResult:
    """:func:`before_restore` (``control_dir``: the control directory as seen here before
    the processes exist; the images checked against the manifest), ``criu restore -d``
    (killed past ``criu_timeout_s``: :class:`CriuTimedOut` says what may be left and
    the command that tries again), :func:`locate` under the restored root, then
    :func:`~.agent.resume` of those processes (``where``: their control sockets once
    they run). ``gpu_map`` is checked against the manifest and this node's GPUs
    before CRIU runs (:class:`~.gpus.GpuMapRefused`), then given to the resume."""
    directory = Path(checkpoint_dir)
    images = Path(os.path.abspath(images_dir))
    prepared = before_restore(directory, control_dir, images)
    if gpu_map:
        gpu_pairs(prepared.manifest, native, gpu_map)
    # Absolute: CRIU resolves --pidfile against its work directory (the images).
    pidfile = Path(os.path.abspath(directory / RESTORED_PIDFILE))
    pidfile.unlink(missing_ok=True)
    args = ["restore", "-d", "-D", str(images), "--pidfile", str(pidfile), *criu_args]
    try:
        timing = _timed(
            "criu_restore",
            on_event,
            lambda: run_criu(criu, args, images / RESTORE_LOG, timeout_s=criu_timeout_s),
            lambda: image_size(images).total,
        )
    except CriuTimedOut as expired:
        raise CriuTimedOut(
            expired.what,
            [*expired.detail, *_after_expiry(directory, images, pidfile)],
            changed=True,
        ) from None
    try:
        root = int(pidfile.read_text().strip())
    except (OSError, ValueError) as exc:
        raise CriuFailed("criu restore wrote no pid file:", [f"{pidfile}: {exc}"]) from None
    located = locate(prepared.manifest.processes(), root)
    resumed = resume(
        directory,
        where=where,
        native=native,
        processes=located,
        restored=True,
        gpu_map=gpu_map,
        options=options,
        on_event=on_event,
    )
    return RestoreResult(
        located, prepared.removed, image_size(images), resumed, (timing, *resumed.timings)
    )


__all__ = [
    "CRIU_ENV",
    "DEFAULT_CRIU_TIMEOUT_S",
    "Criu",
    "CriuDumpFailed",
    "CriuFailed",
    "CriuTimedOut",
    "CriuUnavailable",
    "DumpResult",
    "ImageSize",
    "Prepared",
    "RestoreResult",
    "before_restore",
    "criu_env",
    "dump",
    "find_criu",
    "image_size",
    "locate",
    "restore",
    "run_criu",
    "tree_problems",
    "usable_criu",
]
