"""What the stored parts' sums cost: STORE_STAGED and FETCH_STAGED rates with and without
them (specs/criu.md, "The stored format").

Two creators, one under the shim of ``--build`` (sums on, the default build), one under
that of ``--no-sums-build`` (``cmake -DCUINTERPOSE_STORED_NO_SUMS=ON``: parts without
sums, a measurement build only), each holding ``--gib`` in allocations of 256 MiB
(bench/staging.py's SETUP: each MiB its own value, exported so that the shim saves
it), captured (QUIESCE to PREPARE_UNICAST: the staged copies in host memory). Then
``--repeat`` rounds, the two taking turns so that a machine whose load drifts weighs on
both alike: STORE_STAGED into ``--parts`` new files of ``--dir`` and FETCH_STAGED from
them (the shim's own I/O time, stat_copy_ns), the files removed after each; then the
restore, every MiB checked. No native checkpoint runs: the store and the fetch are the
ops a CRIU dump and restore send. GB is 10^9 bytes. The page cache holds the files
(nothing is synced, as in a dump): the rates are memory's, the sums' cost at its most
visible.

    cmake -S . -B build-nosums -DCUINTERPOSE_STORED_NO_SUMS=ON && cmake --build build-nosums -j
    python3 bench/stored_sums.py [--driver sim|system] [--gib 1] [--parts 16] [--repeat 3] \
        [--build build] [--no-sums-build build-nosums] [--dir /tmp] [--out sums.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from cuinterpose import launch
from cuinterpose.demo import Worker, coordinator_env
from cuinterpose.engine import wire
from cuinterpose.engine.client import Endpoint, call_all
from cuinterpose.engine.wire import Op, Request, Status, socket_name
from staging import SETUP

CAPTURE = (Op.QUIESCE, Op.PREPARE_MULTICAST, Op.SAVE_ALLOCATIONS, Op.PREPARE_UNICAST)
RESTORE = (
    Op.LOAD_ALLOCATIONS,
    Op.RESTORE_UNICAST,
    Op.RESTORE_MULTICAST_CREATORS,
    Op.RESTORE_MULTICAST_IMPORTERS,
    Op.RESTORE_MULTICAST_DEVICES,
    Op.RESTORE_MULTICAST_BINDINGS,
)
DUMP = bytes.fromhex("5a" * 16)


def _call(path: Path, request: Request, timeout: float = 1800.0) -> wire.Reply:
    pid = int(path.name.split("-")[1].split(".")[0])
    endpoint = Endpoint(pid, pid, path)
    reply = call_all([(endpoint, request, request.participant or None)], timeout=timeout)[0]
    if not isinstance(reply, wire.Reply) or reply.status != Status.OK:
        raise SystemExit(f"{request.op.name}: {reply}")
    return reply


def _files(op: Op, paths: list[Path], who: str, sock: Path) -> float:
    """One STORE or FETCH of ``paths``: the shim's I/O seconds."""
    flags = os.O_CREAT | os.O_EXCL | os.O_RDWR if op is Op.STORE_STAGED else os.O_RDONLY
    fds = tuple(os.open(p, flags | os.O_CLOEXEC, 0o600) for p in paths)
    try:
        reply = _call(sock, Request(op, participant=who, resource_id=DUMP, fds=fds))
    finally:
        for fd in fds:
            os.close(fd)
    return reply.stats.copy_ns / 1e9


