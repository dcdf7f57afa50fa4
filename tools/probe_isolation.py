"""Probe: does an importer of a legacy IPC handle reach only the range it was handed?

Two 4 KiB cuMemAllocs A and B in a creator (the driver puts B at A + 4096), the creator
fills B with a secret, shares A by cuIpcGetMemHandle, an importer opens it at A' and
copies from A' (must work), A' + 4096 and the 2 MiB around A' (must fail, as under the
driver: CUDA_ERROR_INVALID_VALUE). Run for three setups: the driver alone, the shim
(default: small requests are the driver's), the shim with SNAPSHOT_SHIM_OWN_SMALL=1 (a
granularity each: A' + 4096 is A's own padding, never B). One JSON line per setup, and
``verdict`` ok when no importer ever read B's secret.

    python3 tools/probe_isolation.py [--driver sim] [--out FILE]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

SMALL = 4096
SECRET = 0x5A


def worker() -> None:
    lib = ctypes.CDLL("libcuda.so.1")

    def name(r: int) -> str:
        s = ctypes.c_char_p()
        lib.cuGetErrorName(r, ctypes.byref(s))
        return (s.value or b"?").decode()

    def ok(r: int, what: str) -> None:
        if r != 0:
            raise SystemExit(f"{what}: {name(r)}")

    class Handle(ctypes.Structure):
        _fields_ = [("reserved", ctypes.c_char * 64)]

    ok(lib.cuInit(0), "cuInit")
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    ok(lib.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
    ok(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    ok(lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    lib.cuMemsetD8_v2.argtypes = [ctypes.c_uint64, ctypes.c_ubyte, ctypes.c_size_t]
    lib.cuMemcpyDtoH_v2.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t]
    lib.cuIpcGetMemHandle.argtypes = [ctypes.POINTER(Handle), ctypes.c_uint64]
    lib.cuIpcOpenMemHandle_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), Handle, ctypes.c_uint]
    for line in sys.stdin:
        cmd = json.loads(line)
        op, out = cmd["op"], {}
        if op == "alloc":
            p = ctypes.c_uint64()
            ok(lib.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(cmd["size"])), "cuMemAlloc")
            ok(lib.cuMemsetD8_v2(p.value, cmd["byte"], cmd["size"]), "cuMemsetD8")
            out = {"va": p.value}
        elif op == "ipc_get":
            h = Handle()
            ok(lib.cuIpcGetMemHandle(ctypes.byref(h), cmd["va"]), "cuIpcGetMemHandle")
            out = {"handle": ctypes.string_at(ctypes.addressof(h), 64).hex()}
        elif op == "ipc_open":
            h = Handle()
            ctypes.memmove(ctypes.addressof(h), bytes.fromhex(cmd["handle"]), 64)
            p = ctypes.c_uint64()
            r = lib.cuIpcOpenMemHandle_v2(ctypes.byref(p), h, 1)
            out = {"result": name(r), "va": p.value}
        elif op == "copy":
            buf = (ctypes.c_ubyte * cmd["size"])()
            r = lib.cuMemcpyDtoH_v2(buf, cmd["va"], cmd["size"])
            out = {"result": name(r), "secret": r == 0 and SECRET in bytes(buf)}
        print(json.dumps(out), flush=True)


class Proc:
    def __init__(self, env: dict[str, str]) -> None:
        self.p = subprocess.Popen(
            [sys.executable, __file__, "worker"],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def __call__(self, **cmd: Any) -> dict[str, Any]:
        assert self.p.stdin and self.p.stdout
        self.p.stdin.write(json.dumps(cmd) + "\n")
        self.p.stdin.flush()
        line = self.p.stdout.readline()
        if not line:
            raise SystemExit(f"worker failed on {cmd}: exit {self.p.wait()}")
        return dict(json.loads(line))

    def close(self) -> None:
        assert self.p.stdin
        self.p.stdin.close()
        self.p.wait(timeout=60)


def probe(setup: str, env: dict[str, str]) -> dict[str, Any]:
    creator, importer = Proc(env), Proc(env)
    try:
        a = creator(op="alloc", size=SMALL, byte=0x11)["va"]
        b = creator(op="alloc", size=SMALL, byte=SECRET)["va"]
        handle = creator(op="ipc_get", va=a)["handle"]
        opened = importer(op="ipc_open", handle=handle)
        result: dict[str, Any] = {
            "setup": setup,
            "b_minus_a": b - a,
            "shim_handle": bytes.fromhex(handle)[:4] == b"CUIH",
            "open": opened["result"],
        }
        if opened["result"] == "CUDA_SUCCESS":
            va = opened["va"]
            around = va & ~((2 << 20) - 1)
            result["copy_range"] = importer(op="copy", va=va, size=SMALL)
            result["copy_next_4k"] = importer(op="copy", va=va + SMALL, size=SMALL)
            result["copy_2mib_around"] = importer(op="copy", va=around, size=2 << 20)
        leaked = any(isinstance(v, dict) and v.get("secret") for v in result.values())
        if leaked:
            result["verdict"] = "LEAK: the importer read B's bytes"
        elif opened["result"] != "CUDA_SUCCESS":
            result["verdict"] = "FAILED: the open itself failed"
        else:
            result["verdict"] = "ok"
        return result
    finally:
        creator.close()
        importer.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--driver", choices=("system", "sim"), default="system")
    args = parser.parse_args()
    from cuinterpose import launch
    from cuinterpose.demo import coordinator_env

    control = Path(tempfile.mkdtemp(prefix="cip-iso-"))
    control.chmod(0o700)
    base = coordinator_env()
    plain = launch.launch_env(
        driver=args.driver, control_dir=control, base=base, preload_shim=False
    )
    shim = launch.launch_env(driver=args.driver, control_dir=control, base=base)
    setups = {
        "driver": plain,
        "shim_default": shim,
        "shim_own_small": {**shim, "SNAPSHOT_SHIM_OWN_SMALL": "1"},
    }
    rows = [probe(name, env) for name, env in setups.items()]
    text = "\n".join(json.dumps(r) for r in rows)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0 if all(r["verdict"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    if sys.argv[1:2] == ["worker"]:
        worker()
    else:
        sys.exit(main())
