"""Loading, resolution and identification of the simulated driver."""

from __future__ import annotations

from pathlib import Path

from tests import simenv
from tests.sim.simtest import sim_only

DRIVER_PROBE = Path(__file__).parent / "workers" / "driver_probe.py"


def test_driver_loads_and_announces_itself(spawn):
    w = spawn()
    r = w("""
name = check(cu.cuDeviceGetName(64, 0)).split(b"\\0")[0].decode()
result = dict(version=check(cu.cuDriverGetVersion()), count=check(cu.cuDeviceGetCount()),
              name=name, uuid0=bytes(check(cu.cuDeviceGetUuid(0)).bytes).hex(),
              uuid1=bytes(check(cu.cuDeviceGetUuid(1)).bytes).hex()
              if check(cu.cuDeviceGetCount()) > 1 else None)
""")
    assert r["version"] >= 13000
    if simenv.is_simulated():
        assert r["version"] == 13000
        assert r["count"] == 2
        assert r["name"] == "cuinterpose simulated GPU"
        assert r["uuid0"] != r["uuid1"]


@sim_only
def test_device_count_is_configurable(namespace):
    env = simenv.sim_env(devices=5, namespace=namespace)
    p = simenv.run_python(DRIVER_PROBE, "count", "5", env=env)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["5", "CUDA_ERROR_INVALID_DEVICE"]


@sim_only
def test_ctypes_marker_and_loaded_from_build():
    p = simenv.run_python(DRIVER_PROBE, "marker", env=simenv.sim_env())
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "1"


@sim_only
def test_not_loaded_unless_asked():
    """Without the library path, libcuda.so.1 is not the simulator."""
    env = {k: v for k, v in simenv.sim_env().items() if k != "LD_LIBRARY_PATH"}
    p = simenv.run_python(DRIVER_PROBE, "which", env=env)
    assert p.stdout.strip() in ("absent", "real"), p.stderr


def test_proc_address_rules(spawn):
    w = spawn()
    r = w("""
def q(name, ver):
    res = cu.cuGetProcAddress(name, ver, 0)
    return [res[0].name, res[2].name if res[0] == 0 else None, int(res[1]) if res[0] == 0 else None]
result = dict(unknown=q(b"cuNoSuchFunction", 13000), dtoh=q(b"cuMemcpyDtoH", 3020),
              future=q(b"cuMemcpyDtoH", 99999), bind12=q(b"cuMulticastBindMem", 12010),
              bind13=q(b"cuMulticastBindMem", 13010),
              ptds=[cu.cuGetProcAddress(b"cuMemcpy", 4000, 2)[0].name],
              names=[cu.cuGetErrorName(cu.CUresult.CUDA_ERROR_INVALID_VALUE)[1].decode(),
                     cu.cuGetErrorString(cu.CUresult.CUDA_ERROR_INVALID_VALUE)[1].decode()])
""")
    # The real driver (specs/records) answers an unknown name with success,
    # a NULL pointer and SYMBOL_NOT_FOUND; a future version is INVALID_VALUE.
    assert r["unknown"] == ["CUDA_SUCCESS", "CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND", 0]
    assert r["dtoh"][:2] == ["CUDA_SUCCESS", "CU_GET_PROC_ADDRESS_SUCCESS"] and r["dtoh"][2]
    assert r["future"][0] == "CUDA_ERROR_INVALID_VALUE"
    assert r["ptds"] == ["CUDA_SUCCESS"]
    assert r["names"] == ["CUDA_ERROR_INVALID_VALUE", "invalid argument"]
    if simenv.is_simulated():
        # Versioned requests get the ABI of that version: two distinct functions.
        assert r["bind12"][2] and r["bind13"][2] and r["bind12"][2] != r["bind13"][2]


@sim_only
def test_versioned_abi_matches_exports(spawn):
    w = spawn()
    r = w("""
lib = ctypes.CDLL("libcuda.so.1")
def addr(sym):
    return ctypes.cast(getattr(lib, sym), ctypes.c_void_p).value
def q(name, ver):
    return int(cu.cuGetProcAddress(name, ver, 0)[1])
result = [q(b"cuMemcpyDtoH", 3020) == addr("cuMemcpyDtoH_v2"),
          q(b"cuMulticastBindMem", 13010) == addr("cuMulticastBindMem_v2"),
          q(b"cuMulticastBindMem", 12010) == addr("cuMulticastBindMem"),
          q(b"cuCtxSynchronize", 13000) == addr("cuCtxSynchronize_v2"),
          q(b"cuCtxSynchronize", 12000) == addr("cuCtxSynchronize"),
          q(b"cuMemGetInfo", 3020) == addr("cuMemGetInfo_v2"),
          cu.cuGetProcAddress(b"cuMemCreate", 10010, 0)[2].name]
""")
    assert r[:6] == [True] * 6
    assert r[6] == "CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT"


@sim_only
def test_every_resolver_request_is_answered_without_crash(spawn):
    """All 526 requests cuda.bindings 13.5 makes: each resolves or is not found."""
    path = simenv.REPO / "specs" / "records" / "cuda-bindings-13.5-resolver-requests.txt"
    reqs = [ln.split() for ln in path.read_text().splitlines() if ln.strip()]
    assert len(reqs) == 526, f"{path} should list cuda.bindings 13.5's 526 requests"
    w = spawn()
    r = w(f"""
reqs = {[(n, int(v[1:])) for n, v in reqs]!r}
out = {{}}
for n, v in reqs:
    res = cu.cuGetProcAddress(n.encode(), v, 0)
    out[n + "@" + str(v)] = [res[0].name, res[2].name]
result = out
""")
    assert len(r) == len(reqs)
    assert {v[0] for v in r.values()} == {"CUDA_SUCCESS"}
    found = {k for k, v in r.items() if v[1] == "CU_GET_PROC_ADDRESS_SUCCESS"}
    for must in ("cuMemCreate@10020", "cuMulticastBindAddr@13010", "cuCheckpointProcessLock@12080"):
        assert must in found


def test_calls_before_init_fail(namespace):
    p = simenv.run_python(DRIVER_PROBE, "before-init", env=simenv.sim_env(namespace=namespace))
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "CUDA_ERROR_NOT_INITIALIZED"
