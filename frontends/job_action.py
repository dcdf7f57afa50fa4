"""``cuinterpose job ...``: suspend, resume, recover and status of a job across nodes.

Each of suspend, resume and recover runs once on every node, with the job's name, this
node's name, every node's name, the store's address and this node's credentials
(specs/multinode.md, docs/multinode.md); status reads the store from anywhere. Each
says whom it waits for at a barrier, prints its node's outcome and the command that
comes next (a line, or JSON with ``--json``) and exits with the node's status
(:data:`JOB_EXITS`).

The store's client is the ``multinode`` extra: this module imports the job modules only
to run a verb, so that ``--help`` works without it and a verb says in one line what to
install.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, TextIO

from . import drivers, targets
from .arguments import (
    CONTROL_DIR_ENV,
    DEFAULT_CONTROL_DIR,
    EXIT_FAILED,
    EXIT_NEEDS_RECOVER,
    EXIT_OK,
    EXIT_USAGE,
    Formatter,
    Parser,
    UsageError,
    VerbHelp,
    add_endpoints,
    add_step_timeout,
    seconds,
    step_timeout,
    verb_adder,
)
from .logs import configure, reset
from .outcomes import Outcome, finish, output_mode

if TYPE_CHECKING:
    from .engine import job, jobstore
    from .engine.native_checkpoint import NativeBackend

PROG: Final = "cuinterpose job"
CREDENTIALS_ENV: Final = "CUINTERPOSE_STORE_CREDENTIALS"  # engine.jobstore's, unimported
EXTRA: Final = "pip install 'cuinterpose[multinode]'"

# Each node's status; the job's is the worst of its nodes' (engine.job.job_code).
JOB_EXITS: Final = """exit status (this node's; the job's is its worst node's):
  0  done (suspend: suspended on every node; resume: this node runs; recover:
     this node is where the job's last run decided, running or suspended)
  1  refused, nothing changed on this node (another node's refusal, a second job
     command, a store that refuses the credentials or lets anyone write)
  2  usage error
  3  the job aborted after this node's group changed: rolled back, it runs as
     before (a resume: with the bytes it had at suspend)
  4  this node is not back, or the job's decision is unknown: stderr prints
     the `cuinterpose job recover ...` to run on this node
"""
STATUS_EXITS: Final = """exit status:
  0  read (the lines say which nodes need `cuinterpose job recover`)
  1  the store could not be read (stderr says why)
  2  usage error"""

_COMMON: Final = (
    "--job J --store http://ETCD:2379 --store-credentials /etc/cuinterpose/a.cred "
    "--node a --nodes a,b"
)
_VERBS: Final[Mapping[str, VerbHelp]] = {
    "suspend": (
        "suspend this node's group as part of the job: every node or none",
        f"cuinterpose job suspend {_COMMON} --checkpoint-dir /ckpt --pid 4242",
        JOB_EXITS,
    ),
    "resume": (
        "resume this node's group as part of the job's resume",
        f"cuinterpose job resume {_COMMON} --checkpoint-dir /ckpt",
        JOB_EXITS,
    ),
    "recover": (
        "bring this node to where the job's last run decided",
        f"cuinterpose job recover {_COMMON} --checkpoint-dir /ckpt",
        JOB_EXITS,
    ),
    "status": (
        "what the store holds of the job: its run, decision, every node (and which need "
        "`job recover`) and its manifest",
        "cuinterpose job status --job J --store http://ETCD:2379 "
        "--store-credentials /etc/cuinterpose/a.cred",
        STATUS_EXITS,
    ),
}


def _names(text: str) -> tuple[str, ...]:
    names = tuple(n for n in text.split(",") if n)
    if not names:
        raise argparse.ArgumentTypeError(f"{text!r} names no node")
    return names


def _ttl(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of seconds") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds")
    return value


def _store_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--job", required=True, help="the job's name (the same on every node)")
    parser.add_argument(
        "--store",
        required=True,
        metavar="URL[,URL...]",
        help="etcd's client URL, http://HOST:PORT (https:// with TLS); a cluster: every "
        "member's, comma-separated",
    )
    parser.add_argument(
        "--store-credentials",
        type=Path,
        metavar="FILE",
        help=f"this node's etcd user, one line USER:PASSWORD in a file only you can read "
        f"(mode 0600, owned by you; default ${CREDENTIALS_ENV})",
    )
    parser.add_argument(
        "--store-insecure",
        action="store_true",
        help="go on against a store whose authentication is off: then any process that "
        "reaches etcd can write this job's decision (commit a suspend some nodes never "
        "made, abort a good one) or delete its run; for a store on loopback of a machine "
        "you alone use",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of lines")


def _node_options(parser: argparse.ArgumentParser, *, processes: bool) -> None:
    _store_options(parser)
    parser.add_argument("--node", required=True, help="this node's name")
    parser.add_argument(
        "--nodes", required=True, type=_names, metavar="A,B,...", help="every node of the job"
    )
    parser.add_argument(
        "--checkpoint-dir", type=Path, required=True, help="this node's checkpoint directory"
    )
    add_endpoints(parser, required=processes)
    add_step_timeout(parser)
    parser.add_argument(
        "--barrier-timeout",
        type=seconds,
        metavar="SECONDS",
        default=60.0,
        help="how long a node waits at a barrier for the others: longer than any node's "
        "longest step",
    )
    parser.add_argument(
        "--lease-ttl",
        type=_ttl,
        metavar="SECONDS",
        default=10,
        help="a node silent this long has lost its lease: the job rolls back",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog=PROG,
        description="A job across nodes, coordinated through an etcd with authentication "
        f"on: how to run one, docs/multinode.md; the design, specs/multinode.md (needs "
        f"the multinode extra: {EXTRA})",
        formatter_class=Formatter,
        epilog=JOB_EXITS,
    )
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    sub = verb_adder(verbs, _VERBS)
    _node_options(sub("suspend"), processes=True)
    _node_options(sub("resume"), processes=False)
    _node_options(sub("recover"), processes=False)
    _store_options(sub("status"))
    return parser


def _target(args: argparse.Namespace, backend: NativeBackend | None) -> job.NodeTarget:
    from .engine import agent, job

    try:
        given = targets.named(args.pid, args.process)
        directory = None if args.verb == "suspend" else args.checkpoint_dir
        if args.verb == "suspend" and not given:
            raise targets.TargetError(["no process named: give --pid PID"], usage=True)
        pairs = targets.resolve(given, directory, proc_root=args.proc_root)
    except targets.TargetError as error:
        if error.usage:
            raise UsageError("\n".join(f"{PROG}: error: {line}" for line in error.lines)) from None
        raise
    processes = [agent.Process(o, n) for o, n in pairs]
    control = args.control_dir
    if control is None:
        control = Path(os.environ.get(CONTROL_DIR_ENV) or DEFAULT_CONTROL_DIR)
    where = agent.Where(control, args.proc_root, args.trust_uid)
    try:
        [where.endpoint(p) for p in processes]  # the same checks as every other verb's
    except ValueError as exc:
        raise UsageError(f"{PROG}: error: {exc}") from None
    native: NativeBackend | None = backend
    if native is None:  # the driver's: asked of the shims at the first native call
        native = drivers.LateBackend(
            args.driver, lambda: [where.endpoint(p) for p in processes], proc_root=args.proc_root
        )
    return job.NodeTarget(tuple(processes), args.checkpoint_dir, where, native)


def _credentials(args: argparse.Namespace) -> jobstore.Credentials | None:
    """The credentials file the flag (else the environment) names, read and checked;
    none named: anonymous (an open store, with --store-insecure)."""
    from .engine import jobstore

    path = args.store_credentials or os.environ.get(CREDENTIALS_ENV) or None
    return None if path is None else jobstore.Credentials.read(path)


def _spec(args: argparse.Namespace) -> job.JobSpec:
    from .engine import job, jobstore

    try:
        return job.JobSpec(
            args.job,
            args.node,
            args.nodes,
            jobstore.addresses(args.store),
            barrier_timeout=args.barrier_timeout,
            lease_ttl=args.lease_ttl,
            credentials=_credentials(args),
            insecure=args.store_insecure,
        )
    except jobstore.CredentialsError:
        raise
    except ValueError as exc:
        raise UsageError(f"{PROG}: error: {exc}") from None


_THEIR_DIRECTORY: Final = "<its checkpoint directory>"


def _node_command(
    args: argparse.Namespace,
    verb: str,
    node: str,
    ckpt: str | None,
    nodes: Sequence[str] | None = None,
) -> str:
    """The command line of ``verb`` on ``node``, with what this one was given (another
    node's credentials file and checkpoint directory, where unknown, said in words)."""
    own = node == getattr(args, "node", None)
    words = ["cuinterpose", "job", verb, "--job", args.job, "--store", args.store]
    if args.store_credentials is not None:
        their = f"<node {node}'s credentials file>"
        words += ["--store-credentials", str(args.store_credentials) if own else their]
    words += ["--store-insecure"] if args.store_insecure else []
    words += ["--node", node]
    listed = nodes or getattr(args, "nodes", None)
    if listed:
        words += ["--nodes", ",".join(listed)]
    words += ["--checkpoint-dir", ckpt or _THEIR_DIRECTORY]
    if own and getattr(args, "control_dir", None) is not None:
        words += ["--control-dir", str(args.control_dir)]
    # The placeholders said in words, unquoted: a person fills them in.
    return " ".join(w if w.startswith("<") else shlex.quote(w) for w in words)


def _next(args: argparse.Namespace, outcome: job.NodeOutcome) -> str:
    """What to run after this node's outcome, on this node (every node for the job)."""
    ckpt = str(args.checkpoint_dir)
    if outcome.code == EXIT_NEEDS_RECOVER:
        return _node_command(args, "recover", args.node, ckpt)
    if outcome.verb == "suspend" and outcome.code == EXIT_OK:
        return _node_command(args, "resume", args.node, ckpt)
    return ""


class _Waits:
    """Tells whom a node waits for at a barrier: a line on stderr for a person, a JSON
    event on stdout with --json (nothing with -q)."""

    def __init__(self, node: str, verb: str, mode: str, out: TextIO, err: TextIO) -> None:
        self.node, self.verb, self.mode, self.out, self.err = node, verb, mode, out, err

    def __call__(self, barrier: str, waiting: tuple[str, ...], waited: float, limit: float) -> None:
        if self.mode == "json":
            event = {"event": "barrier-wait", "node": self.node, "barrier": barrier,
                     "waiting_for": list(waiting), "seconds": round(waited, 3),
                     "timeout": limit}  # fmt: skip
            self.out.write(json.dumps(event) + "\n")
            self.out.flush()
        elif self.mode != "none":
            self.err.write(
                f"{PROG} {self.verb}: node {self.node} at barrier {barrier}, waiting for "
                f"node(s) {','.join(waiting)} ({waited:.0f} s of {limit:g})\n"
            )
            self.err.flush()


def _print(outcome: job.NodeOutcome, args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """The node's end through the one writer of summaries (frontends/outcomes.py): with
    --json one summary line carrying the node's outcome (code, lines, run, decision,
    waits, next); else its lines (on stderr when it did not succeed), the node's line
    and the next command."""
    from .engine.serial import to_json

    ok = outcome.code == EXIT_OK
    then = _next(args, outcome)
    lines = () if ok else (*outcome.lines, *((f"next: {then}",) if then else ()))
    ended = Outcome(
        outcome.code,
        outcome.outcome,
        lines,
        figures={**to_json(outcome), **({"next": then} if then else {})},
        human=(
            *(outcome.lines if ok else ()),
            f"node {outcome.node}: {outcome.verb} {outcome.outcome}",
            # The job's resume is every node's: each runs its own.
            *((f"next: {then}   # and the same on every node",) if then and ok else ()),
        ),
    )
    command = f"job {outcome.verb}"
    return finish(command, output_mode(args, out), ended, out, err, prog=f"{PROG} {outcome.verb}")


def _status(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from .engine import job, jobstore

    try:
        members = jobstore.addresses(args.store)
        store = jobstore.Store(members, credentials=_credentials(args))
        store.open(store.clock() + 10, insecure=args.store_insecure)
        held = job.status(args.job, store)
    except jobstore.OpenStore as exc:
        err.write(f"{PROG} status: {exc}\n{PROG} status: {job.OPEN_STORE_HINT}\n")
        return EXIT_FAILED
    except (ValueError, jobstore.StoreError) as exc:
        err.write(f"{PROG} status: {exc}\n")
        return EXIT_FAILED
    listed = [n["node"] for n in held["nodes"]]
    for node in held["nodes"]:
        if node["needs_recover"]:
            node["next"] = _node_command(
                args, "recover", node["node"], node["checkpoint_dir"], listed
            )
    if args.json:
        document = {"event": "summary", "command": "job status", **held, "exit_code": EXIT_OK}
        out.write(json.dumps(document) + "\n")
        return EXIT_OK
    current = held["current"]
    if not isinstance(current, dict):
        out.write(f"job {args.job}: no run in progress\n")
    else:
        ending = " (decided: ending)" if held["decision"] else ""
        alive = ", ".join(held["alive"]) or "none"
        run = f"run {current.get('run')} ({current.get('verb')})"
        out.write(f"job {args.job}: {run} in progress{ending}; nodes holding a lease: {alive}\n")
    if held["last_run"] is None:
        out.write("no run yet\n")
    else:
        verb = f" ({held['verb']})" if held["verb"] else ""
        out.write(f"last run {held['last_run']}{verb}: {held['decision'] or 'undecided'}\n")
        abort = held["abort"]
        if isinstance(abort, dict):
            out.write(f"  aborted by node {abort.get('node')}: {abort.get('reason')}\n")
    for node in held["nodes"]:
        mark = "  needs recover" if node["needs_recover"] else ""
        out.write(f"  node {node['node']}: {node['state']}{mark}\n")
    manifest = held["manifest"]
    if isinstance(manifest, dict):
        out.write(f"manifest: {manifest.get('state')} (run {manifest.get('run')})\n")
    for node in held["nodes"]:
        if node["needs_recover"]:
            out.write(f"next (on node {node['node']}): {node['next']}\n")
    out.write(f"outcome: {held['outcome']}\n")
    return EXIT_OK


def main(
    argv: Sequence[str] | None = None,
    *,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
    native: NativeBackend | None = None,
) -> int:
    """Run one ``job`` command line; ``native``: the native calls to make instead of
    those on the driver ``--driver`` names (an embedder's backend, a test's fake)."""
    out = stdout if stdout is not None else sys.stdout
    err = stderr if stderr is not None else sys.stderr
    try:
        try:
            args = build_parser().parse_args(argv)
        except SystemExit as exit_:  # --help
            return int(exit_.code or 0) if isinstance(exit_.code, int | None) else EXIT_USAGE
        configure(verbosity=args.verbose, quiet=args.quiet, log_file=args.log_file, stream=err)
        try:
            return _dispatch(args, out, err, native)
        finally:
            reset()
    except UsageError as exc:
        err.write(f"{exc}\n")
        return EXIT_USAGE


def _dispatch(
    args: argparse.Namespace, out: TextIO, err: TextIO, native: NativeBackend | None
) -> int:
    try:
        import etcd3gw  # noqa: F401  # the multinode extra: said in one line, no traceback
    except ImportError:
        err.write(f"{PROG} {args.verb}: needs the multinode extra (etcd3gw): {EXTRA}\n")
        return EXIT_FAILED
    from .engine import agent, job, jobstore
    from .engine.options import Options

    try:
        if args.verb == "status":
            return _status(args, out, err)
        spec = _spec(args)
    except jobstore.CredentialsError as exc:
        err.write(f"{PROG} {args.verb}: {exc}\n")
        return EXIT_FAILED
    try:
        target = _target(args, native)
    except (agent.AgentError, OSError) as exc:
        err.write(f"{PROG} {args.verb}: {exc}\n")
        return EXIT_FAILED
    options = Options(phase_timeout=step_timeout(args.step_timeout))
    mode = output_mode(args, out)
    waits = _Waits(args.node, args.verb, mode, out, err)
    verbs: dict[str, Any] = {
        "suspend": job.suspend_node,
        "resume": job.resume_node,
        "recover": job.recover,
    }
    return _print(verbs[args.verb](spec, target, options=options, on_wait=waits), args, out, err)
