"""The store's own faults survived (specs/multinode.md, "The store's own faults"): a job
on a three-member etcd cluster whose leader is SIGKILLed at every barrier of a suspend
and at its decision, and a node cut from the store mid-run by stopping the TCP proxy it
reaches the store through. Each ends all or none; each prints what it cost (the
seconds from the fault to what the nodes needed: a store that takes writes again, the
decision), the figures specs/multinode.md records (``pytest -s`` shows them).

Simulated nodes as in tests/shim/test_multinode.py; every wait is on an observable
state (the barrier keys, a coordinator's exit), never on time.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

pytest.importorskip("etcd3gw", reason="the multinode extra (etcd3gw) is not installed")

from cuinterpose.engine.jobsession import BARRIERS

from tests.etcdserver import Cluster, Etcd, start_cluster, start_etcd
from tests.multinode import (
    GATE,
    Node,
    arrive_until,
    enrol,
    gate,
    make_node,
    outcome,
    remove_node,
    run_state,
    wait_arrived,
)
from tests.simenv import Spawn
from tests.waiting import wait_until

JOB = "train"
FAST = ("--lease-ttl", "2", "--barrier-timeout", "20", "--step-timeout", "30")
# A leader's loss stops keepalives until the next leader: leases longer than that pause
# (etcd's new leader renews every lease by its TTL; a node unheard for its TTL stops).
CLUSTER = ("--lease-ttl", "5", "--barrier-timeout", "20", "--step-timeout", "30")


@pytest.fixture
def make(stack: None, spawn: Spawn, tmp_path: Path) -> Iterator[Callable[[int], list[Node]]]:
    made: list[Node] = []

    def nodes(count: int) -> list[Node]:
        for i in range(count):
            made.append(make_node(spawn, "abcdefgh"[i], 60 + 4 * i, tmp_path))
        return made

    yield nodes
    for node in made:
        remove_node(node)


def report(fault: str, figures: dict[str, float]) -> None:
    print(f"fault-cost {fault}: " + json.dumps({k: round(v, 3) for k, v in figures.items()}))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_leader_killed_at_every_barrier_and_at_the_decision(
    make: Callable[[int], list[Node]], tmp_path: Path
) -> None:
    cluster: Cluster = start_cluster(tmp_path / "cluster")
    try:
        group = make(2)
        enrol(cluster, JOB, group)
        everyone = [n.name for n in group] + [GATE]
        held = gate(cluster, JOB, everyone, lease_ttl=5)
        runs = [n.start("suspend", cluster.url, JOB, everyone, *CLUSTER) for n in group]
        costs: dict[str, float] = {}
        for step in BARRIERS["suspend"][:-1]:
            wait_arrived(held, [n.name for n in group], step)
            wait_until(cluster.healthy, "every member back")  # a quorum after the kill
            leader = cluster.leader()
            killed = time.monotonic()
            leader.kill()
            held.arrive()  # through whichever member leads next: the store's pause
            costs[step] = time.monotonic() - killed
            leader.launch()  # back (healthy) before the next kill: a quorum stays
        wait_arrived(held, [n.name for n in group], "suspended")
        wait_until(cluster.healthy, "every member back")
        leader = cluster.leader()
        killed = time.monotonic()
        leader.kill()
        decision, _ = held.decide({})
        costs["decision"] = time.monotonic() - killed
        results = [outcome(p) for p in runs]
        assert decision == "commit", results
        assert [r["code"] for r in results] == [0, 0], results
        held.finish({"code": 0})
        leader.start()
        report("leader killed (suspend)", costs)
        # The resume, its leader killed at the decision too; every byte back.
        resumes = [n.start("resume", cluster.url, JOB, everyone, *CLUSTER) for n in group]
        held = gate(cluster, JOB, everyone, "resume", lease_ttl=5)
        arrive_until(held, "resumed")
        wait_arrived(held, [n.name for n in group], "resumed")
        leader = cluster.leader()
        killed = time.monotonic()
        leader.kill()
        assert held.decide({})[0] == "commit"
        report("leader killed (resume decision)", {"decision": time.monotonic() - killed})
        assert [outcome(p)["code"] for p in resumes] == [0, 0]
        held.finish({"code": 0})
        for node in group:
            assert node.mismatches() == []
    finally:
        cluster.stop()


class Proxy:
    """A TCP proxy on loopback to ``port``: what one node reaches the store through, so
    that the test can cut that node alone (:meth:`cut`: every connection closed, and
    the port no longer listens)."""

    def __init__(self, port: int) -> None:
        self.target = port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.listener.getsockname()[1])
        self.sockets: list[socket.socket] = []
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return  # cut
            try:
                server = socket.create_connection(("127.0.0.1", self.target), timeout=2)
            except OSError:
                client.close()
                continue
            with self.lock:
                self.sockets += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def cut(self) -> None:
        # shutdown() first: a close() alone leaves the port listening while the accept
        # thread waits in accept() on it.
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        with self.lock:
            for s in self.sockets:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()
        self.thread.join(timeout=5)


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_node_cut_from_the_store_rolls_itself_back_when_its_lease_ends(
    make: Callable[[int], list[Node]], tmp_path: Path
) -> None:
    etcd: Etcd = start_etcd(tmp_path / "etcd")
    proxy = Proxy(etcd.client_port)
    try:
        group = make(2)
        enrol(etcd, JOB, group)
        a, b = group
        everyone = [a.name, b.name, GATE]
        held = gate(etcd, JOB, everyone)
        # SAVE_ALLOCATIONS' barrier: PREPARE_MULTICAST has torn down on both nodes.
        arrive_until(held, "capture:SAVE_ALLOCATIONS")
        run_a = a.start("suspend", etcd.url, JOB, everyone, *FAST)
        run_b = b.start("suspend", f"http://127.0.0.1:{proxy.port}", JOB, everyone, *FAST)
        wait_arrived(held, [a.name, b.name], "capture:SAVE_ALLOCATIONS")
        cut = time.monotonic()
        proxy.cut()
        wait_until(lambda: "abort" in run_state(held), "the run aborted", timeout_s=30)
        aborted = time.monotonic() - cut
        first, cut_off = outcome(run_a), outcome(run_b)
        ended = time.monotonic() - cut
        abort = run_state(held)["abort"]
        assert "commit" not in run_state(held)
        assert (first["code"], cut_off["code"]) == (3, 3), (first, cut_off)
        assert abort["node"] == "a" and "node(s) b lost the lease" in abort["reason"], abort
        said = " ".join(cut_off["lines"])
        assert "node b lost its lease: cut off from the store" in said, cut_off
        held.finish({"code": 1})
        for node in group:
            assert node.mismatches() == []
        report("node b cut off", {"abort_written": aborted, "both_nodes_ended": ended})
    finally:
        proxy.cut()
        etcd.stop()
