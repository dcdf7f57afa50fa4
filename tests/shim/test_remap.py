"""A group restored onto another GPU (specs/restore.md, "Onto other GPUs"), on real shims and
the simulated driver with two devices.

The creator/importer group of agentgroup.py (a VMM allocation shared by FD, a private
one) also shares owned cudaMalloc memory by legacy IPC (legacy.py); suspended on GPU 0
and resumed with ``--gpu-map 0=1``: every byte at its VA, every allocation and context
of each process on what was GPU 1 (the driver keeps ordinals and changes the GPU behind
them), sharing live both ways and a new share opening. A native restore onto GPU 1 whose
coordinator restore is not told is refused by every shim's LOAD, naming the GPU, and
rolled back.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from cuinterpose.engine import agent
from cuinterpose.engine.gpus import GpuMap, uuid_text
from cuinterpose.engine.wire import Status

from tests.shim import legacy
from tests.shim.agentgroup import Group, RemapBackend, build_group, devices_of
from tests.simenv import Spawn

# What each process says of its context's device and the devices of its memory.
WHERE = """
dev = check(cu.cuCtxGetDevice())
result = bytes(check(cu.cuDeviceGetUuid(dev)).bytes).hex()
"""


@pytest.fixture
def group(spawn: Spawn, shim_env: dict[str, str], plain_env: dict[str, str]) -> Group:
    return build_group(spawn, {**shim_env, **legacy.OWN_SMALL}, plain_env)


def share_legacy(group: Group, seed: int) -> legacy.LegacyPair:
    """The legacy IPC sharing of legacy.py, between the group's creator and importer."""
    c, i = group.creator, group.importer
    big = int(c.check("alloc", size=legacy.BIG)["va"])
    small = int(c.check("alloc", size=legacy.SMALL)["va"])
    private = int(c.check("alloc", size=legacy.PRIVATE)["va"])
    sizes = (legacy.BIG, legacy.SMALL, legacy.PRIVATE)
    for k, (va, size) in enumerate(zip((big, small, private), sizes, strict=True)):
        c.check("fill", va=va, size=size, seed=seed + k)
    opened = [
        int(i.check("ipc_open", handle=c.check("ipc_get", va=va)["handle"])["va"])
        for va in (big, small)
    ]
    return legacy.LegacyPair(c, i, big, small, private, opened[0], opened[1], seed)


@pytest.mark.slow
def test_resumed_onto_gpu_1_with_its_bytes_and_its_sharing(
    group: Group, control_dir: Path, tmp_path: Path
) -> None:
    pair = share_legacy(group, 81)
    native = RemapBackend(group.observer)
    here = native.gpus()
    gpu0, gpu1 = here[0].uuid, here[1].uuid
    where = agent.Where(control_dir)
    workers = (group.creator, group.importer)
    assert {u for w in workers for u in devices_of(w, where)} == {gpu0}
    done = agent.suspend(group.processes, tmp_path, where=where, native=native)
    recorded = json.loads((tmp_path / "manifest.json").read_text())["participants"]
    assert [[g["uuid"] for g in p["gpus"]] for p in recorded] == [[gpu0], [gpu0]]
    creator_gpus = done.manifest.participants[0].gpus
    assert creator_gpus[0].ordinal == 0 and creator_gpus[0].bytes >= 2 * group.size

    resumed = agent.resume(tmp_path, where=where, native=native, gpu_map=GpuMap.parse("0=1"))
    assert resumed.coordinator_restored
    assert group.mismatches() == []
    for worker in workers:  # contexts and every allocation the shim tracks: GPU 1 now
        assert uuid_text(bytes.fromhex(worker(WHERE))) == gpu1
        assert devices_of(worker, where) == [gpu1]
    legacy.shared_both_ways(pair, write_seed=91)
    group.close()


