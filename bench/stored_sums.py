"""What the stored parts' sums cost: STORE_STAGED and FETCH_STAGED rates with and without
them (specs/criu.md, "The stored format").

One creator under the shim holds COUNT allocations of SIZE bytes (bench/staging.py's
SETUP: each MiB its own value, exported so that the shim saves it); the shim captures
(QUIESCE to PREPARE_UNICAST, the staged copies in host memory), then ``--repeat`` times:
STORE_STAGED into ``--parts`` new files of ``--dir`` and FETCH_STAGED from them (the
shim's own I/O time, stat_copy_ns), the files removed between rounds; then the restore,
and every MiB checked. Once with the shim of ``--build`` (sums on, the default build),
once with that of ``--no-sums-build`` (``cmake -DCUINTERPOSE_STORED_NO_SUMS=ON``: the
parts without sums, a measurement build only). No native checkpoint runs: the store and
the fetch are the same ops a CRIU dump and restore send. GB is 10^9 bytes. The page cache
holds the files (nothing is synced, as in a dump): the rates are memory's, the sums' cost
at its most visible.

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


def measure(shim: Path, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    control = launch.ensure_control_dir(work / "control")
    base = coordinator_env()
    if args.driver == "sim":
        base["CUINTERPOSE_SIM_NAMESPACE"] = f"sums-{os.getpid()}-{shim.parent.parent.name}"
    env = launch.launch_env(driver=args.driver, control_dir=control, base=base)
    env["LD_PRELOAD"] = " ".join(
        str(shim) if p.endswith("libcuinterpose.so") else p
        for p in env["LD_PRELOAD"].replace(":", " ").split()
    )
    size = 256 << 20
    count = max(1, int(args.gib * (1 << 30)) // size)
    w = Worker(f"creator-{shim.parent.parent.name}", env, log_dir=work, timeout_s=1800.0)
    try:
        w.send(f"COUNT, SIZE, UNSHARED = {count}, {size}, False\n" + SETUP)
        assert w.reply(timeout_s=1800) == count
        sock = control / socket_name(w.pid)
        who = _call(sock, Request(Op.HANDSHAKE)).participant
        for op in CAPTURE:
            _call(sock, Request(op, participant=who))
        stores, fetches = [], []
        for i in range(args.repeat):
            paths = [args.dir / f"sums-{os.getpid()}-{i}.{k}.bin" for k in range(args.parts)]
            try:
                stores.append(_files(Op.STORE_STAGED, paths, who, sock))
                fetches.append(_files(Op.FETCH_STAGED, paths, who, sock))
            finally:
                for p in paths:
                    p.unlink(missing_ok=True)
        for op in RESTORE:
            _call(sock, Request(op, participant=who))
        w.send("result = CHECK()")
        bad = w.reply(timeout_s=1800)
    finally:
        w.close()
    total = count * size

    def rates(seconds: list[float]) -> dict[str, float]:
        gbps = [total / s / 1e9 for s in seconds]
        return {"median": statistics.median(gbps), "min": min(gbps), "max": max(gbps)}

    return {"bytes": total, "store_gbps": rates(stores), "fetch_gbps": rates(fetches),
            "wrong_mib": bad}  # fmt: skip


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
    with tempfile.TemporaryDirectory(prefix="sums-") as tmp:
        for name, build in (("sums", args.build), ("no_sums", args.no_sums_build)):
            shim = build / "shim_c" / "libcuinterpose.so"
            if not shim.exists():
                print(f"{name}: {shim} is not built", file=sys.stderr)
                return 1
            r = result[name] = measure(shim.resolve(), args, Path(tmp))
            print(f"{name:8} {r['bytes'] / 2**30:.2f} GiB in {args.parts} parts: store "
                  f"{r['store_gbps']['median']:.2f} GB/s [{r['store_gbps']['min']:.2f}, "
                  f"{r['store_gbps']['max']:.2f}], fetch {r['fetch_gbps']['median']:.2f} GB/s "
                  f"[{r['fetch_gbps']['min']:.2f}, {r['fetch_gbps']['max']:.2f}], "
                  f"{r['wrong_mib']} MiB wrong")  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if all(result[n]["wrong_mib"] == 0 for n in ("sums", "no_sums")) else 1


if __name__ == "__main__":
    raise SystemExit(main())
