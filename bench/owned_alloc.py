"""What owning cudaMalloc memory costs: cuMemAlloc/cuMemFree per call, and memory.

Four processes of the same program, on a real GPU (``--driver system``, the default) or
the simulated driver (``--driver sim``, which does not pack small blocks as the driver
does: its memory figures are 2 MiB a block in every mode): the driver alone (no shim),
the shim with ownership off (``SNAPSHOT_SHIM_OWN_ALLOCATIONS=0``: what the shim's
interception alone costs), the shim owning the memory (the default: requests of at least
the granularity) and owning small requests too (``SNAPSHOT_SHIM_OWN_SMALL=1``: a
granularity each). Each allocates ``count`` blocks of each size from 512 B to 1 GiB,
then frees them, and reports the mean ns per call of each, and the device memory the
driver reports used (``cuMemGetInfo``) for many small blocks against the bytes asked
for, and for a CuPy-like job's small arrays. With ``--torch``, a PyTorch job with its
default allocator (tests/gpu/torch_ipc_job.py ``single``) under the shim with and without
ownership, and the GPU memory nvidia-smi reports used by it.

    python3 bench/owned_alloc.py [--driver sim] [--torch] [--out FILE]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SIZES = [512, 4 << 10, 64 << 10, 1 << 20, 2 << 20, 16 << 20, 256 << 20, 1 << 30]
SMALL_BLOCKS = [(512, 20000), (64 << 10, 2000), (1 << 20, 200), ((2 << 20) + (64 << 10), 100)]
# A CuPy-like job: its memory pool asks cudaMalloc for each small array's size rounded
# to 512 B (no arena), here 1000 arrays cycling through these sizes.
CUPY_LIKE = [512, 4 << 10, 32 << 10, 256 << 10]
CUPY_COUNT = 1000
ROOT = Path(__file__).resolve().parents[1]


def count_for(size: int, cap: int) -> int:
    n = 2000 if size <= (2 << 20) else 200 if size <= (16 << 20) else 20 if size < (1 << 30) else 5
    return min(n, cap) if cap else n


def worker(cap: int) -> None:
    lib = ctypes.CDLL("libcuda.so.1")

    def ok(r: int, what: str) -> None:
        if r != 0:
            raise SystemExit(f"{what} failed: CUresult {r}")

    ok(lib.cuInit(0), "cuInit")
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    ok(lib.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
    ok(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    ok(lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    alloc, free = lib.cuMemAlloc_v2, lib.cuMemFree_v2
    free.argtypes = [ctypes.c_uint64]

    def used() -> int:
        f, t = ctypes.c_size_t(), ctypes.c_size_t()
        ok(lib.cuMemGetInfo_v2(ctypes.byref(f), ctypes.byref(t)), "cuMemGetInfo")
        return t.value - f.value

    out: dict[str, Any] = {"calls": [], "small_blocks": []}
    ptr = ctypes.c_uint64()
    for size in [512, 1 << 20]:  # warm up: the shim's server, the driver's pools
        ok(alloc(ctypes.byref(ptr), ctypes.c_size_t(size)), "cuMemAlloc")
        ok(free(ptr.value), "cuMemFree")
    for size in SIZES:
        n = count_for(size, cap)
        ptrs = []
        start = time.perf_counter_ns()
        for _ in range(n):
            ok(alloc(ctypes.byref(ptr), ctypes.c_size_t(size)), f"cuMemAlloc({size})")
            ptrs.append(ptr.value)
        mid = time.perf_counter_ns()
        for p in ptrs:
            ok(free(p), "cuMemFree")
        end = time.perf_counter_ns()
        out["calls"].append(
            {"size": size, "count": n, "alloc_ns": (mid - start) / n, "free_ns": (end - mid) / n}
        )
    for size, n in SMALL_BLOCKS:
        n = min(n, cap) if cap else n
        before = used()
        ptrs = []
        for _ in range(n):
            ok(alloc(ctypes.byref(ptr), ctypes.c_size_t(size)), "cuMemAlloc")
            ptrs.append(ptr.value)
        grown = used() - before
        for p in ptrs:
            ok(free(p), "cuMemFree")
        out["small_blocks"].append(
            {
                "size": size,
                "count": n,
                "asked": size * n,
                "used": grown,
                "overhead": grown / (size * n) - 1,
            }
        )
    n = min(CUPY_COUNT, cap) if cap else CUPY_COUNT
    sizes = [CUPY_LIKE[k % len(CUPY_LIKE)] for k in range(n)]
    before = used()
    ptrs = []
    for size in sizes:
        ok(alloc(ctypes.byref(ptr), ctypes.c_size_t(size)), "cuMemAlloc")
        ptrs.append(ptr.value)
    grown = used() - before
    for p in ptrs:
        ok(free(p), "cuMemFree")
    asked = sum(sizes)
    out["cupy_like"] = {
        "count": n,
        "asked": asked,
        "used": grown,
        "overhead": grown / asked - 1,
    }
    print(json.dumps(out), flush=True)


def run_worker(env: dict[str, str], cap: int) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, __file__, "worker", str(cap)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    if proc.returncode != 0:
        raise SystemExit(f"worker failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def gpu_used_mib() -> int | None:
    smi = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=False,
    )
    try:
        return int(smi.stdout.split()[0])
    except (IndexError, ValueError):
        return None


def torch_memory(env: dict[str, str]) -> dict[str, Any]:
    job = subprocess.Popen(
        [sys.executable, str(ROOT / "tests/gpu/torch_ipc_job.py"), "single"],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert job.stdin and job.stdout
    idle = gpu_used_mib()
    try:
        json.loads(job.stdout.readline())
        used = gpu_used_mib()
    finally:
        job.stdin.write("quit\n")
        job.stdin.flush()
        job.wait(timeout=120)
    return {"gpu_used_mib": used, "before_mib": idle}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--driver", choices=("system", "sim"), default="system")
    parser.add_argument("--torch", action="store_true")
    parser.add_argument(
        "--max-count",
        type=int,
        default=0,
        help="at most this many blocks of a size (the simulated driver: one memfd a block)",
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    from cuinterpose import launch
    from cuinterpose.demo import coordinator_env

    control = Path(tempfile.mkdtemp(prefix="cip-alloc-"))
    control.chmod(0o700)
    base = coordinator_env()
    plain = launch.launch_env(
        driver=args.driver, control_dir=control, base=base, preload_shim=False
    )
    shim = launch.launch_env(driver=args.driver, control_dir=control, base=base)
    modes = {
        "driver": plain,
        "shim_not_owned": {**shim, "SNAPSHOT_SHIM_OWN_ALLOCATIONS": "0"},
        "shim_owned": {**shim, "SNAPSHOT_SHIM_OWN_ALLOCATIONS": "1"},
        "shim_owned_small": {
            **shim,
            "SNAPSHOT_SHIM_OWN_ALLOCATIONS": "1",
            "SNAPSHOT_SHIM_OWN_SMALL": "1",
        },
    }
    result: dict[str, Any] = {"driver": args.driver, "modes": {}}
    for name, env in modes.items():
        result["modes"][name] = run_worker(env, args.max_count)
    rows = zip(*(result["modes"][m]["calls"] for m in modes), strict=True)
    print(f"{'size':>10} " + " ".join(f"{m + ' alloc/free ns':>34}" for m in modes))
    for per_mode in rows:
        cells = " ".join(f"{c['alloc_ns']:>16.0f} {c['free_ns']:>16.0f} " for c in per_mode)
        print(f"{per_mode[0]['size']:>10} {cells}")
    for m in modes:
        for b in result["modes"][m]["small_blocks"]:
            print(
                f"{m}: {b['count']} x {b['size']} B asked {b['asked']} used {b['used']} "
                f"(overhead {b['overhead']:+.2%})"
            )
        c = result["modes"][m]["cupy_like"]
        print(
            f"{m}: CuPy-like {c['count']} arrays asked {c['asked']} used {c['used']} "
            f"(overhead {c['overhead']:+.2%})"
        )
    if args.torch:
        torch_env = {k: v for k, v in shim.items() if k != "PYTORCH_CUDA_ALLOC_CONF"}
        result["torch"] = {
            own: torch_memory({**torch_env, "SNAPSHOT_SHIM_OWN_ALLOCATIONS": own})
            for own in ("0", "1")
        }
        print("torch single job, nvidia-smi used MiB:", json.dumps(result["torch"]))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["worker"]:
        worker(int(sys.argv[2]))
    else:
        sys.exit(main())
