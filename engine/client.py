"""The participant client: one request per connection to a shim's control socket.

Every exchange is bounded: reads are sized by the header (header, then
``message_length`` bytes, then ``count`` records) and the whole exchange, connect
included, runs against one deadline. :func:`call_all` multiplexes non-blocking
sockets in the calling thread so that a phase costs about one round trip however
many participants there are; :func:`call` is the same machinery for one.

A reply is returned whatever its status: deciding what a non-OK status means is
the caller's business. What is raised (or returned, by :func:`call_all`) is a
:class:`ParticipantError` naming the endpoint, the op and the reason.

Endpoints are trusted only as far as the shim trusts its own: a control
directory that is a symbolic link, owned by another user than root or us, or
writable by group or others is refused before anything is sent through it, and
so is a socket whose server (``SO_PEERCRED``) runs as another user.

A connect that finds no socket, or nobody listening, is retried for a short,
bounded time while a process has the endpoint's pid: a live shim re-creates its
endpoint within its heal period (specs/protocol.md). This is not detection, which
decides once, before a verb sends anything, what is at each socket path
(engine/detection.py ``look``): the client never looks at the path, it only retries
the connect it was asked to make, because between that look and a request of a run
seconds later a socket may be healing (removed and re-created, or re-bound after a
restore) or its listen backlog full (EAGAIN); what finally fails is reported per
endpoint (``ParticipantGone``, ``ParticipantHangup``) and named by the caller.
"""

from __future__ import annotations

import array
import errno
import math
import os
import select
import socket
import stat
import struct
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Final

import attrs

from ._rooted import RootedDir
from .wire import (
    CONTROL_DIR_MAX,
    FILE_OPS,
    HEADER_SIZE,
    RECORD_SIZE,
    VERSION,
    Header,
    Op,
    Reply,
    Request,
    VersionMismatch,
    WireError,
    socket_name,
)

# sun_path is 108 bytes including the terminating NUL on Linux.
_SUN_PATH_MAX: Final = 107
# A full listen backlog makes a non-blocking AF_UNIX connect fail with EAGAIN
# (it never returns EINPROGRESS), so such connects are retried on this schedule.
_RETRY_FIRST_S: Final = 0.001
_RETRY_MAX_S: Final = 0.02
# A shim re-creates a control socket whose file was removed or replaced, or that a
# restore left at its bind name, within its heal period (CONTROL_HEAL_MS, 0.1 s:
# specs/protocol.md); a connect that finds no socket, or nobody listening, is
# retried for this long on this schedule before it counts as the process gone.
# Detection (engine/detection.py look) waits as long for a socket file missing
# before anything is sent.
HEAL_WAIT_S: Final = 1.0
_HEAL_RETRY_FIRST_S: Final = 0.01
_HEAL_RETRY_MAX_S: Final = 0.1
# struct ucred: pid, uid, gid.
_UCRED: Final = struct.Struct("3i")


def uid_trusted(uid: int, own_uid: int, trust_uid: int | None = None) -> bool:
    """Whom a client trusts as a server, and as a control directory's owner: root or
    itself, and the one uid an operator named (``--trust-uid``)."""
    return uid in (0, own_uid) or (trust_uid is not None and uid == trust_uid)


def _whom(own: int, trust_uid: int | None) -> str:
    named = f", nor uid {trust_uid} (--trust-uid)" if trust_uid is not None else ""
    return f"not root nor uid {own}{named}"


def rooted_dir_problem(rooted: RootedDir, own_uid: int, trust_uid: int | None) -> str | None:
    """Why the control directory of a process reached inside its root cannot be trusted
    (resolved once: engine/_rooted.py), judged on the descriptor that every request of
    the run goes through; None when it can."""
    problem = rooted.resolve()
    if problem is not None:
        return problem
    st = rooted.stat()
    mode = stat.S_IMODE(st.st_mode)
    if not uid_trusted(st.st_uid, own_uid, trust_uid):
        why = f"is owned by uid {st.st_uid}, {_whom(own_uid, trust_uid)}"
        fix = f"; to trust that uid's pods, give --trust-uid {st.st_uid}"
    elif mode & (stat.S_IWGRP | stat.S_IWOTH):
        why, fix = "is writable by group or others", ""
    else:
        return None
    return (
        f"control directory {rooted.where()} {why} (uid {st.st_uid}, mode {mode:04o}): "
        f"not trusted{fix}"
    )


