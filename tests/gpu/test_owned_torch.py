"""Issue 18 on a real GPU: PyTorch with its default allocator (cudaMalloc, legacy CUDA IPC
between processes) under the shim, which owns that memory, suspended and resumed by
``cuinterpose suspend``/``resume`` (tests/gpu/torch_ipc_job.py is the job).

- a ``torch.multiprocessing`` producer/consumer pair, once paused and once running
  (the producer counting in a shared tensor, the consumer reading it): every tensor's
  bytes right in both processes, no update lost, the consumer's write seen by the
  producer, and a tensor shared afterwards arriving right;
- a single process's matrix products and a captured CUDA graph, replayed after resume.

Skipped without a GPU or torch. Figures (suspend/resume seconds, bytes the shim staged)
are printed and, with CUINTERPOSE_TRACE_OUT, written to owned-torch.json there.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from cuinterpose.demo import CliRun, coordinator_env, run_cli

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.usefixtures("gpu")]

HERE = Path(__file__).resolve().parent
FIGURES: dict[str, Any] = {}


class Job:
    def __init__(self, kind: str, env: dict[str, str], log: Path) -> None:
        self.stderr = log.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "torch_ipc_job.py"), kind],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            text=True,
        )
        self.log = log

    def answer(self, timeout_s: float = 300.0) -> dict[str, Any]:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise AssertionError(f"the job ended: {self.log.read_text()[-3000:]}")
            if line.startswith("{"):
                return dict(json.loads(line))
        raise AssertionError("no answer from the job")

    def ask(self, command: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.answer()

    def end(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.stderr.close()


def job_env(shim_env: dict[str, str]) -> dict[str, str]:
    env = {**shim_env, "PYTHONUNBUFFERED": "1"}
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)  # the default allocator: cudaMalloc
    return env


def staged_bytes(run: CliRun) -> int:
    done = [e for e in run.events if e.get("step") == "capture" and e.get("status") == "done"]
    return int(done[-1].get("bytes", 0)) if done else 0


def cycle(
    name: str,
    pids: list[int],
    control_dir: Path,
    tmp_path: Path,
    plain_env: dict[str, str],
    *,
    staged: bool = True,
) -> None:
    """``cuinterpose suspend`` then ``resume`` of ``pids``; with ``staged``, the shim must
    have staged bytes (the shared memory)."""
    cenv = coordinator_env(plain_env)
    ckpt = tmp_path / f"ckpt-{name}"
    sus = run_cli("suspend", pids=pids, checkpoint_dir=ckpt, control_dir=control_dir, env=cenv)
    assert sus.returncode == 0, sus.stderr
    res = run_cli("resume", pids=pids, checkpoint_dir=ckpt, control_dir=control_dir, env=cenv)
    assert res.returncode == 0, res.stderr
    FIGURES[name] = {
        "suspend_s": round(sus.seconds, 3),
        "resume_s": round(res.seconds, 3),
        "capture_bytes": staged_bytes(sus),
    }
    if staged:
        assert FIGURES[name]["capture_bytes"] > 0, sus.events


def wait_count(job: Job, at_least: int) -> int:
    deadline = time.monotonic() + 120
    while True:
        count = int(job.ask("status")["count"])
        if count >= at_least:
            return count
        assert time.monotonic() < deadline, f"the producer stopped counting at {count}"
        time.sleep(0.05)


@pytest.fixture(autouse=True)
def _torch() -> None:
    pytest.importorskip("torch")


def record(trace_out: Path | None) -> None:
    print(json.dumps(FIGURES, indent=2))
    if trace_out is not None:
        (trace_out / "owned-torch.json").write_text(json.dumps(FIGURES, indent=2))


def test_default_allocator_pair_paused(
    shim_env: dict[str, str],
    plain_env: dict[str, str],
    control_dir: Path,
    tmp_path: Path,
    trace_out: Path | None,
) -> None:
    job = Job("pair", job_env(shim_env), tmp_path / "pair.stderr")
    try:
        hello = job.answer()
        assert job.ask("check") == {"ok": True, "bad": []}
        cycle("pair_paused", hello["pids"], control_dir, tmp_path, plain_env)
        assert job.ask("check") == {"ok": True, "bad": []}
        assert job.ask("share") == {"ok": True}
    finally:
        job.end()
    record(trace_out)


def test_default_allocator_pair_running(
    shim_env: dict[str, str],
    plain_env: dict[str, str],
    control_dir: Path,
    tmp_path: Path,
    trace_out: Path | None,
) -> None:
    job = Job("pair", job_env(shim_env), tmp_path / "pair.stderr")
    try:
        hello = job.answer()
        assert job.ask("run")["running"]
        before = wait_count(job, 200)
        cycle("pair_running", hello["pids"], control_dir, tmp_path, plain_env)
        wait_count(job, before + 200)  # both run on after the resume
        stopped = job.ask("stop")
        assert stopped["count"] == stopped["counter"], stopped  # no update lost
        assert stopped["consumer"]["errors"] == [], stopped
        assert stopped["consumer"]["reads"] > 0 and stopped["ack"] == stopped["consumer"]["reads"]
        FIGURES["pair_running"]["updates"] = stopped["count"]
        assert job.ask("check") == {"ok": True, "bad": []}
        assert job.ask("share") == {"ok": True}
    finally:
        job.end()
    record(trace_out)


def test_single_process_matmul_and_graph(
    shim_env: dict[str, str],
    plain_env: dict[str, str],
    control_dir: Path,
    tmp_path: Path,
    trace_out: Path | None,
) -> None:
    job = Job("single", job_env(shim_env), tmp_path / "single.stderr")
    try:
        hello = job.answer()
        assert job.ask("check") == {"ok": True, "bad": []}
        cycle("single", hello["pids"], control_dir, tmp_path, plain_env, staged=False)
        assert job.ask("check") == {"ok": True, "bad": []}
    finally:
        job.end()
    record(trace_out)
