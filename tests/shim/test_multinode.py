"""A job across simulated nodes, coordinated through a real etcd (specs/multinode.md).

Each node is its own control directory, simulated-driver namespace, creator/importer
group and coordinator process (``cuinterpose job ...``); the ``gate`` node is the test
itself, holding the others at the barrier it chooses. Every wait is on an observable
state: the barrier keys in the store, a coordinator's exit.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

# The job modules import the store's client: without the extra, skip (with the reason).
pytest.importorskip("etcd3gw", reason="the multinode extra (etcd3gw) is not installed")

from cuinterpose.engine import job
from cuinterpose.engine.agent import Process, Where
from cuinterpose.engine.job import NodeTarget
from cuinterpose.engine.jobsession import JobSpec
from cuinterpose.engine.jobstore import Address, Credentials, Store, StoreError
from cuinterpose.engine.options import Options
from cuinterpose.engine.statefile import STATE_FILE_NAME

from tests import simenv
from tests.etcdserver import Etcd, start_etcd
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
from tests.shim import shimenv
from tests.shim.agentgroup import WorkerBackend
from tests.simenv import Spawn

JOB = "train"
# Short enough for the tests, long enough for a loaded two-core machine's keepalives.
FAST = ("--lease-ttl", "2", "--barrier-timeout", "20", "--step-timeout", "30")


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[Etcd]:
    server = start_etcd(tmp_path / "etcd")
    yield server
    server.stop()


@pytest.fixture
def nodes(
    stack: None, spawn: Spawn, tmp_path: Path, etcd: Etcd
) -> Iterator[Callable[[int], list[Node]]]:
    """Simulated nodes, each an etcd user of JOB's role (its credentials file)."""
    made: list[Node] = []

    def make(count: int) -> list[Node]:
        for i in range(count):
            made.append(make_node(spawn, "abcdefgh"[i], 40 + 4 * i, tmp_path))
        enrol(etcd, JOB, made)
        return made

    yield make
    for node in made:
        remove_node(node)


def names(group: list[Node], *more: str) -> list[str]:
    return [n.name for n in group] + list(more)


def test_three_nodes_suspend_and_resume_every_byte(
    etcd: Etcd, nodes: Callable[[int], list[Node]]
) -> None:
    group = nodes(3)
    everyone = names(group)
    suspends = [n.start("suspend", etcd.url, JOB, everyone, *FAST) for n in group]
    results = [outcome(p) for p in suspends]
    assert [r["code"] for r in results] == [0, 0, 0], results
    assert {r["decision"] for r in results} == {"commit"}
    assert results[0]["next"].startswith("cuinterpose job resume --job train --store "), results
    assert (results[0]["outcome"], results[0]["exit_code"]) == ("done", 0), results
    passed = [b["barrier"] for b in results[0]["barriers"]]
    assert passed[0] == "000-joined" and passed[-1].endswith("-suspended"), passed
    assert "004-capture:PREPARE_MULTICAST" in passed
    held = subprocess.run(
        [sys.executable, "-m", "cuinterpose", "job", "status", "--job", JOB, "--store",
         etcd.url, "--store-credentials", str(group[0].credentials[JOB]), "--json"],
        capture_output=True, text=True, check=True, env=group[0].env(),
    )  # fmt: skip
    status = json.loads(held.stdout)
    assert status["decision"] == "commit" and status["current"] is None, status
    assert status["manifest"]["state"] == "suspended"
    assert {n: e["checkpoint_dir"] for n, e in status["manifest"]["nodes"].items()} == {
        n.name: str(n.checkpoint_dir) for n in group
    }
    assert {r["code"] for r in status["results"].values()} == {0}
    resumes = [n.start("resume", etcd.url, JOB, everyone, *FAST) for n in group]
    results = [outcome(p) for p in resumes]
    assert [r["code"] for r in results] == [0, 0, 0], results
    for node in group:
        assert node.mismatches() == []


