"""Simulated nodes for the job tests and the benchmark: each node its own control
directory, simulated-driver namespace, creator/importer group (VMM memory shared by
a POSIX FD, and cudaMalloc memory the shim owns) and coordinator process (``cuinterpose
job ...``, started here); plus the ``gate``, a node played by the test itself through
the library's session, which arrives at each barrier when the test says so.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
from cuinterpose.demo import Worker, pattern_digest
from cuinterpose.engine.jobsession import BARRIERS, JobSpec, Session
from cuinterpose.engine.jobstore import Credentials, addresses

from tests.etcdserver import Cluster, Etcd
from tests.shim import shimenv
from tests.simenv import Spawn
from tests.waiting import wait_until

GATE = "gate"


@attrs.define
class Node:
    name: str
    control_dir: Path
    checkpoint_dir: Path
    creator: Worker
    importer: Worker
    size: int
    seed: int
    vas: dict[str, int] = attrs.field(factory=dict)
    # The node's etcd user of each job (tests/etcdserver.py makes them): a credentials file.
    credentials: dict[str, Path] = attrs.field(factory=dict)

    @property
    def pids(self) -> list[int]:
        return [self.creator.pid, self.importer.pid]

    def mismatches(self) -> list[str]:
        checks = [
            (self.creator, "shared", self.seed),
            (self.importer, "imported", self.seed),
            (self.creator, "owned", self.seed + 1),
        ]
        bad = []
        for worker, label, seed in checks:
            reply = worker.call("digest", va=self.vas[label], size=self.size)
            if not reply.get("ok") or reply.get("digest") != pattern_digest(seed, self.size):
                bad.append(f"node {self.name}: {label} in pid {worker.pid}: {reply}")
        return bad

    def command(
        self, verb: str, url: str, job: str, nodes: Sequence[str], *extra: str
    ) -> list[str]:
        pids = [w for p in self.pids for w in ("--pid", str(p))] if verb == "suspend" else []
        cred = self.credentials.get(job)
        who = ["--store-credentials", str(cred)] if cred else []
        return [
            sys.executable, "-m", "cuinterpose", "job", verb, "--json",
            "--job", job, "--store", url, *who, "--node", self.name, "--nodes", ",".join(nodes),
            "--checkpoint-dir", str(self.checkpoint_dir),
            "--control-dir", str(self.control_dir), *pids, *extra,
        ]  # fmt: skip

    def env(self) -> dict[str, str]:
        env = shimenv.coordinator_cli_env(self.control_dir)
        env.pop("SNAPSHOT_CONTROL_DIR", None)
        return env

    def start(
        self, verb: str, url: str, job: str, nodes: Sequence[str], *extra: str
    ) -> subprocess.Popen[str]:
        return subprocess.Popen(
            self.command(verb, url, job, nodes, *extra),
            env=self.env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )


def outcome(process: subprocess.Popen[str], timeout: float = 60) -> dict[str, Any]:
    """A coordinator's JSON outcome, its exit status checked against it."""
    out, err = process.communicate(timeout=timeout)
    lines = [line for line in out.splitlines() if line.startswith("{")]
    assert lines, f"no outcome (exit {process.returncode}): {out[-1000:]} {err[-2000:]}"
    result: dict[str, Any] = json.loads(lines[-1])
    assert result["code"] == process.returncode, (result, err[-2000:])
    result["stderr"] = err
    return result


def make_node(spawn: Spawn, name: str, seed: int, root: Path) -> Node:
    control_dir = Path(tempfile.mkdtemp(prefix="cip-"))
    control_dir.chmod(0o700)
    namespace = shimenv.sim_namespace_for(control_dir)
    env = shimenv.shim_env(control_dir=control_dir, namespace=namespace)
    env["SNAPSHOT_CONTROL_DIR"] = str(control_dir)
    creator = spawn(f"{name}-creator", env, wait=False)
    importer = spawn(f"{name}-importer", env, wait=False)
    for worker in (creator, importer):
        worker.wait_ready()
    size = 2 * int(creator.check("granularity")["granularity"])
    node = Node(name, control_dir, root / f"ckpt-{name}", creator, importer, size, seed)
    handle, node.vas["shared"] = creator.create_mapped(size, seed=seed)
    node.vas["owned"] = int(creator.check("alloc", size=size)["va"])
    creator.check("fill", va=node.vas["owned"], size=size, seed=seed + 1)
    fd = creator.send_fd_to(importer, int(creator.check("export", handle=handle)["fd"]), close=True)
    imported = int(importer.check("import", fd=fd)["handle"])
    node.vas["imported"] = importer.map_at_new_va(imported, size)
    assert node.mismatches() == []
    return node


def remove_node(node: Node) -> None:
    shutil.rmtree(node.control_dir, ignore_errors=True)
    namespace = shimenv.sim_namespace_for(node.control_dir)
    Path(f"/dev/shm/cuinterpose-sim-{os.getuid()}-{namespace}").unlink(missing_ok=True)


def enrol(server: Etcd | Cluster, job: str, group: Sequence[Node]) -> None:
    """Each node an etcd user of ``job``'s role, its credentials file in ``node.credentials``."""
    for node in group:
        node.credentials[job] = server.credentials(job, node.name)


def gate(
    server: Etcd | Cluster,
    job: str,
    nodes: Sequence[str],
    verb: str = "suspend",
    lease_ttl: int = 2,
) -> Session:
    """The test's own node of the job (an etcd user of the job's role), joined (it starts
    the run)."""
    who = Credentials.read(server.credentials(job, GATE))
    spec = JobSpec(
        job, GATE, tuple(nodes), addresses(server.url), barrier_timeout=30, lease_ttl=lease_ttl,
        credentials=who,
    )  # fmt: skip
    session = Session(spec, verb)  # type: ignore[arg-type]
    session.join()
    return session


def arrive_until(session: Session, step: str) -> None:
    """The gate arrives at every barrier before ``step`` (and waits at none)."""
    while BARRIERS[session.verb][session.seq] != step:
        session.arrive()


def barrier_name(verb: str, step: str) -> str:
    return f"{BARRIERS[verb].index(step):03d}-{step}"


def wait_arrived(session: Session, nodes: Sequence[str], step: str) -> None:
    """Until every node of ``nodes`` has arrived at the barrier of ``step`` (the store's
    barrier keys: an observable state, not a sleep)."""
    name = barrier_name(session.verb, step)

    def there() -> bool:
        snap = session.store.snapshot(session.run_key(), time.monotonic() + 5)
        return session.arrived(name, snap) >= set(nodes)

    wait_until(there, f"nodes {','.join(nodes)} at barrier {name}", timeout_s=60)


def run_state(session: Session) -> dict[str, Any]:
    snap = session.store.snapshot(session.run_key(), time.monotonic() + 5)
    return snap.under(session.run_key())
