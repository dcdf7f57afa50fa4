"""One node's part in one run of a job: joining it, the barriers, the decision.

A job is a set of named nodes, each with its own group and coordinator; a run is one
verb (suspend, resume) of the job, every node's coordinator joined to it. Nodes meet
at a barrier after every step of their machine (specs/multinode.md); the first node
that fails, refuses, times out or finds another's lease gone writes the run's abort,
and every other node stops at its next barrier. The run ends in one decision, commit
or abort, each written by one etcd transaction that the other excludes: a run is
never half decided. Everything lives in the store (:mod:`.jobstore`); this module
says what the keys mean.
"""

from __future__ import annotations

import os
import re
import socket
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final, Literal

import attrs

from ..phases import CAPTURE, RESTORE
from .errors import Interrupted, Problem
from .jobstore import PREFIX, Address, Credentials, Keeper, Snapshot, Store, StoreError
from .statefile import utc_timestamp

__all__ = [
    "BARRIERS",
    "Decision",
    "JobAborted",
    "JobRefused",
    "JobSpec",
    "Session",
    "job_snapshot",
]

Verb = Literal["suspend", "resume"]
# The barriers of each verb, in order: every node arrives at each (the machine's steps
# through Options.on_step), and the last one is the decision's.
BARRIERS: Final[Mapping[str, tuple[str, ...]]] = {
    "suspend": ("joined", *(f"capture:{s.trigger}" for s in CAPTURE.steps), "suspended"),
    "resume": ("joined", *(f"restore:{s.trigger}" for s in RESTORE.steps), "resumed"),
}
MACHINE_OF: Final[Mapping[str, str]] = {"suspend": CAPTURE.name, "resume": RESTORE.name}
_NAME: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
POLL_S: Final = 0.01
# A wait at a barrier is told after this long, then every WAIT_EVERY_S (whom it waits for).
WAIT_FIRST_S: Final = 1.0
WAIT_EVERY_S: Final = 5.0
# Writing the abort when this node is cut off from the store: tried briefly, the others
# abort by themselves when its lease ends.
CUT_OFF_WRITE_S: Final = 1.0
# Told each wait: the barrier, the nodes not there yet, seconds waited, the timeout.
OnWait = Callable[[str, tuple[str, ...], float, float], None]


class JobRefused(Exception):
    """The run could not be joined: nothing was changed on this node."""

    def __init__(self, what: str, lines: Sequence[str] = ()) -> None:
        super().__init__(what, tuple(lines))
        self.what = what
        self.detail = tuple(lines)

    def lines(self) -> tuple[str, ...]:
        return (self.what, *self.detail)


class JobAborted(Interrupted):
    """The run was aborted (by this node or another): the machine stops at this step
    and rolls back what it changed. ``by`` is the node that aborted."""

    def __init__(self, machine: str, step: str, by: str, reason: str) -> None:
        # ``step`` is a barrier's ("capture:SAVE_ALLOCATIONS"): the error names the step.
        super().__init__(
            machine, step.rpartition(":")[2], [Problem(f"job aborted by node {by}: {reason}")]
        )
        self.by = by
        self.why = reason


def _field(record: object, key: str) -> str:
    """A field of a record read from the store, as text ("?" when it has none)."""
    return str(record.get(key, "?")) if isinstance(record, dict) else "?"


def check_name(what: str, name: str) -> str:
    if not _NAME.fullmatch(name):
        raise ValueError(f"{what} {name!r}: want 1 to 63 of A-Z a-z 0-9 . _ - (not first . _ -)")
    return name


def _members(value: Address | Sequence[Address]) -> tuple[Address, ...]:
    return (value,) if isinstance(value, Address) else tuple(value)


