"""The job store: etcd v3, reached through its gRPC gateway's JSON API by ``etcd3gw``.

The only module that imports ``etcd3gw`` (the ``multinode`` extra): everything a job
across nodes agrees on goes through here, as etcd's own transactions, revisions and
leases (specs/multinode.md, "The store"). Nothing here decides for a job; it reads,
writes and compares keys, and says in one exception type when the store did not
answer within the time it was given.

Every request is retried while the store is unreachable or between leaders, on each of
its members in turn, until the caller's deadline: a restarted etcd or a new leader (the
leases renewed by their full TTL) is a pause, not a failure; a store never reached at all
is said within seconds. The client signs in as an etcd user (:class:`Credentials`, a
file only its owner reads) and refuses a store whose authentication is off unless told
(:meth:`Store.open`). What the store answers is checked before use (JSON objects only).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import stat
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, TypeVar
from urllib.parse import urlsplit

import attrs

try:
    from etcd3gw import exceptions as etcd_errors
    from etcd3gw.client import Etcd3Client
except ImportError as exc:  # pragma: no cover: the extra is not installed
    raise ImportError(
        "cuinterpose's job commands need etcd3gw: pip install 'cuinterpose[multinode]'"
    ) from exc

__all__ = [
    "CREDENTIALS_ENV",
    "PREFIX",
    "Address",
    "Credentials",
    "CredentialsError",
    "Keeper",
    "OpenStore",
    "Snapshot",
    "Store",
    "StoreError",
    "addresses",
]

PREFIX: Final = "/cuinterpose/jobs/"
# The file of the store's user and password, when no --store-credentials names one.
CREDENTIALS_ENV: Final = "CUINTERPOSE_STORE_CREDENTIALS"
# One HTTP request's own limit; the retries around it are bounded by the caller's deadline.
# Short: a write that reaches a member between leaders is held by etcd until its own
# request timeout (5 s and more) while another member may answer at once.
REQUEST_TIMEOUT_S: Final = 1.0
RETRY_PAUSE_S: Final = 0.05
# A store never reached since this client began is not a pause but a wrong address or an
# etcd not running: said within this long, not after a barrier timeout.
FIRST_CONTACT_S: Final = 3.0
_CREDENTIALS_MAX: Final = 4096
_USER: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,127}")
# gRPC codes etcd answers with (through its gateway's JSON "code").
_UNAVAILABLE: Final = 14  # leader changed, no leader, request timed out: a pause
_DEADLINE: Final = 4
_UNAUTHENTICATED: Final = 16  # the token expired or came from another member: sign in again
_T = TypeVar("_T")


class StoreError(Exception):
    """The store did not answer (or answered nonsense, or refused us) within the time given."""


class OpenStore(StoreError):
    """The store lets anyone write: its authentication is off."""


class CredentialsError(ValueError):
    """The credentials file cannot be trusted or read."""


@attrs.frozen
class Address:
    """Where one etcd member's client URL is: ``http://HOST:PORT`` (or ``https://``)."""

    host: str
    port: int
    scheme: str = "http"

    @classmethod
    def parse(cls, text: str) -> Address:
        parts = urlsplit(text if "://" in text else f"http://{text}")
        bad_path = parts.path not in ("", "/")
        if parts.scheme not in ("http", "https") or not parts.hostname or bad_path:
            raise ValueError(f"{text!r} is not an etcd client URL (http://HOST:PORT)")
        if parts.username is not None or parts.password is not None:
            # A password in the URL would be said again in every next: line and log.
            shown = parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl()
            raise ValueError(
                f"{shown}: a user or password in the store's URL is refused (it would be "
                "printed and logged): give the user in a credentials file, "
                "--store-credentials FILE"
            )
        try:
            port = parts.port or 2379
        except ValueError:
            raise ValueError(f"{text!r}: the port is not a number") from None
        return cls(parts.hostname, port, parts.scheme)

    def __str__(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}"