def control_dir_problem(
    path: Path, own_uid: int | None = None, trust_uid: int | None = None
) -> str | None:
    """Why the control directory ``path`` cannot be trusted, or None when it can.

    Refused: a symbolic link (the socket could be anywhere), anything not a
    directory, one owned by a user other than root or ``own_uid`` (default: ours),
    one writable by group or others (anyone could plant a socket under a
    participant's name). A missing directory is not judged here: connecting says so.
    """
    own = os.getuid() if own_uid is None else own_uid
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"control directory {path}: {exc.strerror}"
    mode = stat.S_IMODE(st.st_mode)
    if stat.S_ISLNK(st.st_mode):
        why = "is a symbolic link"
    elif not stat.S_ISDIR(st.st_mode):
        why = "is not a directory"
    elif not uid_trusted(st.st_uid, own, trust_uid):
        why = f"is owned by uid {st.st_uid}, {_whom(own, trust_uid)}"
    elif mode & (stat.S_IWGRP | stat.S_IWOTH):
        why = "is writable by group or others"
    else:
        return None
    fix = f"; chmod 700 {path}" if why.startswith("is writable") else ""
    return f"control directory {path} {why} (uid {st.st_uid}, mode {mode:04o}): not trusted{fix}"


def control_dir_length_problem(control_dir: Path) -> str | None:
    """Why the shim would refuse ``control_dir`` for its length, or None (protocol.h's
    CUIP_CONTROL_DIR_MAX: room for the socket names it binds in it)."""
    size = len(os.fsencode(str(control_dir)))
    if size <= CONTROL_DIR_MAX:
        return None
    return (
        f"control directory {control_dir} is {size} bytes long, over the {CONTROL_DIR_MAX} "
        "a shim accepts (a socket path is at most 107 bytes, and the names bound in the "
        "directory take up to 37): choose a shorter one"
    )