class Creator:
    """A worker under one shim build, its allocations filled and captured."""

    def __init__(self, shim: Path, args: argparse.Namespace, work: Path, name: str) -> None:
        self.control = launch.ensure_control_dir(work / f"control-{name}")
        base = coordinator_env()
        if args.driver == "sim":
            base["CUINTERPOSE_SIM_NAMESPACE"] = f"sums-{os.getpid()}-{name}"
        env = launch.launch_env(driver=args.driver, control_dir=self.control, base=base)
        env["LD_PRELOAD"] = " ".join(
            str(shim) if p.endswith("libcuinterpose.so") else p
            for p in env["LD_PRELOAD"].replace(":", " ").split()
        )
        self.size = 256 << 20
        self.count = max(1, int(args.gib * (1 << 30)) // self.size)
        self.worker = Worker(f"creator-{name}", env, log_dir=work, timeout_s=1800.0)
        self.worker.send(f"COUNT, SIZE, UNSHARED = {self.count}, {self.size}, False\n" + SETUP)
        assert self.worker.reply(timeout_s=1800) == self.count
        self.sock = self.control / socket_name(self.worker.pid)
        self.who = _call(self.sock, Request(Op.HANDSHAKE)).participant
        for op in CAPTURE:
            _call(self.sock, Request(op, participant=self.who))

    def round(self, paths: list[Path]) -> tuple[float, float]:
        """One STORE and one FETCH through ``paths`` (removed after): their seconds."""
        try:
            stored = _files(Op.STORE_STAGED, paths, self.who, self.sock)
            fetched = _files(Op.FETCH_STAGED, paths, self.who, self.sock)
        finally:
            for p in paths:
                p.unlink(missing_ok=True)
        return stored, fetched

    def finish(self) -> int:
        """The restore, then the MiBs that are not what they were filled with."""
        for op in RESTORE:
            _call(self.sock, Request(op, participant=self.who))
        self.worker.send("result = CHECK()")
        bad = int(self.worker.reply(timeout_s=1800))
        self.worker.close()
        return bad


def _rates(total: int, seconds: list[float]) -> dict[str, float]:
    gbps = [total / s / 1e9 for s in seconds]
    return {"median": statistics.median(gbps), "min": min(gbps), "max": max(gbps)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--driver", choices=("sim", "system"), default="sim")
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--parts", type=int, default=min(16, os.cpu_count() or 1))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--build", type=Path, default=Path("build"))
    parser.add_argument("--no-sums-build", type=Path, default=Path("build-nosums"))
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    result: dict[str, Any] = {"driver": args.driver, "parts": args.parts}
    shims = {"sums": args.build, "no_sums": args.no_sums_build}
    for name, build in shims.items():
        shim = build / "shim_c" / "libcuinterpose.so"
        if not shim.exists():
            print(f"{name}: {shim} is not built", file=sys.stderr)
            return 1
        shims[name] = shim.resolve()
    with tempfile.TemporaryDirectory(prefix="sums-") as tmp:
        creators = {n: Creator(shim, args, Path(tmp), n) for n, shim in shims.items()}
        seconds: dict[str, tuple[list[float], list[float]]] = {n: ([], []) for n in shims}
        # The two builds take turns, round by round: a machine whose load drifts
        # weighs on both alike.
        for i in range(args.repeat):
            for name, creator in creators.items():
                paths = [args.dir / f"sums-{os.getpid()}-{name}-{i}.{k}.bin"
                         for k in range(args.parts)]  # fmt: skip
                stored, fetched = creator.round(paths)
                seconds[name][0].append(stored)
                seconds[name][1].append(fetched)
        for name, creator in creators.items():
            total = creator.count * creator.size
            r = result[name] = {
                "bytes": total,
                "store_gbps": _rates(total, seconds[name][0]),
                "fetch_gbps": _rates(total, seconds[name][1]),
                "wrong_mib": creator.finish(),
            }
            print(f"{name:8} {total / 2**30:.2f} GiB in {args.parts} parts: store "
                  f"{r['store_gbps']['median']:.2f} GB/s [{r['store_gbps']['min']:.2f}, "
                  f"{r['store_gbps']['max']:.2f}], fetch {r['fetch_gbps']['median']:.2f} GB/s "
                  f"[{r['fetch_gbps']['min']:.2f}, {r['fetch_gbps']['max']:.2f}], "
                  f"{r['wrong_mib']} MiB wrong")  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if all(result[n]["wrong_mib"] == 0 for n in ("sums", "no_sums")) else 1


if __name__ == "__main__":
    raise SystemExit(main())
