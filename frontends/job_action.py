"""``cuinterpose job ...``: suspend, resume, recover and status of a job across nodes.

Each of suspend, resume and recover runs once on every node, with the job's name, this
node's name, every node's name and the store's address (specs/multinode.md); status
reads the store from anywhere. Each prints its node's outcome (a line, or one JSON
object with ``--json``) and exits with the node's status from the one table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Final, TextIO

from . import drivers, targets
from .arguments import (
    CONTROL_DIR_ENV,
    DEFAULT_CONTROL_DIR,
    EXIT_FAILED,
    EXIT_OK,
    EXIT_TABLE,
    EXIT_USAGE,
    READING_EXITS,
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
from .engine import agent, job, jobstore, runner
from .engine.native_checkpoint import NativeBackend
from .engine.serial import to_json
from .logs import configure, reset
from .outcomes import Outcome, finish, output_mode

PROG: Final = "cuinterpose job"

_COMMON: Final = "--job J --store http://ETCD:2379 --node a --nodes a,b"
_VERBS: Final[Mapping[str, VerbHelp]] = {
    "suspend": (
        "suspend this node's group as part of the job: every node or none",
        f"cuinterpose job suspend {_COMMON} --checkpoint-dir /ckpt --pid 4242",
        EXIT_TABLE,
    ),
    "resume": (
        "resume this node's group as part of the job's resume",
        f"cuinterpose job resume {_COMMON} --checkpoint-dir /ckpt",
        EXIT_TABLE,
    ),
    "recover": (
        "bring this node to where the job's last run decided",
        f"cuinterpose job recover {_COMMON} --checkpoint-dir /ckpt",
        EXIT_TABLE,
    ),
    "status": (
        "what the store holds of the job: its run, decision, nodes and manifest",
        "cuinterpose job status --job J --store http://ETCD:2379",
        READING_EXITS,
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
        "--store", required=True, metavar="URL", help="etcd's client URL, http://HOST:PORT"
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
        description="A job across nodes, coordinated through etcd (specs/multinode.md)",
        formatter_class=Formatter,
        epilog=EXIT_TABLE,
    )
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    sub = verb_adder(verbs, _VERBS)
    _node_options(sub("suspend"), processes=True)
    _node_options(sub("resume"), processes=False)
    _node_options(sub("recover"), processes=False)
    _store_options(sub("status"))
    return parser


def _target(args: argparse.Namespace, backend: NativeBackend | None) -> job.NodeTarget:
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
    native = backend
    if native is None:  # the driver's: asked of the shims at the first native call
        native = drivers.LateBackend(
            args.driver, lambda: [where.endpoint(p) for p in processes], proc_root=args.proc_root
        )
    return job.NodeTarget(tuple(processes), args.checkpoint_dir, where, native)


def _spec(args: argparse.Namespace) -> job.JobSpec:
    try:
        return job.JobSpec(
            args.job,
            args.node,
            args.nodes,
            jobstore.Address.parse(args.store),
            barrier_timeout=args.barrier_timeout,
            lease_ttl=args.lease_ttl,
        )
    except ValueError as exc:
        raise UsageError(f"{PROG}: error: {exc}") from None


def _print(outcome: job.NodeOutcome, args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """The node's end through the one writer of summaries (frontends/outcomes.py): with
    --json one summary line carrying the node's outcome (code, lines, run, decision,
    waits); else its lines (on stderr when it did not succeed) and the node's line."""
    ok = outcome.code == EXIT_OK
    ended = Outcome(
        outcome.code,
        outcome.outcome,
        () if ok else outcome.lines,
        figures=to_json(outcome),
        human=(
            *(outcome.lines if ok else ()),
            f"node {outcome.node}: {outcome.verb} {outcome.outcome}",
        ),
    )
    command = f"job {outcome.verb}"
    return finish(command, output_mode(args, out), ended, out, err, prog=f"{PROG} {outcome.verb}")


def _status(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    try:
        address = jobstore.Address.parse(args.store)
        held = job.status(args.job, jobstore.Store(address))
    except (ValueError, jobstore.StoreError) as exc:
        err.write(f"{PROG} status: {exc}\n")
        return EXIT_FAILED
    if args.json:
        out.write(json.dumps(held) + "\n")
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
        out.write(f"last run {held['last_run']}: {held['decision'] or 'undecided'}\n")
    for node, result in sorted(held["results"].items()):
        out.write(f"  node {node}: {result.get('verb')} {result.get('outcome')}\n")
    manifest = held["manifest"]
    if manifest:
        out.write(f"manifest: {manifest.get('state')} (run {manifest.get('run')})\n")
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
    if args.verb == "status":
        return _status(args, out, err)
    spec = _spec(args)
    try:
        target = _target(args, native)
    except (agent.AgentError, OSError) as exc:
        err.write(f"{PROG} {args.verb}: {exc}\n")
        return EXIT_FAILED
    options = runner.Options(phase_timeout=step_timeout(args.step_timeout))
    verbs = {"suspend": job.suspend_node, "resume": job.resume_node, "recover": job.recover}
    return _print(verbs[args.verb](spec, target, options=options), args, out, err)