def _positive_pid(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{attribute.name} must be a positive integer, got {value!r}")


@attrs.frozen
class Endpoint:
    """Where one participant listens, and the two PIDs it is known by.

    ``rooted``: the control directory resolved inside the process's root, through
    which every request goes (a coordinator outside the pods: engine/_rooted.py).
    ``peer_checked``: the socket's server (``SO_PEERCRED``, in the coordinator's pid
    namespace) must be ``observed_pid`` before anything is sent. ``trust_uid``: a uid
    besides root and the coordinator's own whose directory and server are trusted
    (an operator's ``--trust-uid``). ``endpoint_for`` sets all three; an endpoint made
    directly (a replayed trace's, a test's fake participant) has none."""

    observed_pid: int = attrs.field(validator=_positive_pid)
    namespace_pid: int = attrs.field(validator=_positive_pid)
    path: Path = attrs.field(converter=Path)
    rooted: RootedDir | None = attrs.field(default=None, eq=False, repr=False)
    peer_checked: bool = attrs.field(default=False, eq=False, repr=False)
    trust_uid: int | None = attrs.field(default=None, eq=False, repr=False)

    def name(self) -> str:
        """The process, as every message names it."""
        o, n = self.observed_pid, self.namespace_pid
        return f"pid {o}" if o == n else f"pid {o} (ns pid {n})"

    def describe(self) -> str:
        return f"pid {self.observed_pid} (ns pid {self.namespace_pid}) at {self.path}"

    def proc_root(self) -> Path | None:
        """The /proc the process is seen through (None: this process's own)."""
        return self.rooted.proc_root if self.rooted is not None else None

    def entry(self) -> os.stat_result:
        """What is at the socket's path, not followed (through the rooted directory
        where there is one); OSError as ``lstat`` raises it."""
        if self.rooted is not None:
            return self.rooted.lstat_entry(self.path.name)
        return os.lstat(self.path)


def endpoint_for(
    observed_pid: int,
    namespace_pid: int,
    *,
    control_dir: Path,
    proc_root: Path | None = None,
    check_peer: bool = True,
    trust_uid: int | None = None,
) -> Endpoint:
    """The endpoint of the shim in process ``observed_pid``.

    Without ``proc_root`` the control dir is reached directly (the coordinator
    shares the shim's mount namespace). With it, the path goes through the
    process's own root (``<proc-root>/<observed>/root<control-dir>``), so a
    coordinator outside the container reaches the socket the shim bound inside:
    resolved once, inside that root, with no symbolic link at any component
    (engine/_rooted.py), and every request goes through that one resolution.
    ``check_peer``: where the process is named by a pair (a proc root, or two pids
    that differ), the socket's server must be process ``observed_pid``: a socket named
    by the namespace pid may be served by another process than the one observed (off
    only for a test's fake participants, served by the test's own process). A process
    named by one pid in the coordinator's own pid namespace and directory binds its
    socket under that pid, in a directory only root or the coordinator can write; that
    the pid is its own namespace's is detection's check (``pair_problem``).
    """
    _positive_pid(None, attrs.fields(Endpoint).observed_pid, observed_pid)
    _positive_pid(None, attrs.fields(Endpoint).namespace_pid, namespace_pid)
    control_dir = Path(control_dir)
    too_long = control_dir_length_problem(control_dir)
    if too_long is not None:
        raise ValueError(too_long)
    name = socket_name(namespace_pid)
    if proc_root is None:
        paired = check_peer and observed_pid != namespace_pid
        return Endpoint(observed_pid, namespace_pid, control_dir / name, None, paired,
                        trust_uid)  # fmt: skip
    if not control_dir.is_absolute():
        raise ValueError(f"control_dir must be absolute with proc_root, got {control_dir}")
    path = Path(proc_root) / str(observed_pid) / "root" / control_dir.relative_to("/") / name
    rooted = RootedDir(Path(proc_root), observed_pid, control_dir)
    return Endpoint(observed_pid, namespace_pid, path, rooted, check_peer, trust_uid)


class ParticipantError(Exception):
    """A participant did not answer ``op`` with a well-formed, matching reply.

    ``participant`` is the id the endpoint is bound to when the caller named
    one, else the id the reply claimed, else None.
    """

    def __init__(
        self, endpoint: Endpoint, op: Op, reason: str, participant: str | None = None
    ) -> None:
        # Passing every field to Exception keeps the error picklable.
        super().__init__(endpoint, op, reason, participant)
        self.endpoint = endpoint
        self.op = op
        self.reason = reason
        self.participant = participant

    def __str__(self) -> str:
        who = f"participant {self.participant}, " if self.participant else ""
        return f"{who}{self.endpoint.describe()}: {self.op.name}: {self.reason}"


class ParticipantTimeout(ParticipantError):
    """No complete reply arrived before the deadline."""


class ParticipantHangup(ParticipantError):
    """The socket was missing, refused or reset, or closed before a whole reply."""


class ParticipantGone(ParticipantHangup):
    """The process is not there: its control socket is missing, or nobody listens on it
    (after the heal wait, when the process is still visible)."""


class BadReply(ParticipantError):
    """The reply was malformed, echoed another op or came from another participant."""


class ProtocolMismatch(BadReply):
    """The shim speaks another protocol ``version`` (0: not known, as in a replayed
    trace): refused before anything changed, since a shim refuses a request of another
    version and the coordinator reads no further than the reply's version."""

    def __init__(
        self,
        endpoint: Endpoint,
        op: Op,
        reason: str,
        participant: str | None = None,
        version: int = 0,
    ) -> None:
        super().__init__(endpoint, op, reason, participant)
        self.version = version

    def __reduce__(self) -> tuple[object, ...]:
        return (
            type(self),
            (self.endpoint, self.op, self.reason, self.participant, self.version),
        )


def mismatch_reason(version: int) -> str:
    """What an operator does about a shim speaking protocol ``version``."""
    if version < VERSION:
        upgrade = "upgrade the shim preloaded in the workload (or use a cuinterpose matching it)"
    else:
        upgrade = (
            "upgrade cuinterpose, the coordinator's package on this node "
            "(or preload a shim matching it in the workload)"
        )
    return (
        f"its shim speaks protocol version {version}, this coordinator speaks {VERSION}: {upgrade}"
    )


class UntrustedEndpoint(ParticipantError):
    """The control directory or the socket's server is not one to trust: nothing was sent."""


def call(
    endpoint: Endpoint, request: Request, *, timeout: float, expect_participant: str | None
) -> Reply:
    """Send ``request`` to one participant and return its reply (whatever its status).

    ``expect_participant`` is the id the endpoint is bound to (None for
    HANDSHAKE, whose reply establishes the binding). Raises a
    :class:`ParticipantError` subclass on any transport or reply failure.
    """
    (result,) = call_all([(endpoint, request, expect_participant)], timeout=timeout)
    if isinstance(result, ParticipantError):
        raise result
    return result


def call_all(
    calls: Sequence[tuple[Endpoint, Request, str | None]], *, timeout: float
) -> list[Reply | ParticipantError]:
    """Send every request, then collect every reply, all against one deadline.

    Results come back in input order; a participant's failure is its entry in
    the list and does not stop the others from being collected. A request that
    cannot be encoded is the caller's bug and raises :class:`WireError` before
    anything is sent.
    """
    if math.isnan(timeout) or timeout < 0:
        raise ValueError(f"timeout must be a non-negative number of seconds, got {timeout}")
    payloads = [request.encode() for _, request, _ in calls]
    for _, request, _ in calls:
        if request.op in FILE_OPS and not request.fds:
            raise WireError(f"{request.op.name} request lacks the file descriptor it hands")
    deadline = time.monotonic() + timeout
    exchanges = [
        _Exchange(endpoint, request, expect, payload, timeout)
        for (endpoint, request, expect), payload in zip(calls, payloads, strict=True)
    ]
    poller = _Poller()
    own_uid = os.getuid()
    judged: dict[object, str | None] = {}
    try:
        for exchange in exchanges:
            endpoint = exchange.endpoint
            key: object = endpoint.rooted or (endpoint.path.parent, endpoint.trust_uid)
            if key not in judged:
                judged[key] = (
                    rooted_dir_problem(endpoint.rooted, own_uid, endpoint.trust_uid)
                    if endpoint.rooted is not None
                    else control_dir_problem(endpoint.path.parent, own_uid, endpoint.trust_uid)
                )
            problem = judged[key]
            if problem is None:
                problem = _entry_problem(endpoint)
            if problem is not None and endpoint.rooted is not None and endpoint.rooted.missing:
                exchange.fail(ParticipantGone, problem, None)
                continue
            if problem is not None:
                exchange.fail(UntrustedEndpoint, problem, None)
                continue
            exchange.start(poller)
        _drive(exchanges, poller, deadline)
    finally:
        for exchange in exchanges:
            exchange.close(poller)
        poller.close()
    return [exchange.result() for exchange in exchanges]


def _drive(exchanges: list[_Exchange], poller: _Poller, deadline: float) -> None:
    waiting = [x for x in exchanges if x.outcome is None]
    while waiting:
        now = time.monotonic()
        if now >= deadline:
            for exchange in waiting:
                exchange.expire()
            return
        wait = deadline - now
        # Only start() sets retry_at (a connect refused for a full backlog), so when
        # none is set before the wait, none is after it either.
        retries = [x.retry_at for x in waiting if x.retry_at is not None]
        if retries:
            wait = max(0.0, min(wait, min(retries) - now))
        for exchange in poller.ready(wait):
            exchange.on_readable(poller)
        if retries:
            now = time.monotonic()
            for exchange in waiting:
                if exchange.retry_at is not None and exchange.retry_at <= now:
                    exchange.start(poller)
        waiting = [x for x in waiting if x.outcome is None]


class _Poller:
    """epoll over the exchanges' sockets (what selectors.EpollSelector does, minus the
    bookkeeping a phase with many participants would pay per exchange)."""

    def __init__(self) -> None:
        self._epoll = select.epoll()
        self._by_fd: dict[int, _Exchange] = {}

    def register(self, sock: socket.socket, exchange: _Exchange) -> None:
        fd = sock.fileno()
        self._epoll.register(fd, select.EPOLLIN)
        self._by_fd[fd] = exchange

    def unregister(self, sock: socket.socket) -> None:
        fd = sock.fileno()
        self._epoll.unregister(fd)
        del self._by_fd[fd]

    def ready(self, wait: float) -> list[_Exchange]:
        """The exchanges whose socket is readable or hung up, waiting at most ``wait`` s."""
        # Rounded up to the millisecond epoll counts in, as selectors does, so that
        # a wait shorter than that does not return at once and spin.
        timeout = math.ceil(wait * 1e3) * 1e-3 if wait > 0 else 0.0
        by_fd = self._by_fd
        return [by_fd[fd] for fd, _ in self._epoll.poll(timeout) if fd in by_fd]

    def close(self) -> None:
        self._epoll.close()


class _Exchange:
    """One request/reply on its own connection: mutable, private to one call_all."""

    def __init__(
        self,
        endpoint: Endpoint,
        request: Request,
        expect: str | None,
        payload: bytes,
        timeout: float,
    ) -> None:
        self.endpoint = endpoint
        self.request = request
        self.expect = expect
        self.payload = payload
        self.timeout = timeout
        self.sock: socket.socket | None = None
        self.dir_fd: int | None = None
        self.retry_at: float | None = None
        self.retry_delay = _RETRY_FIRST_S
        self.heal_since: float | None = None  # the first connect that found no listener
        self.heal_delay = _HEAL_RETRY_FIRST_S
        self.connect_error: str | None = None  # that connect's reason
        self.connected = False
        self.registered = False
        self.header: Header | None = None
        self.buffer = bytearray(HEADER_SIZE)
        self.filled = 0
        self.outcome: Reply | ParticipantError | None = None

    # -- outcomes -------------------------------------------------------------

    def fail(self, kind: type[ParticipantError], reason: str, participant: str | None) -> None:
        self.outcome = kind(self.endpoint, self.request.op, reason, participant or self.expect)

    def result(self) -> Reply | ParticipantError:
        assert self.outcome is not None
        return self.outcome

    def expire(self) -> None:
        if not self.connected and self.connect_error is not None:
            waited = time.monotonic() - (self.heal_since or time.monotonic())
            reason = f"{self.connect_error} (retried for {waited:.1f} s)"
            self.fail(ParticipantGone, reason, None)  # only a missing or refused socket heals
            return
        if not self.connected:
            reason = f"could not connect within {self.timeout:g} s (listen backlog full)"
        elif self.header is None and self.filled == 0:
            reason = f"no reply within {self.timeout:g} s"
        else:
            reason = (
                f"incomplete reply within {self.timeout:g} s "
                f"({self._received()} of {self._expected()} bytes)"
            )
        from .stopped import stopped

        # The usual cause of a silent shim.
        why = stopped(self.endpoint.observed_pid, self.endpoint.proc_root())
        self.fail(ParticipantTimeout, f"{reason}: {why}" if why else reason, self._claimed())

    # -- connection -----------------------------------------------------------

    def start(self, poller: _Poller) -> None:
        """Connect (or retry a connect) and send the request: never blocks."""
        self.retry_at = None
        try:
            if self.sock is None:
                # Non-blocking from birth (timeout 0.0, as setblocking(False) sets).
                self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK)
            code = self.sock.connect_ex(self._address())
        except OSError as exc:
            self.fail(_unreachable(exc.errno), _connect_reason(exc.errno, exc.strerror), None)
            return
        if code in (errno.EAGAIN, errno.EINPROGRESS):
            self.retry_at = time.monotonic() + self.retry_delay
            self.retry_delay = min(self.retry_delay * 2, _RETRY_MAX_S)
            return
        if code in (errno.ENOENT, errno.ECONNREFUSED) and self._wait_for_heal(code):
            return
        if code != 0:
            reason = _connect_reason(code, os.strerror(code))
            if self.heal_since is not None:
                reason += f" (retried for {time.monotonic() - self.heal_since:.1f} s)"
            self.fail(_unreachable(code), reason, None)
            return
        self.connected = True
        self._close_dir_fd()
        untrusted = _server_problem(self.sock, self.endpoint)
        if untrusted is not None:
            self.fail(UntrustedEndpoint, untrusted, None)
            return
        try:
            # 128 bytes always fit an empty AF_UNIX send buffer; a short send
            # would mean the peer is not a shim, and is reported as a hang-up.
            if not self.request.fds:
                sent = self.sock.send(self.payload, socket.MSG_NOSIGNAL)
            else:  # STORE_STAGED / FETCH_STAGED: the files go with the header's bytes
                fds = array.array("i", self.request.fds)
                sent = self.sock.sendmsg(
                    [self.payload],
                    [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)],
                    socket.MSG_NOSIGNAL,
                )
        except OSError as exc:
            self.fail(ParticipantHangup, f"sending the request failed: {exc.strerror}", None)
            return
        if sent != len(self.payload):
            self.fail(ParticipantHangup, f"sent {sent} of {len(self.payload)} bytes", None)
            return
        poller.register(self.sock, self)
        self.registered = True

    def _wait_for_heal(self, code: int) -> bool:
        """Whether to retry a connect that found no socket or nobody listening.

        A live shim heals its endpoint within its period: the connect is retried
        on a fresh socket, for at most ``HEAL_WAIT_S``, unless no process has the
        endpoint's pid here (then it is gone, and waiting would change nothing)."""
        now = time.monotonic()
        if self.heal_since is None:
            if not pid_visible(self.endpoint.observed_pid):
                return False
            self.heal_since = now
        if now - self.heal_since >= HEAL_WAIT_S:
            return False
        self.connect_error = _connect_reason(code, os.strerror(code))
        assert self.sock is not None
        self.sock.close()  # a connect that failed is not retried on the same socket
        self.sock = None
        self.retry_at = now + self.heal_delay
        self.heal_delay = min(self.heal_delay * 2, _HEAL_RETRY_MAX_S)
        return True

    def _address(self) -> str:
        if self.endpoint.rooted is not None:  # the run's one resolution, never the path
            return self.endpoint.rooted.address(self.endpoint.path.name)
        path = os.fsencode(self.endpoint.path)
        if len(path) <= _SUN_PATH_MAX:
            return os.fsdecode(path)
        # A path through /proc/<pid>/root easily outgrows sun_path: reach the
        # socket through a descriptor of its directory instead.
        if self.dir_fd is None:
            self.dir_fd = os.open(
                self.endpoint.path.parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC
            )
        return f"/proc/self/fd/{self.dir_fd}/{self.endpoint.path.name}"

    def _close_dir_fd(self) -> None:
        if self.dir_fd is not None:
            os.close(self.dir_fd)
            self.dir_fd = None

    def close(self, poller: _Poller) -> None:
        self._close_dir_fd()
        if self.sock is not None:
            if self.registered:
                poller.unregister(self.sock)
                self.registered = False
            self.sock.close()
            self.sock = None

    # -- reading ----------------------------------------------------------------

    def on_readable(self, poller: _Poller) -> None:
        # Keep reading while bytes are there: a body usually arrives with its
        # header, and going back to the selector for it would cost a round.
        while self.outcome is None and self._read_some(poller):
            pass

    def _read_some(self, poller: _Poller) -> bool:
        """Read into the current part (header or body); False when nothing is there yet."""
        assert self.sock is not None
        if self.filled < len(self.buffer):
            view = memoryview(self.buffer)[self.filled :]
            try:
                got = self.sock.recv_into(view)
            except (BlockingIOError, InterruptedError):
                return False
            except OSError as exc:
                self._finish(poller)
                self.fail(
                    ParticipantHangup,
                    f"connection failed after {self._received()} reply bytes: {exc.strerror}",
                    self._claimed(),
                )
                return False
            finally:
                view.release()
            if got == 0:
                self._finish(poller)
                self.fail(
                    ParticipantHangup,
                    f"closed the connection after {self._received()} of "
                    f"{self._expected()} reply bytes",
                    self._claimed(),
                )
                return False
            self.filled += got
            if self.filled < len(self.buffer):
                return True
        if self.header is None:
            self._on_header(poller)  # sizes the body, which may be empty
        else:
            self._on_body(poller)
        return True

    def _on_header(self, poller: _Poller) -> None:
        try:
            header = Header.decode(bytes(self.buffer))
        except VersionMismatch as exc:
            self._finish(poller)
            self.outcome = ProtocolMismatch(
                self.endpoint,
                self.request.op,
                mismatch_reason(exc.version),
                self.expect,
                exc.version,
            )
            return
        except WireError as exc:
            self._finish(poller)
            self.fail(BadReply, f"malformed reply: {exc}", None)
            return
        claimed = header.participant or None
        if header.op != self.request.op:
            self._finish(poller)
            self.fail(
                BadReply,
                f"reply echoes op {_op_name(header.op)}, expected {self.request.op.name}",
                claimed,
            )
            return
        if self.expect is not None and header.participant != self.expect:
            self._finish(poller)
            self.fail(
                BadReply,
                f"reply comes from participant {header.participant or '(none)'}, "
                f"expected {self.expect}",
                self.expect,
            )
            return
        self.header = header
        self.buffer = bytearray(header.message_length + header.count * RECORD_SIZE)
        self.filled = 0

    def _on_body(self, poller: _Poller) -> None:
        header = self.header
        assert header is not None
        self._finish(poller)
        body = memoryview(self.buffer)
        try:
            # One copy of each part (a reply of 65536 records is 18 MiB).
            reply = Reply.from_parts(
                header, bytes(body[: header.message_length]), bytes(body[header.message_length :])
            )
        except WireError as exc:
            self.fail(BadReply, f"malformed reply: {exc}", self._claimed())
            return
        self.outcome = reply

    def _finish(self, poller: _Poller) -> None:
        # Close as soon as the exchange is decided: one request per connection.
        self.close(poller)

    # -- progress, for messages -------------------------------------------------

    def _claimed(self) -> str | None:
        return self.header.participant if self.header is not None else None

    def _received(self) -> int:
        return self.filled + (HEADER_SIZE if self.header is not None else 0)

    def _expected(self) -> str:
        if self.header is None:
            return f"at least {HEADER_SIZE}"
        return str(HEADER_SIZE + len(self.buffer))


