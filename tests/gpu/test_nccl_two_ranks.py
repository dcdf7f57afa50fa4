"""A real framework under the shim: a two-rank ``torch.distributed`` job, NCCL backend,
one GPU a rank on one host (skipped without two GPUs or without torch).

NCCL exchanges its buffers between the ranks through cuMem POSIX-FD export and import
(its log says ``P2P/CUMEM``), so the ranks share GPU memory the way cuinterpose
captures. The job runs collectives, is captured (``cuinterpose prepare``), natively
checkpointed and restored, restored (``cuinterpose restore``), and its collectives give
the right results again; a tensor it kept all along keeps its bytes. Multicast is never
enabled: NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1
in the ranks' environment.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import pytest
from cuinterpose import native_calls
from cuinterpose.demo import coordinator_env, run_cli

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.usefixtures("gpu")]

HERE = Path(__file__).resolve().parent
NO_MULTICAST = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def _gpus() -> int:
    """GPUs torch sees, asked in a child (this process keeps no CUDA context)."""
    probe = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
        env={**coordinator_env(), **NO_MULTICAST},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    try:
        return int(probe.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Rank:
    def __init__(self, rank: int, env: dict[str, str], log: Path) -> None:
        self.rank = rank
        self.stderr = log.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "nccl_rank.py")],
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            text=True,
        )
        self.log = log

    def answer(self, timeout_s: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.proc.stdout], [], [], 1.0)
            if ready:
                line = self.proc.stdout.readline()
                if not line:
                    break
                if line.startswith("{"):
                    return dict(json.loads(line))
            elif self.proc.poll() is not None:
                break
        raise AssertionError(
            f"rank {self.rank} (pid {self.proc.pid}) gave no answer in {timeout_s} s; "
            f"status {self.proc.poll()}; stderr: {self.log.read_text()[-3000:]}"
        )

    def tell(self, cmd: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()

    def dump_stacks(self) -> None:
        """A hung rank's Python stacks on its stderr (faulthandler, SIGUSR1)."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGUSR1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.stderr.close()


def ask_all(ranks: list[Rank], cmd: str, timeout_s: float = 60.0) -> list[dict[str, Any]]:
    """Every rank gets the command before any answer is awaited: a collective returns
    only once all ranks are in it."""
    for r in ranks:
        r.tell(cmd)
    return [r.answer(timeout_s) for r in ranks]


def end_ranks(
    ranks: Sequence[Rank], passed: bool, keep: Path | None, files: Iterable[Path]
) -> None:
    """Stop every rank; after a failure, first dump their stacks and copy ``files``
    (what explains it) into ``keep``."""
    if not passed:
        for r in ranks:
            r.dump_stacks()
        time.sleep(2)  # let faulthandler write before the kill
    for r in ranks:
        r.stop()
    if not passed and keep is not None:
        keep.mkdir(exist_ok=True)
        for f in files:
            shutil.copy(f, keep / f.name)


def test_two_rank_nccl_job_survives_checkpoint_restore(
    shim_env: dict[str, str],
    plain_env: dict[str, str],
    control_dir: Path,
    tmp_path: Path,
    trace_out: Path | None,
) -> None:
    pytest.importorskip("torch")
    if _gpus() < 2:
        pytest.skip("needs two GPUs on this host")
    nccl_log = tmp_path / "nccl"
    nccl_log.mkdir()
    env = {
        **shim_env,
        **NO_MULTICAST,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "WORLD_SIZE": "2",
        "NCCL_DEBUG": "INFO",
        "NCCL_DEBUG_SUBSYS": "INIT,P2P",
        "NCCL_DEBUG_FILE": str(nccl_log / "nccl.%p.log"),
        "NCCL_CUMEM_ENABLE": "1",
        "PYTHONUNBUFFERED": "1",
        "SNAPSHOT_SHIM_DEBUG": "1",  # every tracked call in the rank's stderr
    }
    ranks = [Rank(r, env, tmp_path / f"rank{r}.stderr") for r in range(2)]
    passed = False
    try:
        first = [r.answer(300.0) for r in ranks]
        assert all(a["ready"] and a["ok"] for a in first), first
        pids = [int(a["pid"]) for a in first]
        logs = "".join(p.read_text() for p in nccl_log.iterdir())
        assert "P2P/CUMEM" in logs, logs[-3000:]

        ckpt = tmp_path / "checkpoint"
        cenv = coordinator_env({**plain_env, **NO_MULTICAST})
        trace = (trace_out or tmp_path) / "nccl-capture.jsonl"
        prep = run_cli(
            "prepare",
            pids=pids,
            checkpoint_dir=ckpt,
            control_dir=control_dir,
            env=cenv,
            trace=trace,
            timeout_s=300,
        )
        assert prep.returncode == 0, prep.stderr
        save = prep.phase("SAVE_ALLOCATIONS")
        assert int(save["allocation_count"]) > 0, save  # NCCL's shared buffers moved
        no_multicast = {**plain_env, **NO_MULTICAST}
        ck = native_calls.run_in_subprocess("checkpoint-all", pids, env=no_multicast)
        rs = native_calls.run_in_subprocess("restore-all", pids, env=no_multicast)
        rest = run_cli(
            "restore",
            pids=pids,
            checkpoint_dir=ckpt,
            control_dir=control_dir,
            env=cenv,
            trace=(trace_out or tmp_path) / "nccl-restore.jsonl",
            timeout_s=300,
        )
        assert rest.returncode == 0, rest.stderr
        again = ask_all(ranks, "check")
        assert all(a["ok"] and a["kept_intact"] for a in again), again
        figures = {
            "save": save,
            "load": rest.phase("LOAD_ALLOCATIONS"),
            "capture_s": prep.seconds,
            "restore_s": rest.seconds,
            "native_checkpoint": ck["timings"],
            "native_restore": rs["timings"],
        }
        print(json.dumps(figures, indent=2, default=str))
        if trace_out is not None:
            (trace_out / "nccl-figures.json").write_text(json.dumps(figures, default=str))
        assert all(a["bye"] for a in ask_all(ranks, "quit"))
        passed = True
    finally:
        # What explains a failure: NCCL's logs, the ranks' stderr (shim log, stacks).
        keep = trace_out / "nccl-failure" if trace_out is not None else None
        end_ranks(ranks, passed, keep, [*nccl_log.iterdir(), *tmp_path.glob("rank*.stderr")])
