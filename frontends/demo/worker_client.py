"""The client of the worker application (``worker.py`` beside this file).

One :class:`Worker` per worker process: JSON commands in on its stdin, JSON replies out
on its stdout, file descriptors over a socket pair. The demo and ``bench/checkpoint.py``
drive it with commands (``check("create", ...)``); the test suite also sends it Python
snippets (``w("result = ...")``, the ``exec`` command) to reach any driver call.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any, Final

# The worker application ships with the package: the demo runs from any directory.
WORKER_SCRIPT: Final = Path(__file__).resolve().parent / "worker.py"
DEFAULT_CALL_TIMEOUT_S: Final = 120.0
SANITIZER_MARK: Final = "Sanitizer"


class DemoError(RuntimeError):
    """Something in the demo scenario did not go as it must (names process and step)."""


class WorkerError(DemoError):
    """A worker answered an error, died, or did not answer in time."""

    def __init__(self, worker: str, op: str, reply: Mapping[str, Any], stderr: str = "") -> None:
        self.worker = worker
        self.op = op
        self.reply = dict(reply)
        self.result = str(reply.get("result", ""))
        text = f"{worker}: {op} failed: {reply.get('error', reply)}"
        if reply.get("trace"):
            text += f"\n{reply['trace']}"
        if stderr:
            text += f"\n--- {worker} stderr (tail) ---\n{stderr}"
        super().__init__(text)


class Worker:
    """One worker process: JSON commands in, JSON replies out, FDs over a socketpair.

    Commands: :meth:`call` / :meth:`check` (and the wrappers below). Snippets:
    ``w(code)`` runs Python code in the worker and returns what it left in ``result``;
    :meth:`send` starts one without waiting, :meth:`answered` tells whether it has
    answered yet (to show that a call blocks), :meth:`reply` takes the answer. FDs: a
    snippet's ``send_fd(fd)`` arrives here through :meth:`take_fd`; :meth:`give_fd`
    sends one for the snippet's ``recv_fd()``; :meth:`send_fd_to` relays one between
    two workers by command.
    """

    def __init__(
        self,
        name: str,
        env: Mapping[str, str],
        *,
        device: int = 0,
        python: str | None = None,
        log_dir: Path | None = None,
        timeout_s: float = DEFAULT_CALL_TIMEOUT_S,
        wait: bool = True,
        init_cuda: bool = True,
    ) -> None:
        """Start the worker; with ``wait=False``, call :meth:`wait_ready` before using it
        (several workers then start in parallel). ``init_cuda=False``: the worker makes
        no CUDA call before a command needs one (snippets set CUDA up themselves)."""
        if not WORKER_SCRIPT.is_file():
            raise DemoError(f"the worker application is missing: {WORKER_SCRIPT}")
        self.name = name
        self.timeout_s = timeout_s
        self._chan, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        log_dir = (
            Path(tempfile.mkdtemp(prefix="cuinterpose-worker-")) if log_dir is None else log_dir
        )
        self.stderr_path = log_dir / f"{name}.stderr"
        self._stderr: IO[bytes] = self.stderr_path.open("wb")
        argv = [python or sys.executable, str(WORKER_SCRIPT), "--channel", str(child_end.fileno())]
        argv += ["--device", str(device)]
        if not init_cuda:
            argv.append("--no-cuda-init")
        try:
            self.proc = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=self._stderr,
                env=dict(env),
                pass_fds=(child_end.fileno(),),
                bufsize=0,
            )
        finally:
            child_end.close()
        self.pid = self.proc.pid
        self._ready = False
        self._pending = b""
        self._unanswered = False  # a snippet started with send() awaits its reply()
        self._closed = False
        if wait:
            self.wait_ready()

    def wait_ready(self) -> Worker:
        """Wait for the worker's startup line (it has initialized CUDA, unless told not to)."""
        if not self._ready:
            ready = self._read("startup")
            if not ready.get("ok"):
                self.kill()
                raise WorkerError(self.name, "startup", ready, self.stderr_tail())
            self.pid = int(ready["pid"])
            self._ready = True
        return self

    def __repr__(self) -> str:
        return f"Worker({self.name}, pid {getattr(self, 'pid', '?')})"

    @property
    def closed(self) -> bool:
        return self._closed

    def stderr_text(self) -> str:
        """Everything the worker wrote to stderr so far (the shim's and driver's logs)."""
        try:
            return self.stderr_path.read_text(errors="replace")
        except OSError:
            return ""

    def stderr_tail(self, limit: int = 4000) -> str:
        return self.stderr_text()[-limit:]

    def _exited(self, op: str) -> WorkerError:
        try:
            status: int | str = self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            status = "unknown (still running)"
        return WorkerError(
            self.name, op, {"error": f"worker exited with status {status}"}, self.stderr_tail()
        )

    def _line(self) -> dict[str, Any] | None:
        """The first JSON line already received, if any; other lines are skipped."""
        while True:
            line, sep, rest = self._pending.partition(b"\n")
            if not sep:
                return None
            self._pending = rest
            if line.startswith(b"{"):
                reply: dict[str, Any] = json.loads(line)
                return reply

    def _receive(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for more output; False if none came. EOF is output too
        (an empty read: the caller's next read reports the exit)."""
        out = self.proc.stdout
        assert out is not None
        ready, _, _ = select.select([out], [], [], max(timeout_s, 0.0))
        if not ready:
            return False
        chunk = os.read(out.fileno(), 1 << 16)
        if not chunk:
            raise EOFError
        self._pending += chunk
        return True

    def _read(self, op: str, timeout_s: float | None = None) -> dict[str, Any]:
        """The next JSON line from the worker."""
        wait = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + wait
        while (reply := self._line()) is None:
            try:
                got = self._receive(deadline - time.monotonic())
            except EOFError:
                raise self._exited(op) from None
            if not got:
                raise WorkerError(
                    self.name, op, {"error": f"no reply in {wait} s"}, self.stderr_tail()
                )
        return reply

    def _write(self, op: str, command: Mapping[str, Any]) -> None:
        stdin = self.proc.stdin
        assert stdin is not None
        try:
            stdin.write(json.dumps(command).encode() + b"\n")
            stdin.flush()
        except BrokenPipeError:
            raise self._exited(op) from None

    def call(self, op: str, *, timeout_s: float | None = None, **args: Any) -> dict[str, Any]:
        """Send one command; return the reply, ``ok`` true or not."""
        self.wait_ready()
        if self._unanswered:
            self.reply()
        self._write(op, {"op": op, **args})
        return self._read(op, timeout_s)

    def check(self, op: str, **args: Any) -> dict[str, Any]:
        """Like :meth:`call`, but an error reply raises :class:`WorkerError`."""
        reply = self.call(op, **args)
        if not reply.get("ok"):
            raise WorkerError(self.name, op, reply)
        return reply

    # snippets -------------------------------------------------------------
    def send(self, code: str) -> None:
        """Start a snippet without waiting for its answer (see :meth:`reply`). A snippet
        still unanswered is waited for first: workers can start up concurrently and
        still run in order. It may be sent before the worker is ready: it runs once
        the worker is."""
        if self._unanswered:
            self.reply()
        self._write("exec", {"op": "exec", "code": textwrap.dedent(code)})
        self._unanswered = True

    def reply(self, timeout_s: float | None = None) -> Any:
        """The answer of the snippet started last: its ``result``, or WorkerError."""
        self.wait_ready()
        self._unanswered = False
        reply = self._read("exec", timeout_s)
        if not reply.get("ok"):
            raise WorkerError(self.name, "exec", reply)
        return reply.get("result")

    def answered(self, timeout_s: float) -> bool:
        """Has the snippet started with :meth:`send` answered within ``timeout_s``?"""
        self.wait_ready()
        deadline = time.monotonic() + timeout_s
        while not any(line.startswith(b"{") for line in self._pending.split(b"\n")[:-1]):
            try:
                if not self._receive(deadline - time.monotonic()):
                    return False
            except EOFError:
                return True  # it died: reply() says so
        return True

    def __call__(self, code: str) -> Any:
        """Run a snippet; returns what it left in ``result``."""
        self.send(code)
        return self.reply()

    # file descriptors -----------------------------------------------------
    def take_fd(self) -> int:
        """An FD the worker sent over the channel; the caller owns it."""
        self._chan.settimeout(self.timeout_s)
        _, fds, _, _ = socket.recv_fds(self._chan, 1, 4)
        if len(fds) != 1:
            for extra in fds:
                os.close(extra)
            raise DemoError(f"{self.name}: expected one FD on the channel, got {len(fds)}")
        return int(fds[0])

    def give_fd(self, fd: int) -> None:
        """Send an FD to the worker (for its ``recv_fd``)."""
        self._chan.settimeout(self.timeout_s)
        socket.send_fds(self._chan, [b"F"], [fd])

    def send_fd_to(self, other: Worker, fd: int, *, close: bool = False) -> int:
        """Pass ``fd`` (a number in this worker) to ``other``; returns its number there."""
        self.check("send_fd", fd=fd, close=close)
        mine = self.take_fd()
        try:
            other.give_fd(mine)
        finally:
            os.close(mine)
        return int(other.check("recv_fd")["fd"])

    # convenience wrappers -------------------------------------------------
    def create_mapped(
        self, size: int, *, handle_type: str = "posix", seed: int | None = None
    ) -> tuple[int, int]:
        """Create, reserve, map, grant read-write access, optionally fill: (handle, va)."""
        handle = int(self.check("create", size=size, handle_type=handle_type)["handle"])
        va = int(self.check("reserve", size=size)["va"])
        self.check("map", va=va, size=size, handle=handle)
        self.check("set_access", va=va, size=size)
        if seed is not None:
            self.check("fill", va=va, size=size, seed=seed)
        return handle, va

    def map_at_new_va(self, handle: int, size: int, *, offset: int = 0) -> int:
        va = int(self.check("reserve", size=size)["va"])
        self.check("map", va=va, size=size, handle=handle, offset=offset)
        self.check("set_access", va=va, size=size)
        return va

    def digest(self, va: int, size: int) -> str:
        return str(self.check("digest", va=va, size=size)["digest"])

    # the end --------------------------------------------------------------
    def close(self, timeout_s: float = 30.0) -> int:
        """Let the worker quit; returns its exit status (killed if it does not quit)."""
        if self.proc.poll() is None:
            deadline = time.monotonic() + timeout_s
            with contextlib.suppress(OSError, ValueError):
                assert self.proc.stdin is not None
                self.proc.stdin.write(b'{"op": "quit"}\n')
                self.proc.stdin.close()
            # Read (and drop) what it still says, so that no reply blocks its exit.
            with contextlib.suppress(EOFError, OSError, ValueError):
                while self._receive(deadline - time.monotonic()):
                    self._pending = b""
            try:
                self.proc.wait(timeout=max(deadline - time.monotonic(), 1.0))
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._cleanup()
        return int(self.proc.returncode)

    def close_clean(self, timeout_s: float = 30.0) -> None:
        """:meth:`close`; an exit status other than 0 or a sanitizer report raises
        :class:`WorkerError`."""
        status = self.close(timeout_s)
        stderr = self.stderr_text()
        if status != 0 or SANITIZER_MARK in stderr:
            raise WorkerError(
                self.name, "close", {"error": f"worker exited with status {status}"}, stderr
            )

    def kill(self) -> None:
        """Stop the worker without judging how it ended."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._cleanup()

    def _cleanup(self) -> None:
        if self._closed:
            return
        self._closed = True
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()
        self._chan.close()
        self._stderr.close()
