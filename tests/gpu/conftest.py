"""Fixtures for the real-GPU tests: skipped unless ``CUINTERPOSE_TEST_DRIVER=system`` and
``cuInit`` succeeds on a device that is not the simulated one.

Multicast is never exercised on real hardware unless ``CUINTERPOSE_ALLOW_MULTICAST=1``:
``cuMulticastCreate`` can take a shared host's GPUs out of service. Any test here whose
id mentions multicast is skipped without it.

``CUINTERPOSE_TRACE_OUT``: a directory that receives the coordinator's capture and
restore traces (``--trace``) and the measured figures.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cuinterpose import launch
from cuinterpose.demo import coordinator_env

HERE = Path(__file__).resolve().parent

# Every process these tests start inherits this: no library (NCCL, PyTorch symmetric
# memory, NVSHMEM) creates multicast objects on its own on a real GPU.
NO_LIBRARY_MULTICAST = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
os.environ.update(NO_LIBRARY_MULTICAST)

SIM_DEVICE_NAME = "cuinterpose simulated GPU"
_PROBE = """
import json
from cuda.bindings import driver as cu
err, = cu.cuInit(0)
if err != cu.CUresult.CUDA_SUCCESS:
    print(json.dumps({"error": f"cuInit: {err.name}"})); raise SystemExit(0)
err, dev = cu.cuDeviceGet(0)
err, name = cu.cuDeviceGetName(256, dev)
err, version = cu.cuDriverGetVersion()
print(json.dumps({"name": bytes(name).split(b"\\0", 1)[0].decode(), "driver": int(version)}))
"""


def multicast_allowed() -> bool:
    return os.environ.get("CUINTERPOSE_ALLOW_MULTICAST", "") == "1"


def _gpu_missing() -> str | None:
    if os.environ.get("CUINTERPOSE_TEST_DRIVER", "") != "system":
        return "real-GPU tests: set CUINTERPOSE_TEST_DRIVER=system on a machine with an NVIDIA GPU"
    env = coordinator_env()
    probe = subprocess.run(
        [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, check=False
    )
    try:
        info = json.loads(probe.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return f"no CUDA driver could be loaded: {probe.stderr.strip()[-300:]}"
    if "error" in info:
        return f"no usable GPU: {info['error']}"
    if info["name"] == SIM_DEVICE_NAME or "simulated" in info["name"].lower():
        return f"libcuda.so.1 here is the simulated driver ({info['name']}), not a GPU"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if multicast_allowed():
        return
    guard = pytest.mark.skip(
        reason="multicast on real hardware needs CUINTERPOSE_ALLOW_MULTICAST=1 "
        "(cuMulticastCreate can take a shared host's GPUs out of service)"
    )
    for item in items:
        if item.path.is_relative_to(HERE) and "multicast" in item.nodeid.lower():
            item.add_marker(guard)


@pytest.fixture(scope="session")
def gpu() -> None:
    reason = _gpu_missing()
    if reason:
        pytest.skip(reason)


@pytest.fixture
def shim_env(gpu: None, control_dir: Path) -> dict[str, str]:
    """The real driver with the release shim preloaded (CUINTERPOSE_BUILD_DIR overrides)."""
    try:
        return launch.launch_env(driver="system", control_dir=control_dir, base=coordinator_env())
    except FileNotFoundError as exc:
        pytest.fail(f"the shim is not built: {exc}")


@pytest.fixture
def plain_env(gpu: None, control_dir: Path) -> dict[str, str]:
    return launch.launch_env(
        driver="system", control_dir=control_dir, base=coordinator_env(), preload_shim=False
    )


@pytest.fixture
def trace_out() -> Path | None:
    value = os.environ.get("CUINTERPOSE_TRACE_OUT", "")
    return Path(value) if value else None


@pytest.fixture
def worker_timeout_s() -> float:
    """A command on a real GPU may move gigabytes."""
    return 300.0
