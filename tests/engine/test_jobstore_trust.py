"""Who may write a job's keys (specs/multinode.md, "Who may write"), against a real etcd
with authentication on: a client without credentials or of another job's role cannot
write a decision, and the nodes are not fooled; an open store is refused unless told;
credentials files only their owner reads; a store nobody listens on is said within
seconds; a coordinator that ended does not block the next run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("etcd3gw", reason="the multinode extra (etcd3gw) is not installed")

from cuinterpose.engine.jobsession import JobRefused, JobSpec, Session
from cuinterpose.engine.jobstore import (
    FIRST_CONTACT_S,
    Address,
    Credentials,
    CredentialsError,
    OpenStore,
    Store,
    StoreError,
)

from tests.etcdserver import Etcd, start_etcd

JOBS = "/cuinterpose/jobs/"


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Etcd]:
    server = start_etcd(tmp_path_factory.mktemp("etcd"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def open_etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Etcd]:
    server = start_etcd(tmp_path_factory.mktemp("open-etcd"), auth=False)
    yield server
    server.stop()


def who(etcd: Etcd, job: str, node: str) -> Credentials:
    return Credentials.read(etcd.credentials(job, node))


def spec(etcd: Etcd, job: str, node: str, nodes: tuple[str, ...], **kw: float) -> JobSpec:
    return JobSpec(
        job, node, nodes, Address.parse(etcd.url), credentials=who(etcd, job, node), **kw
    )  # type: ignore[arg-type]


def cli(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cuinterpose", "job", *argv],
        capture_output=True, text=True, timeout=60, check=False, env=env,
    )  # fmt: skip


def test_no_credentials_or_another_jobs_cannot_write_the_decision_and_nodes_are_not_fooled(
    etcd: Etcd,
) -> None:
    nodes = ("a", "b", "c")
    a = Session(spec(etcd, "t1", "a", nodes, lease_ttl=2, barrier_timeout=1.5), "suspend")
    b = Session(spec(etcd, "t1", "b", nodes, lease_ttl=2), "suspend")
    a.join()
    b.join()
    commit = a.run_key("commit")
    anonymous = Store(Address.parse(etcd.url))
    with pytest.raises(StoreError, match="user name is empty"):
        anonymous.put(commit, {"by": "c"}, anonymous.clock() + 5)
    stranger = Store(Address.parse(etcd.url), credentials=who(etcd, "other-job", "c"))
    with pytest.raises(StoreError, match="permission denied"):
        stranger.create({commit: {"by": "c"}}, stranger.clock() + 5, absent=(commit,))
    with pytest.raises(StoreError, match="permission denied"):
        stranger.delete_prefix(f"{JOBS}t1/", stranger.clock() + 5)
    # a and b at the decision; c never comes: the run is aborted, never committed.
    decided: dict[str, str] = {}
    thread = threading.Thread(target=lambda: decided.update(b=b.decide({})[0]))
    thread.start()
    assert a.decide({})[0] == "abort"
    thread.join()
    assert decided == {"b": "abort"}
    held = Store(Address.parse(etcd.url), credentials=who(etcd, "t1", "eyes"))
    values = held.snapshot(a.run_key(), held.clock() + 5).values
    assert commit not in values and "c did not reach" in values[a.run_key("abort")]["reason"]
    for s in (a, b):
        s.finish({"code": 1})


def test_an_open_store_is_refused_unless_told(open_etcd: Etcd, tmp_path: Path) -> None:
    nodes = ("a",)
    plain = JobSpec("t2", "a", nodes, Address.parse(open_etcd.url), lease_ttl=2)
    with pytest.raises(OpenStore, match="authentication is off"):
        Session(plain, "suspend").join()
    # Credentials do not make an open store safe: its sign-in says authentication is off.
    cred = tmp_path / "a.cred"
    cred.write_text("t2.a:secret\n")
    cred.chmod(0o600)
    signed = JobSpec("t2", "a", nodes, Address.parse(open_etcd.url), lease_ttl=2,
                     credentials=Credentials.read(cred))  # fmt: skip
    with pytest.raises(OpenStore, match="authentication off"):
        Session(signed, "suspend").join()
    told = Session(JobSpec("t2", "a", nodes, Address.parse(open_etcd.url), lease_ttl=2,
                           insecure=True), "suspend")  # fmt: skip
    told.join()
    told.finish({"code": 0})
    refused = cli("status", "--job", "t2", "--store", open_etcd.url)
    assert refused.returncode == 1, refused
    assert "lets anyone" in refused.stderr or "answers anyone" in refused.stderr, refused.stderr
    assert "--store-insecure" in refused.stderr and "Traceback" not in refused.stderr
    allowed = cli("status", "--job", "t2", "--store", open_etcd.url, "--store-insecure")
    assert allowed.returncode == 0, allowed.stderr
    assert "--store-insecure" in cli("suspend", "--help").stdout


def test_credentials_files_only_their_owner_reads(tmp_path: Path) -> None:
    good = tmp_path / "good.cred"
    good.write_text("job.a:pw:with:colons\n")
    good.chmod(0o600)
    read = Credentials.read(good)
    assert (read.user, read.password) == ("job.a", "pw:with:colons")
    assert "pw:with" not in repr(read)  # never in a log line
    loose = tmp_path / "loose.cred"
    loose.write_text("job.a:pw\n")
    loose.chmod(0o644)
    with pytest.raises(CredentialsError, match=r"mode 0644 lets others read it: chmod 600"):
        Credentials.read(loose)
    link = tmp_path / "link.cred"
    link.symlink_to(good)
    with pytest.raises(CredentialsError, match="symbolic link is refused"):
        Credentials.read(link)
    for bad in ("no colon\n", "a:\n", ":pw\n", "a:b\nc:d\n", ""):
        wrong = tmp_path / "wrong.cred"
        wrong.unlink(missing_ok=True)
        wrong.write_text(bad)
        wrong.chmod(0o600)
        with pytest.raises(CredentialsError, match="want one line USER:PASSWORD"):
            Credentials.read(wrong)
    if os.geteuid() == 0:
        theirs = tmp_path / "theirs.cred"
        theirs.write_text("job.a:pw\n")
        theirs.chmod(0o600)
        os.chown(theirs, 65534, 65534)
        with pytest.raises(CredentialsError, match="owned by uid 65534, not by you"):
            Credentials.read(theirs)
    ran = cli("status", "--job", "j", "--store", "http://127.0.0.1:1",
              "--store-credentials", str(loose))  # fmt: skip
    assert ran.returncode == 1 and "chmod 600" in ran.stderr, ran
    assert len(ran.stderr.strip().splitlines()) == 1, ran.stderr
    env = {**os.environ, "CUINTERPOSE_STORE_CREDENTIALS": str(loose)}
    from_env = cli("status", "--job", "j", "--store", "http://127.0.0.1:1", env=env)
    assert from_env.returncode == 1 and "chmod 600" in from_env.stderr, from_env


def test_no_credentials_for_a_store_with_authentication_is_said_at_once(etcd: Etcd) -> None:
    anonymous = JobSpec("t5", "a", ("a",), Address.parse(etcd.url), lease_ttl=2)
    with pytest.raises(StoreError, match="authentication on and this node gave no credentials"):
        Session(anonymous, "suspend").join()
    ran = cli("status", "--job", "t5", "--store", etcd.url)
    assert ran.returncode == 1 and "--store-credentials FILE" in ran.stderr, ran


def test_a_wrong_password_is_refused_naming_the_user(etcd: Etcd) -> None:
    etcd.credentials("t3", "a")
    store = Store(Address.parse(etcd.url), credentials=Credentials("t3.a", "not-it", "x.cred"))
    with pytest.raises(StoreError, match=r"refused the credentials of user t3\.a \(x\.cred\)"):
        store.open(store.clock() + 5)


def test_a_store_nobody_listens_on_is_said_within_seconds_not_at_the_deadline() -> None:
    # A clock that runs 10 s a call: past FIRST_CONTACT_S at once, the deadline far off.
    ticks = iter(range(0, 10**9, 10))
    store = Store(Address("127.0.0.1", 1), clock=lambda: float(next(ticks)))
    with pytest.raises(StoreError) as caught:
        store.snapshot("/x/", 1e12)
    said = str(caught.value)
    assert "the job store http://127.0.0.1:1 cannot be reached" in said, said
    assert "nothing listens there" in said and "check that etcd runs" in said, said
    assert FIRST_CONTACT_S <= 5
    # The command says it in one line, whatever its barrier timeout.
    ran = cli("status", "--job", "j", "--store", "http://127.0.0.1:1", "--store-insecure")
    assert ran.returncode == 1 and "nothing listens there" in ran.stderr, ran


_CHILD = """
import sys, time
from cuinterpose.engine.jobsession import JobSpec, Session
from cuinterpose.engine.jobstore import Address, Credentials
url, cred, nodes = sys.argv[1], sys.argv[2], tuple(sys.argv[3].split(","))
spec = JobSpec("t4", "a", nodes, Address.parse(url), lease_ttl=30,
               credentials=Credentials.read(cred))
