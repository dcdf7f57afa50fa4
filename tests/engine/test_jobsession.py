"""One node's run of a job (engine/jobsession.py) against a real etcd, the nodes played by
threads of this process: the barrier's order, the one decision, what refuses joining.
The shims' side is tests/shim/test_multinode.py."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("etcd3gw", reason="the multinode extra (etcd3gw) is not installed")

from cuinterpose.engine.jobsession import (
    BARRIERS,
    JobAborted,
    JobRefused,
    JobSpec,
    Session,
)
from cuinterpose.engine.jobstore import Address, Credentials, Store
from cuinterpose.engine.options import Options

from tests.etcdserver import Etcd, start_etcd


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Etcd]:
    server = start_etcd(tmp_path_factory.mktemp("etcd"))
    yield server
    server.stop()


def spec(etcd: Etcd, job: str, node: str, nodes: tuple[str, ...], **kw: float) -> JobSpec:
    """Node ``node`` of ``job``: an etcd user of the job's role (authentication is on)."""
    who = Credentials.read(etcd.credentials(job, node))
    return JobSpec(job, node, nodes, Address.parse(etcd.url), credentials=who, **kw)  # type: ignore[arg-type]


def reader(etcd: Etcd, job: str) -> Store:
    """A client of ``job``'s role, as the test's own eyes on the store."""
    return Store(
        Address.parse(etcd.url), credentials=Credentials.read(etcd.credentials(job, "eyes"))
    )


def test_the_barriers_follow_the_machines() -> None:
    assert BARRIERS["suspend"][:3] == ("joined", "capture:HANDSHAKE", "capture:QUIESCE")
    assert BARRIERS["suspend"][-1] == "suspended" and BARRIERS["resume"][-1] == "resumed"


def test_every_node_passes_each_barrier_together_and_the_run_commits(etcd: Etcd) -> None:
    nodes = ("a", "b", "c")
    order: list[tuple[str, str]] = []
    decisions: dict[str, str] = {}

    def node(name: str) -> None:
        session = Session(spec(etcd, "j1", name, nodes, lease_ttl=2), "suspend")
        session.join()
        for step in BARRIERS["suspend"][:-1]:
            session.barrier(step)
            order.append((name, step))
        decisions[name] = session.decide({"node": name})[0]
        session.finish({"code": 0})

    threads = [threading.Thread(target=node, args=(n,)) for n in nodes]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert decisions == dict.fromkeys(nodes, "commit")
    steps = [step for _, step in order]
    # No node passed a barrier before every node had passed the one before it.
    for i in range(0, len(steps), 3):
        assert len(set(steps[i : i + 3])) == 1, steps
    held = reader(etcd, "j1").snapshot("/cuinterpose/jobs/j1/", 1e18).values
    assert held["/cuinterpose/jobs/j1/manifest"]["state"] == "suspended"
    assert "/cuinterpose/jobs/j1/current" not in held  # every node finished: no run


def test_an_abort_stops_every_node_at_its_next_barrier_and_excludes_a_commit(etcd: Etcd) -> None:
    nodes = ("a", "b")
    a = Session(spec(etcd, "j2", "a", nodes, lease_ttl=2), "suspend")
    b = Session(spec(etcd, "j2", "b", nodes, lease_ttl=2), "suspend")
    a.join()
    b.join()
    assert a.abort("capture:INSPECT", "refused by a guard") == ("a", "refused by a guard")
    with pytest.raises(JobAborted, match="job aborted by node a: refused by a guard"):
        b.barrier("joined")
    assert b.abort("later", "a second reason") == ("a", "refused by a guard")  # the first stays
    assert b.decide({})[0] == "abort"
    for s in (a, b):
        s.finish({"code": 1})


