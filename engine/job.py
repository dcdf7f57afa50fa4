"""The job verbs: one node's suspend, resume, recover and status of a job across nodes.

Each runs on its node's coordinator, with the job's name, every node's name and the
store's address (specs/multinode.md). The node's own verb is the agent's (the same
machines, the same guards); :mod:`.jobsession` adds the barrier after each step and
the run's one decision. :func:`drive` runs every node's verb from one process, for
tests and for operators who reach every node.

Outcomes use the exit statuses of every other verb, per node: 0 done, 1 refused or
failed before anything changed, 3 changed and rolled back (the group runs as
before), 4 not back (``job recover``). The job's outcome is the worst of its nodes'.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final

import attrs

from .agent import (
    AgentCallback,
    AgentError,
    Process,
    ResumeFailed,
    SuspendFailed,
    Where,
    read_manifest,
    resume,
    suspend,
)
from .errors import CoordinatorError
from .jobsession import (
    BARRIERS,
    Decision,
    JobAborted,
    JobRefused,
    JobSpec,
    OnWait,
    Session,
    Verb,
    coordinator_gone,
    job_snapshot,
)
from .jobstore import PREFIX, OpenStore, Snapshot, Store, StoreError
from .manifest import MANIFEST_FILE_NAME
from .native_checkpoint import NativeBackend, ProcessState, state_names
from .options import Options
from .recovery import recover as recover_group
from .serial import shape, to_json

__all__ = [
    "BARRIERS",
    "JobAborted",
    "JobRefused",
    "JobSpec",
    "NodeOutcome",
    "NodeTarget",
    "drive",
    "job_code",
    "recover",
    "resume_node",
    "status",
    "suspend_node",
]

DONE: Final = 0
REFUSED: Final = 1
ROLLED_BACK: Final = 3
NEEDS_RECOVER: Final = 4
_SEVERITY: Final = {DONE: 0, REFUSED: 1, ROLLED_BACK: 2, NEEDS_RECOVER: 3}
OUTCOMES: Final = {
    DONE: "done",
    REFUSED: "refused, nothing changed",
    ROLLED_BACK: "rolled back: the group runs as before",
    NEEDS_RECOVER: "not back: run `cuinterpose job recover` on this node",
}


@attrs.frozen
class NodeTarget:
    """What one node acts on: its group, its checkpoint directory, how it reaches them."""

    processes: tuple[Process, ...]
    checkpoint_dir: Path = attrs.field(converter=Path)
    where: Where
    native: NativeBackend


def _barriers(waits: tuple[tuple[str, float], ...]) -> list[dict[str, Any]]:
    return [{"barrier": n, "seconds": round(s, 6)} for n, s in waits]


@shape(
    order=("node", "verb", "code", "run", "decision", "lines", "waits"),
    rename={"waits": "barriers"},
    convert={"waits": _barriers},
    extra={"outcome": "code"},
)
@attrs.frozen
class NodeOutcome:
    """One node's end of a job verb."""

    node: str
    verb: str
    code: int
    lines: tuple[str, ...] = ()
    run: str = ""
    decision: str = ""
    # Each barrier this node passed: its name and the seconds it waited there.
    waits: tuple[tuple[str, float], ...] = ()

    @property
    def outcome(self) -> str:
        return OUTCOMES[self.code]


def job_code(codes: Sequence[int]) -> int:
    """The job's outcome: its worst node's."""
    return max(codes, key=lambda c: _SEVERITY[c]) if codes else REFUSED


def _capture_code(error: CoordinatorError) -> int:
    if not error.destroyed:
        return REFUSED
    return ROLLED_BACK if error.rolled_back else NEEDS_RECOVER


def _entry(target: NodeTarget) -> dict[str, Any]:
    return {
        "checkpoint_dir": str(target.checkpoint_dir),
        "control_dir": str(target.where.control_dir),
        "processes": [[p.observed_pid, p.namespace_pid] for p in target.processes],
    }


def _end(session: Session, code: int, lines: Sequence[str], decision: str = "") -> NodeOutcome:
    outcome = NodeOutcome(
        session.spec.node,
        session.verb,
        code,
        tuple(lines),
        session.run_id,
        decision,
        tuple(session.waits),
    )
    session.finish(to_json(outcome))
    return outcome


