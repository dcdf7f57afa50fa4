"""Run the hash kernel the shim carries (shim_c/keep_hash_ptx.h) over the known-answer
vectors on whatever libcuda.so.1 the environment gives (the simulator's C twin, or a GPU),
and print one JSON line: every vector's chunk hashes as the kernel computed them.

Launched as the shim launches it (shim_c/keep.c): blockDim.x 256, one block per 2 MiB
chunk, arguments (device words, word count, output)."""

from __future__ import annotations

import ctypes
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from cuda.bindings import driver as cu

from tests.keephash import reference


def check(result: tuple[object, ...]) -> object:
    err, *rest = result
    if err != cu.CUresult.CUDA_SUCCESS:
        raise SystemExit(f"{err}")
    return rest[0] if len(rest) == 1 else rest


def main() -> None:
    check(cu.cuInit(0))
    dev = check(cu.cuDeviceGet(0))
    ctx = check(cu.cuDevicePrimaryCtxRetain(dev))
    check(cu.cuCtxSetCurrent(ctx))
    mod = check(cu.cuModuleLoadData(reference.ptx().encode() + b"\0"))
    fn = check(cu.cuModuleGetFunction(mod, b"cuip_keep_hash"))
    stream = check(cu.cuStreamCreate(0))
    out: list[list[list[str]]] = []
    for v in reference.vectors():
        words = int(v["words"])  # type: ignore[call-overload]
        raw = reference.vector_data(v)
        chunks = -(-words // reference.CHUNK_WORDS)
        src = int(check(cu.cuMemAlloc(len(raw))))  # type: ignore[call-overload]
        dst = int(check(cu.cuMemAlloc(16 * chunks)))  # type: ignore[call-overload]
        check(cu.cuMemcpyHtoD(src, raw, len(raw)))
        args = [ctypes.c_uint64(src), ctypes.c_uint64(words), ctypes.c_uint64(dst)]
        params = (ctypes.c_void_p * 3)(*(ctypes.addressof(a) for a in args))
        check(cu.cuLaunchKernel(fn, chunks, 1, 1, 256, 1, 1, 0, stream,
                                ctypes.addressof(params), 0))  # fmt: skip
        check(cu.cuStreamSynchronize(stream))
        got = (ctypes.c_uint64 * (2 * chunks))()
        check(cu.cuMemcpyDtoH(ctypes.addressof(got), dst, 16 * chunks))
        out.append([[f"{got[2 * c]:016x}", f"{got[2 * c + 1]:016x}"] for c in range(chunks)])
        check(cu.cuMemFree(src))
        check(cu.cuMemFree(dst))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
