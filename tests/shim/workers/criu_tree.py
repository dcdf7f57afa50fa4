"""A process tree of demo workers that CRIU can dump and restore, and its client.

``python criu_tree.py --token T --env-file F NAME...`` is the tree's root: a plain
process (no CUDA) that starts one worker per NAME with the environment in F (JSON)
and waits for them. A worker (``--serve NAME``) runs the demo worker's commands
(``cuinterpose.demo.worker.Worker``: create, reserve, map, fill, digest, export,
import, ...) and answers each on its own connection to an abstract
``SOCK_SEQPACKET`` socket, ``\\0cuip-tree-<token>-<name>``: one JSON request (with
the FDs it carries) per message, one JSON reply (with its FDs) back.

Why not the suite's :class:`cuinterpose.demo.Worker`: its pipes and socket pair lead
out of the tree to the test runner, which CRIU cannot dump. Here nothing connects
the tree to the outside while it is idle: a listening socket is dumped and
restored with its name, and the client simply connects again. The root is started
in a new session with its output on files, so that ``criu dump`` needs no
``--shell-job``.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

SOCKET_PREFIX: Final = "cuip-tree"
_MESSAGE_MAX: Final = 1 << 16
_PR_SET_CHILD_SUBREAPER: Final = 36


def address(token: str, name: str) -> str:
    return f"\0{SOCKET_PREFIX}-{token}-{name}"


# ---------------------------------------------------------------- the tree's side
# A command handler: (op, arguments) -> the reply's fields; raising answers the error.
Handler = Callable[[str, dict[str, Any]], dict[str, Any]]


def serve(token: str, name: str, handle: Handler) -> int:
    """Answer one request per connection until ``quit``. Served here: ``pid``, ``fds``
    (what each descriptor is), ``take_fd`` (the FD goes back with the reply) and
    ``give_fd`` (the FD came with the request: its number here); the rest ``handle``."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    listener.bind(address(token, name))
    listener.listen(8)
    while True:
        conn, _ = listener.accept()
        with conn:
            message, fds, _, _ = socket.recv_fds(conn, _MESSAGE_MAX, 4)
            if not message:
                continue
            request = json.loads(message)
            op = request.pop("op")
            out_fds: list[int] = []
            try:
                if op == "quit":
                    conn.send(json.dumps({"ok": True}).encode())
                    return 0
                if op == "pid":
                    reply: dict[str, Any] = {"ok": True, "pid": os.getpid()}
                elif op == "fds":
                    reply = {"ok": True, "fds": _descriptors()}
                elif op == "take_fd":
                    out_fds = [int(request["fd"])]
                    reply = {"ok": True}
                elif op == "give_fd":
                    if len(fds) != 1:
                        raise RuntimeError(f"give_fd carries {len(fds)} FDs, not 1")
                    reply = {"ok": True, "fd": fds[0]}
                else:
                    reply = {"ok": True, **handle(op, request)}
            except Exception as exc:
                reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
                for key in ("call", "result"):  # a CUDA call's name and CUresult
                    if hasattr(exc, key):
                        reply[key] = getattr(exc, key)
            socket.send_fds(conn, [json.dumps(reply).encode()], out_fds)
            if op == "take_fd" and request.get("close"):
                os.close(out_fds[0])


def _serve_demo_worker(token: str, name: str, device: int) -> int:
    from cuinterpose.demo import worker as demo  # cuda.bindings: in the worker only

    worker = demo.Worker(None, device)

    def handle(op: str, request: dict[str, Any]) -> dict[str, Any]:
        method = getattr(worker, f"do_{op}", None)
        if not callable(method):
            raise ValueError(f"unknown op {op!r}")
        return dict(method(**request))

    return serve(token, name, handle)


def _descriptors() -> dict[str, str]:
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the directory's own descriptor is gone
            out[fd] = os.readlink(f"/proc/self/fd/{fd}")
    return out


def _root(token: str, env_file: Path, names: Sequence[str], device: int) -> int:
    env = json.loads(env_file.read_text())
    children = [
        subprocess.Popen(
            [sys.executable, __file__, "--serve", name, "--token", token, "--device", str(device)],
            env=env,
            stdin=subprocess.DEVNULL,
        )
        for name in names
    ]
    signal.signal(signal.SIGTERM, lambda *_: [c.kill() for c in children])
    status = 0
    for child in children:
        status |= child.wait()
    return status


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--token", required=True)
    parser.add_argument("--serve", metavar="NAME")
    parser.add_argument("--env-file", type=Path)
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("names", nargs="*")
    args = parser.parse_args()
    if args.serve:
        return _serve_demo_worker(args.token, args.serve, args.device)
    return _root(args.token, args.env_file, args.names, args.device)


# ---------------------------------------------------------------- the client
class TreeError(RuntimeError):
    pass


