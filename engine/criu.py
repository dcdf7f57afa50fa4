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
  images (:func:`store_beside` before the dump, :func:`fetch_beside` before the resume:
  :mod:`.stored`), so that the images hold host state only.

CRIU is run without ``LD_PRELOAD``: neither the shim nor a sanitizer runtime may load
into it.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import stat
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Final

import attrs

from .agent import (
    AgentCallback,
    AgentError,
    Manifest,
    ManifestError,
    Process,
    ResumeResult,
    StepEvent,
    Timing,
    Where,
    read_manifest,
    remove_stale_sockets,
    restore_plan,
    resume,
    suspend,
)
from .client import control_dir_problem
from .errors import CoordinatorError
from .native import DEFAULT_LOCK_TIMEOUT_MS, NativeBackend
from .options import Options
from .stored import fetch, staged_path, store

CRIU_ENV: Final = "CUINTERPOSE_CRIU"
MIN_VERSION: Final = (4, 0)
DUMP_LOG: Final = "dump.log"
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
            "unset: build CRIU 4.x with tools/build_criu.sh"
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
            "cannot restore a vDSO on recent kernels: `vdso: Unexpected rt vDSO area bounds`)"
        )
    checked = run("check")
    if checked.returncode != 0:
        tail = (checked.stderr or checked.stdout).strip()[-500:]
        raise CriuUnavailable(f"`{path} check` exited {checked.returncode}: {tail}")
    return Criu(path, version)


# --------------------------------------------------------------- images
@attrs.frozen
class ImageSize:
    """What a dump wrote: every image file, and of them the memory pages."""

    total: int
    pages: int
    files: int

    def to_json(self) -> dict[str, int]:
        return {"total_bytes": self.total, "pages_bytes": self.pages, "files": self.files}


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


