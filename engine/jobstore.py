"""The job store: etcd v3, reached through its gRPC gateway's JSON API by ``etcd3gw``.

The only module that imports ``etcd3gw`` (the ``multinode`` extra): everything a job
across nodes agrees on goes through here, as etcd's own transactions, revisions and
leases (specs/multinode.md, "The store"). Nothing here decides for a job; it reads,
writes and compares keys, and says in one exception type when the store did not
answer within the time it was given.

Every request is retried while the store is unreachable, until the caller's deadline:
a restarted etcd (its leases renewed by their full TTL when it comes back) is a pause,
not a failure. What the store answers is checked before use (JSON objects only).
"""

from __future__ import annotations

import base64
import contextlib
import json
import threading
import time
from collections.abc import Callable, Mapping
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
    "PREFIX",
    "Address",
    "Keeper",
    "Snapshot",
    "Store",
    "StoreError",
]

PREFIX: Final = "/cuinterpose/jobs/"
# One HTTP request's own limit; the retries around it are bounded by the caller's deadline.
REQUEST_TIMEOUT_S: Final = 2.0
RETRY_PAUSE_S: Final = 0.05
_T = TypeVar("_T")


class StoreError(Exception):
    """The store did not answer (or answered nonsense) within the time given."""


@attrs.frozen
class Address:
    """Where the store's client URL is: ``http://HOST:PORT``."""

    host: str
    port: int

    @classmethod
    def parse(cls, text: str) -> Address:
        parts = urlsplit(text if "://" in text else f"http://{text}")
        if parts.scheme != "http" or not parts.hostname or parts.path not in ("", "/"):
            raise ValueError(f"{text!r} is not an etcd client URL (http://HOST:PORT)")
        try:
            port = parts.port or 2379
        except ValueError:
            raise ValueError(f"{text!r}: the port is not a number") from None
        return cls(parts.hostname, port)

    def __str__(self) -> str:
        return f"http://{self.host}:{self.port}"


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


class Store:
    """One client of one etcd, with every request retried until a deadline."""

    def __init__(self, address: Address, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.address = address
        self.clock = clock
        self._client = Etcd3Client(
            host=address.host, port=address.port, timeout=REQUEST_TIMEOUT_S, api_path="/v3/"
        )

    def _retrying(self, what: str, deadline: float, call: Callable[[], _T]) -> _T:
        last = ""
        while True:
            try:
                return call()
            except (etcd_errors.ConnectionFailedError, etcd_errors.ConnectionTimeoutError) as e:
                last = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
            except etcd_errors.Etcd3Exception as e:
                raise StoreError(f"etcd at {self.address}: {what}: {e}") from None
            if self.clock() >= deadline:
                raise StoreError(f"etcd at {self.address} did not answer ({what}): {last}")
            time.sleep(RETRY_PAUSE_S)

    # -- leases ------------------------------------------------------------------

    def grant(self, ttl_s: int, deadline: float) -> int:
        """A new lease of ``ttl_s`` seconds; its id."""

        def call() -> int:
            reply = self._client.post(
                self._client.get_url("/lease/grant"), json={"TTL": ttl_s, "ID": 0}
            )
            return int(reply["ID"])

        return self._retrying("lease grant", deadline, call)

    def refresh(self, lease: int, deadline: float) -> int:
        """Keep ``lease`` alive; its remaining TTL, or -1 when it has expired."""

        def call() -> int:
            reply = self._client.post(self._client.get_url("/lease/keepalive"), json={"ID": lease})
            return int(reply.get("result", {}).get("TTL", -1))

        return self._retrying("lease keepalive", deadline, call)

    def revoke(self, lease: int, deadline: float) -> None:
        def call() -> None:
            try:
                self._client.post(self._client.get_url("/kv/lease/revoke"), json={"ID": lease})
            except etcd_errors.Etcd3Exception as e:
                if "not found" not in str(e):  # expired already: what revoke wanted
                    raise

        self._retrying("lease revoke", deadline, call)

    # -- keys --------------------------------------------------------------------

    def snapshot(self, prefix: str, deadline: float) -> Snapshot:
        """Every key under ``prefix`` at one revision."""

        def call() -> Snapshot:
            reply = self._client.post(
                self._client.get_url("/kv/range"),
                json={"key": _b64(prefix), "range_end": _range_end(prefix)},
            )
            return self._snapshot(reply)

        return self._retrying(f"read {prefix}", deadline, call)

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

        def call() -> None:
            self._client.post(self._client.get_url("/kv/put"), json=body)

        self._retrying(f"write {key}", deadline, call)

    def delete_prefix(self, prefix: str, deadline: float) -> None:
        body = {"key": _b64(prefix), "range_end": _range_end(prefix)}

        def call() -> None:
            self._client.post(self._client.get_url("/kv/deleterange"), json=body)

        self._retrying(f"delete {prefix}", deadline, call)

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

        def call() -> bool:
            reply = self._client.post(self._client.get_url("/kv/txn"), json=body)
            return bool(reply.get("succeeded", False))

        return self._retrying("transaction", deadline, call)


class Keeper:
    """A lease kept alive by a thread, every third of its TTL, until stopped.

    ``lost`` is set when the store says the lease expired (its holder was silent past
    the TTL: stopped, or cut off from the store); a pause of the store itself is not
    a loss (etcd renews every lease by its TTL when it comes back)."""

    def __init__(self, store: Store, lease: int, ttl_s: int) -> None:
        self.store = store
        self.lease = lease
        self.ttl_s = ttl_s
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"lease-{lease:x}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        period = self.ttl_s / 3
        while not self._stop.wait(period):
            try:
                left = self.store.refresh(self.lease, self.store.clock() + period)
            except StoreError:
                continue  # unreachable: tried again next period
            if left < 0:
                self.lost.set()
                return

    def stop(self, *, revoke: bool, deadline: float) -> None:
        self._stop.set()
        self._thread.join()
        if revoke:
            # Unrevoked, it expires by its TTL: bounded either way.
            with contextlib.suppress(StoreError):
                self.store.revoke(self.lease, deadline)
