"""The entry points of legacy IPC, peer access, pools and pointer attributes pass the
simulator's checkpoint gate like every other: while a controller holds the process
LOCKED, a call to any of them (resolved through cuGetProcAddress at its version) waits
asleep on a futex word of the simulator's state; after the unlock it returns what it
returns when nothing is locked."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests import simenv, snippet
from tests.sim.test_checkpoint import controller

FUTEX = {"x86_64": 202, "aarch64": 98}  # the futex system call's number

pytestmark = pytest.mark.skipif(not simenv.is_simulated(), reason="the simulator's own gate")

CALLS = snippet.load(__file__, "calls")


def _sim_symbol(lib: str) -> tuple[int, int]:
    """(offset, size) of the simulator's state object ``sim`` in its library."""
    for line in subprocess.run(["nm", "-S", lib], capture_output=True, text=True).stdout.split(
        "\n"
    ):
        fields = line.split()
        if len(fields) == 4 and fields[3] == "sim":
            return int(fields[0], 16), int(fields[1], 16)
    raise LookupError(f"{lib}: no symbol 'sim' (stripped?)")


def test_new_entry_points_wait_at_the_gate_while_locked(spawn):
    machine = os.uname().machine
    if machine not in FUTEX:
        pytest.skip(f"the futex system call's number on {machine} is not known here")
    lib = str(simenv.sim_dir() / "libcuda.so.1")
    offset, size = _sim_symbol(lib)
    t, c = spawn(), controller(spawn)
    real = os.path.realpath(lib)
    t(
        f"FUTEX_NR = {FUTEX[machine]}\n"
        "base = min(int(line.split('-')[0], 16) for line in open('/proc/self/maps')\n"
        f"           if line.split()[-1] == {real!r} and int(line.split()[2], 16) == 0)\n"
        f"SIM = (base + {offset}, base + {offset + size})\n" + CALLS
    )
    baseline = t("threads, out, tids = run_all(); [x.join() for x in threads]; result = out")
    assert all(code != 0 for code in baseline), baseline  # every call refused, none crashed
    assert c(f"result = lock({t.pid})") == "CUDA_SUCCESS"
    try:
        waiting = t("threads, out, tids = run_all(); result = held(threads, out, tids)")
    finally:
        assert c(f"result = unlock({t.pid})") == "CUDA_SUCCESS"
    assert waiting == [True] * len(baseline), waiting
    assert t("[x.join() for x in threads]; result = out") == baseline


# (resolver name, version): the ABI symbol the driver exports for it.
ABI = [
    ("cuMemAllocPitch", 3020, "cuMemAllocPitch_v2"),
    ("cuIpcGetMemHandle", 4010, "cuIpcGetMemHandle"),
    ("cuIpcOpenMemHandle", 4010, "cuIpcOpenMemHandle"),
    ("cuIpcOpenMemHandle", 11000, "cuIpcOpenMemHandle_v2"),
    ("cuIpcCloseMemHandle", 4010, "cuIpcCloseMemHandle"),
    ("cuIpcGetEventHandle", 4010, "cuIpcGetEventHandle"),
    ("cuIpcOpenEventHandle", 4010, "cuIpcOpenEventHandle"),
    ("cuCtxEnablePeerAccess", 4000, "cuCtxEnablePeerAccess"),
    ("cuCtxDisablePeerAccess", 4000, "cuCtxDisablePeerAccess"),
    ("cuPointerGetAttribute", 4000, "cuPointerGetAttribute"),
    ("cuPointerGetAttributes", 7000, "cuPointerGetAttributes"),
    ("cuMemPoolCreate", 11020, "cuMemPoolCreate"),
    ("cuMemPoolDestroy", 11020, "cuMemPoolDestroy"),
    ("cuMemPoolExportToShareableHandle", 11020, "cuMemPoolExportToShareableHandle"),
    ("cuMemPoolImportFromShareableHandle", 11020, "cuMemPoolImportFromShareableHandle"),
    ("cuMemPoolExportPointer", 11020, "cuMemPoolExportPointer"),
    ("cuMemPoolImportPointer", 11020, "cuMemPoolImportPointer"),
]


def test_each_resolves_to_its_abi_export_from_its_first_version(spawn):
    w = spawn()
    r = w(f"""
lib = ctypes.CDLL("libcuda.so.1")
def q(name, ver):
    return cu.cuGetProcAddress(name.encode(), ver, 0)
out = []
for name, ver, sym in {ABI!r}:
    found, before = q(name, ver), q(name, ver - 1)
    out.append([name, ver, int(found[1]) == ctypes.cast(getattr(lib, sym), ctypes.c_void_p).value,
                before[2].name if ver != 11000 else "v1 below"])
result = out
""")
    for name, ver, same, before in r:
        assert same, f"{name}@{ver} is not {name}'s ABI export"
        assert before in ("CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT", "v1 below"), (name, before)