@pytest.mark.slow
def test_the_single_process_driver_suspends_and_resumes_every_node(
    etcd: Etcd, nodes: Callable[[int], list[Node]], spawn: Spawn
) -> None:
    group = nodes(2)
    specs = [
        JobSpec(JOB, n.name, tuple(names(group)), Address.parse(etcd.url), lease_ttl=2,
                credentials=Credentials.read(n.credentials[JOB]))
        for n in group
    ]  # fmt: skip
    targets = []
    for node in group:
        env = simenv.sim_env(namespace=shimenv.sim_namespace_for(node.control_dir))
        native = WorkerBackend(spawn(f"{node.name}-observer", env))
        processes = tuple(Process(p, p) for p in node.pids)
        targets.append(NodeTarget(processes, node.checkpoint_dir, Where(node.control_dir), native))
    options = Options(phase_timeout=30)
    for verb in ("suspend", "resume"):
        outcomes = job.drive(verb, specs, targets, options=options)
        assert [o.code for o in outcomes] == [0, 0], outcomes
        assert job.job_code([o.code for o in outcomes]) == 0
    for node in group:
        assert node.mismatches() == []


def test_a_coordinator_killed_mid_capture_rolls_back_every_node(
    etcd: Etcd, nodes: Callable[[int], list[Node]]
) -> None:
    group = nodes(2)
    everyone = names(group, GATE)
    held = gate(etcd, JOB, everyone)
    arrive_until(held, "capture:PREPARE_UNICAST")  # SAVE_ALLOCATIONS done: torn down
    a, b = (n.start("suspend", etcd.url, JOB, everyone, *FAST) for n in group)
    wait_arrived(held, names(group), "capture:PREPARE_UNICAST")
    # Held there by the gate, a says whom it waits for (an event line with --json).
    assert a.stdout is not None
    told: dict[str, object] = {}
    # (an earlier barrier may have had a told wait too: b's coordinator starting)
    while not str(told.get("barrier", "")).endswith("capture:PREPARE_UNICAST"):
        line = a.stdout.readline()
        assert line, "a ended without telling its wait"
        told = json.loads(line) if line.startswith("{") else {}
    assert told["event"] == "barrier-wait" and told["waiting_for"] == [GATE], told
    # A second job suspend on a node while the run is in progress: refused.
    second = outcome(group[0].start("suspend", etcd.url, JOB, everyone, *FAST))
    assert second["code"] == 1 and "already" in " ".join(second["lines"]), second
    b.kill()
    b.wait()
    first = outcome(a)
    assert first["code"] == 3, first  # rolled back: runs as before
    assert "node(s) b lost the lease" in " ".join(first["lines"]), first
    abort = run_state(held)["abort"]
    assert abort["node"] == "a" and "lost the lease" in abort["reason"]
    # Every node listed, b (its coordinator killed, no result) as needing job recover.
    cred = str(group[0].credentials[JOB])
    shown = subprocess.run(
        [sys.executable, "-m", "cuinterpose", "job", "status", "--job", JOB, "--store",
         etcd.url, "--store-credentials", cred],
        capture_output=True, text=True, check=True, env=group[0].env(),
    ).stdout  # fmt: skip
    assert "node a: suspend: rolled back" in shown, shown
    assert "node gate: in the run" in shown, shown
    assert "node b: its coordinator ended without a result" in shown and "needs recover" in shown
    assert "next (on node b): cuinterpose job recover --job train" in shown, shown
    assert "<node b's credentials file>" in shown and "<its checkpoint directory>" in shown
    assert "--node b --nodes a,b,gate" in shown, shown
    held_json = json.loads(subprocess.run(
        [sys.executable, "-m", "cuinterpose", "job", "status", "--job", JOB, "--store",
         etcd.url, "--store-credentials", cred, "--json"],
        capture_output=True, text=True, check=True, env=group[0].env(),
    ).stdout)  # fmt: skip
    assert held_json["needs_recover"] == ["b"] and held_json["exit_code"] == 0, held_json
    assert "aborted" in held_json["outcome"] and "node(s) b need" in held_json["outcome"]
    recovered = outcome(group[1].start("recover", etcd.url, JOB, everyone, *FAST))
    assert recovered["code"] == 0, recovered  # rolled back: running, as `recover` says it
    held.finish({"code": 1})
    for node in group:
        assert node.mismatches() == []


