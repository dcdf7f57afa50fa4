"""``cuinterpose demo``: three CUDA processes sharing memory, checkpointed and restored.

On the simulated driver by default (no GPU needed), with the shim preloaded and a
temporary control directory: a creator makes two exportable allocations and a
private one, an importer maps one allocation twice, another imports both. They
fill memory; then ``cuinterpose suspend`` (capture, native lock and checkpoint
of all: the GPU memory is freed) and ``cuinterpose resume`` (native restore and
unlock of all, then the coordinator restore); every byte is checked at its
original address. On the simulated driver the three processes also form a
multicast team (``multicast.py``: one device each, a member allocation each),
checked after the restore; never on a real GPU. It ends with PASS, or FAIL and
the reason; exit status 0 only on PASS.

The processes are the scriptable worker application
``cuinterpose/demo/worker.py`` (``cuda.bindings.driver`` only), driven through
``worker_client.Worker``; :class:`Scenario` here is what the end-to-end tests, the GPU
tests and ``bench/checkpoint.py`` use too.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Final

import attrs

from .. import launch, native_calls
from ..engine import artifacts
from .multicast import SIM_DEVICES_ENV, MulticastTeam
from .multicast import allowed as multicast_allowed
from .worker_client import DemoError, Worker

PATTERN_CHUNK: Final = 32 << 20
SIM_NAMESPACE_ENV: Final = "CUINTERPOSE_SIM_NAMESPACE"


# --------------------------------------------------------------- the fill pattern
def pattern(seed: int, size: int) -> Iterator[bytes]:
    """The bytes the worker's ``fill`` writes (the same code as ``worker.pattern``)."""
    tile = bytearray(random.Random(seed).randbytes(min(size, PATTERN_CHUNK)))
    for index, off in enumerate(range(0, size, PATTERN_CHUNK)):
        n = min(PATTERN_CHUNK, size - off)
        head = struct.pack("<QQ", seed, index)[: min(16, n)]
        tile[: len(head)] = head
        yield bytes(tile[:n])


def pattern_digest(seed: int, size: int, offset: int = 0, length: int | None = None) -> str:
    """sha256 of ``length`` bytes at ``offset`` of the pattern of ``size`` bytes."""
    end = size if length is None else offset + length
    if not 0 <= offset <= end <= size:
        raise ValueError(f"range {offset}+{end - offset} outside a pattern of {size} bytes")
    digest = hashlib.sha256()
    pos = 0
    for chunk in pattern(seed, size):
        lo, hi = max(offset, pos), min(end, pos + len(chunk))
        if lo < hi:
            digest.update(chunk[lo - pos : hi - pos])
        pos += len(chunk)
        if pos >= end:
            break
    return digest.hexdigest()


# --------------------------------------------------------------- the scenario
@attrs.define
class Region:
    """A range some worker has mapped, and the sha256 its bytes must have."""

    worker: Worker
    label: str
    va: int
    size: int
    expect: str


