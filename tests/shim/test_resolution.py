"""Every way a program reaches the driver ends in the shim.

A C program linked directly against libcuda.so.1, a C program using dlopen + dlsym,
and cuda.bindings (which resolves everything through cuGetProcAddress_v2) must all
get a cuinterpose capability, not a raw FD, when they export an allocation. The
resolvers must hand back the shim's wrapper of the right ABI for a tracked name,
and leave everything else alone.
"""

from __future__ import annotations

import os
import struct
import subprocess
from pathlib import Path

import pytest

from tests import simenv, snippet
from tests.shim import shimenv
from tests.simenv import Spawn


def is_capability(fd: int) -> bool:
    import fcntl

    seals = fcntl.fcntl(fd, 1034)  # F_GET_SEALS
    if seals & 0xF != 0xF:
        return False
    return os.fstat(fd).st_size == 128 and struct.unpack("<I", os.pread(fd, 4, 0))[0] == 0x43495543


@pytest.mark.parametrize("program", ["shim_direct", "shim_dlsym"])
def test_c_program_gets_capability(program: str, control_dir: Path) -> None:
    exe = shimenv.test_program(program)
    env = shimenv.shim_env(control_dir=control_dir)
    env["ASAN_OPTIONS"] = "detect_leaks=1:abort_on_error=1:verify_asan_link_order=0"
    out = subprocess.run([str(exe), "export"], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "capability=1 tagged=1 own_import_same_bytes=1" in out.stdout
    assert "Sanitizer" not in out.stderr
    assert not list(control_dir.glob("*.sock"))  # the socket goes away with the process


@pytest.mark.skipif(not simenv.is_simulated(), reason="compares with the simulated driver")
def test_c_program_without_shim_gets_raw_fd(control_dir: Path) -> None:
    exe = shimenv.test_program("shim_direct")
    out = subprocess.run(
        [str(exe), "export"], env=simenv.sim_env(), capture_output=True, text=True, timeout=60
    )
    # Without the shim the FD is the driver's own and the handle is untagged.
    assert "capability=0 tagged=0" in out.stdout, out.stdout + out.stderr


def test_cuda_bindings_export_is_capability(spawn: Spawn) -> None:
    w = spawn()
    w("H['x'] = check(cu.cuMemCreate(gran, prop(), 0)); send_fd(export(H['x']))")
    handle = w("result = int(H['x'])")
    assert handle >> 48 == 0xC1F0
    fd = w.take_fd()
    assert is_capability(fd)
    os.close(fd)
    w.close_clean()


RESOLVER_PROBE = snippet.load(__file__, "resolver_probe")


def test_resolvers_select_the_shim_and_the_abi(spawn: Spawn) -> None:
    w = spawn()
    w(f"SHIM = {str(shimenv.shim_library())!r}")
    got = w(RESOLVER_PROBE)
    w.close_clean()
    unknown = got.pop("unknown")
    assert unknown[0] == "CUDA_SUCCESS" and unknown[1] == 1 and unknown[2] == 0
    assert got == dict.fromkeys(got, True), got


def test_runtime_entry_point(spawn: Spawn) -> None:
    """cudaGetDriverEntryPoint*: needs a runtime that initialises on this driver (the
    real GPU; the simulated driver does not satisfy libcudart)."""
    try:
        import cuda.pathfinder as pf

        cudart = pf.load_nvidia_dynamic_lib("cudart").abs_path
    except Exception as exc:  # pragma: no cover - depends on the wheel set
        pytest.skip(f"libcudart not available: {exc}")
    w = spawn()
    got = w(
        f"""
import ctypes
rt = ctypes.CDLL({cudart!r})
shim = ctypes.CDLL({str(shimenv.shim_library())!r})
ours = lambda n: ctypes.cast(getattr(shim, n), ctypes.c_void_p).value
p = ctypes.c_void_p(); st = ctypes.c_int(-1)
r1 = rt.cudaGetDriverEntryPointByVersion(b"cuMemCreate", ctypes.byref(p), 12000,
                                         ctypes.c_ulonglong(0), ctypes.byref(st))
by_version = (r1, st.value, p.value == ours("cuMemCreate"))
r2 = rt.cudaGetDriverEntryPoint(b"cuGetProcAddress", ctypes.byref(p), ctypes.c_ulonglong(0),
                                ctypes.byref(st))
plain = (r2, st.value, p.value == ours("cuGetProcAddress_v2"))
result = [by_version, plain]
"""
    )
    w.close_clean()
    if got[0][0] != 0:
        pytest.skip(f"libcudart does not initialise on this driver (cudaError {got[0][0]})")
    assert got == [[0, 0, True], [0, 0, True]]