class TreeWorker:
    """One worker of the tree, reached by its socket's name (its pid after ``pid``)."""

    def __init__(self, token: str, name: str) -> None:
        self.token = token
        self.name = name
        self.pid = 0

    def call(
        self, op: str, *, fds: Sequence[int] = (), timeout_s: float = 120.0, **args: Any
    ) -> tuple[dict[str, Any], list[int]]:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
            s.settimeout(timeout_s)
            s.connect(address(self.token, self.name))
            socket.send_fds(s, [json.dumps({"op": op, **args}).encode()], list(fds))
            message, got, _, _ = socket.recv_fds(s, _MESSAGE_MAX, 4)
        if not message:
            raise TreeError(f"{self.name}: {op}: the worker closed without answering")
        return json.loads(message), got

    def check(self, op: str, **args: Any) -> dict[str, Any]:
        reply, fds = self.call(op, **args)
        for fd in fds:
            os.close(fd)
        if not reply.get("ok"):
            raise TreeError(f"{self.name} (pid {self.pid}): {op} failed: {reply}")
        return reply

    def answers(self) -> bool:
        try:
            self.pid = int(self.check("pid")["pid"])
        except (ConnectionRefusedError, FileNotFoundError):
            return False
        return True

    def take_fd(self, fd: int, *, close: bool = False) -> int:
        reply, fds = self.call("take_fd", fd=fd, close=close)
        if not reply.get("ok") or len(fds) != 1:
            for extra in fds:
                os.close(extra)
            raise TreeError(f"{self.name}: take_fd {fd}: {reply}")
        return fds[0]

    def give_fd(self, fd: int) -> int:
        reply, _ = self.call("give_fd", fds=[fd])
        if not reply.get("ok"):
            raise TreeError(f"{self.name}: give_fd: {reply}")
        return int(reply["fd"])

    def send_fd_to(self, other: TreeWorker, fd: int) -> int:
        mine = self.take_fd(fd, close=True)
        try:
            return other.give_fd(mine)
        finally:
            os.close(mine)

    def create_mapped(
        self, size: int, *, handle_type: str = "posix", seed: int | None = None
    ) -> tuple[int, int]:
        handle = int(self.check("create", size=size, handle_type=handle_type)["handle"])
        va = self.map_at_new_va(handle, size)
        if seed is not None:
            self.check("fill", va=va, size=size, seed=seed)
        return handle, va

    def map_at_new_va(self, handle: int, size: int) -> int:
        va = int(self.check("reserve", size=size)["va"])
        self.check("map", va=va, size=size, handle=handle)
        self.check("set_access", va=va, size=size)
        return va

    def digest(self, va: int, size: int) -> str:
        return str(self.check("digest", va=va, size=size)["digest"])


class Tree:
    """The tree's root process and its workers, started in a new session.

    By default the root is this file's (a demo worker per name, on ``env``); ``program``
    (given the token) is another root's command line, whose workers serve ``names``
    with :func:`serve` and whose environment is ``env``.
    """

    def __init__(
        self,
        names: Sequence[str],
        env: Mapping[str, str],
        work_dir: Path,
        *,
        root_env: Mapping[str, str] | None = None,
        device: int = 0,
        program: Callable[[str], list[str]] | None = None,
    ) -> None:
        self.token = f"{os.getpid()}-{time.monotonic_ns():x}"
        self.work_dir = work_dir
        self.log_path = work_dir / f"tree-{self.token}.log"
        if program is None:
            env_file = work_dir / f"tree-{self.token}.env.json"
            env_file.write_text(json.dumps(dict(env)))
            argv = [sys.executable, __file__, "--token", self.token, "--env-file", str(env_file)]
            argv += ["--device", str(device), *names]
            environment = dict(root_env if root_env is not None else env)
        else:
            argv, environment = program(self.token), dict(env)
        with self.log_path.open("ab") as log:
            self.root = subprocess.Popen(
                argv,
                env=environment,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
                close_fds=True,
            )
        self.root_pid = self.root.pid
        self.workers = {name: TreeWorker(self.token, name) for name in names}

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        for worker in self.workers.values():
            while not worker.answers():
                if not self.restored_pid_alive():
                    raise TreeError(f"the tree's root exited: {self.log_tail()}")
                if time.monotonic() > deadline:
                    raise TreeError(f"{worker.name} not ready in {timeout_s} s: {self.log_tail()}")
                time.sleep(0.02)

    def restored_pid_alive(self) -> bool:
        """Is the root's pid alive (a child of ours, or restored)?"""
        return _state(self.root_pid) not in ("Z", "?")

    def pids(self) -> list[int]:
        return [w.pid for w in self.workers.values()]

    def log_tail(self, limit: int = 4000) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-limit:]
        return ""

    def reap(self, timeout_s: float = 30.0) -> None:
        """Collect the tree's processes once they ended (``criu dump`` kills them), so that
        their pids, the session's among them, are free for ``criu restore``. The root is
        our child; its workers, the helpers a program forks (torch's resource tracker),
        and a restored root are ours through :func:`subreaper`. The session's id stays
        taken while any process of the session, a zombie too, is left, though /proc no
        longer lists the root: every one of them must be gone."""
        if self.root.returncode is None:
            self.root.wait(timeout=timeout_s)
        deadline = time.monotonic() + timeout_s
        # A process still exiting (a GPU context's teardown can take seconds) may hide
        # its stat file before /proc drops it: one seen in the session is waited for
        # until /proc no longer has it.
        left = set(self.pids())
        while left := {p for p in left | _in_session(self.root_pid) if Path(f"/proc/{p}").exists()}:
            for pid in left:
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, os.WNOHANG)
            if time.monotonic() > deadline:
                states = ", ".join(f"{pid} {_state(pid)}" for pid in sorted(left))
                raise TreeError(f"the tree's processes did not end: {states}")
            time.sleep(0.01)

    def close(self) -> None:
        """Ask every worker to quit, then collect the tree; kill what is left."""
        for worker in self.workers.values():
            with contextlib.suppress(OSError, TreeError):
                worker.call("quit", timeout_s=10)
        try:
            self.reap(timeout_s=30)
        except (TreeError, subprocess.TimeoutExpired):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.root_pid, signal.SIGKILL)
            self.reap(timeout_s=30)


