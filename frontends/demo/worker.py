"""A scriptable CUDA VMM application: one JSON command per line on stdin, one JSON reply
per line on stdout.

It uses nothing but ``cuda.bindings.driver`` and the standard library, so it runs the
same on the simulated driver, on a real GPU, with or without the shim preloaded. File
descriptors (capabilities, or raw FDs) travel over the socket given by ``--channel``
(SCM_RIGHTS); the controller relays them between workers.

Every reply has ``ok``; a failed CUDA call answers ``{"ok": false, "call": NAME,
"result": "CUDA_ERROR_...", "error": TEXT}`` and the worker keeps running.

Commands (``op`` plus arguments; integers for handles, addresses and FDs):
  granularity                         -> granularity (minimum, device 0 or ``device``)
  create size [handle_type posix|none|fabric] [device]      -> handle
  reserve size [align] [addr]         -> va
  map va size handle [offset] [flags]
  set_access va size [devices [0]] [access rw|r|none]
  fill va size seed                   writes the seeded pattern (see ``pattern``)
  digest va size                      -> digest (sha256 hex of the bytes)
  export handle [handle_type posix]   -> fd
  send_fd fd [close]                  sends fd over the channel
  recv_fd                             -> fd received over the channel
  import fd [handle_type posix] [close true]  -> handle
  unmap va size | release handle | retain va -> handle | address_free va size
  alloc size -> va (cuMemAlloc) | free va | address_range va -> base, size
  ipc_get va -> handle (64 bytes, hex) | ipc_open handle -> va | ipc_close va
  close fd | sync | pid -> pid | mem_info -> free, total | device -> name, driver_version
  host_copy va size                   DtoH and HtoD through pinned memory -> seconds, GB/s
  exec code                           runs a Python snippet -> result (what it left in ``result``)
  quit

``exec`` (the test harness's way in): every snippet runs in one namespace that holds
``cu``, ``os``, ``check(r)`` (a call's value, or RuntimeError naming the CUresult),
``err(r)`` (the CUresult's name) and ``send_fd(fd)`` / ``recv_fd()`` over the channel; a
snippet that raises answers ``{"ok": false, "error": TEXT, "trace": TRACEBACK}``.

With ``--no-cuda-init`` the worker touches no CUDA call before a command needs it:
snippets then set up CUDA themselves (the first other command initializes it as usual).
Replies go to the stdout the worker started with; anything else written to stdout
(a snippet's ``print``, a library's message) lands on stderr.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import random
import socket
import struct
import sys
import time
import traceback
from collections.abc import Iterator
from typing import Any

from cuda.bindings import driver as cu  # type: ignore[import-untyped]

CHUNK = 32 << 20
IPC_HANDLE_SIZE = 64  # CUipcMemHandle


class CudaCallError(Exception):
    def __init__(self, call: str, result: str) -> None:
        super().__init__(f"{call} failed: {result}")
        self.call = call
        self.result = result


def _name(err: Any) -> str:
    name = getattr(err, "name", None)
    return name if isinstance(name, str) else f"CUresult {int(err)}"


def check(call: str, result: Any) -> Any:
    err = result[0] if isinstance(result, tuple) else result
    if err != cu.CUresult.CUDA_SUCCESS:
        raise CudaCallError(call, _name(err))
    if isinstance(result, tuple):
        rest = result[1:]
        return rest[0] if len(rest) == 1 else rest
    return None


def _tiles(seed: int, size: int) -> Iterator[tuple[bytearray, int]]:
    """(tile, length) per chunk of the pattern; the same tile is rewritten in place."""
    tile = bytearray(random.Random(seed).randbytes(min(size, CHUNK)))
    for index, off in enumerate(range(0, size, CHUNK)):
        n = min(CHUNK, size - off)
        head = struct.pack("<QQ", seed, index)[: min(16, n)]
        tile[: len(head)] = head
        yield tile, n


def pattern(seed: int, size: int) -> list[bytes]:
    """The bytes ``fill`` writes, as chunks: a seeded random tile of up to 32 MiB whose
    first 16 bytes are replaced, chunk by chunk, by (seed, chunk index)."""
    return [bytes(tile[:n]) for tile, n in _tiles(seed, size)]


HANDLE_TYPES = {
    "none": cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_NONE,
    "posix": cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
    "fabric": cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_FABRIC,
}
ACCESS = {
    "rw": cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    "r": cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READ,
    "none": cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_NONE,
}


class Worker:
    def __init__(self, channel: socket.socket | None, device: int) -> None:
        self.channel = channel
        check("cuInit", cu.cuInit(0))
        self.device = check("cuDeviceGet", cu.cuDeviceGet(device))
        self.device_index = device
        ctx = check("cuDevicePrimaryCtxRetain", cu.cuDevicePrimaryCtxRetain(self.device))
        check("cuCtxSetCurrent", cu.cuCtxSetCurrent(ctx))

    # ---------------------------------------------------------------- helpers
    def _prop(self, handle_type: str, device: int) -> Any:
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = device
        prop.requestedHandleTypes = HANDLE_TYPES[handle_type]
        return prop

    @staticmethod
    def _h(value: int) -> Any:
        return cu.CUmemGenericAllocationHandle(int(value))

    @staticmethod
    def _va(value: int) -> Any:
        return cu.CUdeviceptr(int(value))

    # ---------------------------------------------------------------- commands
    def do_granularity(self, device: int | None = None) -> dict[str, Any]:
        prop = self._prop("posix", self.device_index if device is None else device)
        option = cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
        gran = check(
            "cuMemGetAllocationGranularity", cu.cuMemGetAllocationGranularity(prop, option)
        )
        return {"granularity": int(gran)}

    def do_create(
        self, size: int, handle_type: str = "posix", device: int | None = None
    ) -> dict[str, Any]:
        prop = self._prop(handle_type, self.device_index if device is None else device)
        handle = check("cuMemCreate", cu.cuMemCreate(size, prop, 0))
        return {"handle": int(handle)}

    def do_reserve(self, size: int, align: int = 0, addr: int = 0) -> dict[str, Any]:
        va = check("cuMemAddressReserve", cu.cuMemAddressReserve(size, align, self._va(addr), 0))
        return {"va": int(va)}

    def do_map(
        self, va: int, size: int, handle: int, offset: int = 0, flags: int = 0
    ) -> dict[str, Any]:
        check("cuMemMap", cu.cuMemMap(self._va(va), size, offset, self._h(handle), flags))
        return {}

    def do_set_access(
        self, va: int, size: int, devices: list[int] | None = None, access: str = "rw"
    ) -> dict[str, Any]:
        descs = []
        for dev in [self.device_index] if devices is None else devices:
            desc = cu.CUmemAccessDesc()
            desc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            desc.location.id = dev
            desc.flags = ACCESS[access]
            descs.append(desc)
        check("cuMemSetAccess", cu.cuMemSetAccess(self._va(va), size, descs, len(descs)))
        return {}

    def do_fill(self, va: int, size: int, seed: int) -> dict[str, Any]:
        off = 0
        for tile, n in _tiles(seed, size):
            host = (ctypes.c_char * len(tile)).from_buffer(tile)
            try:
                check(
                    "cuMemcpyHtoD", cu.cuMemcpyHtoD(self._va(va + off), ctypes.addressof(host), n)
                )
            finally:
                del host
            off += n
        check("cuCtxSynchronize", cu.cuCtxSynchronize())
        return {}

    def do_digest(self, va: int, size: int) -> dict[str, Any]:
        digest = hashlib.sha256()
        buf = bytearray(min(size, CHUNK))
        host = (ctypes.c_char * len(buf)).from_buffer(buf)
        for off in range(0, size, CHUNK):
            n = min(CHUNK, size - off)
            check("cuMemcpyDtoH", cu.cuMemcpyDtoH(ctypes.addressof(host), self._va(va + off), n))
            digest.update(memoryview(buf)[:n])
        del host
        return {"digest": digest.hexdigest()}

    def do_export(self, handle: int, handle_type: str = "posix") -> dict[str, Any]:
        fd = check(
            "cuMemExportToShareableHandle",
            cu.cuMemExportToShareableHandle(self._h(handle), HANDLE_TYPES[handle_type], 0),
        )
        return {"fd": int(fd)}

    def _channel(self) -> socket.socket:
        if self.channel is None:
            raise RuntimeError("this worker was started without --channel")
        return self.channel

    def do_send_fd(self, fd: int, close: bool = False) -> dict[str, Any]:
        socket.send_fds(self._channel(), [b"F"], [fd])
        if close:
            os.close(fd)
        return {}

    def do_recv_fd(self) -> dict[str, Any]:
        _, fds, _, _ = socket.recv_fds(self._channel(), 1, 4)
        if len(fds) != 1:
            for extra in fds:
                os.close(extra)
            raise RuntimeError(f"expected one FD on the channel, got {len(fds)}")
        return {"fd": fds[0]}

    def do_import(self, fd: int, handle_type: str = "posix", close: bool = True) -> dict[str, Any]:
        try:
            handle = check(
                "cuMemImportFromShareableHandle",
                cu.cuMemImportFromShareableHandle(fd, HANDLE_TYPES[handle_type]),
            )
        finally:
            if close:
                os.close(fd)
        return {"handle": int(handle)}

    def do_unmap(self, va: int, size: int) -> dict[str, Any]:
        check("cuMemUnmap", cu.cuMemUnmap(self._va(va), size))
        return {}

    def do_release(self, handle: int) -> dict[str, Any]:
        check("cuMemRelease", cu.cuMemRelease(self._h(handle)))
        return {}

    def do_retain(self, va: int) -> dict[str, Any]:
        handle = check("cuMemRetainAllocationHandle", cu.cuMemRetainAllocationHandle(va))
        return {"handle": int(handle)}

    def do_address_free(self, va: int, size: int) -> dict[str, Any]:
        check("cuMemAddressFree", cu.cuMemAddressFree(self._va(va), size))
        return {}

    def do_alloc(self, size: int) -> dict[str, Any]:
        return {"va": int(check("cuMemAlloc", cu.cuMemAlloc(size)))}

    def do_free(self, va: int) -> dict[str, Any]:
        check("cuMemFree", cu.cuMemFree(self._va(va)))
        return {}

    def do_address_range(self, va: int) -> dict[str, Any]:
        base, size = check("cuMemGetAddressRange", cu.cuMemGetAddressRange(self._va(va)))
        return {"base": int(base), "size": int(size)}

    def do_ipc_get(self, va: int) -> dict[str, Any]:
        handle = check("cuIpcGetMemHandle", cu.cuIpcGetMemHandle(self._va(va)))
        return {"handle": ctypes.string_at(handle.getPtr(), IPC_HANDLE_SIZE).hex()}

    def do_ipc_open(self, handle: str) -> dict[str, Any]:
        raw = ctypes.create_string_buffer(bytes.fromhex(handle), IPC_HANDLE_SIZE)
        ipc = cu.CUipcMemHandle(_ptr=ctypes.addressof(raw))
        lazy = cu.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
        return {"va": int(check("cuIpcOpenMemHandle", cu.cuIpcOpenMemHandle(ipc, lazy)))}

    def do_ipc_close(self, va: int) -> dict[str, Any]:
        check("cuIpcCloseMemHandle", cu.cuIpcCloseMemHandle(self._va(va)))
        return {}

    def do_close(self, fd: int) -> dict[str, Any]:
        os.close(fd)
        return {}

    def do_sync(self) -> dict[str, Any]:
        check("cuCtxSynchronize", cu.cuCtxSynchronize())
        return {}

    def do_device(self) -> dict[str, Any]:
        raw = check("cuDeviceGetName", cu.cuDeviceGetName(256, self.device))
        name = bytes(raw).split(b"\0", 1)[0].decode(errors="replace")
        version = check("cuDriverGetVersion", cu.cuDriverGetVersion())
        return {"name": name, "driver_version": int(version)}

    def do_pid(self) -> dict[str, Any]:
        return {"pid": os.getpid()}

    def do_mem_info(self) -> dict[str, Any]:
        free, total = check("cuMemGetInfo", cu.cuMemGetInfo())
        return {"free": int(free), "total": int(total)}

    def do_host_copy(self, va: int, size: int) -> dict[str, Any]:
        host = check("cuMemHostAlloc", cu.cuMemHostAlloc(size, 0))
        try:
            check("cuCtxSynchronize", cu.cuCtxSynchronize())
            start = time.perf_counter()
            check("cuMemcpyDtoH", cu.cuMemcpyDtoH(host, self._va(va), size))
            mid = time.perf_counter()
            check("cuMemcpyHtoD", cu.cuMemcpyHtoD(self._va(va), host, size))
            check("cuCtxSynchronize", cu.cuCtxSynchronize())
            end = time.perf_counter()
        finally:
            check("cuMemFreeHost", cu.cuMemFreeHost(host))
        return {
            "dtoh_s": mid - start,
            "htod_s": end - mid,
            "dtoh_gbps": size / (mid - start) / 1e9,
            "htod_gbps": size / (end - mid) / 1e9,
        }


class Snippets:
    """The ``exec`` command: Python snippets run one after another in one namespace."""

    def __init__(self, channel: socket.socket | None) -> None:
        self.channel = channel
        self.namespace: dict[str, Any] = {
            "cu": cu,
            "os": os,
            "check": self.check,
            "err": self.err,
            "send_fd": self.send_fd,
            "recv_fd": self.recv_fd,
        }

    @staticmethod
    def check(result: Any) -> Any:
        err = result[0] if isinstance(result, tuple) else result
        if err != cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(cu.cuGetErrorName(err)[1].decode())
        if isinstance(result, tuple):
            rest = result[1:]
            return rest[0] if len(rest) == 1 else rest
        return None

    @staticmethod
    def err(result: Any) -> str:
        e = result[0] if isinstance(result, tuple) else result
        name = getattr(e, "name", None)
        return name if isinstance(name, str) else str(e)

    def _channel(self) -> socket.socket:
        if self.channel is None:
            raise RuntimeError("this worker was started without --channel")
        return self.channel

    def send_fd(self, fd: int) -> None:
        socket.send_fds(self._channel(), [b"F"], [fd])

    def recv_fd(self) -> int:
        _, fds, _, _ = socket.recv_fds(self._channel(), 1, 1)
        return int(fds[0])

    def run(self, code: str) -> dict[str, Any]:
        self.namespace["result"] = None
        try:
            exec(code, self.namespace)
        except Exception as exc:
            text = f"{type(exc).__name__}: {exc}"
            return {"ok": False, "error": text, "trace": traceback.format_exc()}
        return {"ok": True, "result": self.namespace["result"]}


def _setup_failure(exc: Exception) -> dict[str, Any]:
    if isinstance(exc, CudaCallError):
        return {"ok": False, "call": exc.call, "result": exc.result, "error": str(exc)}
    # the driver library could not be loaded, for one
    return {"ok": False, "error": f"CUDA setup: {type(exc).__name__}: {exc}"}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--channel", type=int, default=-1, help="socket FD for SCM_RIGHTS")
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument(
        "--no-cuda-init", action="store_true", help="leave CUDA alone until a command needs it"
    )
    args = parser.parse_args()
    channel = socket.socket(fileno=args.channel) if args.channel >= 0 else None
    # The replies own the stdout this process started with; stray output goes to stderr.
    sys.stdout.flush()
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    snippets = Snippets(channel)
    worker: Worker | None = None
    if not args.no_cuda_init:
        try:
            worker = Worker(channel, args.device)
        except Exception as exc:
            out.write(json.dumps(_setup_failure(exc)) + "\n")
            out.flush()
            return 1
    out.write(json.dumps({"ok": True, "pid": os.getpid(), "ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        if not line.strip():
            continue
        reply: dict[str, Any]
        try:
            cmd = json.loads(line)
            op = cmd.pop("op")
            if op == "quit":
                out.write(json.dumps({"ok": True}) + "\n")
                out.flush()
                return 0
            if op == "exec":
                reply = snippets.run(cmd["code"])
            elif not callable(getattr(Worker, f"do_{op}", None)):
                raise ValueError(f"unknown op {op!r}")
            else:
                if worker is None:
                    worker = Worker(channel, args.device)
                reply = {"ok": True, **getattr(worker, f"do_{op}")(**cmd)}
        except CudaCallError as exc:
            reply = {"ok": False, "call": exc.call, "result": exc.result, "error": str(exc)}
        except Exception as exc:
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        out.write(json.dumps(reply) + "\n")
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
