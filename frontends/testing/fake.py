"""A fake participant: a real Unix-socket server speaking the wire protocol like a shim.

For the engine's tests and for embedders' tests (``cuinterpose.testing``). It
validates every request as a shim must (``wire.decode_request``, participant
binding), follows the protocol's phase table, and answers from a scripted
topology. Per-op faults inject failures, delays, hangs, hang-ups, foreign ids,
wrong op echoes and garbage. An ``arrival`` barrier shared by several fakes
holds every reply until all of them have received the op, which only a
coordinator that dispatches concurrently can satisfy.

One selector thread per fake serves every connection without blocking; only a
request that must wait (a barrier, a delay or a hang) gets a thread of its own,
so the common path costs no thread start and a fake with 1000 records answers
from bytes encoded once.
"""

from __future__ import annotations

import array
import errno
import math
import os
import re
import secrets
import selectors
import socket
import stat
import struct
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Final, Literal, get_args

import attrs

from ..engine.client import Endpoint
from ..engine.wire import (
    FILE_OPS,
    HEADER_SIZE,
    MESSAGE_MAX,
    PARTICIPANT_LEN,
    RECORDS_MAX,
    SOCKET_PREFIX,
    SOCKET_SUFFIX,
    STORED_ALIGN,
    STORED_HEADER_STRUCT,
    STORED_MAGIC,
    STORED_MAX_PARTS,
    STORED_VERSION,
    VERSION,
    Header,
    Op,
    Phase,
    Record,
    ReplyFlag,
    Request,
    Stats,
    Status,
    WireError,
    decode_request,
)
from ..phases.ops import OP, PHASE_OP

FaultKind = Literal[
    "fail",
    "retry",
    "pending",
    "not_quiet",
    "delay",
    "hang",
    "hangup",
    "wrong_participant",
    "wrong_op",
    "garbage",
]
FAULT_KINDS: Final[frozenset[str]] = frozenset(get_args(FaultKind))

# The shim's phase table, as phases/ declares it once for the shim and this fake.
_REACHES: Final[Mapping[Op, Phase]] = {Op[p.op]: Phase[p.reaches] for p in PHASE_OP.values()}
_STATS_OPS: Final = frozenset(Op[p.op] for p in PHASE_OP.values() if p.transfers)

_GARBAGE: Final = b"\xff" * HEADER_SIZE
# A connection that has not finished its exchange by then is dropped, so a
# client that connects and goes silent cannot pin resources until stop().
_IDLE_S: Final = 30.0
# Granularity at which a delayed or hanging request notices stop() or a hang-up.
_POLL_S: Final = 0.02
_SEND_TIMEOUT_S: Final = 5.0
_UCRED: Final = struct.Struct("3i")
# A request's op (offset 6) and, 78 bytes on, its message_length (offset 84).
_EXPORT_TEXT: Final = struct.Struct("<H76xI")
_STORE: Final = struct.Struct("<H")  # the op, at offset 6 of a request
_FDS_SPACE: Final = socket.CMSG_SPACE(STORED_MAX_PARTS * 4)
_SUN_PATH_MAX: Final = 107


def allowed_phases(op: Op) -> frozenset[Phase]:
    """The shim phases in which ``op`` is served (anything else is WRONG_PHASE)."""
    return frozenset(Phase[n] for n in OP[op.name].served_in)


def is_phase_op(op: Op) -> bool:
    """Ops that move the shim's phase; failing one leaves the shim FAILED."""
    return op in _REACHES


def _check_kind(instance: object, attribute: attrs.Attribute[str], value: str) -> None:
    if value not in FAULT_KINDS:
        raise ValueError(f"fault kind {value!r} is not one of {sorted(FAULT_KINDS)}")


