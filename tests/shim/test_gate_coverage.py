"""Every entry point that launches device work or waits for it passes the gate, by every
path the shim hands out (specs/quiesce.md, "What counts as launching and as
synchronizing"): the shim's own export (what a program linked by name calls), ``dlsym``
of the driver's name, and ``cuGetProcAddress`` (the base name; with
CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM for the ``_ptsz``/``_ptds`` variants).

The test holds the coordinator lease and closes the gate with QUIESCE; a thread of the
worker then calls the entry point. "Held" is observed, not waited for: the thread sleeps
in a futex on the shim's own gate (``/proc/self/task/<tid>/syscall`` names the futex
word, which lies inside the shim's static ``gate``, located from the library's symbol
table). RELEASE opens the gate and the call returns CUDA_SUCCESS. A per-thread variant is
called with stream 0, its thread's default stream: the batch copies' plain ABI refuses
stream 0 (the legacy stream), so their cases also show that each path reaches the driver's
per-thread symbol. One worker serves every case, each starting from an idle device.
"""

from __future__ import annotations

import os
import shutil
import struct
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from cuinterpose.demo import Worker
from cuinterpose.engine import wire

from tests import simenv, snippet
from tests.shim import shimenv

pytestmark = pytest.mark.skipif(
    not simenv.is_simulated(), reason="the cases' arguments are the simulated driver's"
)

Op, Phase, Status = wire.Op, wire.Phase, wire.Status
FUTEX = {"x86_64": 202, "aarch64": 98}  # the futex system call's number
PER_THREAD = 2  # CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM

# (driver symbol, resolver name, version asked of cuGetProcAddress): the entry points
# gated by this change. Their per-thread variants follow, with those of the calls gated
# before (the suffix is cuda.h's: _ptds for the synchronous ones).
NEW = [
    ("cuMemcpy2D_v2", "cuMemcpy2D", 13000),
    ("cuMemcpy2DUnaligned_v2", "cuMemcpy2DUnaligned", 13000),
    ("cuMemcpy3D_v2", "cuMemcpy3D", 13000),
    ("cuMemcpy2DAsync_v2", "cuMemcpy2DAsync", 13000),
    ("cuMemcpy3DAsync_v2", "cuMemcpy3DAsync", 13000),
    ("cuMemcpyPeer", "cuMemcpyPeer", 13000),
    ("cuMemcpyPeerAsync", "cuMemcpyPeerAsync", 13000),
    ("cuMemcpy3DPeer", "cuMemcpy3DPeer", 13000),
    ("cuMemcpy3DPeerAsync", "cuMemcpy3DPeerAsync", 13000),
    ("cuMemcpyBatchAsync", "cuMemcpyBatchAsync", 12080),
    ("cuMemcpyBatchAsync_v2", "cuMemcpyBatchAsync", 13000),
    ("cuMemcpy3DBatchAsync", "cuMemcpy3DBatchAsync", 12080),
    ("cuMemcpy3DBatchAsync_v2", "cuMemcpy3DBatchAsync", 13000),
    ("cuMemAllocAsync", "cuMemAllocAsync", 13000),
    ("cuMemAllocFromPoolAsync", "cuMemAllocFromPoolAsync", 13000),
    ("cuMemFreeAsync", "cuMemFreeAsync", 13000),
    ("cuStreamWaitValue32_v2", "cuStreamWaitValue32", 13000),
    ("cuStreamWaitValue64_v2", "cuStreamWaitValue64", 13000),
    ("cuStreamWriteValue32_v2", "cuStreamWriteValue32", 13000),
    ("cuStreamWriteValue64_v2", "cuStreamWriteValue64", 13000),
    ("cuStreamBatchMemOp_v2", "cuStreamBatchMemOp", 13000),
    # the CUDA 8.0 ABI of the stream memory operations, which the driver still exports
    ("cuStreamWaitValue32", "cuStreamWaitValue32", 11000),
    ("cuStreamWaitValue64", "cuStreamWaitValue64", 11000),
    ("cuStreamWriteValue32", "cuStreamWriteValue32", 11000),
    ("cuStreamWriteValue64", "cuStreamWriteValue64", 11000),
    ("cuStreamBatchMemOp", "cuStreamBatchMemOp", 11000),
    ("cuStreamWaitEvent", "cuStreamWaitEvent", 13000),
    ("cuMemcpyAtoH_v2", "cuMemcpyAtoH", 13000),
    ("cuMemcpyHtoA_v2", "cuMemcpyHtoA", 13000),
    ("cuMemcpyAtoD_v2", "cuMemcpyAtoD", 13000),
    ("cuMemcpyDtoA_v2", "cuMemcpyDtoA", 13000),
    ("cuMemcpyAtoA_v2", "cuMemcpyAtoA", 13000),
    ("cuMemcpyAtoHAsync_v2", "cuMemcpyAtoHAsync", 13000),
    ("cuMemcpyHtoAAsync_v2", "cuMemcpyHtoAAsync", 13000),
    ("cuEventRecordWithFlags", "cuEventRecordWithFlags", 13000),
    ("cuStreamAddCallback", "cuStreamAddCallback", 13000),
    ("cuMemsetD2D8_v2", "cuMemsetD2D8", 13000),
    ("cuMemsetD2D16_v2", "cuMemsetD2D16", 13000),
    ("cuMemsetD2D32_v2", "cuMemsetD2D32", 13000),
    ("cuMemsetD2D8Async", "cuMemsetD2D8Async", 13000),
    ("cuMemsetD2D16Async", "cuMemsetD2D16Async", 13000),
    ("cuMemsetD2D32Async", "cuMemsetD2D32Async", 13000),
]
GATED_BEFORE = [
    ("cuMemcpy", "cuMemcpy", 13000),
    ("cuMemcpyAsync", "cuMemcpyAsync", 13000),
    ("cuMemcpyHtoD_v2", "cuMemcpyHtoD", 13000),
    ("cuMemcpyDtoH_v2", "cuMemcpyDtoH", 13000),
    ("cuMemcpyDtoD_v2", "cuMemcpyDtoD", 13000),
    ("cuMemcpyHtoDAsync_v2", "cuMemcpyHtoDAsync", 13000),
    ("cuMemcpyDtoHAsync_v2", "cuMemcpyDtoHAsync", 13000),
    ("cuMemcpyDtoDAsync_v2", "cuMemcpyDtoDAsync", 13000),
    ("cuMemsetD8_v2", "cuMemsetD8", 13000),
    ("cuMemsetD16_v2", "cuMemsetD16", 13000),
    ("cuMemsetD32_v2", "cuMemsetD32", 13000),
    ("cuMemsetD8Async", "cuMemsetD8Async", 13000),
    ("cuMemsetD16Async", "cuMemsetD16Async", 13000),
    ("cuMemsetD32Async", "cuMemsetD32Async", 13000),
    ("cuStreamSynchronize", "cuStreamSynchronize", 13000),
    ("cuEventRecord", "cuEventRecord", 13000),
    ("cuLaunchHostFunc", "cuLaunchHostFunc", 13000),
]
SYNCHRONOUS = {  # their per-thread variant is _ptds
    "cuMemcpy", "cuMemcpyHtoD_v2", "cuMemcpyDtoH_v2", "cuMemcpyDtoD_v2", "cuMemcpy2D_v2",
    "cuMemcpy2DUnaligned_v2", "cuMemcpy3D_v2", "cuMemcpyPeer", "cuMemcpy3DPeer",
    "cuMemsetD8_v2", "cuMemsetD16_v2", "cuMemsetD32_v2",
    "cuMemsetD2D8_v2", "cuMemsetD2D16_v2", "cuMemsetD2D32_v2",
    "cuMemcpyAtoH_v2", "cuMemcpyHtoA_v2", "cuMemcpyAtoD_v2", "cuMemcpyDtoA_v2", "cuMemcpyAtoA_v2",
}  # fmt: skip


