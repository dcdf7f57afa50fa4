"""Benchmark of the coordinator's own overhead (not a timed test).

Runs the capture and restore machines against 1, 8 and 32 fake participants of
1000 records each, every fake in its own process (as every shim is), and
measures in the same run the raw round trip of a minimal Unix-socket echo of a
128-byte header (one connection per request, as the protocol does), served by
another process. Prints a table and writes JSON to --out.

    .venv/bin/python bench/coordinator.py --out /tmp/coordinator.json

The goal: at 8 participants a phase costs under 3x the raw round trip. The fake
and the coordinator are both Python; --profile N runs cProfile over the
coordinator's side of the machines with N participants, to show where the time
goes.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import multiprocessing
import os
import pstats
import selectors
import shutil
import socket
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from cuinterpose.engine import driver
from cuinterpose.engine.client import Endpoint, ParticipantError, call_all
from cuinterpose.engine.fake import FakeParticipant
from cuinterpose.engine.progress import Event, PhaseEvent
from cuinterpose.engine.wire import (
    HEADER_SIZE,
    Access,
    Op,
    Record,
    RecordFlag,
    RecordKind,
    Reply,
    Request,
    Stats,
    socket_name,
)

GRANULARITY = 2 << 20
VA_BASE = 0x7F00_0000_0000
VA_STRIDE = 0x10_0000_0000
PID_BASE = 100_000
STATS = Stats(count=250, bytes=250 * GRANULARITY, elapsed_ns=1_000_000, copy_ns=500_000)


def participant_id(i: int) -> str:
    return f"{i + 0xC0FFEE:032x}"


def records_for(i: int, n: int, per: int) -> tuple[Record, ...]:
    """``per`` records: allocations created by ``i`` and imports of ``i - 1``'s, each mapped."""
    me = participant_id(i)
    created = per // 4 if n > 1 else per // 2
    imported = per // 2 - created
    records: list[Record] = []

    def add(owner: int, j: int, slot: int) -> None:
        creator = owner == i
        flags = RecordFlag.HANDLE_LIVE
        if creator:
            flags |= RecordFlag.CREATOR | RecordFlag.CONTENT
        rid = (owner * 100_000 + j + 1).to_bytes(16, "little")
        records.append(
            Record(
                kind=RecordKind.ALLOCATION,
                flags=flags,
                id=rid,
                creator=participant_id(owner),
                size=GRANULARITY,
                handle_types=1,
                allocation_type=1,
                location_type=1,
                location_id=i % 8,
                handle_count=1,
            )
        )
        records.append(
            Record(
                kind=RecordKind.MAPPING,
                id=rid,
                address=VA_BASE + i * VA_STRIDE + slot * GRANULARITY,
                size=GRANULARITY,
                access=(Access(1, i % 8, 3),),
            )
        )

    for j in range(created):
        add(i, j, j)
    for j in range(imported):
        add((i - 1) % n, j, created + j)
    if len(records) != per:
        raise ValueError(
            f"{me}: built {len(records)} records, asked for {per} (use a multiple of 4)"
        )
    return tuple(records)


# -- processes serving fakes and the echo ------------------------------------------------


def _fake_main(path: str, participant: str, pid: int, records: tuple[Record, ...],
               ready: Connection, stop: Connection) -> None:  # fmt: skip
    stats = {Op.SAVE_ALLOCATIONS: STATS, Op.LOAD_ALLOCATIONS: STATS}
    with FakeParticipant(
        Path(path), participant=participant, pid=pid, records=records, stats=stats
    ):
        ready.send(True)
        stop.recv()


def _echo_main(path: str, ready: Connection) -> None:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(128)
    ready.send(True)
    while True:
        conn, _ = listener.accept()
        with conn:
            data = b""
            while len(data) < HEADER_SIZE:
                chunk = conn.recv(HEADER_SIZE - len(data))
                if not chunk:
                    break
                data += chunk
            if len(data) == HEADER_SIZE:
                conn.sendall(data)


