"""The kept host copy (SNAPSHOT_SHIM_KEEP_HOST_COPY=1: shim_c/keep.c, content.c), on the
simulated driver, whose cuLaunchKernel runs the C twin of the hash kernel (shim_c/sim/module.c).

Each shape's bytes go round trip (the four shapes of docs/benchmarks.md, scaled down); the
copies are pinned while the application runs, before the first SAVE, and STATUS says how
much host memory they hold; a SAVE after an unchanged cycle copies nothing, one after one
allocation was rewritten copies that allocation only; random single-byte flips between
cycles are every one copied and restored; a hash kernel that does not load or run makes
SAVE copy everything and say why; an allocation freed gives its copy back.
"""

from __future__ import annotations

import json
import random
import re
import struct
import time
from pathlib import Path

import pytest
from cuinterpose.demo import Worker
from cuinterpose.engine import wire

from tests.shim import shimenv
from tests.shim.test_content import finish, make_shared
from tests.shim.test_control import CAPTURE, RESTORE, Shim, native_checkpoint_restore
from tests.simenv import Spawn

Op, Status, Phase, HashState = wire.Op, wire.Status, wire.Phase, wire.HashState
MIB = 1 << 20
CHUNK = 2 * MIB  # keephash.h's KH_CHUNK
KEEP = {"SNAPSHOT_SHIM_KEEP_HOST_COPY": "1", "SNAPSHOT_SHIM_COPY_THREADS": "3"}
# How long the keeper may take to pin a few MiB; the wait ends as soon as STATUS says so.
PIN_WAIT_S = 30.0


def host_copy(reply: wire.Reply) -> wire.HostCopy:
    found = wire.HostCopy.in_reply(reply.records)
    assert found is not None, (reply.op, reply.records)
    return found


def status(c: Shim) -> wire.HostCopy:
    return host_copy(c.ok(Op.STATUS))


def wait_pinned(c: Shim, count: int) -> wire.HostCopy:
    """STATUS until the keeper has pinned `count` copies (it does so in the background)."""
    deadline = time.monotonic() + PIN_WAIT_S
    while (now := status(c)).count != count:
        assert time.monotonic() < deadline, f"{now.count} of {count} copies pinned"
        time.sleep(0.02)
    return now


def digests(w: Worker) -> list[str]:
    return list(w("result = [digest(va, size) for _, va, size, _ in A]"))


def cycle(c: Shim, native: tuple[Spawn, str, Worker] | None = None) -> tuple[wire.Reply, ...]:
    """Capture and restore (with the native checkpoint between when `native`): the SAVE
    and LOAD replies."""
    replies = {}
    for op in CAPTURE:
        replies[op] = c.ok(op)
    if native:
        spawn, namespace, w = native
        assert native_checkpoint_restore(spawn, namespace, [w.pid]) == [2]
    for op in RESTORE:
        replies[op] = c.ok(op)
    return replies[Op.SAVE_ALLOCATIONS], replies[Op.LOAD_ALLOCATIONS]


# The four shapes of docs/benchmarks.md (1 x 8 GiB, 100 x 20 MiB, 96 x 6 MiB, 2048 x 2 MiB),
# in allocations of granules (2 MiB in the simulator), scaled down to seconds.
SHAPES = {
    "one-large": [16],
    "20MiB": [10] * 4,
    "6MiB": [3] * 8,
    "2MiB": [1] * 24,
}