def _per_thread(symbol: str) -> str:
    return symbol + ("_ptds" if symbol in SYNCHRONOUS else "_ptsz")


CASES = [(s, b, v, 0) for s, b, v in NEW] + [
    (_per_thread(s), b, v, PER_THREAD) for s, b, v in NEW + GATED_BEFORE
]
PATHS = ["export", "dlsym", "cuGetProcAddress"]

# The worker's side: resources made once, then per case the call's arguments (made
# while the gate is open), the call on a thread of its own, and the wait for the held
# thread. `ARGS[symbol]` is (argtypes, stream -> args) of the call, without the
# per-thread suffix; a per-thread variant gets stream 0, its thread's default stream.
WORKER_CODE = snippet.load(__file__, "worker_code")


def _elf_symbol(path: Path, name: str) -> tuple[int, int]:
    """(value, size) of a symbol of an ELF64 little-endian file's symbol table."""
    data = path.read_bytes()
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [
        struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)
    ]
    for _, kind, _, _, offset, size, link, _, _, entsize in sections:
        if kind != 2:  # SHT_SYMTAB
            continue
        strings = sections[link][4]
        for k in range(size // entsize):
            at, _, _, _, value, length = struct.unpack_from("<IBBHQQ", data, offset + k * entsize)
            end = data.index(b"\0", strings + at)
            if data[strings + at : end] == name.encode():
                return value, length
    raise LookupError(f"{path}: no symbol {name!r} in its symbol table (stripped?)")


@pytest.fixture(scope="module")
def app() -> Iterator[tuple[Worker, Path]]:
    """One worker with the shim preloaded, set up for every case; its control socket."""
    machine = os.uname().machine
    if machine not in FUTEX:
        pytest.skip(f"the futex system call's number on {machine} is not known here")
    control_dir = Path(tempfile.mkdtemp(prefix="cip-"))  # short: socket paths are limited
    control_dir.chmod(0o700)
    namespace = f"shim-{control_dir.name}"
    shim = shimenv.shim_library()
    gate, size = _elf_symbol(shim, "gate")
    env = shimenv.shim_env(control_dir=control_dir, namespace=namespace)
    worker = Worker("app", env, log_dir=control_dir, wait=False, init_cuda=False)
    worker.send(f"DEV = 0\n{shimenv.WORKER_SETUP}")
    worker.reply()
    real = os.path.realpath(shim)
    worker(
        f"SHIM = {str(shim)!r}\nFUTEX_NR = {FUTEX[machine]}\n"
        "base = min(int(line.split('-')[0], 16) for line in open('/proc/self/maps')\n"
        f"           if line.split()[-1] == {real!r} and int(line.split()[2], 16) == 0)\n"
        f"GATE = (base + {gate}, base + {gate + size})\n" + WORKER_CODE
    )
    try:
        yield worker, shimenv.wait_socket(control_dir, worker.pid)
        worker.close_clean()
    finally:
        Path(f"/dev/shm/cuinterpose-sim-{os.getuid()}-{namespace}").unlink(missing_ok=True)
        shutil.rmtree(control_dir, ignore_errors=True)


def _ask(socket: Path, op: wire.Op, participant: str, lease: bytes) -> wire.Reply:
    return shimenv.request(
        socket, wire.Request(op=op, participant=participant, authorization=lease)
    )[0]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("symbol", "base", "version", "flags"), CASES, ids=[c[0] for c in CASES])