@pytest.mark.slow
def test_a_native_remap_the_shims_are_not_told_of_is_refused_at_load(
    group: Group, control_dir: Path, tmp_path: Path
) -> None:
    """The native restore puts the group on GPU 1, the coordinator restore is given no
    mapping: every shim's LOAD names the GPU that moved, nothing is re-created, the run
    rolls back and the group runs on GPU 1 with its bytes."""
    native = RemapBackend(group.observer)
    here = native.gpus()
    where = agent.Where(control_dir)
    agent.suspend(group.processes, tmp_path, where=where, native=native)
    pairs = ((here[0].uuid, here[1].uuid),)

    class Untold(RemapBackend):
        def restore(self, pid: int) -> None:
            self.restore_onto(pid, pairs)

    with pytest.raises(agent.ResumeFailed) as failed:
        agent.resume(tmp_path, where=where, native=Untold(group.observer))
    text = "\n".join(failed.value.lines())
    assert "LOAD_ALLOCATIONS refused: GPU ordinal 0 was " + here[0].uuid in text, text
    assert f"names {here[1].uuid} now" in text, text
    assert failed.value.running, text
    assert group.mismatches() == []
    group.close()


def run_cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in env.items() if k != "SNAPSHOT_CONTROL_DIR"}
    return subprocess.run(
        [sys.executable, "-m", "cuinterpose", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.slow
def test_the_cli_refuses_a_map_missing_a_gpu_then_resumes_onto_gpu_1_by_uuid(
    group: Group, control_dir: Path, plain_env: dict[str, str], tmp_path: Path
) -> None:
    """`cuinterpose resume --gpu-map` with the command line's own native calls (the
    simulated driver's gpuPairs through cuda.bindings): a map naming GPU 1 alone is
    refused naming GPU 0, nothing changed; then GPU 0's UUID onto GPU 1's."""
    here = RemapBackend(group.observer).gpus()
    where = agent.Where(control_dir)
    ckpt = tmp_path / "ckpt"
    common = ["--checkpoint-dir", str(ckpt), "--control-dir", str(control_dir)]
    common += [w for p in group.pids for w in ("--process", str(p), str(p))]
    assert run_cli(["suspend", *common, "--progress", "none"], plain_env).returncode == 0
    refused = run_cli(["resume", *common, "--progress", "none", "--gpu-map", "1=0"], plain_env)
    assert refused.returncode == 1, refused.stderr
    assert f"GPU 0 {here[0].uuid}" in refused.stderr and "is missing" in refused.stderr
    assert "1 is no GPU the group used" in refused.stderr
    # A target that is not here: that one reason, not also "GPU 0 is missing" (issue 49).
    refused = run_cli(["resume", *common, "--progress", "none", "--gpu-map", "0=5"], plain_env)
    assert refused.returncode == 1, refused.stderr
    assert "5 is no GPU here" in refused.stderr and "is missing" not in refused.stderr, (
        refused.stderr
    )
    mapped = f"{here[0].uuid}={here[1].uuid}"
    done = run_cli(["resume", *common, "--progress", "json", "--gpu-map", mapped], plain_env)
    assert done.returncode == 0, done.stderr
    assert group.mismatches() == []
    for worker in (group.creator, group.importer):
        assert uuid_text(bytes.fromhex(worker(WHERE))) == here[1].uuid
        assert devices_of(worker, where) == [here[1].uuid]
    # The summary says where each process went, in JSON and for a person.
    moved = json.loads(done.stdout.splitlines()[-1])["gpus_moved"]
    assert [(m["pid"], m["ns_pid"]) for m in moved] == [(p, p) for p in group.pids]
    for m in moved:
        assert [(g["left"]["uuid"], g["now"]["uuid"]) for g in m["gpus"]] == [
            (here[0].uuid, here[1].uuid)
        ]
        assert [(g["left"]["ordinal"], g["now"]["ordinal"]) for g in m["gpus"]] == [(0, 1)]
    assert run_cli(["suspend", *common, "--progress", "none"], plain_env).returncode == 0
    home = f"{here[1].uuid}={here[0].uuid}"
    back = run_cli(["resume", *common, "--progress", "human", "--gpu-map", home], plain_env)
    assert back.returncode == 0, back.stderr
    for pid in group.pids:  # the ordinal each had in its own process, the UUID of the GPU
        said = re.compile(rf"onto other GPUs: pid {pid} \(ns pid {pid}\): left GPU \d+ "
                          rf"{here[1].uuid}.*, runs on GPU 0 {here[0].uuid}")  # fmt: skip
        assert said.search(back.stdout), back.stdout
    assert group.mismatches() == []
    for worker in (group.creator, group.importer):
        assert devices_of(worker, where) == [here[0].uuid]
    group.close()


@pytest.mark.slow
def test_a_group_on_both_gpus_swaps_them(
    spawn: Spawn, shim_env: dict[str, str], plain_env: dict[str, str], control_dir: Path,
    tmp_path: Path,
) -> None:  # fmt: skip
    """A creator on GPU 0 sharing cudaMalloc memory with an importer on GPU 1 (which
    reaches it through its access descriptor): --gpu-map 0=1,1=0 puts each on the other
    GPU, their bytes and sharing as before."""
    observer = spawn("observer", plain_env)
    creator = spawn("creator", {**shim_env, **legacy.OWN_SMALL})
    importer = spawn("importer", {**shim_env, **legacy.OWN_SMALL}, device=1)
    pair = share_legacy(Group(creator, importer, observer, 0), 61)
    native = RemapBackend(observer)
    here = native.gpus()
    where = agent.Where(control_dir)
    assert devices_of(creator, where) == [here[0].uuid]
    assert devices_of(importer, where) == [here[0].uuid, here[1].uuid]
    group = [(p, p) for p in pair.pids]
    agent.suspend(group, tmp_path, where=where, native=native)
    agent.resume(tmp_path, where=where, native=native, gpu_map=GpuMap.parse("0=1,1=0"))
    assert devices_of(creator, where) == [here[1].uuid]
    assert devices_of(importer, where) == [here[1].uuid, here[0].uuid]
    assert uuid_text(bytes.fromhex(importer(WHERE))) == here[0].uuid
    legacy.shared_both_ways(pair, write_seed=71)


GOOD = "GPU-00112233-4455-6677-8899-aabbccddeeff"


@pytest.mark.parametrize(
    "mapping",
    [
        "GPU-" + GOOD[4:].upper() + "=" + GOOD,  # upper-case hex digits
        GOOD[:12] + "x" + GOOD[13:] + "=" + GOOD,  # a dash where none belongs
        GOOD[:20] + "\0" + GOOD[21:] + "=" + GOOD,  # a NUL inside a UUID
        GOOD + "=" + GOOD[:-1] + "g",  # a digit that is no hex digit
        GOOD + "=" + GOOD + ",",  # a pair promised, none given
    ],
    ids=["upper", "dash", "nul", "not-hex", "trailing-comma"],
)
def test_a_malformed_gpu_mapping_is_refused_before_anything_is_loaded(
    spawn: Spawn, control_dir: Path, mapping: str
) -> None:
    """LOAD_ALLOCATIONS' GPU mapping is hostile input: every malformed UUID is
    BAD_REQUEST naming the mapping's form, nothing re-created; LOAD without one then
    brings every byte back."""
    from tests.shim.test_content import finish, intact, make_shared
    from tests.shim.test_control import CAPTURE, RESTORE, Shim

    creator = spawn()
    make_shared(creator, [1, 2], seed=60)
    c = Shim(control_dir, creator.pid)
    for op in CAPTURE:
        c.ok(op)
    refused = c.call(RESTORE[0], gpu_map=mapping)
    assert refused.status == Status.BAD_REQUEST, (refused.status, refused.message)
    assert "is not OLD=NEW[,OLD=NEW...]" in refused.message, refused.message
    for op in RESTORE:
        c.ok(op)
    assert intact(creator)
    assert "warning" not in finish(creator)
