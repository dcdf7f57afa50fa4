"""The demo's multicast team: one object across the demo's processes, one device each.

The first worker creates the object and exports it (a capability through the shim);
the others import it. Each adds its own device, creates a private member allocation on
it filled with its own bytes, binds half the object with ``cuMulticastBindMem`` and the
other half with ``cuMulticastBindAddr`` (the device-explicit form in every other
process), and maps the object read-write. After the restore each member must still
hold its own bytes, and a write through every process's multicast address must reach
every member.

Simulated driver only: ``cuMulticastCreate`` can take a shared host's GPUs out of
service, so :func:`allowed` says no for every other driver.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from typing import ClassVar, Final

import attrs

from .worker_client import Worker

SIM_DEVICES_ENV: Final = "CUINTERPOSE_SIM_DEVICES"

# Run once in each worker: its own device's context is pushed around every call of
# the team (the worker's commands run on device 0).
SETUP: Final = r"""
import ctypes, hashlib, random
MC_CTX = check(cu.cuDevicePrimaryCtxRetain(check(cu.cuDeviceGet(MC_DEV))))
MC_POSIX = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
def mc_in(fn):
    check(cu.cuCtxPushCurrent(MC_CTX))
    try:
        return fn()
    finally:
        check(cu.cuCtxPopCurrent())
def mc_access(va, n):
    d = cu.CUmemAccessDesc()
    d.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    d.location.id = MC_DEV
    d.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    check(cu.cuMemSetAccess(va, n, [d], 1))
def mc_map(h, n):
    va = int(check(cu.cuMemAddressReserve(n, 0, 0, 0)))
    check(cu.cuMemMap(va, n, 0, h, 0))
    mc_access(va, n)
    return va
def mc_write(va, seed, n):
    check(cu.cuMemcpyHtoD(va, random.Random(seed).randbytes(n), n))
def mc_digest(va, n):
    buf = (ctypes.c_char * n)()
    check(cu.cuMemcpyDtoH(ctypes.addressof(buf), va, n))
    return hashlib.sha256(bytes(buf)).hexdigest()
def mc_access_of(va):
    loc = cu.CUmemLocation()
    loc.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    loc.id = MC_DEV
    return int(check(cu.cuMemGetAccess(loc, va)))
def mc_prop(n, size):
    p = cu.CUmulticastObjectProp()
    p.numDevices = n; p.size = size; p.handleTypes = int(MC_POSIX); p.flags = 0
    return p
def mc_member():
    p = cu.CUmemAllocationProp()
    p.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    p.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    p.location.id = MC_DEV
    p.requestedHandleTypes = MC_POSIX
    h = check(cu.cuMemCreate(MC_SIZE, p, 0))
    return h, mc_map(h, MC_SIZE)
"""

# Process k binds the first half by handle, the second by address, the 12.1 forms in
# even processes for BIND_MEM and in odd ones for BIND_ADDR.
BIND: Final = r"""
def _bind():
    half = MC_SIZE // 2
    if MC_DEV % 2 == 0:
        check(cu.cuMulticastBindMem(MC, 0, MC_MEM, 0, half, 0))
        check(cu.cuMulticastBindAddr_v2(MC, MC_DEV, half, MC_MVA + half, half, 0))
    else:
        check(cu.cuMulticastBindMem_v2(MC, MC_DEV, 0, MC_MEM, 0, half, 0))
        check(cu.cuMulticastBindAddr(MC, half, MC_MVA + half, half, 0))
    return mc_map(MC, MC_SIZE)
MC_VA = mc_in(_bind)
"""


def allowed(driver: str) -> bool:
    """Multicast runs on the simulated driver only, never on a real GPU."""
    return driver == "sim"


def expected_digest(seed: int, size: int) -> str:
    """The sha256 of what ``mc_write(va, seed, size)`` writes."""
    return hashlib.sha256(random.Random(seed).randbytes(size)).hexdigest()


@attrs.define
class MulticastTeam:
    """A team over ``workers`` (device k in worker k), ``size`` bytes (two granules)."""

    workers: Sequence[Worker]
    size: int

    SEED_MEMBER: ClassVar[int] = 900  # + k: each member's own bytes
    SEED_WRITE: ClassVar[int] = 950  # + k: written through worker k's multicast mapping

    @property
    def member_bytes(self) -> int:
        """The GPU memory the members hold: one allocation of ``size`` per device."""
        return self.size * len(self.workers)

    def build(self) -> None:
        n = len(self.workers)
        for k, w in enumerate(self.workers):
            w(f"MC_DEV = {k}; MC_SIZE = {self.size}")
            w(SETUP)
        first = self.workers[0]
        first(f"MC = mc_in(lambda: check(cu.cuMulticastCreate(mc_prop({n}, MC_SIZE))))")
        export = "int(check(cu.cuMemExportToShareableHandle(MC, MC_POSIX, 0)))"
        cap = int(first(f"result = mc_in(lambda: {export})"))
        for w in self.workers[1:]:
            fd = first.send_fd_to(w, cap, close=False)
            w(
                f"""
MC = mc_in(lambda: check(cu.cuMemImportFromShareableHandle({fd}, MC_POSIX)))
os.close({fd})
"""
            )
        first(f"os.close({cap})")
        for k, w in enumerate(self.workers):
            w(
                f"""
mc_in(lambda: check(cu.cuMulticastAddDevice(MC, MC_DEV)))
MC_MEM, MC_MVA = mc_in(mc_member)
mc_in(lambda: mc_write(MC_MVA, {self.SEED_MEMBER + k}, MC_SIZE))
"""
            )
        for w in self.workers:
            w(BIND)

    def problems(self) -> list[str]:
        """What is wrong with the team now: a member without its own bytes, a multicast
        mapping not read-write, a write through one process missing in a member. The
        members hold their own bytes again afterwards."""
        bad: list[str] = []
        for k, w in enumerate(self.workers):
            if w("result = mc_in(lambda: mc_digest(MC_MVA, MC_SIZE))") != expected_digest(
                self.SEED_MEMBER + k, self.size
            ):
                bad.append(f"{w.name} (pid {w.pid}): the member on device {k} lost its bytes")
            if w("result = mc_in(lambda: mc_access_of(MC_VA))") != 3:
                bad.append(f"{w.name} (pid {w.pid}): the multicast mapping is not read-write")
        for k, writer in enumerate(self.workers):
            seed = self.SEED_WRITE + k
            writer(f"mc_in(lambda: mc_write(MC_VA, {seed}, MC_SIZE))")
            for j, w in enumerate(self.workers):
                got = w("result = mc_in(lambda: mc_digest(MC_MVA, MC_SIZE))")
                if got != expected_digest(seed, self.size):
                    bad.append(
                        f"a write through {writer.name}'s multicast mapping did not reach the"
                        f" member of {w.name} (pid {w.pid}, device {j})"
                    )
        for k, w in enumerate(self.workers):
            w(f"mc_in(lambda: mc_write(MC_MVA, {self.SEED_MEMBER + k}, MC_SIZE))")
        return bad