# What to do about a store whose authentication is off (docs/multinode.md).
OPEN_STORE_HINT: Final = (
    "turn etcd's authentication on and give each node its credentials "
    "(--store-credentials FILE; docs/multinode.md), or pass --store-insecure to let "
    "anyone who reaches the store decide this job"
)


def _refused(spec: JobSpec, verb: str, lines: Sequence[str]) -> NodeOutcome:
    return NodeOutcome(spec.node, verb, REFUSED, tuple(lines))


def _store_lines(exc: BaseException) -> list[str]:
    lines = _lines(exc)
    return [*lines, OPEN_STORE_HINT] if isinstance(exc, OpenStore) else lines


def suspend_node(
    spec: JobSpec,
    target: NodeTarget,
    *,
    options: Options | None = None,
    on_event: AgentCallback | None = None,
    logger: logging.Logger | None = None,
    store: Store | None = None,
    on_wait: OnWait | None = None,
) -> NodeOutcome:
    """This node's part of the job's suspend: the agent's suspend, in lockstep with every
    other node, kept only when every node's went through (else undone here)."""
    session = Session(spec, "suspend", store, on_wait=on_wait)
    try:
        session.join()
    except (JobRefused, StoreError) as exc:
        return _refused(spec, "suspend", _store_lines(exc))
    options = options or Options()
    try:
        session.barrier("joined")
        machine_options = attrs.evolve(options, on_step=session.step_hook())
        suspend(
            target.processes,
            target.checkpoint_dir,
            where=target.where,
            native=target.native,
            options=machine_options,
            on_event=on_event,
            logger=logger,
        )
    except JobAborted as stop:
        return _end(session, _capture_code(stop), stop.lines(), "abort")
    except CoordinatorError as error:
        _abort(session, f"capture:{error.step}", error)
        return _end(session, _capture_code(error), error.lines(), "abort")
    except SuspendFailed as failed:
        _abort(session, "suspend", failed)
        code = ROLLED_BACK if failed.restored else NEEDS_RECOVER
        return _end(session, code, failed.lines(), "abort")
    except (AgentError, ValueError, OSError) as error:
        _abort(session, "suspend", error)
        return _end(session, REFUSED, _lines(error), "abort")
    decision, why = session.decide(_entry(target))
    if decision == "commit":
        return _end(session, DONE, [f"job {spec.job} suspended on every node"], decision)
    if decision == "unknown":
        lines = [
            f"this node is suspended, but the job's decision is not known: {why}",
            "run `cuinterpose job recover` on this node once the store answers",
        ]
        return _end(session, NEEDS_RECOVER, lines, decision)
    lines = [f"job {spec.job} aborted ({why}): this node's suspend is undone"]
    return _end(session, *_undo_suspend(target, options, on_event, logger, lines), decision)


def _undo_suspend(
    target: NodeTarget,
    options: Options,
    on_event: AgentCallback | None,
    logger: logging.Logger | None,
    lines: list[str],
) -> tuple[int, list[str]]:
    try:
        resume(
            target.checkpoint_dir,
            where=target.where,
            native=target.native,
            processes=target.processes,
            options=attrs.evolve(options, on_step=None),
            on_event=on_event,
            logger=logger,
        )
    except (AgentError, CoordinatorError) as failed:
        return NEEDS_RECOVER, [*lines, *_lines(failed)]
    return ROLLED_BACK, [*lines, "resumed: the group runs as before, with its bytes"]


def _abort(session: Session, step: str, error: BaseException) -> None:
    # Unwritten, the others stop at their barrier timeout; this node's outcome says why.
    with contextlib.suppress(StoreError):
        session.abort(step, _lines(error)[0])


def _lines(error: BaseException) -> list[str]:
    lines = getattr(error, "lines", None)
    if callable(lines):
        return [str(line) for line in lines()]
    return [str(error)]


