"""Benchmark of the coordinator's own overhead (not a timed test).

Runs the capture and restore machines against 1, 8 and 32 fake participants of
1000 records each, every fake in its own process (as every shim is), and
measures in the same run, for comparison:

- the raw round trip: a minimal Unix-socket echo of a 128-byte header, one
  connection per request (as the protocol does), served by another process;
- the raw fan-out: the same echo sent to N echo processes at once by a minimal
  selector client, which is the floor for one phase with N participants (one
  connection per participant and per request is the protocol);
- the raw fan-out to the fakes: the same minimal client sending HANDSHAKE to the
  very fake processes the machines talk to, so what the fakes themselves cost
  (they are Python too) is separated from what the coordinator adds.

A phase is measured two ways: ``exchange`` is the elapsed time its progress event
reports (request encoding, sending, waiting for and decoding every reply), and
``step`` is the time from the previous phase's event to its own, which adds
everything the runner does around the exchange (the state machine, building the
requests, checking the replies, and for INSPECT building the topology; guards and
local steps where a machine has them in between). "A phase without records" is
the median step of the phases with neither records nor guards (SAVE_ALLOCATIONS,
PREPARE_UNICAST, RESTORE_*).

The goal (issue 2): at 8 participants a phase costs under 3x the raw round trip.
The output states whether that holds read literally (against the single round
trip) and read against the floor (the raw fan-out to the same 8 processes).

    .venv/bin/python bench/coordinator.py --out /tmp/coordinator.json

Timings are medians over --repeat capture+restore cycles; on a machine shared with
other work, compare runs made under the same conditions. --profile N runs
cProfile over the coordinator's side of the machines with N participants.

``--suspend-group N`` measures instead the coordinator's own share of a whole
``suspend``/``resume`` (the engine's calls, as the command line makes them) on the
simulated driver: N real processes with the shim preloaded (a creator sharing one
allocation with N-1 importers), --repeat cycles, and per cycle the steps that are the
coordinator's (``detect``, which holds every STATUS before HANDSHAKE, ``capture``,
``coordinator_restore``) apart from the native ones (lock, checkpoint, restore, unlock),
which are the driver's; the coordinator's share is a verb's whole time less its native
steps. Needs ``make build``.

    .venv/bin/python bench/coordinator.py --suspend-group 4 --repeat 20
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
import struct
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from cuinterpose.engine import runner
from cuinterpose.engine.client import Endpoint, ParticipantError, call_all
from cuinterpose.engine.progress import Event, OpEvent
from cuinterpose.engine.wire import (
    HEADER_SIZE,
    RECORD_SIZE,
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
from cuinterpose.testing import FakeParticipant

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


def _fan_out_once(paths: Sequence[str], payload: bytes, selector: selectors.BaseSelector) -> None:
    """Send ``payload`` to every path on a connection of its own, read every whole reply
    (header, then the message and records it announces), the least a client can do."""
    socks = []
    for path in paths:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(path)
        sock.sendall(payload)
        sock.setblocking(False)
        selector.register(sock, selectors.EVENT_READ, [bytearray(), HEADER_SIZE])
        socks.append(sock)
    waiting = len(socks)
    while waiting:
        for key, _ in selector.select():
            state = key.data
            buffer = state[0]
            chunk = key.fileobj.recv(state[1] - len(buffer))  # type: ignore[union-attr]
            if not chunk:
                raise RuntimeError("a server hung up mid-reply")
            buffer += chunk
            if len(buffer) == HEADER_SIZE == state[1]:
                (count,) = struct.unpack_from("<I", buffer, 12)
                (message_length,) = struct.unpack_from("<I", buffer, 84)
                state[1] = HEADER_SIZE + message_length + count * RECORD_SIZE
            if len(buffer) == state[1]:
                selector.unregister(key.fileobj)
                waiting -= 1
    for sock in socks:
        sock.close()


def _fan_out(paths: Sequence[str], payload: bytes, iterations: int) -> dict[str, float]:
    samples = []
    with selectors.DefaultSelector() as selector:
        for _ in range(min(20, iterations)):  # warm up: first connections, page faults
            _fan_out_once(paths, payload, selector)
        for _ in range(iterations):
            began = time.perf_counter()
            _fan_out_once(paths, payload, selector)
            samples.append(time.perf_counter() - began)
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
    try:
        return _fan_out(paths, payload, iterations)
    finally:
        for server in servers:
            server.kill()
            server.join()


def raw_fan_out_to_fakes(endpoints: Sequence[Endpoint], iterations: int) -> dict[str, float]:
    """HANDSHAKE (no records, changes nothing) to the fakes themselves, minimal client:
    what the fakes take to answer, with next to nothing of the coordinator's in it."""
    return _fan_out([str(e.path) for e in endpoints], Request(Op.HANDSHAKE).encode(), iterations)