@contextlib.contextmanager
def fakes(n: int, per: int, control_dir: Path) -> Iterator[list[Endpoint]]:
    context = multiprocessing.get_context("fork")
    workers: list[tuple[Any, Connection]] = []
    endpoints: list[Endpoint] = []
    try:
        for i in range(n):
            pid = PID_BASE + i
            path = control_dir / socket_name(pid)
            ready_r, ready_w = context.Pipe(duplex=False)
            stop_r, stop_w = context.Pipe(duplex=False)
            args = (str(path), participant_id(i), pid, records_for(i, n, per), ready_w, stop_r)
            process = context.Process(target=_fake_main, args=args, daemon=True)
            process.start()
            workers.append((process, stop_w))
            if not ready_r.poll(30):
                raise RuntimeError(f"fake {i} did not start")
            ready_r.recv()
            endpoints.append(Endpoint(pid, pid, path))
        yield endpoints
    finally:
        for _, stop in workers:
            with contextlib.suppress(OSError):
                stop.send(True)
        for process, _ in workers:
            process.join(10)
            if process.is_alive():
                process.kill()


def raw_round_trip(work: Path, iterations: int) -> dict[str, float]:
    context = multiprocessing.get_context("fork")
    path = str(work / "echo.sock")
    ready_r, ready_w = context.Pipe(duplex=False)
    server = context.Process(target=_echo_main, args=(path, ready_w), daemon=True)
    server.start()
    ready_r.recv()
    payload = Request(Op.INSPECT, participant=participant_id(1)).encode()
    samples = []
    try:
        for _ in range(iterations):
            began = time.perf_counter()
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.connect(path)
                sock.sendall(payload)
                got = b""
                while len(got) < HEADER_SIZE:
                    chunk = sock.recv(HEADER_SIZE - len(got))
                    if not chunk:
                        raise RuntimeError("echo server hung up")
                    got += chunk
            samples.append(time.perf_counter() - began)
    finally:
        server.kill()
        server.join()
    return _summary(samples)


def raw_fan_out(work: Path, n: int, iterations: int) -> dict[str, float]:
    """The same echo to ``n`` echo processes at once (minimal selector client): the floor
    the hardware and the kernel set for one phase with ``n`` participants."""
    context = multiprocessing.get_context("fork")
    paths, servers = [], []
    for i in range(n):
        path = str(work / f"echo-{n}-{i}.sock")
        ready_r, ready_w = context.Pipe(duplex=False)
        server = context.Process(target=_echo_main, args=(path, ready_w), daemon=True)
        server.start()
        ready_r.recv()
        paths.append(path)
        servers.append(server)
    payload = Request(Op.INSPECT, participant=participant_id(1)).encode()
    samples = []
    try:
        with selectors.DefaultSelector() as selector:
            for _ in range(iterations):
                began = time.perf_counter()
                socks = []
                for path in paths:
                    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    sock.connect(path)
                    sock.sendall(payload)
                    sock.setblocking(False)
                    selector.register(sock, selectors.EVENT_READ, bytearray())
                    socks.append(sock)
                waiting = len(socks)
                while waiting:
                    for key, _ in selector.select():
                        buffer = key.data
                        buffer += key.fileobj.recv(HEADER_SIZE - len(buffer))  # type: ignore[union-attr]
                        if len(buffer) == HEADER_SIZE:
                            selector.unregister(key.fileobj)
                            waiting -= 1
                for sock in socks:
                    sock.close()
                samples.append(time.perf_counter() - began)
    finally:
        for server in servers:
            server.kill()
            server.join()
    return _summary(samples)


