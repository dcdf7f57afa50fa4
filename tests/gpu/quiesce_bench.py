"""The open gate's cost per call (specs/quiesce.md): a launch-heavy loop with and without
the shim preloaded, in nanoseconds per call.

    python tests/gpu/quiesce_bench.py [--driver sim|system] [--calls N] [--repeats R]

A small C program (compiled here with ``cc``) resolves the driver's entry points with
``dlsym`` (the shim substitutes its gated wrappers there, as for any application) and
times, on one non-blocking stream of device 0: ``cuEventRecord`` (a launch),
``cuMemsetD8Async`` of one byte (a launch that queues device work) and
``cuStreamSynchronize`` of an idle stream (a synchronizing call). Each loop runs
``--repeats`` times; the median ns/call of each, with and without the shim, and their
difference are printed as one JSON object. ``--driver sim`` (default) uses the simulated
driver of ``build/``; ``system`` the machine's (on the H200). Never uses multicast.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

PROGRAM = r"""
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

typedef int CUresult;
typedef void *CUstream;
typedef void *CUevent;
typedef void *CUcontext;
typedef unsigned long long CUdeviceptr;

static void *need(void *lib, const char *name)
{
    void *p = dlsym(lib, name);
    if (!p) {
        fprintf(stderr, "no %s\n", name);
        exit(2);
    }
    return p;
}

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e9 + ts.tv_nsec;
}

#define CHECK(x)                                                                   \
    do {                                                                           \
        CUresult r_ = (x);                                                         \
        if (r_) {                                                                  \
            fprintf(stderr, "%s: %d\n", #x, r_);                                   \
            exit(3);                                                               \
        }                                                                          \
    } while (0)

int main(int argc, char **argv)
{
    long n = argc > 1 ? atol(argv[1]) : 100000;
    void *lib = dlopen("libcuda.so.1", RTLD_NOW);
    CUresult (*init)(unsigned) = need(lib, "cuInit");
    CUresult (*dev_get)(int *, int) = need(lib, "cuDeviceGet");
    CUresult (*retain)(CUcontext *, int) = need(lib, "cuDevicePrimaryCtxRetain");
    CUresult (*set)(CUcontext) = need(lib, "cuCtxSetCurrent");
    CUresult (*stream_create)(CUstream *, unsigned) = need(lib, "cuStreamCreate");
    CUresult (*event_create)(CUevent *, unsigned) = need(lib, "cuEventCreate");
    CUresult (*record)(CUevent, CUstream) = need(lib, "cuEventRecord");
    CUresult (*sync)(CUstream) = need(lib, "cuStreamSynchronize");
    CUresult (*alloc)(CUdeviceptr *, size_t) = need(lib, "cuMemAlloc_v2");
    CUresult (*memset8)(CUdeviceptr, unsigned char, size_t, CUstream) =
        need(lib, "cuMemsetD8Async");
    int dev;
    CUcontext ctx;
    CUstream s;
    CUevent ev;
    CUdeviceptr p;
    double t0, rec, set_ns, syn;

    CHECK(init(0));
    CHECK(dev_get(&dev, 0));
    CHECK(retain(&ctx, dev));
    CHECK(set(ctx));
    CHECK(stream_create(&s, 1));
    CHECK(event_create(&ev, 2)); /* CU_EVENT_DISABLE_TIMING */
    CHECK(alloc(&p, 4096));
    t0 = now();
    for (long i = 0; i < n; i++)
        CHECK(record(ev, s));
    rec = (now() - t0) / n;
    CHECK(sync(s));
    t0 = now();
    for (long i = 0; i < n; i++)
        CHECK(memset8(p, (unsigned char)i, 1, s));
    set_ns = (now() - t0) / n;
    CHECK(sync(s));
    t0 = now();
    for (long i = 0; i < n; i++)
        CHECK(sync(s));
    syn = (now() - t0) / n;
    printf("{\"cuEventRecord\": %.1f, \"cuMemsetD8Async\": %.1f, \"cuStreamSynchronize\": %.1f}\n",
           rec, set_ns, syn);
    return 0;
}
"""


def build(tmp: Path) -> Path:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise SystemExit("no C compiler (cc) on this machine")
    src, exe = tmp / "gate_bench.c", tmp / "gate_bench"
    src.write_text(PROGRAM)
    subprocess.run([cc, "-O2", "-o", str(exe), str(src), "-ldl"], check=True)
    return exe


def run(exe: Path, env: dict[str, str], calls: int) -> dict[str, float]:
    out = subprocess.run(
        [str(exe), str(calls)], env=env, capture_output=True, text=True, check=False, timeout=600
    )
    if out.returncode != 0:
        raise SystemExit(f"gate_bench failed ({out.returncode}): {out.stderr[-2000:]}")
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--driver", choices=("sim", "system"), default="sim")
    parser.add_argument("--build", default=str(REPO / "build"), help="the release build")
    parser.add_argument("--calls", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    build_dir = Path(args.build)
    shim = build_dir / "shim_c" / "libcuinterpose.so"
    if not shim.is_file():
        raise SystemExit(f"{shim} missing: run `make build`")
    plain = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    plain.update(
        NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1"
    )
    if args.driver == "sim":
        sim = str(build_dir / "shim_c" / "sim")
        plain["LD_LIBRARY_PATH"] = sim + os.pathsep + plain.get("LD_LIBRARY_PATH", "")
    control = tempfile.mkdtemp(prefix="cuip-bench-")
    shimmed = {**plain, "LD_PRELOAD": str(shim), "SNAPSHOT_CONTROL_DIR": control}
    with tempfile.TemporaryDirectory(prefix="cuip-gate-") as tmp:
        exe = build(Path(tmp))
        runs: dict[str, list[dict[str, float]]] = {"without": [], "with": []}
        for _ in range(args.repeats):  # interleaved: drift hits both alike
            runs["without"].append(run(exe, plain, args.calls))
            runs["with"].append(run(exe, shimmed, args.calls))
    shutil.rmtree(control, ignore_errors=True)
    calls = list(runs["without"][0])
    median = {
        side: {c: statistics.median(r[c] for r in rs) for c in calls} for side, rs in runs.items()
    }
    result = {
        "driver": args.driver,
        "calls_per_loop": args.calls,
        "repeats": args.repeats,
        "ns_per_call_without_shim": median["without"],
        "ns_per_call_with_shim": median["with"],
        "shim_overhead_ns": {c: round(median["with"][c] - median["without"][c], 1) for c in calls},
    }
    json.dump(result, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
