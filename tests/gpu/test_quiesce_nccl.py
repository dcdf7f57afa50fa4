"""Issue 13 on two GPUs: a two-rank ``torch.distributed`` NCCL job looping ``all_reduce``
+ check, never told to pause, is suspended and resumed through ``cuinterpose
suspend``/``resume`` several times in a row; every iteration's result is right and no
rank sees an error (skipped without two GPUs or without torch). The shim's QUIESCE
brings the ranks to a quiet point itself (specs/quiesce.md).

Multicast is never enabled: NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
NVSHMEM_DISABLE_NVLS=1. Figures (QUIESCE's time, suspend and resume times) are printed
and, with CUINTERPOSE_TRACE_OUT, written to quiesce-nccl.json there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from cuinterpose.demo import coordinator_env, run_cli

from tests.gpu.test_nccl_two_ranks import NO_MULTICAST, Rank, _free_port, _gpus, end_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.usefixtures("gpu")]

HERE = Path(__file__).resolve().parent
# Suspends in a row (CUINTERPOSE_NCCL_SUSPENDS overrides: the H200 runs use more).
SUSPENDS = int(os.environ.get("CUINTERPOSE_NCCL_SUSPENDS", "3"))
PROGRESS = 20  # iterations each rank must complete between two suspends


class LoopRank(Rank):
    """A rank running nccl_quiesce_rank.py (the parent's answer, tell, stop and stacks)."""

    def __init__(self, rank: int, env: dict[str, str], log: Path) -> None:
        # Not the parent's __init__: that one starts nccl_rank.py.
        self.rank = rank
        self.log = log
        self.stderr = log.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "nccl_quiesce_rank.py")],
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            text=True,
        )

    def status(self) -> dict[str, Any]:
        self.tell("status")
        return self.answer(60.0)


def wait_progress(ranks: list[LoopRank], at_least: int, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        states = [r.status() for r in ranks]
        for s in states:
            assert not s["bad"] and not s["errors"], states
        if all(int(s["iters"]) >= at_least for s in states):
            return
        assert time.monotonic() < deadline, f"no progress to {at_least}: {states}"
        time.sleep(0.2)


def test_a_looping_nccl_job_is_suspended_and_resumed_repeatedly(
    shim_env: dict[str, str],
    plain_env: dict[str, str],
    control_dir: Path,
    tmp_path: Path,
    trace_out: Path | None,
) -> None:
    pytest.importorskip("torch")
    if _gpus() < 2:
        pytest.skip("needs two GPUs on this host")
    env = {
        **shim_env,
        **NO_MULTICAST,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "WORLD_SIZE": "2",
        "NCCL_CUMEM_ENABLE": "1",
        "PYTHONUNBUFFERED": "1",
    }
    ranks = [LoopRank(r, env, tmp_path / f"rank{r}.stderr") for r in range(2)]
    cenv = coordinator_env({**plain_env, **NO_MULTICAST})
    suspends: list[dict[str, Any]] = []
    passed = False
    try:
        first = [r.answer(300.0) for r in ranks]
        assert all(a["ready"] for a in first), first
        pids = [int(a["pid"]) for a in first]
        wait_progress(ranks, PROGRESS)
        for k in range(SUSPENDS):
            ckpt = tmp_path / f"checkpoint-{k}"
            sus = run_cli(
                "suspend", pids=pids, checkpoint_dir=ckpt, control_dir=control_dir,
                env=cenv, timeout_s=300,
            )  # fmt: skip
            assert sus.returncode == 0, sus.stderr
            at_suspend = [int(r.status()["iters"]) for r in ranks]
            res = run_cli(
                "resume", pids=pids, checkpoint_dir=ckpt, control_dir=control_dir,
                env=cenv, timeout_s=300,
            )  # fmt: skip
            assert res.returncode == 0, res.stderr
            wait_progress(ranks, max(at_suspend) + PROGRESS)
            quiesce = [e for e in sus.events if e.get("phase") == "QUIESCE"]
            # Every QUIESCE round that left a rank not quiet, and every refused attempt.
            not_yet = [e for e in sus.events if e.get("event") == "quiesce_round"]
            refused = [e for e in sus.events if e.get("event") == "failed"]
            suspends.append(
                {
                    "suspend_s": sus.seconds,
                    "resume_s": res.seconds,
                    "quiesce": quiesce,
                    "quiesce_rounds_not_quiet": not_yet,
                    "refused_attempts": refused,
                    "iterations_at_suspend": at_suspend,
                }
            )
        stop_at = max(int(r.status()["iters"]) for r in ranks) + 5
        for r in ranks:
            r.tell(f"stop {stop_at}")
        final = [r.answer(300.0) for r in ranks]
        assert all(f["stopped"] == stop_at and not f["bad"] and not f["errors"] for f in final), (
            final
        )
        figures = {"suspends": suspends, "iterations": stop_at}
        print(json.dumps(figures, indent=2, default=str))
        if trace_out is not None:
            (trace_out / "quiesce-nccl.json").write_text(json.dumps(figures, default=str))
        for r in ranks:
            r.tell("quit")
        assert all(r.answer(120.0)["bye"] for r in ranks)
        passed = True
    finally:
        keep = trace_out / "quiesce-nccl-failure" if trace_out is not None else None
        end_ranks(ranks, passed, keep, tmp_path.glob("rank*.stderr"))