def test_one_nodes_refusal_refuses_the_job_before_anything_is_torn_down(
    etcd: Etcd, nodes: Callable[[int], list[Node]]
) -> None:
    group = nodes(2)
    # b's checkpoint directory holds a capture never restored: its guard of
    # PREPARE_MULTICAST (the first op that tears down) refuses there.
    group[1].checkpoint_dir.mkdir()
    (group[1].checkpoint_dir / STATE_FILE_NAME).write_text("{}")
    runs = [n.start("suspend", etcd.url, JOB, names(group), *FAST) for n in group]
    a, b = (outcome(p) for p in runs)
    assert (a["code"], b["code"]) == (1, 1), (a, b)
    assert "never restored" in " ".join(b["lines"]), b
    assert "job aborted by node b" in " ".join(a["lines"]), a
    # a never passed the barrier of PREPARE_MULTICAST (it may have seen the abort
    # already at INSPECT's, when b passed it and refused first).
    assert all(passed["barrier"] < "004" for passed in a["barriers"]), a
    for node in group:
        assert node.mismatches() == []


def test_a_job_aborted_after_every_nodes_native_checkpoint_is_undone_everywhere(
    etcd: Etcd, nodes: Callable[[int], list[Node]]
) -> None:
    group = nodes(2)
    everyone = names(group, GATE)
    held = gate(etcd, JOB, everyone)
    arrive_until(held, "suspended")
    runs = [n.start("suspend", etcd.url, JOB, everyone, *FAST) for n in group]
    wait_arrived(held, names(group), "suspended")  # both checkpointed natively, waiting
    # Nobody but the job's nodes decides: an anonymous client and another job's user
    # cannot write the commit (the store refuses), so nodes a and b are not fooled.
    commit = held.run_key("commit")
    anonymous = Store(Address.parse(etcd.url))
    with pytest.raises(StoreError, match="user name is empty"):
        anonymous.put(commit, {"by": GATE}, anonymous.clock() + 5)
    other = Store(
        Address.parse(etcd.url), credentials=Credentials.read(etcd.credentials("other", GATE))
    )
    with pytest.raises(StoreError, match="permission denied"):
        other.put(commit, {"by": GATE}, other.clock() + 5)
    held.abort("suspended", "the gate's native checkpoint failed")
    results = [outcome(p) for p in runs]
    assert [r["code"] for r in results] == [3, 3], results
    assert all("suspend is undone" in r["lines"][0] for r in results), results
    held.finish({"code": 1})
    for node in group:
        assert node.mismatches() == []


@pytest.mark.slow
def test_a_node_that_never_reaches_a_barrier_times_the_job_out(
    etcd: Etcd, nodes: Callable[[int], list[Node]]
) -> None:
    group = nodes(2)
    everyone = names(group, GATE)
    held = gate(etcd, JOB, everyone)
    arrive_until(held, "capture:SAVE_ALLOCATIONS")
    short = ("--lease-ttl", "2", "--barrier-timeout", "3", "--step-timeout", "30")
    runs = [n.start("suspend", etcd.url, JOB, everyone, *short) for n in group]
    results = [outcome(p) for p in runs]
    assert [r["code"] for r in results] == [3, 3], results  # PREPARE_MULTICAST had run
    reason = run_state(held)["abort"]["reason"]
    assert "did not reach barrier 005-capture:SAVE_ALLOCATIONS" in reason and "gate" in reason
    held.finish({"code": 1})
    for node in group:
        assert node.mismatches() == []


@pytest.mark.slow
def test_a_stopped_node_agent_past_its_lease_rolls_the_others_back(
    etcd: Etcd, nodes: Callable[[int], list[Node]]
) -> None:
    group = nodes(2)
    everyone = names(group, GATE)
    held = gate(etcd, JOB, everyone)
    arrive_until(held, "capture:SAVE_ALLOCATIONS")
    a, b = (n.start("suspend", etcd.url, JOB, everyone, *FAST) for n in group)
    wait_arrived(held, names(group), "capture:SAVE_ALLOCATIONS")
    os.kill(b.pid, signal.SIGSTOP)
    try:
        held.arrive()  # the gate passes SAVE: a goes on, then waits for b
        first = outcome(a)
    finally:
        os.kill(b.pid, signal.SIGCONT)
    assert first["code"] == 3, first
    assert "node(s) b lost the lease" in " ".join(first["lines"]), first
    woken = outcome(b)  # woken, it finds the abort at its next barrier and rolls back
    assert woken["code"] == 3, woken
    held.finish({"code": 1})
    for node in group:
        assert node.mismatches() == []


