"""Real programs suspended and resumed *while they run* (the shim quiesces them), each
checked after (tests/gpu/running_programs.py holds them):

- a torch training loop (AdamW, deterministic algorithms, each step's batch made on the
  GPU from its own seed): after resume it trains on; at the end the same process trains
  as many steps again from scratch and the weights must be bit-identical;
- a transformers model generating greedily in a loop: every generation after resume
  gives the tokens of the first;
- a JAX jitted loop (its memory not preallocated): every result after resume is the
  first one;
- numba: a device array shared to a child by CUDA IPC: both see its bytes after resume,
  and the child's write reaches the parent;
- CuPy: a 4 KiB array shared by CUDA IPC: refused by default with both processes running
  on and the bytes intact, the refusal naming ``SNAPSHOT_SHIM_OWN_SMALL=1``; with that
  setting it is suspended and resumed.

Each reports its suspend and resume seconds (``cuinterpose suspend``/``resume``) and, for
the single processes, the native checkpoint alone of the same program run without the
shim (lock, checkpoint, restore, unlock). Skipped without a GPU or without the library.
With CUINTERPOSE_TRACE_OUT the figures go to running-programs.json there.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cuinterpose.demo import CliRun, coordinator_env, run_cli

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.usefixtures("gpu")]

HERE = Path(__file__).resolve().parent
FIGURES: dict[str, Any] = {}
# Work units a program must do before a suspend and after its resume: proof that it ran
# on both sides (counted by the program, read over its status command).
UNITS = {"train": 30, "generate": 3, "jax": 20}

NATIVE_CYCLE = """
import json, sys, time
from cuda.bindings import driver as cu
pid = int(sys.argv[1])
assert cu.cuInit(0)[0] == cu.CUresult.CUDA_SUCCESS
lock = cu.CUcheckpointLockArgs(); lock.timeoutMs = 30000
seconds = {}
for name, call in (
    ("lock", lambda: cu.cuCheckpointProcessLock(pid, lock)),
    ("checkpoint", lambda: cu.cuCheckpointProcessCheckpoint(pid, cu.CUcheckpointCheckpointArgs())),
    ("restore", lambda: cu.cuCheckpointProcessRestore(pid, cu.CUcheckpointRestoreArgs())),
    ("unlock", lambda: cu.cuCheckpointProcessUnlock(pid, cu.CUcheckpointUnlockArgs())),
):
    t = time.perf_counter()
    r = call()
    err = r[0] if isinstance(r, tuple) else r
    assert err == cu.CUresult.CUDA_SUCCESS, (name, err)
    seconds[name] = time.perf_counter() - t
print(json.dumps({"suspend_s": round(seconds["lock"] + seconds["checkpoint"], 3),
                  "resume_s": round(seconds["restore"] + seconds["unlock"], 3)}))