def _entry_problem(endpoint: Endpoint) -> str | None:
    """Why the socket's own name is not to be connected to: a symbolic link there would
    be followed by the connect, in the coordinator's mount namespace. Anything else (a
    socket, nothing yet while a shim heals it) is the connect's to find out."""
    try:
        st = endpoint.entry()
    except OSError:
        return None
    if stat.S_ISLNK(st.st_mode):
        return f"the control socket {endpoint.path} is a symbolic link: not followed"
    return None


def _server_problem(sock: socket.socket, endpoint: Endpoint) -> str | None:
    """Why the process serving ``sock`` is not the one to talk to, or None: another
    user's, or (``peer_checked``) another process than the endpoint's. ``SO_PEERCRED``
    gives the server's pid in the coordinator's pid namespace: the observed pid."""
    try:
        pid, uid, _ = _UCRED.unpack(
            sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
        )
    except OSError as exc:
        return f"SO_PEERCRED failed: {exc.strerror}"
    own = os.getuid()
    if not uid_trusted(uid, own, endpoint.trust_uid):
        return (f"the control socket is served by pid {pid} of uid {uid}, "
                f"{_whom(own, endpoint.trust_uid)}")  # fmt: skip
    if endpoint.peer_checked and pid != endpoint.observed_pid:
        return (
            f"the control socket is served by pid {pid}, not by {endpoint.name()}: "
            "another process answers at that process's socket; nothing was sent"
        )
    return None


def pid_visible(pid: int) -> bool:
    """Whether some process has ``pid`` in the coordinator's pid namespace."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # EPERM: it exists, as another user
    return True


def _op_name(value: int) -> str:
    try:
        return Op(value).name
    except ValueError:
        return f"unknown op {value}"


def _unreachable(code: int | None) -> type[ParticipantHangup]:
    """A connect that found no socket, or nobody listening, means the process is gone."""
    return ParticipantGone if code in (errno.ENOENT, errno.ECONNREFUSED) else ParticipantHangup


def _connect_reason(code: int | None, text: str | None) -> str:
    if code == errno.ENOENT:
        return "control socket does not exist"
    if code == errno.ECONNREFUSED:
        return "connection refused (nothing is listening on the control socket)"
    name = errno.errorcode.get(code or 0, "error")
    return f"could not connect: {name} {text or ''}".rstrip()