@pytest.mark.slow
def test_etcd_restarted_mid_run_the_job_completes_or_rolls_back_never_half(
    etcd: Etcd, nodes: Callable[[int], list[Node]]
) -> None:
    group = nodes(2)
    everyone = names(group, GATE)
    # The gate's lease outlives the restart and the sign-in again that follows it.
    held = gate(etcd, JOB, everyone, lease_ttl=5)
    arrive_until(held, "capture:SAVE_ALLOCATIONS")
    runs = [n.start("suspend", etcd.url, JOB, everyone, *FAST) for n in group]
    wait_arrived(held, names(group), "capture:SAVE_ALLOCATIONS")
    etcd.stop()
    etcd.start()  # the same data: the run, its barriers and leases are back
    arrive_until(held, "suspended")
    decision, _ = held.decide({})
    results = [outcome(p) for p in runs]
    codes = {r["code"] for r in results}
    assert decision in ("commit", "abort")
    assert codes == ({0} if decision == "commit" else {3}), (decision, results)
    held.finish({"code": 0})
    if decision == "commit":
        resumes = [n.start("resume", etcd.url, JOB, everyone, *FAST) for n in group]
        held = gate(etcd, JOB, everyone, "resume", lease_ttl=5)
        arrive_until(held, "resumed")
        resumed = held.decide({})
        assert resumed[0] == "commit", (resumed, [outcome(p) for p in resumes])
        assert [outcome(p)["code"] for p in resumes] == [0, 0]
        held.finish({"code": 0})
    for node in group:
        assert node.mismatches() == []


@pytest.mark.slow
def test_the_store_gone_at_the_decision_leaves_it_to_recover_never_half(
    etcd: Etcd, nodes: Callable[[int], list[Node]]
) -> None:
    group = nodes(2)
    everyone = names(group, GATE)
    held = gate(etcd, JOB, everyone)
    arrive_until(held, "suspended")
    # The barrier timeout counts from a node's arrival at the decision's barrier: the
    # store must be gone before it ends, or the nodes abort for want of the gate.
    short = ("--lease-ttl", "2", "--barrier-timeout", "3", "--step-timeout", "30")
    runs = [n.start("suspend", etcd.url, JOB, everyone, *short) for n in group]
    wait_arrived(held, names(group), "suspended")  # suspended here, the decision to come
    etcd.stop()
    results = [outcome(p) for p in runs]
    assert [r["code"] for r in results] == [4, 4], results  # they cannot know: recover
    assert all(r["decision"] == "unknown" for r in results), results
    etcd.start()
    assert held._node_keeper is not None
    held._node_keeper.stop(revoke=True, deadline=held.clock() + 5)  # the gate is gone too
    # etcd renewed the leases it held by their TTL when it came back, but the nodes'
    # coordinators have ended (this host, their pids gone): recover need not wait for
    # those leases (tests/engine/test_jobstore_trust.py shows it with leases of 30 s);
    # the first one aborts the undecided run, each undoes its suspend.
    recovers = [n.start("recover", etcd.url, JOB, everyone, *FAST) for n in group]
    recovered = [outcome(p) for p in recovers]
    assert [r["code"] for r in recovered] == [0, 0], recovered  # aborted: undone on each
    assert all("(suspend): abort" in r["lines"][0] for r in recovered), recovered
    reason = run_state(held)["abort"]["reason"]
    assert "the run ended undecided" in reason, reason
    for node in group:
        assert node.mismatches() == []


@pytest.mark.slow
def test_a_job_resume_aborted_mid_restore_rolls_every_node_back_to_running(
    etcd: Etcd, nodes: Callable[[int], list[Node]]
) -> None:
    group = nodes(2)
    everyone = names(group, GATE)
    held = gate(etcd, JOB, everyone)
    arrive_until(held, "suspended")
    runs = [n.start("suspend", etcd.url, JOB, everyone, *FAST) for n in group]
    assert held.decide({})[0] == "commit"
    assert [outcome(p)["code"] for p in runs] == [0, 0]
    held.finish({"code": 0})
    held = gate(etcd, JOB, everyone, "resume")
    arrive_until(held, "restore:RESTORE_UNICAST")  # LOAD_ALLOCATIONS has run
    runs = [n.start("resume", etcd.url, JOB, everyone, *FAST) for n in group]
    wait_arrived(held, names(group), "restore:RESTORE_UNICAST")
    held.abort("restore:RESTORE_UNICAST", "the gate's restore failed")
    results = [outcome(p) for p in runs]
    assert [r["code"] for r in results] == [3, 3], results  # running, bytes of the suspend
    held.finish({"code": 3})
    for node in group:
        assert node.mismatches() == []