"""


class Program:
    def __init__(self, kind: str, env: dict[str, str], log: Path) -> None:
        self.kind = kind
        self.stderr = log.open("w")
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "running_programs.py"), kind],
            env={
                **env,
                "PYTHONUNBUFFERED": "1",
                "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
                # JAX would take 75% of the GPU up front: the suspend would move that.
                "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
            },
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            text=True,
        )
        ready = self.answer(600.0)
        assert ready.get("ready"), ready
        self.pids = [int(p) for p in ready["pids"]]

    def answer(self, timeout_s: float = 300.0) -> dict[str, Any]:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise AssertionError(f"{self.kind} ended: {self.log.read_text()[-3000:]}")
            if line.startswith("{"):
                return dict(json.loads(line))
        raise AssertionError(f"no answer from {self.kind}")

    def ask(self, command: str, timeout_s: float = 300.0) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.answer(timeout_s)

    def count(self) -> int:
        return int(self.ask("status")["count"])

    def wait_count(self, at_least: int) -> int:
        deadline = time.monotonic() + 300
        while (count := self.count()) < at_least:
            assert time.monotonic() < deadline, f"{self.kind} stopped at {count} work units"
            time.sleep(0.05)
        return count

    def end(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write("finish\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=120)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.stderr.close()


def needs(module: str) -> None:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed here")


def suspend_resume(
    name: str, program: Program, control_dir: Path, tmp_path: Path, cenv: dict[str, str]
) -> tuple[CliRun, CliRun]:
    ckpt = tmp_path / f"ckpt-{name}"
    pids = program.pids
    sus = run_cli("suspend", pids=pids, checkpoint_dir=ckpt, control_dir=control_dir, env=cenv)
    assert sus.returncode == 0, sus.stderr
    res = run_cli("resume", pids=pids, checkpoint_dir=ckpt, control_dir=control_dir, env=cenv)
    assert res.returncode == 0, res.stderr
    FIGURES.setdefault(name, {}).update(
        {"suspend_s": round(sus.seconds, 3), "resume_s": round(res.seconds, 3)}
    )
    return sus, res


def native_alone(name: str, kind: str, plain_env: dict[str, str], tmp_path: Path) -> None:
    """The same program without the shim, through the native checkpoint alone."""
    program = Program(kind, plain_env, tmp_path / f"{kind}-native.log")
    try:
        program.wait_count(UNITS[kind])
        cycle = subprocess.run(
            [sys.executable, "-c", NATIVE_CYCLE, str(program.pids[0])],
            env=coordinator_env(plain_env),
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        assert cycle.returncode == 0, cycle.stderr[-2000:]
        FIGURES.setdefault(name, {})["native"] = json.loads(cycle.stdout.strip().splitlines()[-1])
        program.wait_count(program.count() + UNITS[kind])
    finally:
        program.end()


def run_on(
    program: Program, name: str, control_dir: Path, tmp_path: Path, env: dict[str, str]
) -> None:
    """Suspend and resume ``program`` while it works; it must not move while suspended
    and must go on after."""
    cenv = coordinator_env(env)
    program.wait_count(UNITS[program.kind])
    ckpt = tmp_path / f"ckpt-{name}"
    sus = run_cli(
        "suspend", pids=program.pids, checkpoint_dir=ckpt, control_dir=control_dir, env=cenv
    )
    assert sus.returncode == 0, sus.stderr
    # Its status thread answers while it is suspended; its loop must not move.
    frozen = program.count()
    assert program.count() == frozen, "the program ran on while suspended"
    res = run_cli(
        "resume", pids=program.pids, checkpoint_dir=ckpt, control_dir=control_dir, env=cenv
    )
    assert res.returncode == 0, res.stderr
    program.wait_count(frozen + UNITS[program.kind])
    FIGURES.setdefault(name, {}).update(
        {
            "suspend_s": round(sus.seconds, 3),
            "resume_s": round(res.seconds, 3),
            "units_at_suspend": frozen,
        }
    )


def finish_after_a_cycle(
    kind: str,
    shim_env: dict[str, str],
    plain_env: dict[str, str],
    control_dir: Path,
    tmp_path: Path,
) -> dict[str, Any]:
    """Start ``kind`` under the shim, suspend and resume it while it works (run_on), then
    have it finish: its verdict, the work units it did recorded, and the same program
    through the native checkpoint alone beside it."""
    program = Program(kind, shim_env, tmp_path / f"{kind}.log")
    try:
        run_on(program, kind, control_dir, tmp_path, plain_env)
        assert program.proc.stdin is not None
        program.proc.stdin.write("finish\n")
        program.proc.stdin.flush()
        verdict = program.answer(600.0)
    finally:
        program.end()
    FIGURES[kind]["verdict"] = verdict
    native_alone(kind, kind, plain_env, tmp_path)
    return verdict


@pytest.fixture(autouse=True, scope="module")
def _record() -> Iterator[None]:
    yield
    print(json.dumps(FIGURES, indent=2))
    trace = os.environ.get("CUINTERPOSE_TRACE_OUT", "")
    if trace:
        (Path(trace) / "running-programs.json").write_text(json.dumps(FIGURES, indent=2))


def test_a_training_loop_trains_on_bit_identically(
    shim_env: dict[str, str], plain_env: dict[str, str], control_dir: Path, tmp_path: Path
) -> None:
    needs("torch")
    verdict = finish_after_a_cycle("train", shim_env, plain_env, control_dir, tmp_path)
    assert verdict["steps"] > FIGURES["train"]["units_at_suspend"], verdict
    assert verdict["identical"], f"the weights differ from a run from scratch: {verdict}"


def test_greedy_generation_gives_the_same_tokens_after_resume(
    shim_env: dict[str, str], plain_env: dict[str, str], control_dir: Path, tmp_path: Path
) -> None:
    needs("transformers")
    verdict = finish_after_a_cycle("generate", shim_env, plain_env, control_dir, tmp_path)
    assert verdict["generations"] > FIGURES["generate"]["units_at_suspend"], verdict
    assert verdict["mismatches"] == 0, verdict


def test_numba_ipc_sharing_survives_and_the_childs_write_reaches_the_parent(
    shim_env: dict[str, str], plain_env: dict[str, str], control_dir: Path, tmp_path: Path
) -> None:
    needs("numba")
    program = Program("numba", shim_env, tmp_path / "numba.log")
    try:
        assert len(program.pids) == 2
        assert program.ask("check 7") == {"parent": True, "child": True}
        suspend_resume("numba", program, control_dir, tmp_path, coordinator_env(plain_env))
        assert program.ask("check 7") == {"parent": True, "child": True}
        assert program.ask("write 9") == {"child_wrote": True, "parent_sees": True}
        assert program.ask("check 9") == {"parent": True, "child": True}
    finally:
        program.end()


def test_cupy_small_ipc_is_refused_by_default_and_captured_when_owned(
    shim_env: dict[str, str], plain_env: dict[str, str], control_dir: Path, tmp_path: Path
) -> None:
    needs("cupy")
    cenv = coordinator_env(plain_env)
    program = Program("cupy", shim_env, tmp_path / "cupy.log")
    try:
        sus = run_cli(
            "suspend",
            pids=program.pids,
            checkpoint_dir=tmp_path / "ckpt-refused",
            control_dir=control_dir,
            env=cenv,
        )
        assert sus.returncode != 0, "a small array shared by legacy IPC was captured"
        assert "SNAPSHOT_SHIM_OWN_SMALL=1" in sus.stderr, sus.stderr
        FIGURES["cupy_refused"] = {"exit": sus.returncode, "stderr": sus.stderr.strip()[-600:]}
        assert program.ask("check 7") == {"parent": True, "child": True}
        assert program.ask("write 5") == {"child_wrote": True, "parent_sees": True}
    finally:
        program.end()

    owned = {**shim_env, "SNAPSHOT_SHIM_OWN_SMALL": "1"}
    program = Program("cupy", owned, tmp_path / "cupy-owned.log")
    try:
        suspend_resume("cupy_owned", program, control_dir, tmp_path, cenv)
        assert program.ask("check 7") == {"parent": True, "child": True}
        assert program.ask("write 9") == {"child_wrote": True, "parent_sees": True}
    finally:
        program.end()


def test_a_jax_loop_gives_the_same_result_after_resume(
    shim_env: dict[str, str], plain_env: dict[str, str], control_dir: Path, tmp_path: Path
) -> None:
    needs("jax")
    verdict = finish_after_a_cycle("jax", shim_env, plain_env, control_dir, tmp_path)
    assert verdict["iterations"] > FIGURES["jax"]["units_at_suspend"], verdict
    assert verdict["mismatches"] == 0, verdict