def addresses(text: str) -> tuple[Address, ...]:
    """The members of a store: one client URL, or several separated by commas."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise ValueError(f"{text!r} names no etcd client URL")
    return tuple(Address.parse(p) for p in parts)


@attrs.frozen
class Credentials:
    """An etcd user and its password, read from a file only its owner can read."""

    user: str
    password: str = attrs.field(repr=False)
    source: str = ""

    @classmethod
    def read(cls, path: str | os.PathLike[str]) -> Credentials:
        """``USER:PASSWORD`` on one line (etcdctl's ``--user``), from a regular file owned by
        this user and readable by nobody else (mode 0600 or 0400): anyone who can read it
        can write the job's keys."""
        name = os.fspath(path)
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError as exc:
            raise CredentialsError(
                f"store credentials {name}: {exc.strerror or exc} (a symbolic link is refused)"
            ) from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise CredentialsError(f"store credentials {name}: not a regular file")
            if info.st_uid != os.geteuid():
                raise CredentialsError(
                    f"store credentials {name}: owned by uid {info.st_uid}, not by you "
                    f"(uid {os.geteuid()})"
                )
            if info.st_mode & 0o077:
                raise CredentialsError(
                    f"store credentials {name}: mode {stat.S_IMODE(info.st_mode):04o} lets "
                    f"others read it: chmod 600 {name}"
                )
            raw = os.read(fd, _CREDENTIALS_MAX + 1)
        finally:
            os.close(fd)
        if len(raw) > _CREDENTIALS_MAX:
            raise CredentialsError(
                f"store credentials {name}: longer than {_CREDENTIALS_MAX} bytes"
            )
        try:
            text = raw.decode()
        except UnicodeDecodeError:
            raise CredentialsError(f"store credentials {name}: not UTF-8 text") from None
        lines = [line for line in text.splitlines() if line.strip()]
        user, colon, password = (lines[0] if len(lines) == 1 else "").partition(":")
        if not colon or not _USER.fullmatch(user) or not password:
            raise CredentialsError(
                f"store credentials {name}: want one line USER:PASSWORD (etcdctl's --user)"
            )
        return cls(user, password, name)


@attrs.frozen
class Snapshot:
    """Every key under a prefix at one revision of the store (values decoded JSON)."""

    revision: int
    values: Mapping[str, Any]

    def under(self, prefix: str) -> dict[str, Any]:
        """The keys under ``prefix``, named by what follows it."""
        return {k[len(prefix) :]: v for k, v in self.values.items() if k.startswith(prefix)}


def _decode_value(key: str, raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise StoreError(f"the store's key {key} holds no JSON value") from None


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _range_end(prefix: str) -> str:
    """etcd's end of the range of every key beginning with ``prefix`` (its last byte + 1)."""
    raw = bytearray(prefix.encode())
    raw[-1] += 1
    return base64.b64encode(bytes(raw)).decode()


@attrs.frozen
class _Answer:
    """What etcd said when it refused a request: its gRPC code and message."""

    code: int
    message: str

    @classmethod
    def of(cls, error: etcd_errors.Etcd3Exception) -> _Answer:
        text = error.detail_text or ""
        try:
            body = json.loads(text)
        except ValueError:
            body = None
        if isinstance(body, dict):
            code = body.get("code")
            message = body.get("error") or body.get("message") or ""
            return cls(code if isinstance(code, int) else -1, str(message)[:300])
        reason = " ".join(str(a) for a in error.args)
        return cls(-1, (text or reason or type(error).__name__).splitlines()[0][:300])

    @property
    def transient(self) -> bool:
        return self.code in (_UNAVAILABLE, _DEADLINE)


class Store:
    """One client of one etcd (a member or several of one cluster, tried in turn), signed
    in as the credentials' user, with every request retried until a deadline."""

    def __init__(
        self,
        address: Address | Sequence[Address],
        *,
        credentials: Credentials | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.members = (address,) if isinstance(address, Address) else tuple(address)
        if not self.members:
            raise ValueError("a store needs at least one etcd client URL")
        self.credentials = credentials
        self.clock = clock
        self._clients = [
            Etcd3Client(
                host=a.host,
                port=a.port,
                protocol=a.scheme,
                timeout=REQUEST_TIMEOUT_S,
                api_path="/v3/",
            )
            for a in self.members
        ]
        # Each member's own token (etcd's simple tokens are not shared between members).
        self._tokens: dict[int, str] = {}
        self._lock = threading.Lock()
        self._at = 0  # the member tried first
        self._reached = False
        self.opened = False  # signed in, and the store checked (:meth:`open`)

    @property
    def address(self) -> str:
        return ",".join(str(a) for a in self.members)

    def _sign_in(self, index: int) -> str:
        """A token of member ``index`` for the credentials' user ('' without credentials)."""
        if self.credentials is None:
            return ""
        with self._lock:
            token = self._tokens.get(index)
        if token:
            return token
        client = self._clients[index]
        body = {"name": self.credentials.user, "password": self.credentials.password}
        try:
            reply = client.post(client.get_url("/auth/authenticate"), json=body)
        except (etcd_errors.ConnectionFailedError, etcd_errors.ConnectionTimeoutError):
            raise
        except etcd_errors.Etcd3Exception as e:
            answer = _Answer.of(e)
            if answer.transient:
                raise etcd_errors.ConnectionFailedError(answer.message) from None
            if "not enabled" in answer.message:
                raise OpenStore(
                    f"etcd at {self.members[index]} has its authentication off: anyone who "
                    "reaches it can write every job's decision"
                ) from None
            raise StoreError(
                f"etcd at {self.members[index]} refused the credentials of user "
                f"{self.credentials.user} ({self.credentials.source}): {answer.message}"
            ) from None
        token = reply.get("token") if isinstance(reply, dict) else None
        if not isinstance(token, str) or not token:
            raise StoreError(f"etcd at {self.members[index]} answered a sign-in with no token")
        with self._lock:
            self._tokens[index] = token
        return token

    def _post(self, index: int, path: str, body: Mapping[str, Any], *, anonymous: bool) -> Any:
        client = self._clients[index]
        headers = {}
        if not anonymous:
            token = self._sign_in(index)
            if token:
                headers["Authorization"] = token
        reply = client.post(client.get_url(path), json=dict(body), headers=headers)
        if not isinstance(reply, dict):
            raise StoreError(f"etcd at {self.members[index]} answered {path} with {reply!r:.200}")
        return reply

    def _retrying(
        self,
        what: str,
        deadline: float,
        call: Callable[[Callable[..., Any]], _T],
        *,
        anonymous: bool = False,
    ) -> _T:
        """``call(post)`` until it answers: each member in turn while one is unreachable or
        between leaders, signed in again when a token is refused, until ``deadline`` (and
        within :data:`FIRST_CONTACT_S` while no member was ever reached)."""
        last = ""
        began = self.clock()
        refused = 0
        tries = 0
        while True:
            index = self._at
            tries += 1

            def post(path: str, body: Mapping[str, Any], index: int = index) -> Any:
                return self._post(index, path, body, anonymous=anonymous)

            try:
                answer = call(post)
                self._reached = True
                return answer
            except (etcd_errors.ConnectionFailedError, etcd_errors.ConnectionTimeoutError) as e:
                text = str(e) or str(e.detail_text or "") or type(e).__name__
                last = text.splitlines()[0][:200] if text else type(e).__name__
                if isinstance(e, etcd_errors.ConnectionFailedError) and "refused" in text:
                    refused += 1
                self._at = (index + 1) % len(self.members)
            except etcd_errors.Etcd3Exception as e:
                answer_ = _Answer.of(e)
                if answer_.code == _UNAUTHENTICATED and self.credentials is not None:
                    with self._lock:
                        self._tokens.pop(index, None)
                    last = answer_.message
                elif answer_.transient:
                    last = answer_.message
                    self._at = (index + 1) % len(self.members)
                else:
                    denied = " (the credentials' user may not do this)" if (
                        "permission denied" in answer_.message
                        or "user name is empty" in answer_.message
                    ) else ""  # fmt: skip
                    raise StoreError(
                        f"etcd at {self.members[index]}: {what}: {answer_.message}{denied}"
                    ) from None
            now = self.clock()
            if not self._reached and now - began >= FIRST_CONTACT_S:
                nobody = "nothing listens there" if refused >= tries else "it does not answer"
                raise StoreError(
                    f"the job store {self.address} cannot be reached ({what}): {nobody} "
                    f"({last}); check that etcd runs, that --store is its client URL "
                    "(etcd's --advertise-client-urls) and that this node reaches it"
                )
            if now >= deadline:
                raise StoreError(f"etcd at {self.address} did not answer ({what}): {last}")
            time.sleep(RETRY_PAUSE_S)

    # -- who may write -------------------------------------------------------------

    def open(self, deadline: float, *, insecure: bool = False) -> None:
        """Sign in, and refuse a store that lets anyone write (its authentication off)
        unless ``insecure``: :class:`OpenStore`."""
        try:
            if self.credentials is not None:
                self._retrying("sign in", deadline, lambda post: self._sign_in(self._at))
        except OpenStore:
            if not insecure:
                raise
            self.credentials = None  # nothing to sign in to
        if insecure:
            self.opened = True
            return

        def probe(post: Callable[..., Any]) -> bool:
            try:
                post("/kv/range", {"key": _b64(PREFIX), "limit": 1})
            except etcd_errors.Etcd3Exception as e:
                answer = _Answer.of(e)
                if answer.code == _UNAUTHENTICATED or "user name is empty" in answer.message:
                    return False
                raise
            return True

        if self._retrying("anonymous read", deadline, probe, anonymous=True):
            raise OpenStore(
                f"etcd at {self.address} answers anyone: its authentication is off, so any "
                "process that reaches it can write a job's decision"
            )
        if self.credentials is None:
            raise StoreError(
                f"etcd at {self.address} has its authentication on and this node gave no "
                f"credentials: name its credentials file with --store-credentials FILE "
                f"(or ${CREDENTIALS_ENV})"
            )
        self.opened = True

    # -- leases ------------------------------------------------------------------

    def grant(self, ttl_s: int, deadline: float) -> int:
        """A new lease of ``ttl_s`` seconds; its id."""

        def call(post: Callable[..., Any]) -> int:
            return int(post("/lease/grant", {"TTL": ttl_s, "ID": 0})["ID"])

        return self._retrying("lease grant", deadline, call)

    def refresh(self, lease: int, deadline: float) -> int:
        """Keep ``lease`` alive; its remaining TTL, or -1 when it has expired."""

        def call(post: Callable[..., Any]) -> int:
            result = post("/lease/keepalive", {"ID": lease}).get("result", {})
            return int(result.get("TTL", -1)) if isinstance(result, dict) else -1

        return self._retrying("lease keepalive", deadline, call)

    def revoke(self, lease: int, deadline: float) -> None:
        def call(post: Callable[..., Any]) -> None:
            try:
                post("/kv/lease/revoke", {"ID": lease})
            except etcd_errors.Etcd3Exception as e:
                if "not found" not in str(_Answer.of(e).message):  # expired already
                    raise

        self._retrying("lease revoke", deadline, call)

    # -- keys --------------------------------------------------------------------

    def snapshot(self, prefix: str, deadline: float) -> Snapshot:
        """Every key under ``prefix`` at one revision."""
        body = {"key": _b64(prefix), "range_end": _range_end(prefix)}
        return self._retrying(
            f"read {prefix}", deadline, lambda post: self._snapshot(post("/kv/range", body))
        )

    def _snapshot(self, reply: Any) -> Snapshot:
        if not isinstance(reply, dict) or not isinstance(reply.get("header"), dict):
            raise StoreError(f"etcd at {self.address} answered a range with {reply!r:.200}")
        values: dict[str, Any] = {}
        for kv in reply.get("kvs", []):
            key = base64.b64decode(kv["key"]).decode("utf-8", "replace")
            values[key] = _decode_value(key, base64.b64decode(kv.get("value", "")))
        return Snapshot(int(reply["header"]["revision"]), values)

    def put(self, key: str, value: Any, deadline: float, *, lease: int | None = None) -> None:
        body: dict[str, Any] = {"key": _b64(key), "value": _b64(json.dumps(value))}
        if lease is not None:
            body["lease"] = lease
        self._retrying(f"write {key}", deadline, lambda post: post("/kv/put", body))

    def delete_prefix(self, prefix: str, deadline: float) -> None:
        body = {"key": _b64(prefix), "range_end": _range_end(prefix)}
        self._retrying(f"delete {prefix}", deadline, lambda post: post("/kv/deleterange", body))

    def create(
        self,
        puts: Mapping[str, Any],
        deadline: float,
        *,
        absent: tuple[str, ...] = (),
        present: tuple[str, ...] = (),
        lease: int | None = None,
        leased: tuple[str, ...] = (),
        delete: tuple[str, ...] = (),
        equal: Mapping[str, Any] | None = None,
    ) -> bool:
        """One transaction: write ``puts`` (those named in ``leased`` on ``lease``) and
        delete every key under each prefix of ``delete``, when every key of ``absent``
        does not exist, every key of ``present`` does and each of ``equal`` holds its
        value there; whether it wrote. A retry
        after a lost answer may find its own earlier write: callers compare what they
        read back, never this answer alone."""
        compare = (
            [
                {"key": _b64(k), "result": "EQUAL", "target": "CREATE", "create_revision": 0}
                for k in absent
            ]
            + [
                {"key": _b64(k), "result": "GREATER", "target": "CREATE", "create_revision": 0}
                for k in present
            ]
            + [
                {"key": _b64(k), "result": "EQUAL", "target": "VALUE", "value": _b64(json.dumps(v))}
                for k, v in (equal or {}).items()
            ]
        )
        success = []
        for key, value in puts.items():
            put: dict[str, Any] = {"key": _b64(key), "value": _b64(json.dumps(value))}
            if key in leased and lease is not None:
                put["lease"] = lease
            success.append({"request_put": put})
        for prefix in delete:
            success.append(
                {"request_delete_range": {"key": _b64(prefix), "range_end": _range_end(prefix)}}
            )
        body = {"compare": compare, "success": success, "failure": []}

        def call(post: Callable[..., Any]) -> bool:
            return bool(post("/kv/txn", body).get("succeeded", False))

        return self._retrying("transaction", deadline, call)


class Keeper:
    """A lease kept alive by a thread, every third of its TTL, until stopped.

    ``lost`` is set when the store says the lease expired (its holder was silent past
    the TTL: stopped, or cut off from the store); a pause of the store itself is not
    a loss (etcd renews every lease by its TTL when it comes back). :meth:`silent_until`
    is when the store, unheard since the last renewal, has let the lease go for all
    this holder can know: a node cut off from the store stops there."""

    def __init__(self, store: Store, lease: int, ttl_s: int) -> None:
        self.store = store
        self.lease = lease
        self.ttl_s = ttl_s
        self.lost = threading.Event()
        self._renewed = store.clock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"lease-{lease:x}", daemon=True)
        self._thread.start()

    def silent_until(self) -> float:
        """The clock's time at which the lease ends unless a renewal gets through."""
        return self._renewed + self.ttl_s

    def _run(self) -> None:
        period = self.ttl_s / 3
        while not self._stop.wait(period):
            asked = self.store.clock()
            try:
                left = self.store.refresh(self.lease, asked + period)
            except StoreError:
                continue  # unreachable: tried again next period
            if left < 0:
                self.lost.set()
                return
            self._renewed = asked

    def stop(self, *, revoke: bool, deadline: float) -> None:
        self._stop.set()
        self._thread.join()
        if revoke:
            # Unrevoked, it expires by its TTL: bounded either way.
            with contextlib.suppress(StoreError):
                self.store.revoke(self.lease, deadline)