def _summary(samples: Sequence[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "median_s": statistics.median(ordered),
        "min_s": ordered[0],
        "p90_s": ordered[min(len(ordered) - 1, int(len(ordered) * 0.9))],
        "samples": float(len(ordered)),
    }


def run_machines(
    endpoints: Sequence[Endpoint],
    checkpoint_dir: Path,
    repeat: int,
    profile: cProfile.Profile | None,
) -> dict[str, Any]:
    phases: dict[str, list[float]] = defaultdict(list)
    totals: dict[str, list[float]] = defaultdict(list)

    def collect(event: Event) -> None:
        if isinstance(event, PhaseEvent):
            phases[f"{event.machine} {event.phase}"].append(event.elapsed_s)

    cpu: dict[str, list[float]] = defaultdict(list)

    def measured(
        calls: Sequence[tuple[Endpoint, Request, str | None]], *, timeout: float
    ) -> list[Reply | ParticipantError]:
        # The coordinator's own CPU time for the exchange: what the fakes cost is not in it.
        began = time.process_time()
        results = call_all(calls, timeout=timeout)
        cpu[calls[0][1].op.name].append(time.process_time() - began)
        return results

    options = driver.Options(phase_timeout=60.0, on_progress=collect, transport=measured)
    for _ in range(repeat):
        for name, run in (("capture", driver.capture), ("restore", driver.restore)):
            began = time.perf_counter()
            if profile is not None:
                profile.enable()
            run(endpoints, checkpoint_dir, options)
            if profile is not None:
                profile.disable()
            totals[name].append(time.perf_counter() - began)
    return {
        "phases": {name: _summary(samples) for name, samples in phases.items()},
        "coordinator_cpu_per_op": {op: _summary(samples) for op, samples in cpu.items()},
        "machines": {name: _summary(samples) for name, samples in totals.items()},
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    parser.add_argument("--participants", default="1,8,32")
    parser.add_argument("--records", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=10, help="capture+restore cycles per size")
    parser.add_argument("--raw-iterations", type=int, default=2000)
    parser.add_argument("--profile", type=int, metavar="N", help="cProfile the run with N fakes")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.participants.split(",")]
    work = Path(tempfile.mkdtemp(prefix="cuip-bench-"))
    try:
        raw = raw_round_trip(work, args.raw_iterations)
        results: dict[str, Any] = {
            "cpus": os.cpu_count(),
            "records_per_participant": args.records,
            "repeat": args.repeat,
            "raw_round_trip": raw,
            "participants": {},
        }
        profile_text = ""
        for n in sizes:
            control = work / f"control-{n}"
            control.mkdir()
            checkpoint = work / f"ckpt-{n}"
            checkpoint.mkdir()
            profile = cProfile.Profile() if args.profile == n else None
            results.setdefault("raw_fan_out", {})[str(n)] = raw_fan_out(
                work, n, max(50, args.raw_iterations // max(1, n))
            )
            with fakes(n, args.records, control) as endpoints:
                results["participants"][str(n)] = run_machines(
                    endpoints, checkpoint, args.repeat, profile
                )
            if profile is not None:
                text = io.StringIO()
                pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(60)
                profile_text = text.getvalue()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _print_table(results, sizes)
    if profile_text:
        print(profile_text)
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


def _print_table(results: dict[str, Any], sizes: Sequence[int]) -> None:
    raw = results["raw_round_trip"]["median_s"]
    print(
        f"raw Unix-socket round trip (128-byte echo, new connection each): "
        f"median {raw * 1e6:.1f} us, min {results['raw_round_trip']['min_s'] * 1e6:.1f} us"
    )
    print(
        f"{results['records_per_participant']} records per participant, "
        f"{results['repeat']} capture+restore cycles, {results['cpus']} CPUs; "
        "cells: median wall ms (x raw round trip) / coordinator CPU ms"
    )
    width = 30
    header = f"{'phase':36}" + "".join(f"{f'{n} participants':>{width}}" for n in sizes)
    print(header)
    print("-" * len(header))

    def row(name: str, cells: list[str]) -> None:
        print(f"{name:36}" + "".join(f"{c:>{width}}" for c in cells))

    row(
        "raw fan-out (N echo processes)",
        [
            f"{results['raw_fan_out'][str(n)]['median_s'] * 1e3:.3f} ms "
            f"({results['raw_fan_out'][str(n)]['median_s'] / raw:.1f}x)"
            for n in sizes
        ],
    )
    for name in results["participants"][str(sizes[0])]["phases"]:
        op = name.split()[1]
        cells = []
        for n in sizes:
            figures = results["participants"][str(n)]
            wall = figures["phases"][name]["median_s"]
            cpu = figures["coordinator_cpu_per_op"][op]["median_s"]
            cells.append(f"{wall * 1e3:.3f} ms ({wall / raw:.1f}x) / {cpu * 1e3:.3f}")
        row(name, cells)
    for machine in ("capture", "restore"):
        row(
            f"whole {machine} machine",
            [
                f"{results['participants'][str(n)]['machines'][machine]['median_s'] * 1e3:.1f} ms"
                for n in sizes
            ],
        )
        # What is not a wire op: guards (validation), topology building, the state file.
        row(
            f"  {machine}: outside the wire ops",
            [f"{_outside(results['participants'][str(n)], machine) * 1e3:.1f} ms" for n in sizes],
        )


def _outside(figures: dict[str, Any], machine: str) -> float:
    ops = sum(v["median_s"] for k, v in figures["phases"].items() if k.startswith(machine))
    return float(figures["machines"][machine]["median_s"] - ops)


if __name__ == "__main__":
    sys.exit(main())