def _suspended(spec: JobSpec) -> Callable[[Snapshot], list[str]]:
    """What refuses a job resume: a job not suspended, or this node not in it."""

    def check(snap: Snapshot) -> list[str]:
        manifest = snap.values.get(spec.prefix + "manifest")
        if not isinstance(manifest, dict) or manifest.get("state") != "suspended":
            state = manifest.get("state") if isinstance(manifest, dict) else "never suspended"
            return [f"job {spec.job} is {state}, not suspended"]
        nodes = manifest.get("nodes")
        if not isinstance(nodes, dict) or spec.node not in nodes:
            return [f"node {spec.node} is not in job {spec.job}'s manifest"]
        return []

    return check


def resume_node(
    spec: JobSpec,
    target: NodeTarget,
    *,
    options: Options | None = None,
    on_event: AgentCallback | None = None,
    logger: logging.Logger | None = None,
    store: Store | None = None,
    on_wait: OnWait | None = None,
) -> NodeOutcome:
    """This node's part of the job's resume: refused on every node before anything
    changes when any node cannot resume; then the agent's resume with a barrier after
    each step of the restore machine."""
    session = Session(spec, "resume", store, on_wait=on_wait)
    try:
        session.join(expect=_suspended(spec))
    except (JobRefused, StoreError) as exc:
        return _refused(spec, "resume", _store_lines(exc))
    options = options or Options()
    try:
        manifest = read_manifest(target.checkpoint_dir)
        if manifest.resumed_at:
            raise AgentError(
                f"job resume refused: {target.checkpoint_dir} was resumed at {manifest.resumed_at}",
                [],
            )
    except (AgentError, OSError) as error:
        _abort(session, "joined", error)
        return _end(session, REFUSED, _lines(error), "abort")
    try:
        session.barrier("joined")
    except JobAborted as stop:
        return _end(session, REFUSED, stop.lines(), "abort")
    try:
        resume(
            target.checkpoint_dir,
            where=target.where,
            native=target.native,
            processes=target.processes,
            options=attrs.evolve(options, on_step=session.step_hook()),
            on_event=on_event,
            logger=logger,
        )
    except ResumeFailed as failed:
        if not isinstance(failed.__cause__, JobAborted):
            _abort(session, "resume", failed)
        code = ROLLED_BACK if failed.running else NEEDS_RECOVER
        return _end(session, code, failed.lines(), "abort")
    except (AgentError, OSError) as error:
        _abort(session, "resume", error)
        return _end(session, REFUSED, _lines(error), "abort")
    decision, why = session.decide(_entry(target))
    lines = [f"job {spec.job} resumed on every node"] if decision == "commit" else [
        f"this node's group runs; the job's resume did not complete everywhere: {why}"
    ]  # fmt: skip
    return _end(session, DONE, lines, decision)


def recover(
    spec: JobSpec,
    target: NodeTarget,
    *,
    options: Options | None = None,
    store: Store | None = None,
    on_wait: OnWait | None = None,
) -> NodeOutcome:
    """Bring this node to where the job's last run decided: nothing when it committed a
    suspend (the group stays suspended), else the group back to running (a suspend
    undone by a resume, or the capture or restore rolled back or forward). A run left
    undecided (its coordinators gone) is aborted first. Back to running is done (exit
    0), as the single-node recover says it; its lines say what was undone."""
    del on_wait  # recover waits for no other node
    store = store or Store(spec.store, credentials=spec.credentials)
    options = attrs.evolve(options or Options(), on_step=None)
    timeout = spec.barrier_timeout
    try:
        if not store.opened:
            store.open(store.clock() + timeout, insecure=spec.insecure)
        decision, run, verb = _decide_last(spec, store, timeout)
    except (JobRefused, StoreError) as exc:
        return _refused(spec, "recover", _store_lines(exc))
    lines = [f"job {spec.job}'s run {run} ({verb}): {decision}"]
    manifest_path = target.checkpoint_dir / MANIFEST_FILE_NAME
    suspended_here = False
    if manifest_path.exists():
        try:
            suspended_here = not read_manifest(target.checkpoint_dir).resumed_at
        except AgentError as error:
            return NodeOutcome(spec.node, "recover", NEEDS_RECOVER, (*lines, *error.lines()), run)
    if decision == "commit" and verb == "suspend" and suspended_here:
        lines.append("the job is suspended: this node stays so (`cuinterpose job resume`)")
        return _recorded(store, spec, run, NodeOutcome(spec.node, "recover", DONE, tuple(lines)))
    pids = [p.observed_pid for p in target.processes]
    checkpointed = suspended_here and all(
        s == ProcessState.CHECKPOINTED.name for s in state_names(target.native, pids).values()
    )
    if checkpointed:
        code, lines = _undo_suspend(target, options, None, None, lines)
        code = DONE if code == ROLLED_BACK else code  # running again: what recover is for
        return _recorded(store, spec, run, NodeOutcome(spec.node, "recover", code, tuple(lines)))
    try:
        endpoints = [target.where.endpoint(p) for p in target.processes]
    except ValueError as exc:  # a control directory no shim could have bound in
        return NodeOutcome(spec.node, "recover", REFUSED, (*lines, f"recover refused: {exc}"), run)
    try:
        report = recover_group(endpoints, target.checkpoint_dir, options)
    except CoordinatorError as error:
        outcome = NodeOutcome(spec.node, "recover", NEEDS_RECOVER, (*lines, *error.lines()), run)
        return _recorded(store, spec, run, outcome)
    outcome = NodeOutcome(spec.node, "recover", DONE, (*lines, *report.lines()), run)
    return _recorded(store, spec, run, outcome)