@attrs.define
class Scenario:
    """The three-process sharing topology of the shim issue.

    - ``creator``: X (exportable, ``x_size``), Y (exportable, ``y_size``), P (private,
      ``p_size``), each mapped and filled; it keeps one more export of X (``late_fd``)
      for a process that arrives after the restore.
    - ``twice``: imports X and maps it twice, whole at two VAs (the real driver maps
      only whole allocations).
    - ``both``: imports X and Y, maps both, and overwrites Y with its own pattern.
    """

    creator: Worker
    twice: Worker
    both: Worker
    x_size: int
    y_size: int
    p_size: int
    handles: dict[str, int] = attrs.field(factory=dict)
    vas: dict[str, int] = attrs.field(factory=dict)
    late_fd: int = -1
    regions: list[Region] = attrs.field(factory=list)

    SEED_X: ClassVar[int] = 11
    SEED_Y_CREATOR: ClassVar[int] = 12
    SEED_P: ClassVar[int] = 13
    SEED_Y_BOTH: ClassVar[int] = 21

    @property
    def workers(self) -> tuple[Worker, Worker, Worker]:
        return (self.creator, self.twice, self.both)

    @property
    def pids(self) -> list[int]:
        return [w.pid for w in self.workers]

    @property
    def shared_bytes(self) -> int:
        return self.x_size + self.y_size

    @property
    def staged_bytes(self) -> int:
        """What the creator's SAVE moves: its shared and its private allocations (the
        shim stages every allocation it created, SNAPSHOT_SHIM_STAGE_PRIVATE)."""
        return self.x_size + self.y_size + self.p_size

    def build(self) -> None:
        c, t, b = self.creator, self.twice, self.both
        x, y, p = self.x_size, self.y_size, self.p_size
        hx, vx = c.create_mapped(x, seed=self.SEED_X)
        hy, vy = c.create_mapped(y, seed=self.SEED_Y_CREATOR)
        hp, vp = c.create_mapped(p, handle_type="none", seed=self.SEED_P)
        self.handles.update(creator_x=hx, creator_y=hy, creator_p=hp)
        self.vas.update(creator_x=vx, creator_y=vy, creator_p=vp)

        def share(handle: int, to: Worker) -> int:
            fd = int(c.check("export", handle=handle)["fd"])
            theirs = c.send_fd_to(to, fd, close=True)
            return int(to.check("import", fd=theirs)["handle"])

        hx_t = share(hx, t)
        self.handles["twice_x"] = hx_t
        self.vas["twice_x"] = t.map_at_new_va(hx_t, x)
        self.vas["twice_x_second"] = t.map_at_new_va(hx_t, x)

        hx_b, hy_b = share(hx, b), share(hy, b)
        self.handles.update(both_x=hx_b, both_y=hy_b)
        self.vas["both_x"] = b.map_at_new_va(hx_b, x)
        self.vas["both_y"] = b.map_at_new_va(hy_b, y)
        b.check("fill", va=self.vas["both_y"], size=y, seed=self.SEED_Y_BOTH)

        self.late_fd = int(c.check("export", handle=hx)["fd"])

        dx = pattern_digest(self.SEED_X, x)
        dy = pattern_digest(self.SEED_Y_BOTH, y)
        self.regions = [
            Region(c, "creator X", vx, x, dx),
            Region(c, "creator Y", vy, y, dy),
            Region(c, "creator P (private)", vp, p, pattern_digest(self.SEED_P, p)),
            Region(t, "importer X", self.vas["twice_x"], x, dx),
            Region(t, "importer X, 2nd map", self.vas["twice_x_second"], x, dx),
            Region(b, "importer X", self.vas["both_x"], x, dx),
            Region(b, "importer Y", self.vas["both_y"], y, dy),
        ]

    def mismatches(self) -> list[str]:
        """Every region whose bytes are not what they must be, or cannot be read."""
        bad: list[str] = []
        for r in self.regions:
            reply = r.worker.call("digest", va=r.va, size=r.size)
            if not reply.get("ok"):
                bad.append(
                    f"{r.worker.name} (pid {r.worker.pid}) {r.label} at {r.va:#x}: "
                    f"{reply.get('error')}"
                )
            elif reply["digest"] != r.expect:
                bad.append(
                    f"{r.worker.name} (pid {r.worker.pid}) {r.label} at {r.va:#x}: bytes differ"
                )
        return bad

    @property
    def region_bytes(self) -> int:
        return sum(r.size for r in self.regions)


# --------------------------------------------------------------- the coordinator CLI
@attrs.frozen
class CliRun:
    """One ``cuinterpose prepare|restore`` run: exit status, JSON events, stderr, time."""

    returncode: int
    events: tuple[dict[str, Any], ...]
    stderr: str
    seconds: float

    def phase(self, name: str) -> dict[str, Any]:
        for event in self.events:
            if event.get("event") == "phase" and event.get("phase") == name:
                return event
        return {}