@attrs.frozen
class JobSpec:
    """Which job, which node this is, every node of the job, and the store's bounds."""

    job: str = attrs.field(validator=lambda _i, _a, v: check_name("job", v))
    node: str = attrs.field(validator=lambda _i, _a, v: check_name("node", v))
    nodes: tuple[str, ...] = attrs.field(converter=tuple)
    # The store's members: one etcd client URL, or every member of a cluster.
    store: tuple[Address, ...] = attrs.field(converter=_members)
    # How long a node waits at one barrier for the others (and for the store).
    barrier_timeout: float = 60.0
    # A node silent for this long (stopped, cut off) has lost its lease: the run aborts.
    lease_ttl: int = 10
    # Who this node is to the store (an etcd user of the job's role), none: anonymous.
    credentials: Credentials | None = None
    # Go on against a store whose authentication is off (anyone can decide the job).
    insecure: bool = False

    def __attrs_post_init__(self) -> None:
        for n in self.nodes:
            check_name("node", n)
        if len(set(self.nodes)) != len(self.nodes) or self.node not in self.nodes:
            raise ValueError(
                f"nodes {','.join(self.nodes)}: each once, and node {self.node} among them"
            )
        if not self.barrier_timeout > 0 or self.lease_ttl < 1:
            raise ValueError("the barrier timeout and the lease TTL must be positive")

    @property
    def prefix(self) -> str:
        return f"{PREFIX}{self.job}/"


Decision = Literal["commit", "abort", "unknown"]


def job_snapshot(store: Store, job: str, timeout: float) -> Snapshot:
    """Everything the store holds of ``job``."""
    return store.snapshot(f"{PREFIX}{check_name('job', job)}/", time.monotonic() + timeout)


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _pid_namespace() -> str:
    """This process's pid namespace (``pid:[4026531836]``): a pid means the same process
    only to a reader in the same one (two pods of one host may share a host name)."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def _start_time(pid: int) -> int | None:
    """A process's start time (clock ticks after boot), None when there is no such process."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rpartition(")")[2].split()
    if fields[:1] == ["Z"]:  # ended, not yet reaped
        return None
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def coordinator_info() -> dict[str, Any]:
    """Who this coordinator is, for its member key: enough for a later command on the
    same host to tell whether it still runs (pid, start time, boot)."""
    pid = os.getpid()
    return {
        "pid": pid,
        "host": socket.gethostname(),
        "boot": _boot_id(),
        "pidns": _pid_namespace(),
        "start": _start_time(pid),
        "at": utc_timestamp(),
    }


def coordinator_gone(info: object) -> bool:
    """Whether a member key's coordinator is known to have ended: recorded on this host
    (and boot) with a pid that no longer runs, or runs another process (its start time
    differs). A coordinator of another host or pid namespace is never known gone (its
    lease says it)."""
    if not isinstance(info, dict) or info.get("host") != socket.gethostname():
        return False
    if info.get("pidns") != _pid_namespace() or not _pid_namespace():
        return False
    pid, start = info.get("pid"), info.get("start")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    if info.get("boot") and info.get("boot") != _boot_id():
        return True
    now = _start_time(pid)
    return now is None or (isinstance(start, int) and now != start)