def test_a_closed_gate_holds_the_call_and_an_open_one_lets_it_through(
    app: tuple[Worker, Path], symbol: str, base: str, version: int, flags: int, path: str
) -> None:
    worker, socket = app
    worker(f"prepare({symbol!r}, {base!r}, {version}, {flags}, {path!r})")
    participant = shimenv.handshake(socket).participant
    lease = os.urandom(16)
    assert _ask(socket, Op.HANDSHAKE, "", lease).status == Status.OK
    quiet = _ask(socket, Op.QUIESCE, participant, lease)
    assert (quiet.status, quiet.phase) == (Status.OK, Phase.QUIESCED), quiet.message
    try:
        fired = worker("result = fire()")
    finally:
        released = _ask(socket, Op.RELEASE, "", lease)
    assert fired == {"held": True, "returned": False}, f"{symbol} via {path}: {fired}"
    assert (released.status, released.phase) == (Status.OK, Phase.ACTIVE), released.message
    assert worker("result = finish()") == 0, f"{symbol} via {path}"


# The simulated driver's side of the new entry points, as cuda.h describes them (the
# test above only shows that they answer CUDA_SUCCESS).
SIM_BEHAVIOUR = snippet.load(__file__, "sim_behaviour")


def test_the_simulated_driver_does_what_the_entry_points_promise(
    app: tuple[Worker, Path],
) -> None:
    worker, _ = app
    got = worker(SIM_BEHAVIOUR)
    invalid = 1  # CUDA_ERROR_INVALID_VALUE
    assert got == {
        "2d": 0, "2d_rows": True, "2d_gaps": True,
        "3d": 0, "3d_rows": True,
        "2d_row_over_pitch": invalid, "2d_unknown_array": invalid,
        "array_in": 0, "array_out": 0, "array_round_trip": True, "array_2d": 0,
        "array_2d_bytes": True, "array_2d_past_end": invalid, "array_past_end": invalid,
        "array_destroyed": invalid, "array_three_channels": "CUDA_ERROR_INVALID_VALUE",
        "2d_memset": 0, "2d_memset_rows": True, "2d_memset_gaps": True,
        "2d_memset_narrow_pitch": invalid,
        "callback": 0, "called": True, "callback_flags": invalid, "record_flags": invalid,
        # the legacy stream is refused; stream 0 of a _ptsz call is the thread's own
        "batch_legacy": invalid, "batch_per_thread": 0, "batch_per_thread_resolved": 0,
        "batch_no_attrs": invalid, "batch_bad_second": invalid, "batch_bad_second_index": 1,
        "batch_bad_second_queued_nothing": True,
        "write_barrier_flag": invalid, "write_barrier_flag_v1": 0, "write_misaligned": invalid,
        "wait_host_pointer": invalid, "free_unknown": invalid, "pool_unknown": invalid,
        "wait": 0, "waiting": "CUDA_ERROR_NOT_READY", "memset_before_write": "00000000",
        "write": 0, "memset_after_write": "05000000",
        "alloc": 0, "alloc_usable": "CUDA_SUCCESS", "free": 0, "freed": invalid,
    }  # fmt: skip
