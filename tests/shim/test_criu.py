"""The round trip through CRIU on real shims and the simulated driver (specs/criu.md).

A creator and an importer sharing memory, in one process tree
(tests/shim/workers/criu_tree.py), suspended, dumped by CRIU (which kills them),
restored by CRIU and resumed: every byte at its VA in both, the importer's write
reaching the creator, a new share working, the shims ACTIVE at their published
paths with no lease left. Through the library, through ``cuinterpose criu`` into a
fresh control directory, and through plain ``criu`` driving the action script.

Needs a usable CRIU (>= 4.0, ``criu check`` passing: root): ``$CUINTERPOSE_CRIU`` or
``criu`` on PATH (tools/build_criu.sh); skipped with the reason otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cuinterpose.demo import Worker, pattern_digest
from cuinterpose.demo.scenario import pattern
from cuinterpose.engine import agent, criu, stored
from cuinterpose.engine.errors import CoordinatorError
from cuinterpose.engine.gpus import GpuMap
from cuinterpose.engine.options import default_stored_parts

from tests.shim import legacy
from tests.shim.agentgroup import RemapBackend, WorkerBackend, devices_of
from tests.shim.workers.criu_tree import Tree, TreeGroup, subreaper, thread_states
from tests.simenv import REPO, Spawn

# Dumps and restores whole process trees with CRIU: longer than the default timeout.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

# What the action script needs of this environment: the simulated driver (and the
# sanitizer runtime it is built with) for its native calls.
SIM_VARIABLES = (
    "LD_LIBRARY_PATH",
    "LD_PRELOAD",
    "ASAN_OPTIONS",
    "UBSAN_OPTIONS",
    "CUINTERPOSE_SIM_NAMESPACE",
    "CUINTERPOSE_SIM_DEVICES",
)


@pytest.fixture(scope="session")
def criu_binary() -> criu.Criu:
    try:
        return criu.usable_criu()
    except criu.CriuUnavailable as exc:
        pytest.skip(f"no usable CRIU: {exc}")


@pytest.fixture
def observer(spawn: Spawn, plain_env: dict[str, str]) -> Worker:
    """A plain process on the simulated driver: the native checkpoint calls."""
    return spawn("observer", plain_env)


@pytest.fixture
def group(
    criu_binary: criu.Criu, shim_env: dict[str, str], observer: Worker, tmp_path: Path
) -> Iterator[TreeGroup]:
    root_env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    size = 2 * int(observer.check("granularity")["granularity"])
    with subreaper():
        # SMALL owned too: share_legacy shares it by legacy IPC.
        env = {**shim_env, **legacy.OWN_SMALL}
        tree = Tree(["creator", "importer"], env, tmp_path, root_env=root_env)
        try:
            tree.wait_ready()
            yield TreeGroup(tree, size)
        finally:
            tree.close()


def run_cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    if "--proc-root" not in args:  # else the control directory comes from the environment
        env = {k: v for k, v in env.items() if k != "SNAPSHOT_CONTROL_DIR"}
    return subprocess.run(
        [sys.executable, "-m", "cuinterpose", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def process_args(group: TreeGroup) -> list[str]:
    return [w for p in group.tree.pids() for w in ("--process", str(p), str(p))]


def gone(pids: list[int]) -> bool:
    return not any(Path(f"/proc/{p}").exists() for p in pids)


def assert_sharing_back(
    group: TreeGroup, where: agent.Where, native: WorkerBackend, seed_x: int = TreeGroup.SEED_X
) -> None:
    """Bytes at their VAs (X's of ``seed_x``), the importer's write reaching the creator, a
    new share, and each shim ACTIVE at its published path, holding no lease (no pidfd)."""
    assert group.mismatches(seed_x) == []
    size = group.size
    group.importer.check("fill", va=group.importer_x, size=size, seed=5)
    assert group.creator.digest(group.creator_x, size) == pattern_digest(5, size)
    handle, _ = group.creator.create_mapped(size, seed=9)
    assert group.importer.digest(group.share(handle), size) == pattern_digest(9, size)
    rows = agent.status(group.processes, where, native)
    assert {(r.native_state, r.shim_phase) for r in rows} == {("RUNNING", "ACTIVE")}, rows
    for path in (where.endpoint(agent.Process(p, p)).path for p in group.tree.pids()):
        assert stat.S_ISSOCK(os.lstat(path).st_mode), path
    for worker in (group.creator, group.importer):
        fds = worker.check("fds")["fds"]
        assert not [t for t in fds.values() if "pidfd" in t], fds


# What the importer writes into X before the dump (test_a_sharing_group_...).
SEED_W = 73


def window(seed: int, size: int) -> bytes:
    """64 bytes from inside the fill pattern of ``seed``: found wherever its bytes are."""
    return next(pattern(seed, size))[4096 : 4096 + 64]


@pytest.mark.parametrize("beside", [True, False], ids=["bytes-beside", "bytes-in-images"])
def test_a_sharing_group_goes_through_criu_dump_and_restore(
    group: TreeGroup,
    criu_binary: criu.Criu,
    observer: Worker,
    control_dir: Path,
    tmp_path: Path,
    beside: bool,
) -> None:
    """By default the creator's staged X and P go to its file of the checkpoint directory
    (STORE_STAGED) and its image holds none of their bytes (X's, written by the importer
    just before, are the probe: nothing else of the creator's ever held them); with the
    bytes in the images (``bytes_beside=False``) no file is written and the image holds
    them. Either way every byte is back after the restore."""
    native = WorkerBackend(observer)
    where = agent.Where(control_dir)
    ckpt, images = tmp_path / "ckpt", tmp_path / "images"
    pids = group.tree.pids()
    steps: list[agent.AgentEvent] = []
    group.importer.check("fill", va=group.importer_x, size=group.size, seed=SEED_W)
    dumped = criu.dump(
        group.processes,
        ckpt,
        images,
        tree=group.tree.root_pid,
        criu=criu_binary,
        where=where,
        native=native,
        on_event=steps.append,
        bytes_beside=beside,
    )
    assert [t.step for t in dumped.timings] == [
        "detect",
        "capture",
        "native_lock",
        "native_checkpoint",
        *(["store_staged"] if beside else []),
        "criu_dump",
    ]
    assert dumped.manifest.prepared
    group.tree.reap()  # criu dump killed the tree
    assert gone([group.tree.root_pid, *pids])
    files = stored.stored_files(ckpt)
    # Each process's parts (the importer's hold no allocation: headers alone).
    assert len(files) == (2 * default_stored_parts() if beside else 0)
    # Only the shim's staging can have put SEED_W's bytes in the creator's memory (the
    # importer wrote them); its pages image is the one with P's (its own fill's copies).
    pages = [p.read_bytes() for p in images.glob("pages-*.img")]
    (creator_pages,) = [b for b in pages if window(TreeGroup.SEED_P, group.size) in b]
    probe = window(SEED_W, group.size)
    assert (probe in creator_pages) is not beside
    assert any(probe in f.read_bytes() for f in files) is beside
    if beside:
        assert dumped.timings[4].bytes == 2 * group.size

    try:
        restored = criu.restore(
            ckpt, images, criu=criu_binary, where=where, native=native, control_dir=control_dir
        )
    except (agent.AgentError, CoordinatorError) as exc:
        # What the restored processes' threads are doing says why a shim did not
        # answer (its listener heals the endpoint from poll: shim_c/control.c).
        pytest.fail(f"{exc}\nthreads:\n{thread_states(pids)}\ntree log:\n{group.tree.log_tail()}")
    assert [p.observed_pid for p in restored.processes] == pids
    assert [t.step for t in restored.timings] == [
        "criu_restore",
        "native_restore",
        "native_unlock",
        *(["fetch_staged"] if beside else []),
        "coordinator_restore",
    ]
    assert restored.resumed.coordinator_restored
    assert agent.read_manifest(ckpt).resumed_at
    done = {e.step for e in steps if isinstance(e, agent.StepEvent) and e.status == "done"}
    assert "criu_dump" in done
    # CRIU re-created each listener at its bind name; the shim published it again, and
    # says so only at debug level: the application's stderr is the workload's (issue 29).
    log = group.tree.log_tail(1 << 20)
    assert "control endpoint healed" not in log, log
    assert_sharing_back(group, where, native, seed_x=SEED_W)


def test_a_failed_dump_after_the_store_resumes_the_group_with_its_bytes(
    group: TreeGroup,
    criu_binary: criu.Criu,
    observer: Worker,
    control_dir: Path,
    tmp_path: Path,
) -> None:
    """``criu dump`` refused (an option CRIU does not know) after the staged bytes went
    to their files: the shims fetch them back and the group resumes, every byte right."""
    native = WorkerBackend(observer)
    where = agent.Where(control_dir)
    ckpt = tmp_path / "ckpt"
    steps: list[agent.AgentEvent] = []
    with pytest.raises(criu.CriuDumpFailed) as info:
        criu.dump(
            group.processes,
            ckpt,
            tmp_path / "images",
            tree=group.tree.root_pid,
            criu=criu_binary,
            where=where,
            native=native,
            criu_args=["--no-such-option"],
            on_event=steps.append,
        )
    assert info.value.restored, str(info.value)
    done = [e.step for e in steps if isinstance(e, agent.StepEvent) and e.status == "done"]
    # The resume of the failed dump fetched the stored bytes before its restore.
    after = done[done.index("store_staged") :]
    assert after.index("fetch_staged") < after.index("coordinator_restore"), done
    assert len(stored.stored_files(ckpt)) == 2 * default_stored_parts()
    assert_sharing_back(group, where, native)


def share_legacy(group: TreeGroup, seed: int) -> legacy.LegacyPair:
    """Owned cudaMalloc memory shared by legacy IPC (legacy.py) between the tree's creator
    and importer, beside their VMM sharing."""
    c, i = group.creator, group.importer
    vas = [int(c.check("alloc", size=n)["va"]) for n in (legacy.BIG, legacy.SMALL, legacy.PRIVATE)]
    for k, (va, n) in enumerate(zip(vas, (legacy.BIG, legacy.SMALL, legacy.PRIVATE), strict=True)):
        c.check("fill", va=va, size=n, seed=seed + k)
    opened = [int(i.check("ipc_open", handle=c.check("ipc_get", va=va)["handle"])["va"])
              for va in vas[:2]]  # fmt: skip
    return legacy.LegacyPair(c, i, vas[0], vas[1], vas[2], opened[0], opened[1], seed)  # type: ignore[arg-type]


def test_a_copied_checkpoint_is_restored_twice_onto_another_nodes_gpu(
    group: TreeGroup,
    criu_binary: criu.Criu,
    observer: Worker,
    spawn: Spawn,
    plain_env: dict[str, str],
    control_dir: Path,
    tmp_path: Path,
) -> None:
    """Dumped on GPU 0 of this node; the checkpoint directory and the images copied
    elsewhere and the originals removed; restored from the copy into an emptied control
    directory by a coordinator of another simulated node (CUINTERPOSE_SIM_NODE), onto
    its GPU 1 (--gpu-map 0=1); the group killed, and restored again from the same copy.
    Each time: every byte as dumped, every process on that GPU, sharing both ways (VMM
    and legacy IPC) and a new share."""
    pair = share_legacy(group, 81)
    native = RemapBackend(observer)
    node_b = spawn("observer-b", {**plain_env, "CUINTERPOSE_SIM_NODE": "node-b"})
    other = RemapBackend(node_b)
    there = other.gpus()
    assert there[1].uuid not in {g.uuid for g in native.gpus()}
    where = agent.Where(control_dir)
    ckpt, images = tmp_path / "ckpt", tmp_path / "images"
    pids = group.tree.pids()
    criu.dump(group.processes, ckpt, images, tree=group.tree.root_pid, criu=criu_binary,
              where=where, native=native)  # fmt: skip
    group.tree.reap()
    copy = tmp_path / "elsewhere"
    shutil.copytree(ckpt, copy / "ckpt", symlinks=True)
    shutil.copytree(images, copy / "images", symlinks=True)
    shutil.rmtree(ckpt)
    shutil.rmtree(images)
    for round_ in (1, 2):
        shutil.rmtree(control_dir)  # the restoring node's: nothing of the old one left
        try:
            restored = criu.restore(copy / "ckpt", copy / "images", criu=criu_binary,
                                    where=where, native=other, control_dir=control_dir,
                                    gpu_map=GpuMap.parse("0=1"))  # fmt: skip
        except (agent.AgentError, CoordinatorError) as exc:
            pytest.fail(f"round {round_}: {exc}\nthreads:\n{thread_states(pids)}\n"
                        f"tree log:\n{group.tree.log_tail()}")  # fmt: skip
        assert [p.observed_pid for p in restored.processes] == pids
        assert restored.resumed.coordinator_restored
        assert agent.read_manifest(copy / "ckpt").resumed_from_images
        for worker in (group.creator, group.importer):
            assert devices_of(worker, where) == [there[1].uuid], round_
        legacy.shared_both_ways(pair, write_seed=90 + 10 * round_)
        assert_sharing_back(group, where, other)
        os.killpg(group.tree.root_pid, signal.SIGKILL)  # gone before the next restore
        group.tree.reap()


def summary(run: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    lines = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert lines and lines[-1]["event"] == "summary", run.stdout
    return lines[-1]


def test_the_cli_verbs_restore_into_a_fresh_control_directory(
    group: TreeGroup,
    criu_binary: criu.Criu,
    observer: Worker,
    control_dir: Path,
    plain_env: dict[str, str],
    tmp_path: Path,
) -> None:
    ckpt, images = tmp_path / "ckpt", tmp_path / "images"
    common = ["--checkpoint-dir", str(ckpt), "--images-dir", str(images)]
    common += ["--control-dir", str(control_dir), "--criu", str(criu_binary.path)]
    dump = run_cli(
        ["criu", "dump", *common, "--tree", str(group.tree.root_pid), *process_args(group)],
        plain_env,
    )
    assert dump.returncode == 0, dump.stderr
    dumped = summary(dump)
    assert [t["phase"] for t in dumped["timings"]][-1] == "criu_dump"
    assert dumped["images"]["pages_bytes"] >= 2 * group.size
    group.tree.reap()
    # Restored on a node whose control directory is new: nothing of the old one is left.
    shutil.rmtree(control_dir)

    # After the restore the shims are reached through /proc/<pid>/root, as from outside
    # a container; before it, the directory as seen here.
    where = ["--proc-root", "/proc", "--before-restore-dir", str(control_dir)]
    paths = ["--checkpoint-dir", str(ckpt), "--images-dir", str(images)]
    restore = run_cli(  # the identity mapping given: the same GPUs, named
        ["criu", "restore", *paths, *where, "--criu", str(criu_binary.path), "--gpu-map", "0=0"],
        {**plain_env, "SNAPSHOT_CONTROL_DIR": str(control_dir)},
    )
    assert restore.returncode == 0, restore.stderr
    restored = summary(restore)
    assert [p["observed_pid"] for p in restored["processes"]] == group.tree.pids()
    assert stat.S_IMODE(control_dir.stat().st_mode) == 0o700
    assert_sharing_back(group, agent.Where(control_dir), WorkerBackend(observer))


def test_the_cli_verbs_take_relative_paths_and_the_printed_restore_works(
    group: TreeGroup,
    criu_binary: criu.Criu,
    observer: Worker,
    control_dir: Path,
    plain_env: dict[str, str],
    tmp_path: Path,
) -> None:
    """CRIU resolves -o and --pidfile against -D: relative directories, typed from a
    scratch directory, and the `next:` command as printed (issue 29)."""
    env = {k: v for k, v in plain_env.items() if k != "SNAPSHOT_CONTROL_DIR"}
    env["CUINTERPOSE_CRIU"] = str(criu_binary.path)
    common = ["--checkpoint-dir", "rc1/ck", "--images-dir", "rc1/img"]
    dump = subprocess.run(
        [sys.executable, "-m", "cuinterpose", "criu", "dump", *common, "--control-dir",
         str(control_dir), "--tree", str(group.tree.root_pid), *process_args(group)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert dump.returncode == 0, dump.stderr
    printed = summary(dump)["next"]
    assert printed == (f"cuinterpose criu restore --checkpoint-dir rc1/ck --images-dir rc1/img "
                       f"--control-dir {control_dir}")  # fmt: skip
    assert (tmp_path / "rc1" / "img" / criu.DUMP_LOG).is_file()
    group.tree.reap()
    bin_dir = Path(sys.executable).parent
    restore = subprocess.run(
        ["bash", "-c", printed], cwd=tmp_path, env={**env, "PATH": f"{bin_dir}:{env['PATH']}"},
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert restore.returncode == 0, restore.stderr
    assert (tmp_path / "rc1" / "ck" / criu.RESTORED_PIDFILE).is_file()
    assert_sharing_back(group, agent.Where(control_dir), WorkerBackend(observer))


def test_plain_criu_drives_the_action_script(
    group: TreeGroup,
    criu_binary: criu.Criu,
    observer: Worker,
    control_dir: Path,
    plain_env: dict[str, str],
    tmp_path: Path,
) -> None:
    ckpt, images, script = tmp_path / "ckpt", tmp_path / "images", tmp_path / "action"
    images.mkdir()
    keep = [w for name in SIM_VARIABLES for w in ("--keep-env", name)]
    wrote = run_cli(
        [
            "criu",
            "action-script",
            "--out",
            str(script),
            "--checkpoint-dir",
            str(ckpt),
            "--control-dir",
            str(control_dir),
            *process_args(group),
            *keep,
        ],
        plain_env,
    )
    assert wrote.returncode == 0, wrote.stderr
    base = [str(criu_binary.path), "-D", str(images), "--action-script", str(script), "-v4"]

    def run_criu(verb: str, *args: str) -> None:
        done = subprocess.run(
            [*base, verb, *args, "-o", f"{verb}.log"],
            env=criu.criu_env(plain_env),
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        log = (images / f"{verb}.log").read_text(errors="replace")
        assert done.returncode == 0, done.stderr + log[-3000:]

    run_criu("dump", "-t", str(group.tree.root_pid))
    manifest = agent.read_manifest(ckpt)  # pre-dump suspended the group
    assert manifest.prepared and not manifest.resumed_at
    assert manifest.images is not None  # post-dump sealed the images
    assert manifest.images.directory == str(images.resolve())
    group.tree.reap()
    run_criu("restore", "-d")
    assert agent.read_manifest(ckpt).resumed_at  # post-resume resumed it
    assert_sharing_back(group, agent.Where(control_dir), WorkerBackend(observer))


def test_a_restore_of_older_images_is_refused_and_the_newest_restores(
    group: TreeGroup,
    criu_binary: criu.Criu,
    observer: Worker,
    control_dir: Path,
    plain_env: dict[str, str],
    tmp_path: Path,
) -> None:
    """Dump to A, restore A, change the bytes, dump to B with the same checkpoint
    directory: a restore of A is refused before CRIU runs (the processes stay gone),
    naming both; B restores, with the changed bytes."""
    native = WorkerBackend(observer)
    where = agent.Where(control_dir)
    ckpt, first, second = tmp_path / "ckpt", tmp_path / "A", tmp_path / "B"
    pids = group.tree.pids()

    def dump(images: Path) -> None:
        criu.dump(group.processes, ckpt, images, tree=group.tree.root_pid, criu=criu_binary,
                  where=where, native=native)  # fmt: skip
        group.tree.reap()
        assert gone([group.tree.root_pid, *pids])
        assert stat.S_IMODE(images.stat().st_mode) == 0o700
        pages = [p for p in images.iterdir() if p.name.startswith("pages-")]
        assert pages and all(stat.S_IMODE(p.stat().st_mode) & 0o077 == 0 for p in pages)

    def restore(images: Path) -> None:
        criu.restore(ckpt, images, criu=criu_binary, where=where, native=native,
                     control_dir=control_dir)  # fmt: skip

    dump(first)
    restore(first)
    group.importer.check("fill", va=group.importer_x, size=group.size, seed=5)
    dump(second)
    refused = run_cli(
        ["criu", "restore", "--checkpoint-dir", str(ckpt), "--images-dir", str(first),
         "--control-dir", str(control_dir), "--criu", str(criu_binary.path), "--json"],
        plain_env,
    )  # fmt: skip
    assert refused.returncode == 1, refused.stderr
    assert f"the images in {first} are not the group's of {ckpt}" in refused.stderr
    assert f"records the images dumped to {second}" in refused.stderr, refused.stderr
    assert gone(pids)  # CRIU did not run
    restore(second)
    assert group.creator.digest(group.creator_x, group.size) == pattern_digest(5, group.size)


def test_the_criu_benchmark_runs_on_the_simulator(
    criu_binary: criu.Criu, stack: None, tmp_path: Path
) -> None:
    """bench/criu.py is what the H200 run executes (tests/gpu/run_criu_h200.sh)."""
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    out = tmp_path / "criu.json"
    args = ["--driver", "sim", "--mib", "4", "--criu", str(criu_binary.path), "--out", str(out)]
    run = subprocess.run(
        [sys.executable, str(REPO / "bench" / "criu.py"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(out.read_text())["group"]
    assert all(result["verified"].values()), result
    # The staged bytes beside the images: the creator's parts hold all of them, each
    # part's header padded to 4096 bytes.
    parts = result["stored_files"]
    assert result["bytes_beside"] and parts == 2 * default_stored_parts()
    assert result["gpu_bytes"] <= result["stored_bytes"] < result["gpu_bytes"] + (parts + 2) * 4096
    # Every allocation a process created is staged (specs/shim.md): the creator's
    # shared X and its private P, so all the GPU bytes.
    assert result["dump"]["steps"]["capture"]["bytes"] == result["gpu_bytes"]
    assert set(result["restore"]["steps"]) == {
        "criu_restore",
        "fetch_staged",
        "native_restore",
        "native_unlock",
        "coordinator_restore",
    }


def test_the_bundle_runs_criu_with_its_own_libraries(
    criu_binary: criu.Criu, tmp_path: Path
) -> None:
    """tools/bundle_criu.sh is how CRIU reaches the GPU machines (no network there)."""
    if criu_binary.path.read_bytes()[:4] != b"\x7fELF":
        pytest.skip(f"{criu_binary.path} is not the binary itself (a wrapper?)")
    dest = tmp_path / "bundle"
    made = subprocess.run(
        [str(REPO / "tools" / "bundle_criu.sh"), str(dest), str(criu_binary.path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert made.returncode == 0, made.stderr
    assert sum(f.stat().st_size for f in dest.rglob("*") if f.is_file()) < 40 << 20
    bundled = criu.usable_criu(dest / "criu")  # --version and `criu check` through it
    assert bundled.version == criu_binary.version
    assert any(p.name.startswith("ld-linux") for p in (dest / "lib").iterdir())


def test_a_refused_pre_dump_aborts_criu_dump_and_the_group_runs_on(
    group: TreeGroup,
    criu_binary: criu.Criu,
    observer: Worker,
    control_dir: Path,
    plain_env: dict[str, str],
    tmp_path: Path,
) -> None:
    ckpt, images, script = tmp_path / "ckpt", tmp_path / "images", tmp_path / "action"
    images.mkdir()
    keep = [w for name in SIM_VARIABLES for w in ("--keep-env", name)]
    creator = str(group.creator.pid)
    # Only the creator: its importer is outside the team, which the capture refuses
    # before anything changes (specs/recovery.md, whole teams only).
    args = ["criu", "action-script", "--out", str(script), "--checkpoint-dir", str(ckpt)]
    args += ["--control-dir", str(control_dir), "--process", creator, creator, *keep]
    assert run_cli(args, plain_env).returncode == 0
    argv = [str(criu_binary.path), "dump", "-t", str(group.tree.root_pid), "-D", str(images)]
    argv += ["--action-script", str(script), "-o", "dump.log"]
    dump = subprocess.run(
        argv,
        env=criu.criu_env(plain_env),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert dump.returncode != 0
    log = (images / "dump.log").read_text(errors="replace")  # the script's output too
    left_out = "imported this allocation and is not among the processes named"
    assert left_out in log and "Pre dump script failed" in log, log[-3000:]
    assert not (ckpt / agent.MANIFEST_FILE_NAME).exists()
    assert_sharing_back(group, agent.Where(control_dir), WorkerBackend(observer))