def run_cli(
    command: str,
    *,
    pids: Sequence[int],
    checkpoint_dir: Path,
    control_dir: Path,
    env: Mapping[str, str] | None = None,
    trace: Path | None = None,
    timeout_s: float = 300.0,
) -> CliRun:
    """Run ``python -m cuinterpose COMMAND`` for ``pids`` (same PID namespace)."""
    argv = [sys.executable, "-m", "cuinterpose", command, "--checkpoint-dir", str(checkpoint_dir)]
    argv += ["--control-dir", str(control_dir), "--progress", "json"]
    for pid in pids:
        argv += ["--process", str(pid), str(pid)]
    if trace is not None:
        argv += ["--trace", str(trace)]
    start = time.perf_counter()
    proc = subprocess.run(
        argv,
        env=dict(os.environ if env is None else env),
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    seconds = time.perf_counter() - start
    events: list[dict[str, Any]] = []
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            with contextlib.suppress(json.JSONDecodeError):
                events.append(json.loads(line))
    return CliRun(proc.returncode, tuple(events), proc.stderr, seconds)


def coordinator_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The coordinator's own environment: no shim, no sanitizer runtime preloaded."""
    env = dict(os.environ if base is None else base)
    env.pop("LD_PRELOAD", None)
    return env


# --------------------------------------------------------------- the demo
# Device-wide memory in use, summed over devices 0..N-1, by the observer (plain driver).
_USED: Final = """
used = 0
for ordinal in range({devices}):
    ctx = check(cu.cuDevicePrimaryCtxRetain(check(cu.cuDeviceGet(ordinal))))
    check(cu.cuCtxPushCurrent(ctx))
    try:
        free, total = check(cu.cuMemGetInfo())
        used += int(total) - int(free)
    finally:
        check(cu.cuCtxPopCurrent())
result = used
"""


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def _gbps(event: Mapping[str, Any], key: str, nbytes: int, seconds: float) -> str:
    value = event.get(key)
    if isinstance(value, int | float) and value > 0:
        return f"{value:.2f} GB/s"
    return f"{nbytes / seconds / 1e9:.2f} GB/s (demo clock)" if seconds > 0 else "n/a"


def run_demo(*, driver: str = "sim", out: Callable[[str], None] = print) -> int:
    """Run the three-process checkpoint/restore demo; 0 only if every byte matched."""
    if driver not in launch.DRIVERS:
        out(f"demo: unknown driver {driver!r}")
        return 2
    with tempfile.TemporaryDirectory(prefix="cuinterpose-demo-") as tmp:
        root = Path(tmp)
        control = launch.ensure_control_dir(root / "control")
        ckpt = root / "checkpoint"
        ckpt.mkdir()
        base = dict(os.environ)
        shm: Path | None = None
        if driver == "sim":
            # A private simulated device: its memory accounting sees only this demo.
            namespace = f"demo-{os.getpid()}-{root.name}"
            base[SIM_NAMESPACE_ENV] = namespace
            # The multicast team puts each of the three processes on its own device.
            base[SIM_DEVICES_ENV] = str(max(3, int(base.get(SIM_DEVICES_ENV, "0") or 0)))
            shm = Path(f"/dev/shm/cuinterpose-sim-{os.getuid()}-{namespace}")
        try:
            shim_env = launch.launch_env(driver=driver, control_dir=control, base=base)
            plain_env = launch.launch_env(
                driver=driver, control_dir=control, base=base, preload_shim=False
            )
        except (artifacts.ArtifactMissingError, launch.LaunchError) as exc:
            out(f"demo: {exc}")
            return 1
        workers: list[Worker] = []
        try:
            return _demo(driver, root, control, ckpt, shim_env, plain_env, workers, out)
        except (DemoError, native_calls.NativeError, native_calls.NativeUnavailableError) as exc:
            out(f"FAIL: {exc}")
            return 1
        finally:
            for w in workers:
                w.kill()
            if shm is not None:
                shm.unlink(missing_ok=True)


def _demo(
    driver: str,
    root: Path,
    control: Path,
    ckpt: Path,
    shim_env: dict[str, str],
    plain_env: dict[str, str],
    workers: list[Worker],
    out: Callable[[str], None],
) -> int:
    t_start = time.perf_counter()
    workers.append(Worker("observer", plain_env, log_dir=root, wait=False))
    for name in ("creator", "importer-twice", "importer-both"):
        workers.append(Worker(name, shim_env, log_dir=root, wait=False))
    observer = workers[0]
    for w in workers:
        w.wait_ready()
    gran = int(observer.check("granularity")["granularity"])
    unit = 2 * gran
    scen = Scenario(workers[1], workers[2], workers[3], 4 * unit, 2 * unit, unit)
    out(f"cuinterpose demo: {driver} driver, control dir {control}")
    out("  processes: " + ", ".join(f"{w.name} pid {w.pid}" for w in scen.workers))

    # The GPU memory in use on every device the processes use (the team puts one member
    # on each worker's device), so that what is used, freed and saved count the same.
    devices = len(scen.workers) if multicast_allowed(driver) else 1

    def used() -> int:
        return int(observer(_USED.format(devices=devices)))

    used_idle = used()
    scen.build()
    out(
        f"  allocations: X {_mib(scen.x_size)} exportable, shared by all 3 (mapped twice in "
        f"{scen.twice.name}); Y {_mib(scen.y_size)} exportable, shared by 2; "
        f"P {_mib(scen.p_size)} private"
    )
    out(
        f"  filled {_mib(scen.x_size + scen.y_size + scen.p_size)}, seen through "
        f"{len(scen.regions)} mapped ranges ({_mib(scen.region_bytes)})"
    )
    team: MulticastTeam | None = None
    if multicast_allowed(driver):
        team = MulticastTeam(scen.workers, unit)
        team.build()
        out(
            f"  multicast team: {len(scen.workers)} processes, one device each, a"
            f" {_mib(unit)} object exported by {scen.creator.name} (a capability) and"
            f" imported by the others; a {_mib(unit)} member per device bound by handle"
            " and by address (12.1 and device-explicit forms), the object mapped read-write"
        )
    else:
        out("  multicast team: not built (multicast runs on the simulated driver only)")
    bad = scen.mismatches() + (team.problems() if team else [])
    if bad:
        raise DemoError("before checkpoint: " + "; ".join(bad))
    # Measured once everything the suspend saves exists: the team's members included.
    used_before = used()
    where = f"the {devices} devices the processes use" if devices > 1 else "device 0"
    counted = "the allocations and the team's members" if team else "the allocations"
    out(
        f"  GPU memory used before the suspend: {_mib(used_before - used_idle)} "
        f"(cuMemGetInfo on {where}: {counted}, each once)"
    )

    # The CLI makes the native calls itself: it loads the same driver as the workers.
    def run(command: str) -> CliRun:
        done = run_cli(
            command, pids=scen.pids, checkpoint_dir=ckpt, control_dir=control, env=plain_env
        )
        if done.returncode != 0:
            raise DemoError(
                f"cuinterpose {command} exited {done.returncode}: {done.stderr.strip()}"
            )
        return done

    def steps(done: CliRun) -> str:
        return ", ".join(
            f"{e['step']} {e['seconds']:.3f} s"
            for e in done.events
            if e.get("event") == "step" and e.get("status") == "done"
        )

    suspended = run("suspend")
    used_suspended = used()
    save = suspended.phase("SAVE_ALLOCATIONS")
    freed = used_before - used_suspended
    out(f"suspend: {suspended.seconds:.3f} s ({steps(suspended)})")
    out(
        f"  saved {save.get('allocation_count', '?')} allocations (shared and private), "
        f"{_mib(int(save.get('allocation_bytes', 0)))}, SAVE "
        f"{_gbps(save, 'gb_per_s', scen.staged_bytes, suspended.seconds)}; every process "
        f"CHECKPOINTED; GPU memory used {_mib(used_suspended - used_idle)}: "
        f"{_mib(freed)} freed while suspended"
    )
    resumed = run("resume")
    used_after = used()
    load = resumed.phase("LOAD_ALLOCATIONS")
    out(f"resume: {resumed.seconds:.3f} s ({steps(resumed)})")
    out(
        f"  loaded {load.get('allocation_count', '?')} allocations, "
        f"{_mib(int(load.get('allocation_bytes', 0)))}, LOAD "
        f"{_gbps(load, 'gb_per_s', scen.staged_bytes, resumed.seconds)}; GPU memory used "
        f"{_mib(used_after - used_idle)} (before the suspend: {_mib(used_before - used_idle)})"
    )

    problems = scen.mismatches()
    if team is not None:
        team_problems = team.problems()
        problems += team_problems
        if not team_problems:
            out(
                f"multicast team verified: {len(team.workers)} members hold their bytes, every"
                " multicast mapping is read-write, a write through each process reached"
                " every member"
            )
    expected_freed = scen.x_size + scen.y_size + scen.p_size
    expected_freed += team.member_bytes if team is not None else 0
    if freed < expected_freed:
        problems.append(
            f"only {_mib(freed)} of GPU memory freed while suspended, "
            f"expected at least {_mib(expected_freed)}"
        )
    if used_after < used_before:
        problems.append(
            f"GPU memory used after resume {_mib(used_after - used_idle)} is less "
            f"than before {_mib(used_before - used_idle)}"
        )
    for w in workers:
        status = w.close()
        if status != 0:
            problems.append(f"{w.name} exited with status {status}: {w.stderr_tail()}")
    if problems:
        for problem in problems:
            out(f"  MISMATCH {problem}")
        out(f"FAIL: {problems[0]}")
        return 1
    out(
        f"PASS: {len(scen.regions)} ranges, {_mib(scen.region_bytes)}, every byte back at its "
        f"original VA in all 3 processes; {_mib(freed)} of GPU memory freed while suspended; "
        f"total {time.perf_counter() - t_start:.2f} s"
    )
    return 0