def test_a_barrier_times_out_naming_the_late_node(etcd: Etcd) -> None:
    nodes = ("a", "late")
    a = Session(spec(etcd, "j3", "a", nodes, lease_ttl=2, barrier_timeout=0.5), "suspend")
    late = Session(spec(etcd, "j3", "late", nodes, lease_ttl=2), "suspend")
    a.join()
    late.join()
    with pytest.raises(JobAborted, match=r"node\(s\) late did not reach barrier 000-joined"):
        a.barrier("joined")
    a.finish({"code": 1})
    late.finish({"code": 1})


def test_joining_is_refused_for_another_verb_a_second_command_or_an_undecided_run(
    etcd: Etcd,
) -> None:
    nodes = ("a", "b")
    a = Session(spec(etcd, "j4", "a", nodes, lease_ttl=2), "suspend")
    a.join()
    with pytest.raises(JobRefused, match="node a is in job j4's run"):
        Session(spec(etcd, "j4", "a", nodes, lease_ttl=2), "suspend").join()
    with pytest.raises(JobRefused, match="has a run in progress"):
        Session(spec(etcd, "j4", "b", nodes, lease_ttl=2), "resume").join()
    with pytest.raises(JobRefused, match="has a run in progress"):
        Session(spec(etcd, "j4", "b", ("a", "b", "c"), lease_ttl=2), "suspend").join()
    a.finish({"code": 4})  # b never came: the run is left undecided once a's lease goes
    store = reader(etcd, "j4")
    store.delete_prefix("/cuinterpose/jobs/j4/current", 1e18)
    with pytest.raises(JobRefused, match="ended undecided"):
        Session(spec(etcd, "j4", "b", nodes, lease_ttl=2), "suspend").join()


def test_names_and_addresses_are_checked() -> None:
    with pytest.raises(ValueError, match=r"job '\.\./x'"):
        JobSpec("../x", "a", ("a",), Address("h", 1))
    with pytest.raises(ValueError, match="node c among them"):
        JobSpec("j", "c", ("a", "b"), Address("h", 1))
    with pytest.raises(ValueError, match="not an etcd client URL"):
        Address.parse("https://h:1/x")
    assert Address.parse("10.0.0.1:2379") == Address("10.0.0.1", 2379)
    # A password in the URL would be printed in every next: line: refused, not shown.
    with pytest.raises(ValueError, match="--store-credentials FILE") as info:
        Address.parse("http://root:s3cret@etcd:2379")
    assert "s3cret" not in str(info.value) and "http://etcd:2379" in str(info.value)


def test_a_store_that_never_answers_is_a_store_error(tmp_path: Path) -> None:
    from cuinterpose.engine.jobstore import StoreError

    store = Store(Address("127.0.0.1", 1))
    with pytest.raises(StoreError, match="did not answer"):
        store.snapshot("/x/", store.clock() + 0.2)


def test_runs_one_after_another_are_joined_by_every_node_at_once(etcd: Etcd) -> None:
    # The run that starts the next one deletes the last in the same transaction: a
    # node joining meanwhile never finds a last run without its decision.
    nodes = ("a", "b", "c")
    for verb in ("suspend", "resume") * 3:
        decisions: list[str] = []

        def node(name: str, verb: str = verb, decisions: list[str] = decisions) -> None:
            session = Session(spec(etcd, "j5", name, nodes, lease_ttl=2), verb)  # type: ignore[arg-type]
            session.join()
            session.barrier("joined")
            decisions.append(session.decide({})[0])
            session.finish({"code": 0})

        threads = [threading.Thread(target=node, args=(n,)) for n in nodes]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert decisions == ["commit"] * 3, verb


class _NoNative:
    """A native backend no test here reaches: the verbs refuse before it."""

    def __getattr__(self, name: str) -> object:
        raise AssertionError(f"native {name} called")


def _target(control: Path) -> object:
    from cuinterpose.engine.agent import Process, Where
    from cuinterpose.engine.job import NodeTarget

    return NodeTarget((Process(1, 1),), control / "ckpt", Where(control), _NoNative())  # type: ignore[arg-type]