def _decide_last(spec: JobSpec, store: Store, timeout: float) -> tuple[Decision, str, str]:
    """The job's last run, its verb and decision; abort it when it has none and none of
    its coordinators is alive (refused while one is)."""
    session = Session(spec, "suspend", store)
    snap = store.snapshot(spec.prefix, store.clock() + timeout)
    last = snap.values.get(spec.prefix + "last")
    if not isinstance(last, str):
        raise JobRefused(f"job recover: job {spec.job} has no run in the store")
    session.run_id = last
    run = session.run_key()
    verb = str(snap.values.get(run + "verb", "?"))
    if run + "commit" in snap.values:
        return "commit", last, verb
    if run + "abort" not in snap.values:
        held = snap.under(run + "alive/")
        alive = sorted(n for n, info in held.items() if not coordinator_gone(info))
        if alive:
            raise JobRefused(
                f"job recover refused: job {spec.job}'s run {last} is in progress "
                f"(node(s) {','.join(alive)} hold their lease)"
            )
        gone = ",".join(sorted(held))
        reason = "the run ended undecided" + (
            f" (node(s) {gone}: coordinator ended, its lease not yet)" if gone else ""
        )
        record = {"node": spec.node, "step": "recover", "reason": reason}
        store.create({run + "abort": record}, store.clock() + timeout, absent=(run + "commit",))
        return _decide_last(spec, store, timeout)
    return "abort", last, verb


def _recorded(store: Store, spec: JobSpec, run: str, outcome: NodeOutcome) -> NodeOutcome:
    session = Session(spec, "suspend", store)
    session.run_id = run
    try:
        store.put(
            session.run_key(f"results/{spec.node}"),
            to_json(outcome),
            store.clock() + spec.barrier_timeout,
        )
    except StoreError as exc:
        return attrs.evolve(outcome, lines=(*outcome.lines, f"not recorded in the store: {exc}"))
    return outcome


def status(job: str, store: Store, timeout: float = 10.0) -> dict[str, Any]:
    """What the store holds of ``job``: the run in progress, the last run's decision, every
    node of it (its result, whether it holds its lease, whether it needs ``job
    recover``), the job manifest; ``outcome`` says the job's state in a few words."""
    snap = job_snapshot(store, job, timeout)
    keys = snap.under(f"{PREFIX}{job}/")
    last = keys.get("last")
    last = last if isinstance(last, str) else None
    run_keys = {
        k[len(f"runs/{last}/") :]: v for k, v in keys.items() if k.startswith(f"runs/{last}/")
    }
    decision = "commit" if "commit" in run_keys else "abort" if "abort" in run_keys else None
    current = keys.get("current")
    manifest = keys.get("manifest")
    nodes = _nodes_of(run_keys, current, manifest)
    per_node = [_node_status(n, run_keys, decision, manifest) for n in nodes]
    needs = [n["node"] for n in per_node if n["needs_recover"]]
    if last is None:
        outcome = "no run yet"
    elif isinstance(current, dict) and current.get("run") == last and decision is None:
        outcome = "run in progress"
    elif decision is None:
        outcome = "last run undecided: run `cuinterpose job recover` on every node"
    else:
        verb = str(run_keys.get("verb", "?"))
        outcome = f"{verb} {'committed' if decision == 'commit' else 'aborted'}"
    if needs and "recover" not in outcome:
        outcome += f"; node(s) {','.join(needs)} need `cuinterpose job recover`"
    return {
        "job": job,
        "revision": snap.revision,
        "outcome": outcome,
        "current": current,
        "last_run": last,
        "verb": run_keys.get("verb"),
        "decision": decision,
        "abort": run_keys.get("abort"),
        "members": sorted(k[len("members/") :] for k in run_keys if k.startswith("members/")),
        "alive": sorted(k[len("alive/") :] for k in run_keys if k.startswith("alive/")),
        "results": {
            k[len("results/") :]: v for k, v in run_keys.items() if k.startswith("results/")
        },
        "nodes": per_node,
        "needs_recover": needs,
        "manifest": manifest,
    }