def _check_seconds(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    if math.isnan(value) or value < 0:
        raise ValueError(f"fault seconds must be >= 0, got {value}")


@attrs.frozen
class Fault:
    """What a fake does instead of (or on top of) answering an op normally.

    - ``fail``: answer ``status`` with ``message`` (after the phase check, like a
      shim whose CUDA work failed); a phase op leaves the fake FAILED, unless
      the status is REFUSED (a shim's refusal leaves its phase as it was).
    - ``retry``: answer RETRY (out of memory, nothing kept, the phase unchanged) the
      first ``times`` times the op arrives, then answer normally; ``times`` 0
      answers RETRY every time. ``fail`` counts ``times`` the same way.
    - ``pending``: QUIESCE only: answer PENDING in phase ACTIVE (not quiet yet, the gate
      kept closed) with ``message``, counting ``times`` the same way.
    - ``not_quiet``: QUIESCE only: answer REFUSED in phase ACTIVE with the NOT_QUIET
      flag (not quiet within the deadline, the gate open again) and ``message``,
      counting ``times`` the same way.
    - ``delay``: wait ``seconds``, then answer normally.
    - ``hang``: never answer (until the client hangs up or the fake stops).
    - ``hangup``: close the connection without answering.
    - ``wrong_participant`` / ``wrong_op``: answer normally, but with another
      participant id / another op in the reply.
    - ``garbage``: answer bytes that are not a message.

    Faults apply to well-formed requests for this participant (a malformed or
    misaddressed one is refused first, as a shim refuses it); ``hang``,
    ``hangup`` and ``garbage`` change no phase.
    """

    kind: FaultKind = attrs.field(validator=_check_kind)
    status: Status = Status.CUDA_FAILED
    message: str = "injected failure"
    seconds: float = attrs.field(default=0.0, validator=_check_seconds)
    times: int = attrs.field(default=0, validator=attrs.validators.ge(0))

    def __attrs_post_init__(self) -> None:
        if self.kind == "fail" and self.status is Status.OK:
            raise ValueError("a 'fail' fault needs a non-OK status")
        if self.kind == "not_quiet" and self.status is not Status.REFUSED:
            raise ValueError("a 'not_quiet' fault answers REFUSED (its status is not chosen)")


class FakeParticipantError(RuntimeError):
    """The fake itself went wrong (a bug in the fake, not in what it was sent)."""


def _default_pid(socket_path: Path) -> int:
    """The PID in a ``cuinterpose-<pid>.sock`` name, so the endpoint and the fake agree."""
    pattern = re.escape(SOCKET_PREFIX) + r"([1-9][0-9]{0,9})" + re.escape(SOCKET_SUFFIX)
    match = re.fullmatch(pattern, socket_path.name)
    if match and int(match.group(1)) < 2**32:
        return int(match.group(1))
    return 1 + secrets.randbelow(4_000_000)


def _text(message: str) -> bytes:
    raw = message.encode("utf-8")
    if len(raw) <= MESSAGE_MAX:
        return raw
    return raw[:MESSAGE_MAX].decode("utf-8", "ignore").encode("utf-8")


class _Conn:
    """One accepted connection in the selector loop: read 128 bytes, write the reply."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.started = time.monotonic()
        self.request = bytearray(HEADER_SIZE)
        self.filled = 0
        self.out: memoryview | None = None
        self.registered = False
        self.fds: list[int] = []  # STORE_STAGED / FETCH_STAGED's parts (SCM_RIGHTS)


class _Conns:
    """The loop's open connections; touched by the loop thread only."""

    def __init__(self, selector: selectors.BaseSelector) -> None:
        self.selector = selector
        self.open: dict[int, _Conn] = {}

    def add(self, conn: _Conn) -> None:
        self.open[conn.sock.fileno()] = conn

    def watch(self, conn: _Conn, events: int) -> None:
        # Registered lazily: most requests are read and answered at accept
        # time, without ever going through the selector.
        if conn.registered:
            self.selector.modify(conn.sock, events, conn)
        else:
            self.selector.register(conn.sock, events, conn)
            conn.registered = True

    def release(self, conn: _Conn) -> socket.socket:
        """Stop tracking ``conn`` and hand its socket over (to a worker, or to close)."""
        if conn.registered:
            self.selector.unregister(conn.sock)
            conn.registered = False
        del self.open[conn.sock.fileno()]
        return conn.sock

    def drop(self, conn: _Conn) -> None:
        for fd in conn.fds:
            os.close(fd)
        conn.fds = []
        self.release(conn).close()

    def close_all(self) -> None:
        for conn in list(self.open.values()):
            self.drop(conn)


class FakeParticipant:
    """A participant that answers like a shim, from a scripted topology."""

    def __init__(
        self,
        socket_path: Path,
        *,
        participant: str | None = None,
        pid: int | None = None,
        phase: Phase = Phase.ACTIVE,
        records: Sequence[Record] = (),
        restored_records: Sequence[Record] | None = None,
        stats: Mapping[Op, Stats] | None = None,
        script: Mapping[Op, Fault] | None = None,
        arrival: threading.Barrier | None = None,
        driver: str = "",
        version: int = VERSION,
    ) -> None:
        self.socket_path = Path(socket_path)
        # The protocol version it speaks: of another than the coordinator's, it
        # answers every request BAD_REQUEST in its own version and changes nothing,
        # as a shim does a request of another version.
        self.version = version
        self.driver = driver  # what STATUS with ask_driver answers (protocol.h)
        self.participant = participant if participant is not None else secrets.token_hex(16)
        # Encoding once validates the id and every record up front, and spares
        # each INSPECT reply from re-encoding them.
        Header(op=int(Op.HANDSHAKE), participant=self.participant).encode()
        self.pid = pid if pid is not None else _default_pid(self.socket_path)
        if not 0 < self.pid < 2**32:
            raise ValueError(f"pid must fit a u32 and be positive, got {self.pid}")
        self.records = tuple(records)
        for name, group in (("records", records), ("restored_records", restored_records or ())):
            if len(group) > RECORDS_MAX:
                raise ValueError(f"{len(group)} {name} exceed the protocol's {RECORDS_MAX}")
        self.restored_records = (
            self.records if restored_records is None else tuple(restored_records)
        )
        self._blob = b"".join(r.encode() for r in self.records)
        self._restored_blob = b"".join(r.encode() for r in self.restored_records)
        self.stats: dict[Op, Stats] = dict(stats or {})
        self.script: Mapping[Op, Fault] = dict(script or {})
        self.arrival = arrival

        self._lock = threading.Lock()
        self._phase = Phase(phase)
        self._reason = ""
        self._restored = False
        self._received: list[Op] = []
        self._releases = 0
        self._retried: dict[Op, int] = {}
        self._quiesce_deadlines: list[int] = []
        self._gpu_maps: list[str] = []
        self._advances = 0
        self._errors: list[BaseException] = []
        self._barrier_waiters = 0
        self._stopping = threading.Event()
        self._listener: socket.socket | None = None
        self._inode: tuple[int, int] | None = None
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None
        self._loop: threading.Thread | None = None
        self._workers: set[threading.Thread] = set()

    # -- public state -----------------------------------------------------------

    @property
    def received(self) -> list[Op]:
        """The ops of every well-formed request received so far, in order."""
        with self._lock:
            return list(self._received)

    @property
    def quiesce_deadlines(self) -> list[int]:
        """The deadline (ns; 0: none) each QUIESCE request carried, in order."""
        with self._lock:
            return list(self._quiesce_deadlines)

    @property
    def gpu_maps(self) -> list[str]:
        """The GPU mapping each LOAD_ALLOCATIONS request carried ("": none), in order."""
        with self._lock:
            return list(self._gpu_maps)

    @property
    def advances(self) -> int:
        """QUIESCE requests that found the fake QUIESCED: advances (specs/quiesce.md)."""
        with self._lock:
            return self._advances

    @property
    def releases(self) -> int:
        """RELEASE requests received: a run ends its lease with one. The fake keeps no
        lease, so they are counted here, apart from the machines' ops in received."""
        with self._lock:
            return self._releases

    @property
    def phase(self) -> Phase:
        with self._lock:
            return self._phase

    @property
    def endpoint(self) -> Endpoint:
        """This fake as the coordinator addresses it (observed and ns pid alike)."""
        return Endpoint(self.pid, self.pid, self.socket_path)

    def describe(self) -> str:
        return f"fake participant {self.participant} (pid {self.pid}) at {self.socket_path}"

    # -- lifecycle ----------------------------------------------------------------

    def start(self) -> FakeParticipant:
        if self._loop is not None or self._stopping.is_set():
            raise FakeParticipantError(f"{self.describe()} can be started only once")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            _bind(listener, self.socket_path)
            os.chmod(self.socket_path, 0o600)
            info = os.stat(self.socket_path)
            self._inode = (info.st_dev, info.st_ino)
            listener.listen(128)
            listener.setblocking(False)
        except BaseException:
            listener.close()
            raise
        self._listener = listener
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        # Made here, not in the thread, so that a started fake holds all its
        # descriptors when start() returns.
        selector = selectors.DefaultSelector()
        self._loop = threading.Thread(
            target=self._serve, args=(selector,), name=f"fake-{self.pid}", daemon=True
        )
        self._loop.start()
        return self

    def stop(self) -> None:
        """Stop serving, join every thread, close every socket and remove the socket file.

        Raises :class:`FakeParticipantError` if the fake hit a bug of its own
        while serving, so that such a bug fails the test that used it.
        """
        if self._loop is None:
            return
        self._stopping.set()
        assert self._wake_w is not None
        self._wake_w.send(b"x")
        with self._lock:
            waiting = self._barrier_waiters
        if waiting and self.arrival is not None:
            # Our own requests would otherwise sit out the barrier's timeout.
            self.arrival.abort()
        self._loop.join()
        # The loop has ended, so no new worker can appear.
        with self._lock:
            workers = list(self._workers)
        for worker in workers:
            worker.join()
        self._loop = None
        for sock in (self._wake_r, self._wake_w):
            if sock is not None:
                sock.close()
        self._wake_r = self._wake_w = None
        with self._lock:
            errors = list(self._errors)
        if errors:
            raise FakeParticipantError(f"{self.describe()} failed: {errors[0]!r}") from errors[0]

    def __enter__(self) -> FakeParticipant:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- the selector loop --------------------------------------------------------

    def _serve(self, selector: selectors.BaseSelector) -> None:
        listener, wake = self._listener, self._wake_r
        assert listener is not None and wake is not None
        with selector:
            conns = _Conns(selector)
            selector.register(listener, selectors.EVENT_READ, None)
            selector.register(wake, selectors.EVENT_READ, None)
            try:
                while not self._stopping.is_set():
                    for key, events in selector.select(1.0):
                        if key.fileobj is listener:
                            self._accept(listener, conns)
                        elif isinstance(key.data, _Conn):
                            self._guarded(key.data, events, conns)
                    self._drop_idle(conns)
            except Exception as exc:  # a bug in the fake: reported by stop()
                with self._lock:
                    self._errors.append(exc)
            finally:
                conns.close_all()
                self._close_listener()

    def _close_listener(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        try:
            info = os.stat(self.socket_path)
        except FileNotFoundError:
            return
        # Only our own socket file: another server may have taken the path since.
        if (info.st_dev, info.st_ino) == self._inode and stat.S_ISSOCK(info.st_mode):
            self.socket_path.unlink()

    def _accept(self, listener: socket.socket, conns: _Conns) -> None:
        while True:
            try:
                sock, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.ECONNABORTED, errno.EMFILE, errno.ENFILE):
                    return
                raise
            _, uid, _ = _UCRED.unpack(
                sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
            )
            # As a shim: serve only root and our own user.
            if uid not in (0, os.getuid()):
                sock.close()
                continue
            sock.setblocking(False)
            conn = _Conn(sock)
            conns.add(conn)
            # A client sends its request right after connecting: it is usually
            # here already, and answering now saves a trip through the selector.
            self._guarded(conn, selectors.EVENT_READ, conns)

    def _drop_idle(self, conns: _Conns) -> None:
        now = time.monotonic()
        for conn in [c for c in conns.open.values() if now - c.started > _IDLE_S]:
            conns.drop(conn)

    def _guarded(self, conn: _Conn, events: int, conns: _Conns) -> None:
        """Serve one connection; a bug while doing so costs that connection only."""
        try:
            self._service(conn, events, conns)
        except Exception as exc:  # reported by stop(), so the test using the fake fails
            with self._lock:
                self._errors.append(exc)
            if conns.open.get(conn.sock.fileno()) is conn:
                conns.drop(conn)

    def _service(self, conn: _Conn, events: int, conns: _Conns) -> None:
        try:
            if conn.out is not None:
                if events & selectors.EVENT_WRITE:
                    self._write(conn, conns)
                elif events & selectors.EVENT_READ and not conn.sock.recv(1):
                    # The client gave up while we were still writing.
                    conns.drop(conn)
                return
            got, ancillary, _, _ = conn.sock.recvmsg_into(
                [memoryview(conn.request)[conn.filled :]], _FDS_SPACE
            )
            for level, kind, data in ancillary:
                if (level, kind) == (socket.SOL_SOCKET, socket.SCM_RIGHTS):
                    conn.fds += array.array("i", data[: len(data) - len(data) % 4])
        except (BlockingIOError, InterruptedError):
            conns.watch(conn, selectors.EVENT_READ)
            return
        except OSError:
            conns.drop(conn)
            return
        if got == 0:
            conns.drop(conn)
            return
        conn.filled += got
        if conn.filled == HEADER_SIZE and len(conn.request) == HEADER_SIZE:
            # EXPORT's text (the fetcher's id) and LOAD_ALLOCATIONS' (the GPU mapping)
            # follow the header: read it too, so that nothing is left unread when the
            # connection closes.
            op, length = _EXPORT_TEXT.unpack_from(conn.request, 6)
            if (op == Op.EXPORT and 0 < length <= PARTICIPANT_LEN) or (
                op == Op.LOAD_ALLOCATIONS and 0 < length <= MESSAGE_MAX
            ):
                conn.request.extend(bytes(length))
        if conn.filled < len(conn.request):
            conns.watch(conn, selectors.EVENT_READ)
            return
        self._dispatch(conn, conns)

    def _dispatch(self, conn: _Conn, conns: _Conns) -> None:
        raw = bytes(conn.request)
        fds, conn.fds = conn.fds, []
        try:
            if len(fds) and _STORE.unpack_from(raw, 6)[0] == Op.STORE_STAGED:
                self._write_parts(raw, fds)
        finally:
            for fd in fds:
                os.close(fd)
        if self.version != VERSION:
            self._reply_now(conn, self._refusal(raw, "bad magic or version"), conns)
            return
        try:
            request, _ = decode_request(raw)
        except WireError as exc:
            self._reply_now(conn, self._refusal(raw, str(exc)), conns)
            return
        if request.op is Op.RELEASE:
            with self._lock:
                self._releases += 1
                if self._phase is Phase.QUIESCED:
                    self._phase = Phase.ACTIVE  # the shim reopens its gate: nothing was torn down
            self._reply_now(conn, self._encode(Op.RELEASE, Status.OK, ""), conns)
            return
        with self._lock:
            self._received.append(request.op)
            if request.op is Op.QUIESCE:
                self._quiesce_deadlines.append(request.deadline_ns)
            if request.op is Op.LOAD_ALLOCATIONS:
                self._gpu_maps.append(request.gpu_map)
        fault = self.script.get(request.op)
        if self.arrival is None and (fault is None or fault.kind not in ("delay", "hang")):
            self._reply_now(conn, self._answer(request, fault), conns)
            return
        # This request must wait: give its socket to a thread of its own.
        worker = threading.Thread(
            target=self._slow_path, args=(conns.release(conn), request, fault), daemon=True
        )
        with self._lock:
            self._workers.add(worker)
        worker.start()

    def _write_parts(self, raw: bytes, fds: Sequence[int]) -> None:
        """STORE_STAGED as a shim with nothing staged answers it: each part its header
        (protocol.h's stored files) naming this participant and the request's dump, so
        that the coordinator's checks before a fetch find the parts it handed."""
        try:
            request, _ = decode_request(raw)
        except WireError:
            return
        if self.phase not in allowed_phases(Op.STORE_STAGED) or Op.STORE_STAGED in self.script:
            return  # refused or scripted: the test says what happens
        for k, fd in enumerate(fds):
            try:
                os.pwrite(fd, STORED_HEADER_STRUCT.pack(
                    STORED_MAGIC, STORED_VERSION, 0, k, len(fds), 0, STORED_ALIGN,
                    self.participant.encode(), request.resource_id, 0,
                ), 0)  # fmt: skip
            except OSError:
                return  # a descriptor it cannot write: as a shim, nothing more

    def _reply_now(self, conn: _Conn, reply: bytes | None, conns: _Conns) -> None:
        if reply is None:
            conns.drop(conn)
            return
        conn.out = memoryview(reply)
        self._write(conn, conns)

    def _write(self, conn: _Conn, conns: _Conns) -> None:
        assert conn.out is not None
        try:
            sent = conn.sock.send(conn.out, socket.MSG_NOSIGNAL)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            conns.drop(conn)
            return
        conn.out = conn.out[sent:]
        if conn.out:
            conns.watch(conn, selectors.EVENT_READ | selectors.EVENT_WRITE)
        else:
            conns.drop(conn)

    # -- requests that wait ---------------------------------------------------------

    def _slow_path(self, sock: socket.socket, request: Request, fault: Fault | None) -> None:
        try:
            with sock:
                reply = self._slow_reply(sock, request, fault)
                if reply is not None and not self._stopping.is_set():
                    sock.setblocking(True)
                    sock.settimeout(_SEND_TIMEOUT_S)
                    sock.sendall(reply, socket.MSG_NOSIGNAL)
        except OSError:
            pass  # the client went away: nothing to answer
        except Exception as exc:  # a bug in the fake: reported by stop()
            with self._lock:
                self._errors.append(exc)
        finally:
            with self._lock:
                self._workers.discard(threading.current_thread())

    def _slow_reply(
        self, sock: socket.socket, request: Request, fault: Fault | None
    ) -> bytes | None:
        if self.arrival is not None and not self._await_arrival(request.op):
            return self._encode(
                request.op,
                Status.INTERNAL,
                f"arrival barrier broken: not every participant received {request.op.name}",
            )
        if fault is not None and fault.kind == "delay" and not self._pause(sock, fault.seconds):
            return None
        if fault is not None and fault.kind == "hang":
            self._pause(sock, math.inf)
            return None
        return self._answer(request, fault)

    def _await_arrival(self, op: Op) -> bool:
        assert self.arrival is not None
        with self._lock:
            # stop() aborts the barrier if it sees a waiter; one that comes
            # after stop() began must not start waiting at all.
            if self._stopping.is_set():
                return False
            self._barrier_waiters += 1
        try:
            # The barrier's own timeout applies; without one, stop() ends the wait.
            self.arrival.wait()
            return True
        except threading.BrokenBarrierError:
            return False
        finally:
            with self._lock:
                self._barrier_waiters -= 1

    def _pause(self, sock: socket.socket, seconds: float) -> bool:
        """Wait ``seconds``; False if the client hung up or the fake is stopping first."""
        deadline = time.monotonic() + seconds
        with selectors.DefaultSelector() as selector:
            selector.register(sock, selectors.EVENT_READ)
            while not self._stopping.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    return True
                # The request was read whole, so anything readable now is the
                # client closing (or misbehaving): either way it is gone.
                if selector.select(min(left, _POLL_S)):
                    return False
        return False

    # -- answers ------------------------------------------------------------------

    def _answer(self, request: Request, fault: Fault | None) -> bytes | None:
        """The reply bytes for a well-formed request (None: hang up without one)."""
        op = request.op
        anonymous = op is Op.HANDSHAKE or (op is Op.STATUS and not request.participant)
        if not anonymous and request.participant != self.participant:
            return self._encode(
                op,
                Status.WRONG_PARTICIPANT,
                f"request names participant {request.participant or '(none)'}, "
                f"this is {self.participant}",
            )
        kind = fault.kind if fault is not None else None
        if kind == "hangup":
            return None
        if kind == "garbage":
            return _GARBAGE
        participant = secrets.token_hex(16) if kind == "wrong_participant" else self.participant
        echoed = Op(op % len(Op) + 1) if kind == "wrong_op" else op
        with self._lock:
            phase = self._phase
            if phase not in allowed_phases(op):
                return self._encode(
                    echoed,
                    Status.WRONG_PHASE,
                    f"{op.name} is not allowed in phase {phase.name}",
                    participant=participant,
                )
            if op is Op.STATUS and (request.ask_driver or request.ask_devices) and kind is None:
                # The driver's path; both asked, its line then the devices report; the
                # devices alone, their report (no GPU here: empty).
                said = self.driver if request.ask_driver else ""
                said += "\n" if request.ask_driver and request.ask_devices else ""
                return self._encode(echoed, Status.OK, said, participant=participant)
            if op is Op.QUIESCE and phase is Phase.QUIESCED:
                self._advances += 1
            if kind in ("retry", "fail", "pending", "not_quiet"):
                assert fault is not None
                answered = self._retried.get(op, 0)
                if fault.times and answered >= fault.times:
                    return self._succeed(op, echoed, participant)
                self._retried[op] = answered + 1
            if kind == "retry":
                return self._encode(
                    echoed, Status.RETRY, "out of memory (injected)", participant=participant
                )
            if kind == "pending":
                assert fault is not None
                self._phase = Phase.ACTIVE
                return self._encode(echoed, Status.PENDING, fault.message, participant=participant)
            if kind == "not_quiet":
                assert fault is not None
                self._phase = Phase.ACTIVE  # the shim opened its gate again
                return self._encode(
                    echoed,
                    Status.REFUSED,
                    fault.message,
                    participant=participant,
                    flags=int(ReplyFlag.NOT_QUIET),
                )
            if kind == "fail":
                assert fault is not None
                if op is Op.QUIESCE:
                    self._phase = Phase.ACTIVE  # a refused QUIESCE opens the gate, advance or not
                if is_phase_op(op) and fault.status is not Status.REFUSED:
                    self._phase = Phase.FAILED
                    self._reason = f"{op.name} failed: {fault.message}"
                return self._encode(echoed, fault.status, fault.message, participant=participant)
            return self._succeed(op, echoed, participant)

    def _succeed(self, op: Op, echoed: Op, participant: str) -> bytes:
        # Called with the lock held: the phase changes with the answer.
        if op is Op.HANDSHAKE or op is Op.STATUS:
            # A fake's ops complete at once: STATUS never finds one in flight.
            message = self._reason if self._phase is Phase.FAILED else ""
            return self._encode(echoed, Status.OK, message, participant=participant)
        if op is Op.INSPECT:
            blob = self._restored_blob if self._restored else self._blob
            count = len(self.restored_records if self._restored else self.records)
            return self._encode(echoed, Status.OK, "", participant=participant, count=count) + blob
        if op is Op.EXPORT:
            return self._encode(
                echoed,
                Status.NOT_FOUND,
                "fake participant exports nothing",
                participant=participant,
            )
        if op in FILE_OPS:
            # The descriptor the request handed is closed on receipt (read without its
            # ancillary data); the phase stays; the stats are the test's to set.
            stats = self.stats.get(op, Stats())
            return self._encode(echoed, Status.OK, "", participant=participant, stats=stats)
        self._phase = _REACHES[op]
        if op is Op.RESTORE_MULTICAST_BINDINGS:
            self._restored = True
        elif op is Op.ROLLBACK_IMPORTS:
            self._restored = False  # back to what it was before the capture
        # QUIESCE's stat_count is the threads held at the gate (a test may set it).
        stats = self.stats.get(op, Stats()) if op in _STATS_OPS | {Op.QUIESCE} else Stats()
        return self._encode(echoed, Status.OK, "", participant=participant, stats=stats)

    def _encode(
        self,
        op: int,
        status: Status,
        message: str,
        *,
        participant: str | None = None,
        count: int = 0,
        stats: Stats | None = None,
        flags: int = 0,
    ) -> bytes:
        text = _text(message)
        header = Header(
            op=op,
            status=int(status),
            count=count,
            participant=participant if participant is not None else self.participant,
            message_length=len(text),
            pid=self.pid,
            # Reading one attribute is atomic; a caller that changes the phase
            # holds the lock, so the reply reports the phase after the op.
            phase=int(self._phase),
            stats=stats if stats is not None else Stats(),
            flags=flags,
            version=self.version,
        )
        return header.encode() + text

    def _refusal(self, raw: bytes, reason: str) -> bytes:
        """BAD_REQUEST for bytes decode_request refused, echoing their op field."""
        (op,) = struct.unpack_from("<H", raw, 6)
        return self._encode(op, Status.BAD_REQUEST, f"bad request: {reason}")


def _bind(sock: socket.socket, path: Path) -> None:
    if path.exists() or path.is_symlink():
        raise FileExistsError(errno.EEXIST, "refusing to replace an existing file", str(path))
    if len(os.fsencode(path)) <= _SUN_PATH_MAX:
        sock.bind(os.fspath(path))
        return
    # Too long for sun_path: bind through a descriptor of the directory.
    dir_fd = os.open(path.parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        sock.bind(f"/proc/self/fd/{dir_fd}/{path.name}")
    finally:
        os.close(dir_fd)