def test_a_job_resume_is_refused_on_a_job_never_suspended(etcd: Etcd, control_dir: Path) -> None:
    from cuinterpose.engine import job

    done = job.resume_node(spec(etcd, "j6", "a", ("a", "b")), _target(control_dir))  # type: ignore[arg-type]
    assert done.code == 1 and "job j6 is never suspended, not suspended" in done.lines[1], done


def test_recover_aborts_a_run_left_undecided_and_refuses_one_in_progress(
    etcd: Etcd, control_dir: Path
) -> None:
    from cuinterpose.engine import job

    nodes = ("a", "b")
    a = Session(spec(etcd, "j7", "a", nodes, lease_ttl=2), "suspend")
    a.join()
    refused = job.recover(spec(etcd, "j7", "b", nodes), _target(control_dir))  # type: ignore[arg-type]
    assert refused.code == 1 and "in progress (node(s) a hold" in refused.lines[0], refused
    assert a._node_keeper is not None
    a._node_keeper.stop(revoke=True, deadline=a.clock() + 5)  # a's coordinator is gone
    # No shim behind the target: the node's own recover cannot run (exit 4), but the
    # run is decided first, for every node.
    quick = Options(phase_timeout=0.3)  # the sockets are not there: fail at once
    stranded = job.recover(spec(etcd, "j7", "b", nodes), _target(control_dir), options=quick)  # type: ignore[arg-type]
    assert stranded.code == 4 and stranded.lines[0].endswith("(suspend): abort"), stranded
    held = reader(etcd, "j7").snapshot("/cuinterpose/jobs/j7/", a.clock() + 5)
    abort = held.values[a.run_key("abort")]
    assert abort["reason"] == "the run ended undecided" and abort["node"] == "b"


def test_a_wait_is_told_after_a_second_then_every_five() -> None:
    from cuinterpose.engine.jobsession import WAIT_EVERY_S, WAIT_FIRST_S

    now = [100.0]
    store = Store(Address("127.0.0.1", 1), clock=lambda: now[0])
    told: list[tuple[str, tuple[str, ...], float, float]] = []
    nodes = ("a", "b", "c")
    session = Session(JobSpec("j", "a", nodes, Address("127.0.0.1", 1)), "suspend", store,
                      on_wait=lambda *said: told.append(said))  # fmt: skip
    began, last = now[0], 0.0
    for step in (0.5, WAIT_FIRST_S, WAIT_FIRST_S + 1, WAIT_FIRST_S + WAIT_EVERY_S):
        now[0] = began + step
        last = session._told("005-capture:SAVE_ALLOCATIONS", {"c", "b"}, began, last)
    assert told == [
        ("005-capture:SAVE_ALLOCATIONS", ("b", "c"), WAIT_FIRST_S, 60.0),
        ("005-capture:SAVE_ALLOCATIONS", ("b", "c"), WAIT_FIRST_S + WAIT_EVERY_S, 60.0),
    ]


def test_the_command_tells_a_wait_on_stderr_or_as_an_event() -> None:
    import io
    import json

    from cuinterpose import job_action

    out, err = io.StringIO(), io.StringIO()
    job_action._Waits("a", "suspend", "human", out, err)("005-x", ("b", "c"), 3.2, 60)
    assert err.getvalue() == (
        "cuinterpose job suspend: node a at barrier 005-x, waiting for node(s) b,c (3 s of 60)\n"
    )
    job_action._Waits("a", "suspend", "json", out, err)("005-x", ("b",), 3.2, 60)
    event = json.loads(out.getvalue())
    assert event == {"event": "barrier-wait", "node": "a", "barrier": "005-x",
                     "waiting_for": ["b"], "seconds": 3.2, "timeout": 60}  # fmt: skip
    quiet = io.StringIO()
    job_action._Waits("a", "suspend", "none", quiet, quiet)("005-x", ("b",), 3.2, 60)
    assert quiet.getvalue() == ""