def _nodes_of(run_keys: dict[str, Any], current: Any, manifest: Any) -> list[str]:
    """The last run's nodes: as its record names them (else every node the store names)."""
    for record in (run_keys.get("record"), current):
        listed = record.get("nodes") if isinstance(record, dict) else None
        if isinstance(listed, list) and all(isinstance(n, str) for n in listed):
            return list(listed)
    named = {k.split("/", 1)[1] for k in run_keys if k.count("/") == 1 and "/" in k}
    if isinstance(manifest, dict) and isinstance(manifest.get("nodes"), dict):
        named |= set(manifest["nodes"])
    return sorted(n for n in named if isinstance(n, str))


def _node_status(
    node: str, run_keys: dict[str, Any], decision: str | None, manifest: Any
) -> dict[str, Any]:
    """One node of the last run: its state in words, and whether it needs ``job recover``."""
    result = run_keys.get(f"results/{node}")
    member = run_keys.get(f"members/{node}")
    alive = run_keys.get(f"alive/{node}")
    entry = run_keys.get(f"nodes/{node}")
    if not isinstance(entry, dict) and isinstance(manifest, dict):
        entry = (manifest.get("nodes") or {}).get(node)
    checkpoint_dir = entry.get("checkpoint_dir") if isinstance(entry, dict) else None
    if isinstance(result, dict):
        code = result.get("code")
        state = f"{result.get('verb')}: {result.get('outcome')}"
        needs = code == NEEDS_RECOVER
    elif alive is not None and not coordinator_gone(alive):
        state, needs = "in the run: its coordinator holds its lease", False
    elif member is not None:
        ended = "its coordinator ended" if decision else "its coordinator is gone"
        state, needs = f"{ended} without a result: its group may be half-way", True
    else:
        state, needs = "never joined the run: nothing changed there", False
    return {
        "node": node,
        "state": state,
        "needs_recover": bool(needs),
        "checkpoint_dir": checkpoint_dir if isinstance(checkpoint_dir, str) else None,
        "result": result if isinstance(result, dict) else None,
    }


def drive(
    verb: Verb | str,
    specs: Sequence[JobSpec],
    targets: Sequence[NodeTarget],
    *,
    options: Options | None = None,
) -> list[NodeOutcome]:
    """Every node's ``verb`` (suspend, resume, recover) from this one process, a thread
    per node; their outcomes in the order given (:func:`job_code` is the job's)."""
    verbs: dict[str, Callable[..., NodeOutcome]] = {
        "suspend": suspend_node,
        "resume": resume_node,
        "recover": recover,
    }
    if verb not in verbs or len(specs) != len(targets) or not specs:
        raise ValueError(f"drive({verb!r}): a verb of {sorted(verbs)} and one target per node")
    results: list[NodeOutcome | None] = [None] * len(specs)

    def one(i: int) -> None:
        try:
            results[i] = verbs[verb](specs[i], targets[i], options=options)
        except Exception as exc:  # a bug: the node's outcome says so, the others go on
            results[i] = NodeOutcome(specs[i].node, verb, NEEDS_RECOVER, (f"internal: {exc!r}",))

    threads = [threading.Thread(target=one, args=(i,), name=s.node) for i, s in enumerate(specs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [r for r in results if r is not None]