class Session:
    """This node in one run: joined, kept alive by its lease, at its barriers."""

    def __init__(
        self,
        spec: JobSpec,
        verb: Verb,
        store: Store | None = None,
        *,
        on_wait: OnWait | None = None,
    ) -> None:
        self.spec = spec
        self.verb = verb
        self.store = store or Store(spec.store, credentials=spec.credentials)
        self.on_wait = on_wait
        self.cut_off = False  # this node lost the store for its lease's TTL
        self.clock: Callable[[], float] = self.store.clock
        self.run_id = ""
        self.seq = 0
        self.waits: list[tuple[str, float]] = []  # each barrier: its name, seconds waited
        self._node_keeper: Keeper | None = None
        self._run_keeper: Keeper | None = None
        self._current: dict[str, Any] = {}  # the run's record, as joined

    # -- keys --------------------------------------------------------------------

    @property
    def current_key(self) -> str:
        return self.spec.prefix + "current"

    def run_key(self, rest: str = "") -> str:
        return f"{self.spec.prefix}runs/{self.run_id}/{rest}"

    def barrier_name(self, seq: int) -> str:
        return f"{seq:03d}-{BARRIERS[self.verb][seq]}"

    def _deadline(self) -> float:
        return self.clock() + self.spec.barrier_timeout

    # -- joining -------------------------------------------------------------------

    def join(self, *, expect: Callable[[Snapshot], list[str]] | None = None) -> None:
        """Join the job's run of this verb in progress, or start one. ``expect`` says
        what, in the store's view of the job, refuses this verb (none: go on).

        Raises :class:`JobRefused` when another verb's run is in progress, this node is
        in it already (a second job command), the last run was left undecided (``job
        recover`` first), or ``expect`` refuses; :class:`StoreError` when the store
        does not answer, refuses the credentials or lets anyone write
        (:class:`~.jobstore.OpenStore`)."""
        deadline = self._deadline()
        if not self.store.opened:
            self.store.open(deadline, insecure=self.spec.insecure)
        lease = self.store.grant(self.spec.lease_ttl, deadline)
        self._node_keeper = Keeper(self.store, lease, self.spec.lease_ttl)
        try:
            self._join(lease, deadline, expect)
        except BaseException:
            self._node_keeper.stop(revoke=True, deadline=self.clock() + 1)
            self._node_keeper = None
            raise

    def _join(
        self, lease: int, deadline: float, expect: Callable[[Snapshot], list[str]] | None
    ) -> None:
        me = self.spec.node
        info = coordinator_info()
        while True:
            if self.clock() >= deadline:
                raise StoreError(f"job {self.spec.job}: could not join a run in time")
            snap = self.store.snapshot(self.spec.prefix, deadline)
            current = snap.values.get(self.current_key)
            if current is None:
                self._start(snap, lease, deadline, expect)
                continue
            if not isinstance(current, dict) or not isinstance(current.get("run"), str):
                raise JobRefused(
                    f"job {self.spec.job}: the store's {self.current_key} is not a run"
                )
            self.run_id = current["run"]
            if self._ended(snap, current, deadline):
                continue
            members = snap.under(self.run_key("members/"))
            if members.get(me) != info:  # else: our own join, its answer lost (a retry)
                self._refuse_joining(snap, current, expect)
                joined = self.store.create(
                    {self.run_key(f"members/{me}"): info, self.run_key(f"alive/{me}"): info},
                    deadline,
                    absent=(self.run_key(f"members/{me}"), self.run_key("abort")),
                    present=(self.current_key,),
                    lease=lease,
                    leased=(self.run_key(f"alive/{me}"),),
                )
                if not joined:
                    continue  # read again: what changed says why (or that it did write)
            self._current = dict(current)
            run_lease = current.get("lease")
            if isinstance(run_lease, int):
                self._run_keeper = Keeper(self.store, run_lease, self.spec.lease_ttl)
            return

    def _ended(self, snap: Snapshot, current: Mapping[str, Any], deadline: float) -> bool:
        """The run in progress is decided and none of its coordinators runs any more (each
        one's lease gone, or its pid on this host ended): it is over, though its key
        waits for its run lease; end it now (whether this deleted it or another did)."""
        run = self.run_key()
        if run + "abort" not in snap.values and run + "commit" not in snap.values:
            return False
        alive = snap.under(run + "alive/")
        if any(not coordinator_gone(info) for info in alive.values()):
            return False
        self.store.create(
            {}, deadline, delete=(self.current_key,), equal={self.current_key: current}
        )
        return True

    def _refuse_joining(
        self,
        snap: Snapshot,
        current: Mapping[str, Any],
        expect: Callable[[Snapshot], list[str]] | None,
    ) -> None:
        job, me = self.spec.job, self.spec.node
        run = self.run_key()
        nodes = current.get("nodes")
        theirs = tuple(str(n) for n in nodes) if isinstance(nodes, list) else ()
        if current.get("verb") != self.verb or theirs != self.spec.nodes:
            raise JobRefused(
                f"job {self.verb} refused: job {job} has a run in progress ({run}):",
                [
                    f"its verb {current.get('verb')}, nodes {','.join(theirs)}",
                    f"this command: {self.verb} of nodes {','.join(self.spec.nodes)}",
                ],
            )
        members = snap.under(run + "members/")
        decided = run + "abort" in snap.values or run + "commit" in snap.values
        if me in members and not (decided and coordinator_gone(members[me])):
            pid = _field(members[me], "pid")
            if coordinator_gone(members[me]):
                # Its coordinator died in the run: whatever it changed here needs recover,
                # and the run cannot go on without it.
                reason = f"node {me}'s coordinator (pid {pid}) ended in the run"
                self.abort("joined", reason)
                raise JobRefused(
                    f"job {self.verb} refused: {reason}; job {job}'s run {self.run_id} is aborted",
                    [f"run `cuinterpose job recover` on node {me} first, then this again"],
                )
            raise JobRefused(
                f"job {self.verb} refused: node {me} is in job {job}'s run {self.run_id} "
                f"already (coordinator pid {pid} on {_field(members[me], 'host')}): one "
                "command per node",
            )
        if decided:  # (this node's own part of it ended: only others still at it)
            running = sorted(
                n for n, i in snap.under(run + "alive/").items() if not coordinator_gone(i)
            )
            raise JobRefused(
                f"job {self.verb} refused: job {job}'s run {self.run_id} is ending (node(s) "
                f"{','.join(running)} still at it); try again when `cuinterpose job status` "
                "shows no run in progress"
            )
        problems = expect(snap) if expect else []
        if problems:
            raise JobRefused(f"job {self.verb} refused for job {job}:", problems)

    def _start(
        self,
        snap: Snapshot,
        lease: int,
        deadline: float,
        expect: Callable[[Snapshot], list[str]] | None,
    ) -> None:
        """No run in progress: start one, unless the last one was left undecided."""
        job = self.spec.job
        last = snap.values.get(self.spec.prefix + "last")
        old: tuple[str, ...] = ()
        if isinstance(last, str):
            old = (f"{self.spec.prefix}runs/{last}/",)
            decided = old[0] + "commit" in snap.values or old[0] + "abort" in snap.values
            if not decided:
                raise JobRefused(
                    f"job {self.verb} refused: job {job}'s last run {last} ended undecided "
                    "(its coordinators gone):",
                    ["run `cuinterpose job recover` on every node first"],
                )
        problems = expect(snap) if expect else []
        if problems:
            raise JobRefused(f"job {self.verb} refused for job {job}:", problems)
        run_id = uuid.uuid4().hex[:12]
        run_lease = self.store.grant(self.spec.lease_ttl, deadline)
        record = {
            "run": run_id,
            "verb": self.verb,
            "nodes": list(self.spec.nodes),
            "lease": run_lease,
            "started_by": self.spec.node,
            "at": utc_timestamp(),
        }
        # Only the last run is kept (its decision and results, until a new one starts):
        # deleted in the transaction that starts the next, so that no node ever reads a
        # last run without its decision.
        self.store.create(
            {
                self.current_key: record,
                self.spec.prefix + "last": run_id,
                f"{self.spec.prefix}runs/{run_id}/verb": self.verb,
                # The run's nodes, kept once `current` goes (job status lists each).
                f"{self.spec.prefix}runs/{run_id}/record": record,
            },
            deadline,
            absent=(self.current_key,),
            lease=run_lease,
            leased=(self.current_key,),
            delete=old,
            equal={self.spec.prefix + "last": last} if old else None,
        )

    # -- barriers ------------------------------------------------------------------

    def arrive(self, deadline: float | None = None) -> str:
        """Post this node's arrival at its next barrier (trying until ``deadline``, else
        the barrier timeout); the barrier's name."""
        name = self.barrier_name(self.seq)
        self.seq += 1
        assert self._node_keeper is not None, "arrive() before join()"
        value = {"at": utc_timestamp()}
        self.store.put(
            self.run_key(f"barriers/{name}/{self.spec.node}"),
            value,
            self._deadline() if deadline is None else deadline,
            lease=self._node_keeper.lease,
        )
        return name

    def arrived(self, name: str, snap: Snapshot) -> set[str]:
        return set(snap.under(self.run_key(f"barriers/{name}/")))

    def _bounded(self, deadline: float) -> float:
        """A store request's deadline at a barrier: no later than the end of this node's
        lease by silence (the store unheard that long has let it go)."""
        if self._node_keeper is None:
            return deadline
        return min(deadline, self._node_keeper.silent_until())

    def _silenced(self) -> str | None:
        """Why this node must stop for want of the store (None: it may go on)."""
        if self._node_keeper is None or self.clock() < self._node_keeper.silent_until():
            return None
        self.cut_off = True
        return (
            f"node {self.spec.node} lost its lease: cut off from the store "
            f"{self.store.address} for {self.spec.lease_ttl} s"
        )

    def _told(self, name: str, waiting: set[str], began: float, told: float) -> float:
        """Tell ``on_wait`` whom this node waits for, after WAIT_FIRST_S and every
        WAIT_EVERY_S; when it was last told."""
        now = self.clock()
        if self.on_wait is None or not waiting or now - began < WAIT_FIRST_S:
            return told
        if told and now - told < WAIT_EVERY_S:
            return told
        self.on_wait(name, tuple(sorted(waiting)), now - began, self.spec.barrier_timeout)
        return now

    def barrier(self, step: str) -> None:
        """Arrive at the barrier after ``step`` and wait for every node; raise
        :class:`JobAborted` when the run is aborted (by another, or by this node on a
        timeout, a lost lease or the store gone)."""
        expected = BARRIERS[self.verb][self.seq] if self.seq < len(BARRIERS[self.verb]) else ""
        if expected != step:
            # A capture started over (QUIESCE found no quiet point) or a bug: the nodes
            # would wait at different barriers; stop all of them instead.
            self.abort_and_raise(step, f"arrived at {step}, the job's barrier is {expected}")
        began = self.clock()
        try:
            name = self.arrive(self._bounded(self._deadline()))
        except StoreError as exc:
            self.abort_and_raise(step, self._silenced() or str(exc))
        deadline = began + self.spec.barrier_timeout
        told = 0.0
        while True:
            snap = self._read(step, deadline)
            self._stop_if_aborted(step, snap)
            here = self.arrived(name, snap)
            if here >= set(self.spec.nodes):
                self.waits.append((name, self.clock() - began))
                return
            told = self._told(name, set(self.spec.nodes) - here, began, told)
            problem = self._liveness(snap)
            if problem is None and self.clock() >= deadline:
                late = sorted(set(self.spec.nodes) - here)
                problem = (
                    f"node(s) {','.join(late)} did not reach barrier {name} "
                    f"within {self.spec.barrier_timeout:g} s"
                )
            if problem is not None:
                self.abort_and_raise(step, problem)
            time.sleep(POLL_S)

    def step_hook(self) -> Callable[[str, str], None]:
        """The ``Options.on_step`` of this run's machine: a barrier before each step acts
        (its guards passed on this node). Steps of other machines (a suspend's undo runs
        the restore machine on this node alone) pass."""
        machine = MACHINE_OF[self.verb]

        def hook(spec: str, step: str) -> None:
            if spec == machine:
                self.barrier(f"{machine}:{step}")

        return hook

    def _read(self, step: str, deadline: float) -> Snapshot:
        try:
            return self.store.snapshot(self.run_key(), self._bounded(deadline))
        except StoreError as exc:
            silenced = self._silenced()
            if silenced is not None:
                self.abort_and_raise(step, silenced)  # written if the store is back
            raise JobAborted(MACHINE_OF[self.verb], step, self.spec.node, str(exc)) from None

    def _stop_if_aborted(self, step: str, snap: Snapshot) -> None:
        abort = snap.values.get(self.run_key("abort"))
        if abort is not None:
            raise JobAborted(
                MACHINE_OF[self.verb], step, _field(abort, "node"), _field(abort, "reason")
            )

    def _liveness(self, snap: Snapshot) -> str | None:
        """Why the run cannot go on for want of a live node (None: every joined node
        holds its lease)."""
        assert self._node_keeper is not None
        if self._node_keeper.lost.is_set():
            return f"node {self.spec.node} lost its lease (silent past {self.spec.lease_ttl} s)"
        members = snap.under(self.run_key("members/"))
        alive = snap.under(self.run_key("alive/"))
        gone = sorted(set(members) - set(alive))
        if gone:
            return (
                f"node(s) {','.join(gone)} lost the lease (its coordinator stopped or was "
                f"cut off from the store for {self.spec.lease_ttl} s)"
            )
        return None

    # -- the decision ------------------------------------------------------------------

    def abort(self, step: str, reason: str) -> tuple[str, str]:
        """Write the run's abort unless it is decided already; the decision's node and
        reason as the store holds them (this node's, or the one written first). Raises
        StoreError when the store does not answer."""
        record = {"node": self.spec.node, "step": step, "reason": reason, "at": utc_timestamp()}
        deadline = self.clock() + CUT_OFF_WRITE_S if self.cut_off else self._deadline()
        self.store.create(
            {self.run_key("abort"): record},
            deadline,
            absent=(self.run_key("abort"), self.run_key("commit")),
        )
        held = self.store.snapshot(self.run_key("abort"), deadline).values
        written = held.get(self.run_key("abort"), record)
        return _field(written, "node"), _field(written, "reason")

    def abort_and_raise(self, step: str, reason: str) -> Any:
        machine = MACHINE_OF[self.verb]
        try:
            by, why = self.abort(step, reason)
        except StoreError as exc:
            by, why = self.spec.node, f"{reason}; the abort could not be written: {exc}"
        raise JobAborted(machine, step, by, why)

    def decide(self, entry: Mapping[str, Any]) -> tuple[Decision, str]:
        """This node's part is done (``entry``: what the job manifest records of it):
        arrive at the last barrier and wait for the decision; commit when every node
        arrived. ``unknown`` when the store did not answer within the barrier timeout
        (``job recover`` learns it later)."""
        final = BARRIERS[self.verb][-1]
        began = self.clock()
        deadline = began + self.spec.barrier_timeout
        try:
            self.store.put(self.run_key(f"nodes/{self.spec.node}"), dict(entry), deadline)
            name = self.arrive()
            told = 0.0
            while True:
                snap = self.store.snapshot(self.run_key(), deadline)
                commit = snap.values.get(self.run_key("commit"))
                abort = snap.values.get(self.run_key("abort"))
                if commit is not None:
                    self.waits.append((name, self.clock() - began))
                    return "commit", ""
                if abort is not None:
                    return "abort", f"node {_field(abort, 'node')}: {_field(abort, 'reason')}"
                here = self.arrived(name, snap)
                told = self._told(name, set(self.spec.nodes) - here, began, told)
                if here >= set(self.spec.nodes):
                    if not self._commit(snap, name, deadline):
                        time.sleep(POLL_S)  # a key of the barrier went meanwhile: read again
                    continue
                problem = self._liveness(snap)
                if problem is None and self.clock() >= deadline:
                    late = ",".join(sorted(set(self.spec.nodes) - here))
                    problem = f"node(s) {late} did not reach barrier {name} in time"
                if problem is not None:
                    self.abort(final, problem)
                    continue
                time.sleep(POLL_S)
        except StoreError as exc:
            return "unknown", str(exc)

    def _commit(self, snap: Snapshot, name: str, deadline: float) -> bool:
        nodes = snap.under(self.run_key("nodes/"))
        manifest = {
            "job": self.spec.job,
            "run": self.run_id,
            "verb": self.verb,
            "state": "suspended" if self.verb == "suspend" else "resumed",
            "at": utc_timestamp(),
            "nodes": {n: nodes.get(n, {}) for n in self.spec.nodes},
        }
        return self.store.create(
            {
                self.run_key("commit"): {"by": self.spec.node},
                self.spec.prefix + "manifest": manifest,
            },
            deadline,
            absent=(self.run_key("abort"), self.run_key("commit")),
            present=tuple(self.run_key(f"barriers/{name}/{n}") for n in self.spec.nodes),
        )

    # -- the end ---------------------------------------------------------------------

    def finish(self, result: Mapping[str, Any]) -> None:
        """Record this node's result, and end the run once every node has one; the
        leases go (their keys with them). Never raises: the store bounds what is left."""
        limit = CUT_OFF_WRITE_S if self.cut_off else min(self.spec.barrier_timeout, 5.0)
        deadline = self.clock() + limit
        try:
            if self.run_id:
                self.store.put(self.run_key(f"results/{self.spec.node}"), dict(result), deadline)
                snap = self.store.snapshot(self.run_key("results/"), deadline)
                if set(snap.under(self.run_key("results/"))) >= set(self.spec.nodes):
                    # Only this run's: another node may have ended it and a new one begun.
                    equal = {self.current_key: self._current}
                    self.store.create({}, deadline, delete=(self.current_key,), equal=equal)
        except StoreError:
            pass  # the run's lease expires by itself: `job status` shows the rest
        for keeper in (self._run_keeper, self._node_keeper):
            if keeper is not None:
                keeper.stop(revoke=keeper is self._node_keeper, deadline=deadline)
