"""Issues 32 and 33 on real GPUs: PyTorch jobs (tests/gpu/torch_ipc_job.py) suspended on
GPU 0 and resumed with ``--gpu-map`` onto GPU ``$CUINTERPOSE_REMAP_TO`` (default 0: the
identity mapping given explicitly, on one GPU; 1 on two GPUs: the move).

- a ``torch.multiprocessing`` pair, default allocator (owned cudaMalloc memory, legacy
  IPC) and with expandable segments (VMM, POSIX FD): suspended and resumed once without
  a mapping (the reference time), then with the mapping by ordinal, and (identity) by
  UUID; after it every tensor's bytes, both processes' contexts on the target GPU (the
  driver's UUID), the consumer's write reaching the producer, a new share, a matmul;
- a single process's matmuls and captured CUDA graph, moved the same way;
- the native checkpoint alone (a process without the shim) with the same gpuPairs,
  and without: what the remap costs the driver;
- a creator on GPU 0 sharing cudaMalloc memory with an importer (on two GPUs: on
  GPU 1), moved with the GPUs swapped (0=1,1=0; on one GPU: 0=0).

Skipped without a GPU, torch, or the target GPU. Figures go to remap.json in
``$CUINTERPOSE_TRACE_OUT`` (printed too).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cuinterpose.demo import coordinator_env
from cuinterpose.engine import agent
from cuinterpose.engine.gpus import Gpu, GpuMap
from cuinterpose.engine.native_checkpoint import CudaBackend, ProcessState, run_step

from tests.gpu.test_owned_torch import Job, wait_count
from tests.shim import legacy
from tests.shim.agentgroup import devices_of
from tests.simenv import Spawn

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.usefixtures("gpu")]

TARGET = int(os.environ.get("CUINTERPOSE_REMAP_TO", "0"))
FIGURES: dict[str, Any] = {"target": TARGET}


@pytest.fixture(scope="module")
def gpus(gpu: None) -> tuple[Gpu, ...]:
    pytest.importorskip("torch")
    found = CudaBackend().gpus()
    if len(found) <= TARGET:
        pytest.skip(f"GPU {TARGET} is not here ({len(found)} GPUs)")
    FIGURES["gpus"] = [[g.ordinal, g.uuid, g.name, g.bytes] for g in found]
    return found


@pytest.fixture(scope="module", autouse=True)
def _record() -> Iterator[None]:
    yield
    print(json.dumps(FIGURES, indent=2))
    trace_out = os.environ.get("CUINTERPOSE_TRACE_OUT", "")
    if trace_out:
        (Path(trace_out) / "remap.json").write_text(json.dumps(FIGURES, indent=2))


def cli(verb: str, pids: list[int], ckpt: Path, control_dir: Path, env: dict[str, str],
        *extra: str) -> float:  # fmt: skip
    """``cuinterpose VERB`` of ``pids``; its seconds. Fails the test with its stderr."""
    argv = [sys.executable, "-m", "cuinterpose", verb, "--checkpoint-dir", str(ckpt)]
    argv += ["--control-dir", str(control_dir), "--progress", "json", *extra]
    for pid in pids:
        argv += ["--process", str(pid), str(pid)]
    began = time.perf_counter()
    run = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300, check=False)
    seconds = time.perf_counter() - began
    assert run.returncode == 0, f"{verb} {extra}: exit {run.returncode}\n{run.stderr[-4000:]}"
    return round(seconds, 3)


def cycle(name: str, pids: list[int], control_dir: Path, tmp_path: Path,
          plain_env: dict[str, str], *mapping: str) -> None:  # fmt: skip
    """suspend, then resume with ``mapping`` (``--gpu-map X``, or nothing)."""
    env = coordinator_env(plain_env)
    ckpt = tmp_path / f"ckpt-{name}"
    suspend_s = cli("suspend", pids, ckpt, control_dir, env)
    extra = ("--gpu-map", mapping[0]) if mapping else ()
    resume_s = cli("resume", pids, ckpt, control_dir, env, *extra)
    gpus_recorded = [p.get("gpus") for p in json.loads((ckpt / "manifest.json").read_text())
                     ["participants"]]  # fmt: skip
    FIGURES[name] = {"map": mapping[0] if mapping else "", "suspend_s": suspend_s,
                     "resume_s": resume_s, "manifest_gpus": gpus_recorded}  # fmt: skip


def job_env(shim_env: dict[str, str], expandable: bool) -> dict[str, str]:
    env = {**shim_env, "PYTHONUNBUFFERED": "1"}
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    if expandable:
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    return env


def on(answer: dict[str, Any], gpu: Gpu) -> None:
    for who in ("producer", "consumer"):
        if who in answer:
            assert answer[who]["driver"] == gpu.uuid, answer


@pytest.mark.parametrize("allocator", ["default", "expandable"])
def test_pair_moved(
    allocator: str,
    gpus: tuple[Gpu, ...],
    shim_env: dict[str, str],
    plain_env: dict[str, str],
    control_dir: Path,
    tmp_path: Path,
) -> None:
    job = Job("pair", job_env(shim_env, allocator == "expandable"), tmp_path / "pair.stderr")
    try:
        pids = job.answer()["pids"]
        assert job.ask("check") == {"ok": True, "bad": []}
        on(job.ask("where"), gpus[0])
        cycle(f"pair_{allocator}_plain", pids, control_dir, tmp_path, plain_env)
        assert job.ask("check") == {"ok": True, "bad": []}
        cycle(f"pair_{allocator}_map", pids, control_dir, tmp_path, plain_env, f"0={TARGET}")
        where = job.ask("where")
        FIGURES[f"pair_{allocator}_map"]["where"] = where
        on(where, gpus[TARGET])
        if TARGET == 0:  # the identity by UUID too
            uuids = f"{gpus[0].uuid}={gpus[0].uuid}"
            cycle(f"pair_{allocator}_uuid", pids, control_dir, tmp_path, plain_env, uuids)
            on(job.ask("where"), gpus[0])
        assert job.ask("check") == {"ok": True, "bad": []}
        assert job.ask("matmul") == {"ok": True}
        assert job.ask("run")["running"]
        wait_count(job, 100)
        stopped = job.ask("stop")
        assert stopped["count"] == stopped["counter"], stopped  # no update lost
        assert stopped["consumer"]["errors"] == [], stopped
        assert stopped["ack"] == stopped["consumer"]["reads"] > 0, stopped  # their write
        assert job.ask("share") == {"ok": True}
    finally:
        job.end()


def test_single_process_moved(
    gpus: tuple[Gpu, ...],
    shim_env: dict[str, str],
    plain_env: dict[str, str],
    control_dir: Path,
    tmp_path: Path,
) -> None:
    """Matmuls and a captured CUDA graph replayed after the move."""
    job = Job("single", job_env(shim_env, False), tmp_path / "single.stderr")
    try:
        pids = job.answer()["pids"]
        assert job.ask("check") == {"ok": True, "bad": []}
        cycle("single_map", pids, control_dir, tmp_path, plain_env, f"0={TARGET}")
        on(job.ask("where"), gpus[TARGET])
        assert job.ask("check") == {"ok": True, "bad": []}
    finally:
        job.end()


def native_cycle(
    backend: CudaBackend, pid: int, pairs: tuple[tuple[str, str], ...]
) -> dict[str, float]:
    began = time.perf_counter()
    run_step(backend, "lock", [pid])
    run_step(backend, "checkpoint", [pid])
    mid = time.perf_counter()
    run_step(backend, "restore", [pid], gpu_pairs=pairs)
    run_step(backend, "unlock", [pid])
    assert backend.state(pid) is ProcessState.RUNNING
    end = time.perf_counter()
    return {"suspend_s": round(mid - began, 3), "resume_s": round(end - mid, 3)}


def test_native_alone_with_the_same_gpu_pairs(
    gpus: tuple[Gpu, ...], plain_env: dict[str, str], tmp_path: Path
) -> None:
    """A process without the shim: the native checkpoint alone, restored without pairs,
    then with the pair GPU 0 -> target (the driver's own cost of the remap)."""
    env = {**coordinator_env(plain_env), "PYTHONUNBUFFERED": "1"}
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    job = Job("single", env, tmp_path / "native.stderr")
    backend = CudaBackend()
    try:
        (pid,) = job.answer()["pids"]
        FIGURES["native_plain"] = native_cycle(backend, pid, ())
        assert job.ask("check") == {"ok": True, "bad": []}
        pairs = ((gpus[0].uuid, gpus[TARGET].uuid),)
        FIGURES["native_map"] = native_cycle(backend, pid, pairs)
        on(job.ask("where"), gpus[TARGET])
        assert job.ask("check") == {"ok": True, "bad": []}
    finally:
        job.end()


def test_creator_importer_group_moved(
    gpus: tuple[Gpu, ...],
    spawn: Spawn,
    shim_env: dict[str, str],
    control_dir: Path,
    tmp_path: Path,
) -> None:
    """A creator on GPU 0 sharing cudaMalloc memory by legacy IPC with an importer on
    GPU ``TARGET`` (on two GPUs: reaching it over the link), resumed with the GPUs
    swapped (0=1,1=0; one GPU: 0=0): each on the other GPU, bytes and sharing both ways,
    a new share."""
    mapping = "0=1,1=0" if TARGET == 1 else "0=0"
    creator = spawn("creator", {**shim_env, **legacy.OWN_SMALL})
    importer = spawn("importer", {**shim_env, **legacy.OWN_SMALL}, device=TARGET)
    big = int(creator.check("alloc", size=legacy.BIG)["va"])
    small = int(creator.check("alloc", size=legacy.SMALL)["va"])
    private = int(creator.check("alloc", size=legacy.PRIVATE)["va"])
    for k, (va, n) in enumerate(
        ((big, legacy.BIG), (small, legacy.SMALL), (private, legacy.PRIVATE))
    ):
        creator.check("fill", va=va, size=n, seed=41 + k)
    handles = [creator.check("ipc_get", va=va)["handle"] for va in (big, small)]
    opened = [int(importer.check("ipc_open", handle=h)["va"]) for h in handles]
    pair = legacy.LegacyPair(creator, importer, big, small, private, opened[0], opened[1], 41)
    native = CudaBackend()
    where = agent.Where(control_dir)
    began = time.perf_counter()
    agent.suspend([(p, p) for p in pair.pids], tmp_path, where=where, native=native)
    mid = time.perf_counter()
    agent.resume(tmp_path, where=where, native=native, gpu_map=GpuMap.parse(mapping))
    end = time.perf_counter()
    FIGURES["group"] = {"map": mapping, "suspend_s": round(mid - began, 3),
                        "resume_s": round(end - mid, 3)}  # fmt: skip
    assert devices_of(creator, where) == [gpus[TARGET].uuid]
    h = importer(
        "dev = check(cu.cuCtxGetDevice())\n"
        "result = bytes(check(cu.cuDeviceGetUuid(dev)).bytes).hex()"
    )
    assert f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}" == gpus[0].uuid
    legacy.shared_both_ways(pair, write_seed=51)