@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
def test_round_trip_every_shape(
    spawn: Spawn, control_dir: Path, sim_namespace: str, shape: str
) -> None:
    """The copies are pinned before the first SAVE; the first SAVE hashes and copies every
    byte straight into them (no bounce buffer: no memcpy), the next one, nothing changed,
    copies nothing; every byte back after each LOAD, with the native checkpoint between.
    STATUS states the host memory: the allocations' sizes, plus 16 bytes a chunk."""
    creator = spawn(extra={**KEEP, "SNAPSHOT_SHIM_TIMING": "1"})
    sizes = SHAPES[shape]
    gran = make_shared(creator, sizes, seed=300)
    assert gran == CHUNK
    total = sum(sizes) * gran
    c = Shim(control_dir, creator.pid)
    held = wait_pinned(c, len(sizes))
    assert (held.bytes, held.overhead) == (total, 16 * (total // CHUNK + len(sizes)))
    before = digests(creator)
    save, load = cycle(c, (spawn, sim_namespace, creator))
    first = host_copy(save)
    assert (first.hash, first.copied, first.unchanged) == (HashState.FIRST, total, 0)
    assert (save.stats.count, save.stats.bytes) == (len(sizes), total)
    assert host_copy(load).copied == total
    assert digests(creator) == before
    save, load = cycle(c)
    again = host_copy(save)
    assert (again.hash, again.copied, again.unchanged) == (HashState.COMPARED, 0, total)
    assert (save.stats.count, save.stats.bytes) == (len(sizes), total)
    assert digests(creator) == before
    assert status(c).bytes == total  # kept across cycles, nothing more
    log = finish(creator)
    timed = [line.split(" ", 1)[1] for line in log.splitlines()
             if line.startswith("cuinterpose-timing ")]  # fmt: skip
    saves = [t for t in map(json.loads, timed) if t["op"] == "SAVE_ALLOCATIONS"]
    assert [(t["kept"], t["bytes_copied"], t["hash"]) for t in saves] == [
        (True, total, "first"),
        (True, 0, "compared"),
    ]
    # Straight DMA: nothing went through a bounce buffer, nothing was faulted in.
    assert all(t["thread_s"]["memcpy"] == 0 and t["populate_method"] == "none" for t in saves)
    assert "warning" not in log


def test_rewritten_allocation_alone_is_copied(spawn: Spawn, control_dir: Path) -> None:
    """After one allocation is rewritten, the next SAVE copies its chunks only, and the
    summary (HOST_COPY) says how much it left."""
    creator = spawn(extra=KEEP)
    sizes = [4, 2, 5, 1]
    gran = make_shared(creator, sizes, seed=500)
    total = sum(sizes) * gran
    c = Shim(control_dir, creator.pid)
    wait_pinned(c, len(sizes))
    cycle(c)
    creator("h, va, size, _ = A[2]; fill(va, size, 4242); A[2] = (h, va, size, 4242)")
    after = digests(creator)
    save, _ = cycle(c)
    kept = host_copy(save)
    assert (kept.hash, kept.copied, kept.unchanged) == (
        HashState.COMPARED, 5 * gran, total - 5 * gran
    )  # fmt: skip
    assert digests(creator) == after
    # Half of one chunk rewritten: that chunk alone.
    creator("h, va, size, _ = A[0]; check(cu.cuMemcpyHtoD(va + gran + 7, bytes(1000), 1000))")
    after = digests(creator)
    save, _ = cycle(c)
    assert (host_copy(save).copied, host_copy(save).unchanged) == (gran, total - gran)
    assert digests(creator) == after
    assert "warning" not in finish(creator)


FLIP = """
import random as _r
_rng = _r.Random({seed})
touched = set()
for _ in range({flips}):
    k = _rng.randrange(len(A))
    h, va, size, _s = A[k]
    off = _rng.randrange(size)
    buf = (ctypes.c_ubyte * 1)()
    check(cu.cuMemcpyDtoH(ctypes.addressof(buf), va + off, 1))
    new = bytes([buf[0] ^ _rng.randrange(1, 256)])
    check(cu.cuMemcpyHtoD(va + off, new, 1))
    touched.add((k, off // gran))
result = sorted(touched)
"""


@pytest.mark.threads  # make tsan: the keeper beside the ops
def test_random_flips_are_every_one_copied(spawn: Spawn, control_dir: Path) -> None:
    """Between cycles, one to three bytes at random offsets of random allocations take
    another value: each SAVE copies exactly the chunks they lie in (the hash missed none),
    and after each LOAD every byte is what the application wrote."""
    creator = spawn(extra=KEEP)
    sizes = [3, 1, 4, 1, 5, 2]
    gran = make_shared(creator, sizes, seed=700)
    total = sum(sizes) * gran
    c = Shim(control_dir, creator.pid)
    wait_pinned(c, len(sizes))
    cycle(c)
    rng = random.Random(47)
    for n in range(25):
        touched = creator(FLIP.format(seed=rng.randrange(1 << 30), flips=rng.randrange(1, 4)))
        after = digests(creator)
        save, _ = cycle(c)
        kept = host_copy(save)
        assert kept.hash == HashState.COMPARED, n
        assert (kept.copied, kept.unchanged) == (
            len(touched) * gran, total - len(touched) * gran
        ), (n, touched)  # fmt: skip
        assert digests(creator) == after, n
    assert "warning" not in finish(creator)


@pytest.mark.parametrize(
    ("helper", "first", "call", "result"),
    [
        ("cuinterposeSimFailModule", True, "cuModuleLoadData of the hash kernel", "INVALID_PTX"),
        ("cuinterposeSimFailLaunch", False, "cuLaunchKernel of the hash kernel", "LAUNCH_FAILED"),
    ],
    ids=["load", "launch"],
)
def test_hash_failure_copies_everything_and_says_why(
    spawn: Spawn, control_dir: Path, helper: str, first: bool, call: str, result: str
) -> None:
    """The kernel does not load (the first SAVE) or does not launch (a later one): that
    SAVE copies every byte, its reply says why and its record says so (UNAVAILABLE), the
    log too; the bytes come back; the next SAVE hashes again (copying every byte once more,
    since the copy's hashes were dropped), and the one after copies nothing."""
    code = {"INVALID_PTX": 218, "LAUNCH_FAILED": 719}[result]
    arm = f"ctypes.CDLL('libcuda.so.1').{helper}(0, {{}}); result = None"
    creator = spawn(extra=KEEP)
    if first:  # before the shim loads the kernel ahead, and at every load until disarmed
        creator(arm.format(code))
    sizes = [2, 3]
    gran = make_shared(creator, sizes, seed=900)
    total = sum(sizes) * gran
    c = Shim(control_dir, creator.pid)
    wait_pinned(c, len(sizes))
    if not first:
        cycle(c)
        creator(arm.format(code))
    creator("h, va, size, _ = A[1]; fill(va, size, 77); A[1] = (h, va, size, 77)")
    after = digests(creator)
    save, _ = cycle(c)
    if first:
        creator(arm.format(0))
    kept = host_copy(save)
    assert (kept.hash, kept.copied, kept.unchanged) == (HashState.UNAVAILABLE, total, 0)
    assert re.fullmatch(
        rf"SAVE_ALLOCATIONS copied every byte of the kept host copies: {call}.* failed: "
        rf"CUDA_ERROR_{result}",
        save.message,
    ), save.message
    assert digests(creator) == after
    save, _ = cycle(c)
    assert (host_copy(save).hash, host_copy(save).copied) == (HashState.FIRST, total)
    save, _ = cycle(c)
    assert (host_copy(save).hash, host_copy(save).copied) == (HashState.COMPARED, 0)
    assert digests(creator) == after
    log = finish(creator)
    assert f"SAVE_ALLOCATIONS copies every byte of the kept host copies: {call}" in log, log


def test_freed_allocation_gives_its_copy_back(spawn: Spawn, control_dir: Path) -> None:
    """The copies follow the allocations: one released (unmapped and released) loses its
    copy, a new one gets one, while the application runs; the host memory STATUS states is
    the live allocations' sizes throughout."""
    creator = spawn(extra=KEEP)
    sizes = [2, 3, 1]
    gran = make_shared(creator, sizes, seed=1100)
    c = Shim(control_dir, creator.pid)
    assert wait_pinned(c, 3).bytes == 6 * gran
    creator("h, va, size, _ = A.pop(1); check(cu.cuMemUnmap(va, size)); check(cu.cuMemRelease(h))")
    assert wait_pinned(c, 2).bytes == 3 * gran
    creator(
        "h = check(cu.cuMemCreate(4 * gran, prop(), 0)); va = map_rw(h, 4 * gran); "
        "fill(va, 4 * gran, 5); A.append((h, va, 4 * gran, 5))"
    )
    assert wait_pinned(c, 3).bytes == 7 * gran
    after = digests(creator)
    save, _ = cycle(c)
    assert host_copy(save).copied == 7 * gran
    assert digests(creator) == after
    assert "warning" not in finish(creator)


def test_off_by_default(spawn: Spawn, control_dir: Path) -> None:
    """Without the setting: no HOST_COPY record anywhere, nothing pinned for it."""
    creator = spawn()
    make_shared(creator, [2], seed=1)
    c = Shim(control_dir, creator.pid)
    assert wire.HostCopy.in_reply(c.ok(Op.STATUS).records) is None
    save, load = cycle(c)
    assert wire.HostCopy.in_reply(save.records) is None
    assert wire.HostCopy.in_reply(load.records) is None
    finish(creator)


@pytest.mark.slow
def test_suspend_summary_and_status_through_the_cli(
    spawn: Spawn,
    shim_env: dict[str, str],
    plain_env: dict[str, str],
    control_dir: Path,
    tmp_path: Path,
) -> None:
    """`cuinterpose status` states the host memory the kept copies hold; a second suspend,
    nothing written in between, says (JSON and human) that it copied nothing and left every
    byte; the group comes back intact."""
    from tests.shim.agentgroup import build_group
    from tests.shim.test_agent import process_args, run_cli, status_json

    group = build_group(spawn, {**shim_env, **KEEP}, plain_env)
    env = dict(plain_env)
    deadline = time.monotonic() + PIN_WAIT_S
    while (row := status_json(group, control_dir, env)[group.pids[0]]).get("host_copy") is None or (
        row["host_copy"]["copies"] < 2
    ):
        assert time.monotonic() < deadline, row
        time.sleep(0.05)
    assert row["host_copy"]["bytes"] == 2 * group.size  # the shared X and the private P
    ckpt = tmp_path / "ckpt"
    common = ["--checkpoint-dir", str(ckpt), "--control-dir", str(control_dir)]
    for n in range(2):
        run = run_cli(["suspend", *common, *process_args(group), "--progress", "json"], env)
        assert run.returncode == 0, run.stderr
        staging = json.loads(run.stdout.splitlines()[-1])["staging"]
        copied = 0 if n else 2 * group.size
        assert (staging["kept"], staging["bytes_copied"], staging["bytes_unchanged"]) == (
            True, copied, 2 * group.size - copied
        ), staging  # fmt: skip
        run = run_cli(["resume", *common, *process_args(group)], env)
        assert run.returncode == 0, run.stderr
        assert group.mismatches() == []
    run = run_cli(["suspend", *common, *process_args(group), "--progress", "human"], env)
    assert run.returncode == 0, run.stderr
    assert "kept host copies: 0 B copied, 8.00 MiB unchanged" in run.stdout, run.stdout
    # Suspended: the copies hold the bytes, giving them back is refused, naming why.
    where = ["--control-dir", str(control_dir), *process_args(group)]
    run = run_cli(["host-copy", *where, "--give-back"], env)
    assert run.returncode == 1 and "HOST_COPY answered WRONG_PHASE" in run.stderr, run.stderr
    assert run_cli(["resume", *common, *process_args(group)], env).returncode == 0
    assert group.mismatches() == []
    # Given back by request: nothing held, the mode off; turned on again: pinned again.
    run = run_cli(["host-copy", *where, "--give-back"], env)
    assert run.returncode == 0, run.stderr
    assert "kept host copy off, every copy given back" in run.stdout, run.stdout
    assert status_json(group, control_dir, env)[group.pids[0]].get("host_copy") is None
    run = run_cli(["host-copy", *where, "--json"], env)
    assert run.returncode == 0, run.stderr
    while (row := status_json(group, control_dir, env)[group.pids[0]]).get("host_copy") is None or (
        row["host_copy"]["copies"] < 2
    ):
        assert time.monotonic() < deadline + PIN_WAIT_S, row
        time.sleep(0.05)
    group.close()


def test_a_copy_the_host_cannot_spare_is_not_pinned_and_says_so(
    spawn: Spawn, control_dir: Path
) -> None:
    """A copy is pinned only while the host keeps 1/16 of its memory (at least 1 GiB)
    available after it (SNAPSHOT_SHIM_TEST_HOST_AVAILABLE_MIB stands for /proc/meminfo):
    with 1030 MiB available, 2 MiB is pinned and 10 MiB is not. The one not pinned goes
    through the staging memory every cycle, the log says why; STATUS counts only what is
    pinned; every byte comes back."""
    shimenv.needs_test_hooks("SNAPSHOT_SHIM_TEST_HOST_AVAILABLE_MIB")
    creator = spawn(extra={**KEEP, "SNAPSHOT_SHIM_TEST_HOST_AVAILABLE_MIB": "1030"})
    gran = make_shared(creator, [1, 5], seed=1300)
    c = Shim(control_dir, creator.pid)
    held = wait_pinned(c, 1)
    assert held.bytes == gran
    after = digests(creator)
    for n in range(2):
        save, _ = cycle(c)
        kept = host_copy(save)
        assert (kept.copied, kept.unchanged) == ((5 + (0 if n else 1)) * gran, gran if n else 0)
        assert digests(creator) == after
    assert status(c) == held
    log = finish(creator)
    assert re.search(
        r"kept host copy not pinned \(its allocation goes through the staging memory\): "
        rf"pinning {5 * gran} bytes would leave \d+ of the host's {1030 * MIB} bytes available, "
        rf"less than the {1 << 30} the kept host copy leaves free",
        log,
    ), log
    assert f"an allocation of {5 * gran} bytes has no kept host copy" in log


@pytest.mark.threads  # make tsan: the keeper beside the ops
def test_host_copy_request_turns_the_mode_on_and_gives_everything_back(
    spawn: Spawn, control_dir: Path
) -> None:
    """HOST_COPY over the wire, in a process started without the setting: KEEP pins a copy
    of every allocation in the background (the next SAVE hashes them, the one after copies
    nothing); GIVE_BACK frees every copy and turns the mode off (STATUS and SAVE carry no
    HOST_COPY record any more); outside ACTIVE it is WRONG_PHASE and changes nothing; a
    request asking anything else is BAD_REQUEST."""
    from tests.shim.test_control import header

    creator = spawn(extra={"SNAPSHOT_SHIM_COPY_THREADS": "3"})
    sizes = [2, 3]
    gran = make_shared(creator, sizes, seed=1500)
    total = sum(sizes) * gran
    c = Shim(control_dir, creator.pid)
    assert wire.HostCopy.in_reply(c.ok(Op.STATUS).records) is None
    after = digests(creator)
    assert host_copy(c.ok(Op.HOST_COPY)).hash == HashState.NOT_SAVED
    assert wait_pinned(c, 2).bytes == total
    save, _ = cycle(c)
    assert (host_copy(save).hash, host_copy(save).copied) == (HashState.FIRST, total)
    save, _ = cycle(c)
    assert (host_copy(save).hash, host_copy(save).copied) == (HashState.COMPARED, 0)
    assert digests(creator) == after
    for op in CAPTURE:  # PREPARED: the copies hold the staged bytes
        c.ok(op)
    refused = c.call(Op.HOST_COPY, give_back=True)
    assert (refused.status, refused.phase) == (Status.WRONG_PHASE, Phase.PREPARED)
    for op in RESTORE:
        c.ok(op)
    assert digests(creator) == after
    given = host_copy(c.ok(Op.HOST_COPY, give_back=True))
    assert (given.bytes, given.count) == (0, 0)
    assert wire.HostCopy.in_reply(c.ok(Op.STATUS).records) is None
    save, _ = cycle(c)
    assert wire.HostCopy.in_reply(save.records) is None
    assert digests(creator) == after
    me = c.participant.encode()
    for asked in (0, 3):
        got = shimenv.raw_exchange(
            c.path, bytes(header(op=Op.HOST_COPY, participant=me, stat_count=asked))
        )
        assert struct.unpack_from("<i", got, 8)[0] == Status.BAD_REQUEST, asked
    with pytest.raises(wire.WireError, match="gives host copies back"):
        wire.Request(Op.STATUS, give_back=True).encode()
    assert "warning" not in finish(creator)