Session(spec, "suspend").join()
print("joined", flush=True)
time.sleep(120)
"""


def _killed_member(etcd: Etcd, nodes: str) -> int:
    """Node a's coordinator, joined to t4's run and then SIGKILLed (its lease, 30 s,
    outlives it); its pid."""
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, etcd.url, str(etcd.credentials("t4", "a")), nodes],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert child.stdout is not None and child.stdout.readline().strip() == "joined"
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    return child.pid


def test_a_coordinator_that_ended_blocks_no_later_run(etcd: Etcd) -> None:
    nodes = ("a", "b")
    pid = _killed_member(etcd, "a,b")
    b = Session(spec(etcd, "t4", "b", nodes, lease_ttl=2), "suspend")
    b.join()
    first = b.run_id
    # Undecided, a's coordinator gone: a retry on node a aborts the run and says what to do.
    with pytest.raises(JobRefused, match=rf"node a's coordinator \(pid {pid}\) ended in the run"):
        Session(spec(etcd, "t4", "a", nodes, lease_ttl=2), "suspend").join()
    held = Store(Address.parse(etcd.url), credentials=who(etcd, "t4", "eyes"))
    abort = held.snapshot(b.run_key("abort"), held.clock() + 5).values[b.run_key("abort")]
    assert abort["node"] == "a" and f"pid {pid}" in abort["reason"]
    # Decided, b still rolling back: a waits for b, whatever its own ended coordinator.
    with pytest.raises(JobRefused, match=r"is ending \(node\(s\) b still at it\)"):
        Session(spec(etcd, "t4", "a", nodes, lease_ttl=2), "suspend").join()
    b.finish({"code": 1})
    # Decided now, its only live lease a dead coordinator's: the next run starts at once
    # (before, refused as "node a is in the run already" until that lease ended).
    again = Session(spec(etcd, "t4", "a", nodes, lease_ttl=2), "suspend")
    again.join()
    assert again.run_id != first
    again.abort("joined", "test done")
    again.finish({"code": 1})


def test_a_coordinator_is_known_gone_only_on_its_own_host_and_pid_namespace() -> None:
    from cuinterpose.engine.jobsession import coordinator_gone, coordinator_info

    me = coordinator_info()
    assert not coordinator_gone(me)
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True, check=True)  # fmt: skip
    assert coordinator_gone({**me, "pid": int(ended.stdout)})  # no such process now
    assert coordinator_gone({**me, "start": me["start"] + 1})  # the pid is another's
    assert coordinator_gone({**me, "boot": "another-boot"})  # rebooted since
    assert not coordinator_gone({**me, "pid": int(ended.stdout), "host": "elsewhere"})
    assert not coordinator_gone({**me, "pid": int(ended.stdout), "pidns": "pid:[1]"})
    for hostile in (None, [], {"pid": "1"}, {**me, "pid": True}, {**me, "pid": -1}):
        assert not coordinator_gone(hostile)