@contextlib.contextmanager
def subreaper() -> Iterator[None]:
    """This process adopts its descendants' orphans while the block runs: the workers of
    a dumped tree (their root is gone) and a tree restored by ``criu restore -d`` (whose
    parent, CRIU, exits), so that they can be collected and their pids reused."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
    try:
        yield
    finally:
        libc.prctl(_PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)


class TreeGroup:
    """The creator/importer group of tests/shim/agentgroup.py on a tree: the creator holds
    X (exportable, filled with SEED_X) and P (private, SEED_P), the importer maps X."""

    SEED_X = 71
    SEED_P = 72

    def __init__(self, tree: Tree, size: int) -> None:
        self.tree = tree
        self.creator = tree.workers["creator"]
        self.importer = tree.workers["importer"]
        self.size = size
        self.handle, self.creator_x = self.creator.create_mapped(size, seed=self.SEED_X)
        _, self.creator_p = self.creator.create_mapped(size, handle_type="none", seed=self.SEED_P)
        self.importer_x = self.share(self.handle)

    def share(self, handle: int) -> int:
        """Export ``handle`` from the creator, import and map it in the importer: its VA."""
        fd = int(self.creator.check("export", handle=handle)["fd"])
        theirs = self.creator.send_fd_to(self.importer, fd)
        imported = int(self.importer.check("import", fd=theirs)["handle"])
        return self.importer.map_at_new_va(imported, self.size)

    @property
    def processes(self) -> list[tuple[int, int]]:
        return [(p, p) for p in self.tree.pids()]

    def mismatches(self, seed_x: int = SEED_X) -> list[str]:
        from cuinterpose.demo import pattern_digest

        checks = [
            (self.creator, "creator X", self.creator_x, seed_x),
            (self.creator, "creator P", self.creator_p, self.SEED_P),
            (self.importer, "importer X", self.importer_x, seed_x),
        ]
        bad = []
        for worker, label, va, seed in checks:
            reply, _ = worker.call("digest", va=va, size=self.size)
            if not reply.get("ok") or reply.get("digest") != pattern_digest(seed, self.size):
                bad.append(f"{label} (pid {worker.pid}, VA {va:#x}): {reply}")
        return bad


def thread_states(pids: Sequence[int]) -> str:
    """Each thread of each process: its name, where it sleeps (``wchan``), its system
    call and, where readable (root), its kernel stack. What a failed round trip needs
    to say: a shim whose listener thread is not in ``poll`` cannot heal its endpoint
    (shim_c/control.c)."""
    lines = []
    for pid in pids:
        task = Path(f"/proc/{pid}/task")
        try:
            tids = sorted(task.iterdir(), key=lambda t: int(t.name))
        except OSError as exc:
            lines.append(f"pid {pid}: {exc.strerror}")
            continue
        lines.append(f"pid {pid}: {len(tids)} threads")
        for tid in tids:
            fields = []
            for name in ("comm", "wchan", "syscall", "stack"):
                with contextlib.suppress(OSError):
                    text = (tid / name).read_text(errors="replace").strip()
                    fields.append(f"{name}={' | '.join(text.splitlines()[:6])}")
            lines.append(f"  {tid.name} " + " ".join(fields))
    return "\n".join(lines)


def _in_session(session: int) -> set[int]:
    """The processes, zombies among them, whose session is ``session``."""
    members = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        if int(fields[3]) == session:
            members.add(int(entry.name))
    return members


def _state(pid: int) -> str:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "?"
    return text.rsplit(")", 1)[1].split()[0]


if __name__ == "__main__":
    sys.exit(main())