def run_criu(
    criu: Criu,
    args: Sequence[str],
    log: Path,
    *,
    timeout_s: float | None = None,
    environ: Mapping[str, str] | None = None,
) -> float:
    """Run ``criu ARGS -o LOG``; its seconds, or :class:`CriuFailed` with its errors."""
    argv = [str(criu.path), *args, "-o", str(log), "-v4"]
    began = time.perf_counter()
    try:
        done = subprocess.run(
            argv,
            env=criu_env(environ),
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise CriuFailed(f"`{' '.join(argv)}` failed:", [str(exc)]) from None
    seconds = time.perf_counter() - began
    if done.returncode != 0:
        errors = _log_errors(log)
        hints = [*_pid_holders(errors), *_remaps_in_the_way(errors)]
        lines = [f"exit status {done.returncode}", *errors, *hints]
        if done.stderr.strip():
            lines.insert(1, done.stderr.strip()[-500:])
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
        path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        os.mkdir(path, 0o700)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            os.fchmod(fd, 0o700)  # mkdir's mode passes the umask
        finally:
            os.close(fd)
    except FileExistsError:
        pass
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


def before_restore(checkpoint_dir: Path, control_dir: Path | None) -> Prepared:
    """Check that ``criu restore`` may recreate the group of ``checkpoint_dir``, and free
    its sockets' paths in ``control_dir`` (the shims' control directory as seen here;
    None when it cannot be seen before the processes exist, e.g. a tmpfs of their mount
    namespace: then nothing is removed, and the shims re-publish their sockets)."""
    directory = Path(checkpoint_dir)
    manifest = read_manifest(directory)
    if manifest.resumed_at:
        raise ManifestError(
            f"restore refused: the group in {directory} was resumed at {manifest.resumed_at}:",
            ["its images are older than the group that ran since; suspend and dump it again"],
        )
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


def store_beside(
    checkpoint_dir: Path,
    manifest: Manifest,
    *,
    where: Where,
    options: Options | None = None,
    staged_bytes: int = 0,
    on_event: AgentCallback | None = None,
) -> Timing | None:
    """After a suspend: every shim's staged copies into its file of ``checkpoint_dir``
    (:func:`.stored.store`), timed as ``store_staged``; None when nothing was staged
    (the group was not prepared)."""
    if not manifest.prepared:
        return None
    files: list[int] = []

    def run() -> float:
        done = store(
            checkpoint_dir, manifest, where=where, options=options, staged_bytes=staged_bytes
        )
        files.append(sum(f.bytes for f in done))
        return max((f.seconds for f in done), default=0.0)

    return _timed("store_staged", on_event, run, lambda: files[0] if files else 0)


def fetch_beside(
    checkpoint_dir: Path,
    manifest: Manifest,
    processes: Sequence[Process],
    *,
    where: Where,
    options: Options | None = None,
    on_event: AgentCallback | None = None,
    missing_ok: bool = False,
) -> Timing | None:
    """Before the resume of a dumped group: every shim's staged copies back from its file
    (:func:`.stored.fetch`), timed as ``fetch_staged``; None when the dump left them in
    the images (no file is there). ``missing_ok``: after a failed dump, only the shims
    whose STORE went through have a file."""
    ids = [p.participant for p in manifest.participants]
    if not manifest.prepared or not any(i and staged_path(checkpoint_dir, i).exists() for i in ids):
        return None
    files: list[int] = []

    def run() -> float:
        done = fetch(
            checkpoint_dir,
            manifest,
            processes,
            where=where,
            options=options,
            missing_ok=missing_ok,
        )
        files.append(sum(f.bytes for f in done))
        return max((f.seconds for f in done), default=0.0)

    return _timed("fetch_staged", on_event, run, lambda: files[0] if files else 0)


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
    bytes_beside: bool = True,
) -> DumpResult:
    """Suspend the group, then ``criu dump -t TREE`` into ``images_dir`` (which kills the
    tree unless ``criu_args`` say ``--leave-running``). A failed dump leaves the tree
    running: the group is resumed (:class:`CriuDumpFailed` says whether that worked).
    ``bytes_beside``: the staged GPU bytes go to files of ``checkpoint_dir`` before the
    dump (:func:`store_beside`); False leaves them to the images."""
    images = Path(images_dir)
    images.mkdir(parents=True, exist_ok=True)
    done = suspend(
        processes,
        checkpoint_dir,
        where=where,
        native=native,
        requested=requested,
        options=options,
        lock_timeout_ms=lock_timeout_ms,
        on_event=on_event,
    )
    stored: Timing | None = None
    try:
        if bytes_beside:
            staged = done.staging.allocation_bytes if done.staging else 0
            stored = store_beside(
                checkpoint_dir,
                done.manifest,
                where=where,
                options=options,
                staged_bytes=staged,
                on_event=on_event,
            )
        else:  # an earlier dump's files would be taken for this one's at restore
            for p in done.manifest.participants:
                if p.participant:
                    staged_path(checkpoint_dir, p.participant).unlink(missing_ok=True)
        args = ["dump", "-t", str(tree), "-D", str(images), *DUMP_ARGS, *criu_args]
        timing = _timed(
            "criu_dump",
            on_event,
            lambda: run_criu(criu, args, images / DUMP_LOG),
            lambda: image_size(images).total,
        )
    except AgentError as failure:  # criu dump failed, or STORE_STAGED did
        lines = list(failure.lines())
        try:
            # The bytes the shims stored must be in memory before LOAD_ALLOCATIONS.
            fetch_beside(
                checkpoint_dir,
                done.manifest,
                done.manifest.processes(),
                where=where,
                options=options,
                on_event=on_event,
                missing_ok=True,
            )
            resume(checkpoint_dir, where=where, native=native, options=options, on_event=on_event)
        except (AgentError, CoordinatorError) as error:
            lines += [f"resume: {line}" for line in error.lines()]
            raise CriuDumpFailed(
                "criu dump failed, and the group is not resumed:", lines, restored=False
            ) from failure
        lines.append("resumed: the group runs as before the suspend")
        raise CriuDumpFailed("criu dump failed:", lines, restored=True) from failure
    steps = (*done.timings, *((stored,) if stored else ()), timing)
    return DumpResult(done.manifest, image_size(images), steps)


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
    on_event: AgentCallback | None = None,
) -> RestoreResult:
    """:func:`before_restore` (``control_dir``: the control directory as seen here before
    the processes exist), ``criu restore -d``, :func:`locate` under the restored root,
    then :func:`~.agent.resume` of those processes (``where``: their control sockets
    once they run)."""
    directory = Path(checkpoint_dir)
    images = Path(images_dir)
    prepared = before_restore(directory, control_dir)
    pidfile = directory / RESTORED_PIDFILE
    pidfile.unlink(missing_ok=True)
    args = ["restore", "-d", "-D", str(images), "--pidfile", str(pidfile), *criu_args]
    timing = _timed(
        "criu_restore",
        on_event,
        lambda: run_criu(criu, args, images / RESTORE_LOG),
        lambda: image_size(images).total,
    )
    try:
        root = int(pidfile.read_text().strip())
    except (OSError, ValueError) as exc:
        raise CriuFailed("criu restore wrote no pid file:", [f"{pidfile}: {exc}"]) from None
    located = locate(prepared.manifest.processes(), root)
    fetched = fetch_beside(
        directory, prepared.manifest, located, where=where, options=options, on_event=on_event
    )
    resumed = resume(
        directory,
        where=where,
        native=native,
        processes=located,
        restored=True,
        options=options,
        on_event=on_event,
    )
    steps = (timing, *((fetched,) if fetched else ()), *resumed.timings)
    return RestoreResult(located, prepared.removed, image_size(images), resumed, steps)


__all__ = [
    "CRIU_ENV",
    "Criu",
    "CriuDumpFailed",
    "CriuFailed",
    "CriuUnavailable",
    "DumpResult",
    "ImageSize",
    "Prepared",
    "RestoreResult",
    "before_restore",
    "criu_env",
    "dump",
    "fetch_beside",
    "find_criu",
    "image_size",
    "locate",
    "restore",
    "run_criu",
    "store_beside",
    "usable_criu",
]