def _summary(samples: Sequence[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "median_s": statistics.median(ordered),
        "min_s": ordered[0],
        "p90_s": ordered[min(len(ordered) - 1, int(len(ordered) * 0.9))],
        "samples": float(len(ordered)),
    }


# Wire phases with neither records nor guards: what "a phase" costs, plainly.
PLAIN_PHASES = (
    "capture SAVE_ALLOCATIONS",
    "capture PREPARE_UNICAST",
    "restore RESTORE_UNICAST",
    "restore RESTORE_MULTICAST_CREATORS",
    "restore RESTORE_MULTICAST_IMPORTERS",
    "restore RESTORE_MULTICAST_DEVICES",
    "restore RESTORE_MULTICAST_BINDINGS",
)
GOAL_PARTICIPANTS = 8
GOAL_RATIO = 3.0


def run_machines(
    endpoints: Sequence[Endpoint],
    checkpoint_dir: Path,
    repeat: int,
    profile: cProfile.Profile | None,
) -> dict[str, Any]:
    exchanges: dict[str, list[float]] = defaultdict(list)
    steps: dict[str, list[float]] = defaultdict(list)
    totals: dict[str, list[float]] = defaultdict(list)
    cpu: dict[str, list[float]] = defaultdict(list)
    last = [0.0]  # when the previous phase's event came (or the machine started)
    machine = [""]

    def collect(event: Event) -> None:
        now = time.perf_counter()
        if isinstance(event, OpEvent):
            name = f"{event.machine} {event.phase}"
            exchanges[name].append(event.elapsed_s)
            steps[name].append(now - last[0])
            last[0] = now

    def measured(
        calls: Sequence[tuple[Endpoint, Request, str | None]], *, timeout: float
    ) -> list[Reply | ParticipantError]:
        # The coordinator's own CPU time for the exchange: what the fakes cost is not in it.
        began = time.process_time()
        results = call_all(calls, timeout=timeout)
        cpu[f"{machine[0]} {calls[0][1].op.name}"].append(time.process_time() - began)
        return results

    options = runner.Options(phase_timeout=60.0, on_progress=collect, transport=measured)
    for _ in range(repeat):
        for name, run in (("capture", runner.capture), ("restore", runner.restore)):
            machine[0] = name
            if profile is not None:
                profile.enable()
            began = last[0] = time.perf_counter()
            run(endpoints, checkpoint_dir, options)
            totals[name].append(time.perf_counter() - began)
            if profile is not None:
                profile.disable()
    plain_steps = [x for name in PLAIN_PHASES for x in steps.get(name, ())]
    plain_exchanges = [x for name in PLAIN_PHASES for x in exchanges.get(name, ())]
    return {
        "phases": {name: _summary(samples) for name, samples in exchanges.items()},
        "steps": {name: _summary(samples) for name, samples in steps.items()},
        "coordinator_cpu": {name: _summary(samples) for name, samples in cpu.items()},
        "machines": {name: _summary(samples) for name, samples in totals.items()},
        "phase_without_records": {
            "step": _summary(plain_steps),
            "exchange": _summary(plain_exchanges),
        },
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    parser.add_argument("--participants", default="1,8,32")
    parser.add_argument("--records", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=10, help="capture+restore cycles per size")
    parser.add_argument("--raw-iterations", type=int, default=2000)
    parser.add_argument("--profile", type=int, metavar="N", help="cProfile the run with N fakes")
    parser.add_argument(
        "--suspend-group",
        type=int,
        metavar="N",
        help="time the coordinator's share of suspend/resume of N shimmed sim processes",
    )
    args = parser.parse_args(argv)
    if args.suspend_group is not None:
        figures = suspend_cycles(args.suspend_group, args.repeat)
        _print_suspend(figures)
        if args.out is not None:
            args.out.write_text(json.dumps(figures, indent=2) + "\n")
        return 0
    sizes = [int(s) for s in args.participants.split(",")]
    work = Path(tempfile.mkdtemp(prefix="cuip-bench-"))
    try:
        raw = raw_round_trip(work, args.raw_iterations)
        results: dict[str, Any] = {
            "cpus": os.cpu_count(),
            "records_per_participant": args.records,
            "repeat": args.repeat,
            "raw_round_trip": raw,
            "raw_fan_out": {},
            "raw_fan_out_to_fakes": {},
            "participants": {},
        }
        profile_text = ""
        for n in sizes:
            control = work / f"control-{n}"
            control.mkdir()
            checkpoint = work / f"ckpt-{n}"
            checkpoint.mkdir()
            profile = cProfile.Profile() if args.profile == n else None
            iterations = max(50, args.raw_iterations // max(1, n))
            results["raw_fan_out"][str(n)] = raw_fan_out(work, n, iterations)
            with fakes(n, args.records, control) as endpoints:
                results["raw_fan_out_to_fakes"][str(n)] = raw_fan_out_to_fakes(
                    endpoints, iterations
                )
                results["participants"][str(n)] = run_machines(
                    endpoints, checkpoint, args.repeat, profile
                )
            results["participants"][str(n)]["goal"] = _goal(results, n)
            if profile is not None:
                text = io.StringIO()
                pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(60)
                profile_text = text.getvalue()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _print_report(results, sizes)
    if profile_text:
        print(profile_text)
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


_COORDINATOR_STEPS = ("detect", "capture", "coordinator_restore")


def suspend_cycles(n: int, cycles: int, mib: int = 8) -> dict[str, Any]:
    """``cycles`` suspend+resume of N sim processes sharing ``mib`` MiB, through the
    engine (agent.suspend/resume, the native calls on the simulated driver the shims
    report); every step's seconds, the median of each, and the coordinator's share."""
    from cuinterpose import launch
    from cuinterpose.demo import Worker
    from cuinterpose.engine import agent

    if n < 2:
        raise SystemExit("--suspend-group needs at least 2 processes (a creator and an importer)")
    work = Path(tempfile.mkdtemp(prefix="cuip-bench-suspend-"))
    namespace = f"bench-coordinator-{os.getpid()}"
    # The native calls are made in this process, on the simulator's shared state.
    os.environ["CUINTERPOSE_SIM_NAMESPACE"] = namespace
    base = dict(os.environ)
    base.pop("LD_PRELOAD", None)
    control = launch.ensure_control_dir(work / "control")
    shim = launch.launch_env(driver="sim", control_dir=control, base=base)
    workers: list[Worker] = []
    steps: dict[str, list[float]] = defaultdict(list)
    try:
        size = mib << 20
        creator = Worker("creator", shim, log_dir=work, timeout_s=120.0)
        workers.append(creator)
        handle, _ = creator.create_mapped(size, seed=7)
        for i in range(1, n):
            importer = Worker(f"importer-{i}", shim, log_dir=work, timeout_s=120.0)
            workers.append(importer)
            fd = creator.send_fd_to(
                importer, int(creator.check("export", handle=handle)["fd"]), close=True
            )
            importer.map_at_new_va(int(importer.check("import", fd=fd)["handle"]), size)
        group = [(w.pid, w.pid) for w in workers]
        where = agent.Where(control)
        for cycle in range(cycles):
            directory = work / f"ck-{cycle}"
            began = time.perf_counter()
            suspended = agent.suspend(group, directory, where=where)
            steps["suspend_total"].append(time.perf_counter() - began)
            began = time.perf_counter()
            resumed = agent.resume(directory, where=where)
            steps["resume_total"].append(time.perf_counter() - began)
            for timing in (*suspended.timings, *resumed.timings):
                steps[timing.step].append(timing.seconds)
    finally:
        for w in workers:
            w.kill()
        Path(f"/dev/shm/cuinterpose-sim-{os.getuid()}-{namespace}").unlink(missing_ok=True)
        shutil.rmtree(work, ignore_errors=True)
    medians = {step: statistics.median(seconds) for step, seconds in steps.items()}
    return {
        "processes": n,
        "shared_mib": mib,
        "cycles": cycles,
        "cpus": os.cpu_count(),
        "median_s": medians,
        # Everything but the driver's own calls: the group's checks, every STATUS, the
        # machines, the manifest.
        "coordinator_share_of_suspend_s": statistics.median(
            total - native
            for total, native in zip(
                steps["suspend_total"],
                map(sum, zip(steps["native_lock"], steps["native_checkpoint"], strict=True)),
                strict=True,
            )
        ),
        "coordinator_share_of_resume_s": statistics.median(
            total - native
            for total, native in zip(
                steps["resume_total"],
                map(sum, zip(steps["native_restore"], steps["native_unlock"], strict=True)),
                strict=True,
            )
        ),
        "samples_s": dict(steps),
    }


def _print_suspend(figures: dict[str, Any]) -> None:
    print(
        f"suspend/resume of {figures['processes']} sim processes "
        f"({figures['shared_mib']} MiB shared), median of {figures['cycles']} cycles:"
    )
    for step, seconds in figures["median_s"].items():
        mine = " (coordinator)" if step in _COORDINATOR_STEPS else ""
        print(f"  {step:<22} {_ms(seconds):>10}{mine}")
    print(f"  coordinator's share of a suspend: {_ms(figures['coordinator_share_of_suspend_s'])}")
    print(f"  coordinator's share of a resume:  {_ms(figures['coordinator_share_of_resume_s'])}")


def _goal(results: dict[str, Any], n: int) -> dict[str, Any]:
    """A phase without records against the raw round trip and against the raw fan-out."""
    phase = results["participants"][str(n)]["phase_without_records"]["step"]["median_s"]
    round_trip = results["raw_round_trip"]["median_s"]
    fan_out = results["raw_fan_out"][str(n)]["median_s"]
    to_fakes = results["raw_fan_out_to_fakes"][str(n)]["median_s"]
    return {
        "phase_s": phase,
        "x_raw_round_trip": phase / round_trip,
        "x_raw_fan_out": phase / fan_out,
        "x_raw_fan_out_to_fakes": phase / to_fakes,
        "met_vs_raw_round_trip": phase / round_trip < GOAL_RATIO,
        "met_vs_raw_fan_out": phase / fan_out < GOAL_RATIO,
    }


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}"


def _print_report(results: dict[str, Any], sizes: Sequence[int]) -> None:
    rt = results["raw_round_trip"]["median_s"]
    print(
        f"{results['records_per_participant']} records per participant,"
        f" {results['repeat']} capture+restore cycles per size, {results['cpus']} CPUs;"
        " every figure a median"
    )
    print(
        f"raw round trip (128-byte echo to 1 process, new connection each): {rt * 1e6:.1f} us"
        f" (min {results['raw_round_trip']['min_s'] * 1e6:.1f} us)"
    )
    for n in sizes:
        figures = results["participants"][str(n)]
        fan = results["raw_fan_out"][str(n)]["median_s"]
        fakes_floor = results["raw_fan_out_to_fakes"][str(n)]["median_s"]
        print()
        print(
            f"== {n} participant{'s' if n != 1 else ''}: raw fan-out {_ms(fan)} ms"
            f" ({fan / rt:.1f}x the round trip); raw fan-out to the fakes {_ms(fakes_floor)} ms"
        )
        print(
            f"{'phase':38}{'exchange ms':>12}{'step ms':>11}{'step/rt':>10}"
            f"{'step/fan-out':>14}{'coord. CPU ms':>15}"
        )
        for name, summary in figures["phases"].items():
            step = figures["steps"][name]["median_s"]
            cpu = figures["coordinator_cpu"][name]["median_s"]
            print(
                f"{name:38}{_ms(summary['median_s']):>12}{_ms(step):>11}{step / rt:>9.1f}x"
                f"{step / fan:>13.1f}x{_ms(cpu):>15}"
            )
        for machine in ("capture", "restore"):
            total = figures["machines"][machine]["median_s"]
            print(
                f"whole {machine}: {total * 1e3:.1f} ms, of which"
                f" {_outside(figures, machine) * 1e3:.1f} ms outside the exchanges"
                " (runner, guards and validation, topology, state file)"
            )
    print()
    print(f"{'summary (ms unless said)':38}" + "".join(f"{f'N={n}':>12}" for n in sizes))

    def row(label: str, values: Sequence[str]) -> None:
        print(f"{label:38}" + "".join(f"{v:>12}" for v in values))

    per = [results["participants"][str(n)] for n in sizes]
    row(
        "raw fan-out (echo processes)",
        [_ms(results["raw_fan_out"][str(n)]["median_s"]) for n in sizes],
    )
    row(
        "raw fan-out to the fakes",
        [_ms(results["raw_fan_out_to_fakes"][str(n)]["median_s"]) for n in sizes],
    )
    row(
        "phase without records: exchange",
        [_ms(f["phase_without_records"]["exchange"]["median_s"]) for f in per],
    )
    row("phase without records: step", [_ms(f["goal"]["phase_s"]) for f in per])
    row("  x raw round trip", [f"{f['goal']['x_raw_round_trip']:.1f}x" for f in per])
    row("  x raw fan-out to N", [f"{f['goal']['x_raw_fan_out']:.2f}x" for f in per])
    row(
        "  x raw fan-out to the N fakes",
        [f"{f['goal']['x_raw_fan_out_to_fakes']:.2f}x" for f in per],
    )
    for name in ("capture INSPECT", "restore INSPECT"):
        row(f"{name}: step", [_ms(f["steps"][name]["median_s"]) for f in per])
    for machine in ("capture", "restore"):
        row(f"whole {machine}", [f"{f['machines'][machine]['median_s'] * 1e3:.1f}" for f in per])
    print()
    n = GOAL_PARTICIPANTS if GOAL_PARTICIPANTS in sizes else sizes[-1]
    goal = results["participants"][str(n)]["goal"]
    print(
        f"goal (issue 2): at {GOAL_PARTICIPANTS} participants a phase costs under"
        f" {GOAL_RATIO:g}x the raw round trip"
        + ("" if n == GOAL_PARTICIPANTS else f" (not measured; shown at {n})")
    )
    print(f"  a phase without records at {n}: {_ms(goal['phase_s'])} ms (step, runner included)")
    print(
        f"  read literally, against the single round trip ({rt * 1e6:.1f} us):"
        f" {goal['x_raw_round_trip']:.1f}x -> {_verdict(goal['met_vs_raw_round_trip'])}"
    )
    fan = results["raw_fan_out"][str(n)]["median_s"]
    print(
        f"  against the floor, the raw fan-out to the same {n} processes ({_ms(fan)} ms; one"
        f" connection per request is the protocol): {goal['x_raw_fan_out']:.2f}x ->"
        f" {_verdict(goal['met_vs_raw_fan_out'])}"
    )


def _verdict(met: bool) -> str:
    return "MET" if met else "NOT MET"


def _outside(figures: dict[str, Any], machine: str) -> float:
    ops = sum(v["median_s"] for k, v in figures["phases"].items() if k.startswith(machine))
    return float(figures["machines"][machine]["median_s"] - ops)


if __name__ == "__main__":
    sys.exit(main())
