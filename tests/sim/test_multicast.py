"""Multicast teams across processes. On a real GPU these run only with
CUINTERPOSE_ALLOW_MULTICAST=1 (cuMulticastCreate can take a shared host's
GPUs out of service); they are written for the simulator's node of
CUINTERPOSE_SIM_DEVICES devices."""

from __future__ import annotations

import hashlib

import pytest

from tests import simenv, snippet
from tests.sim.simtest import (
    MiB,
    hand_over,
    needs_multicast,
    pattern_bytes,
    psha,
    sim_only,
)

pytestmark = needs_multicast

MC = snippet.load(__file__, "mc")
THREE = {"CUINTERPOSE_SIM_DEVICES": "3"}


def team(spawn, n_devices_env=None):
    """Creator on device 0 exports a 2-device, 8 MiB team to a member on device 1."""
    a = spawn(device=0, extra=n_devices_env)
    b = spawn(device=1, extra=n_devices_env)
    for w in (a, b):
        w(MC)
    a("""
mc = check(cu.cuMulticastCreate(mcprop(2, 8 * MiB)))
send_fd(check(cu.cuMemExportToShareableHandle(mc, POSIX, 0)))
""")
    hand_over(a, b)
    b("fd = recv_fd(); mc = check(cu.cuMemImportFromShareableHandle(fd, POSIX)); os.close(fd)")
    return a, b


def test_granularity_and_create_arguments(spawn):
    w = spawn()
    w(MC)
    r = w("""
gmin = cu.CUmulticastGranularity_flags.CU_MULTICAST_GRANULARITY_MINIMUM
grec = cu.CUmulticastGranularity_flags.CU_MULTICAST_GRANULARITY_RECOMMENDED
result = dict(gmin=int(check(cu.cuMulticastGetGranularity(mcprop(2, 2 * MiB), gmin))),
              grec=int(check(cu.cuMulticastGetGranularity(mcprop(2, 2 * MiB), grec))),
              zero_devices=err(cu.cuMulticastCreate(mcprop(0, 2 * MiB))),
              unaligned=err(cu.cuMulticastCreate(mcprop(2, MiB))),
              zero_size=err(cu.cuMulticastCreate(mcprop(2, 0))),
              too_many=err(cu.cuMulticastCreate(mcprop(3, 2 * MiB))))
""")
    assert r["gmin"] == 2 * MiB and r["grec"] % r["gmin"] == 0
    iv = "CUDA_ERROR_INVALID_VALUE"
    assert r["zero_devices"] == r["unaligned"] == r["zero_size"] == iv
    if simenv.is_simulated():
        assert r["too_many"] == iv  # a 3-device team on a 2-device node


def test_bind_waits_for_the_whole_team(spawn):
    a, b = team(spawn)
    a("""
check(cu.cuMulticastAddDevice(mc, 0))
hm = check(cu.cuMemCreate(2 * MiB, prop(), 0))
""")
    a.send("result = err(cu.cuMulticastBindMem(mc, 0, hm, 0, 2 * MiB, 0))")
    assert not a.answered(0.7), "bind returned before every device was added"
    b("check(cu.cuMulticastAddDevice(mc, 1))")
    assert a.answered(10)
    assert a.reply() == "CUDA_SUCCESS"


def test_map_waits_for_the_whole_team_and_is_shared(spawn):
    a, b = team(spawn)
    a("check(cu.cuMulticastAddDevice(mc, 0)); va = check(cu.cuMemAddressReserve(8 * MiB, 0, 0, 0))")
    a.send("""
check(cu.cuMemMap(va, 8 * MiB, 0, mc, 0)); access(va, 8 * MiB); write(va, pattern(2, 4 * MiB))
""")
    assert not a.answered(0.7), "cuMemMap of a multicast object returned before the team was full"
    b("check(cu.cuMulticastAddDevice(mc, 1))")
    assert a.answered(10)
    a.reply()
    got = b("""
va = check(cu.cuMemAddressReserve(8 * MiB, 0, 0, 0))
check(cu.cuMemMap(va, 8 * MiB, 0, mc, 0)); access(va, 8 * MiB)
result = sha(va, 4 * MiB)
""")
    assert got == psha(2, 4 * MiB)


def test_add_device_rules(spawn):
    a, b = team(spawn, THREE)
    r = a("result = [err(cu.cuMulticastAddDevice(mc, d)) for d in (0, 0, 7)]")
    assert r == ["CUDA_SUCCESS", "CUDA_ERROR_INVALID_VALUE", "CUDA_ERROR_INVALID_DEVICE"]
    r = b("result = [err(cu.cuMulticastAddDevice(mc, d)) for d in (0, 1, 2)]")
    # Twice across processes, then the team is full.
    assert r == ["CUDA_ERROR_INVALID_VALUE", "CUDA_SUCCESS", "CUDA_ERROR_INVALID_VALUE"]


def test_bind_unbind_rules(spawn):
    a, b = team(spawn)
    a("check(cu.cuMulticastAddDevice(mc, 0))")
    b("check(cu.cuMulticastAddDevice(mc, 1))")
    r = b("""
hm = check(cu.cuMemCreate(4 * MiB, prop(), 0))
hn = check(cu.cuMemCreate(2 * MiB, prop(NONE_H), 0))
h0 = check(cu.cuMemCreate(2 * MiB, prop(dev=0), 0))
out = {}
out["v2"] = err(cu.cuMulticastBindMem_v2(mc, 1, 0, hm, 0, 2 * MiB, 0))
out["overlap"] = err(cu.cuMulticastBindMem_v2(mc, 1, 0, hm, 2 * MiB, 2 * MiB, 0))
out["mc_out_of_range"] = err(cu.cuMulticastBindMem_v2(mc, 1, 8 * MiB, hm, 0, 2 * MiB, 0))
out["mc_straddles_end"] = err(cu.cuMulticastBindMem_v2(mc, 1, 6 * MiB, hm, 0, 4 * MiB, 0))
out["mem_out_of_range"] = err(cu.cuMulticastBindMem_v2(mc, 1, 4 * MiB, hm, 4 * MiB, 2 * MiB, 0))
out["unaligned"] = err(cu.cuMulticastBindMem_v2(mc, 1, MiB, hm, 0, 2 * MiB, 0))
out["flags"] = err(cu.cuMulticastBindMem_v2(mc, 1, 4 * MiB, hm, 2 * MiB, 2 * MiB, 1))
out["wrong_device"] = err(cu.cuMulticastBindMem_v2(mc, 0, 4 * MiB, hm, 2 * MiB, 2 * MiB, 0))
out["not_shareable"] = err(cu.cuMulticastBindMem_v2(mc, 1, 4 * MiB, hn, 0, 2 * MiB, 0))
out["unbind_not_bound"] = err(cu.cuMulticastUnbind(mc, 1, 2 * MiB, 2 * MiB))
out["unbind_wrong_size"] = err(cu.cuMulticastUnbind(mc, 1, 0, 4 * MiB))
out["unbind"] = err(cu.cuMulticastUnbind(mc, 1, 0, 2 * MiB))
out["unbind_twice"] = err(cu.cuMulticastUnbind(mc, 1, 0, 2 * MiB))
out["unbind_bad_device"] = err(cu.cuMulticastUnbind(mc, 9, 0, 2 * MiB))
# the 12.1 form binds on the memory's own device; BindAddr by mapped address
out["v1"] = err(cu.cuMulticastBindMem(mc, 0, hm, 0, 2 * MiB, 0))
va = check(cu.cuMemAddressReserve(4 * MiB, 0, 0, 0)); check(cu.cuMemMap(va, 4 * MiB, 0, hm, 0))
out["addr_v2"] = err(cu.cuMulticastBindAddr_v2(mc, 1, 2 * MiB, int(va) + 2 * MiB, 2 * MiB, 0))
out["addr_unmapped"] = err(cu.cuMulticastBindAddr(mc, 4 * MiB, int(va) + 4 * MiB, 2 * MiB, 0))
result = out
""")
    ok, iv, idev = "CUDA_SUCCESS", "CUDA_ERROR_INVALID_VALUE", "CUDA_ERROR_INVALID_DEVICE"
    assert r["v2"] == ok
    assert r["overlap"] == r["mc_out_of_range"] == r["mc_straddles_end"] == iv
    assert r["mem_out_of_range"] == r["unaligned"] == r["flags"] == iv
    assert r["wrong_device"] == idev
    assert r["not_shareable"] == iv
    assert r["unbind_not_bound"] == r["unbind_wrong_size"] == iv
    assert r["unbind"] == ok and r["unbind_twice"] == iv
    assert r["unbind_bad_device"] == idev
    assert r["v1"] == ok and r["addr_v2"] == ok
    assert r["addr_unmapped"] == iv
    # Device 0's process binds at the same offset: bindings are per device.
    assert (
        a("""
hm = check(cu.cuMemCreate(2 * MiB, prop(), 0))
result = err(cu.cuMulticastBindMem_v2(mc, 0, 0, hm, 0, 2 * MiB, 0))
""")
        == ok
    )


@sim_only
@pytest.mark.parametrize("call", ["bind", "map"])
def test_team_that_never_completes_times_out(spawn, call):
    w = spawn(extra={"CUINTERPOSE_SIM_MC_WAIT_MS": "300"})
    w(MC)
    r = w(f"""
mc = check(cu.cuMulticastCreate(mcprop(2, 2 * MiB)))
check(cu.cuMulticastAddDevice(mc, 0))
hm = check(cu.cuMemCreate(2 * MiB, prop(), 0))
va = check(cu.cuMemAddressReserve(2 * MiB, 0, 0, 0))
if "{call}" == "bind":
    result = err(cu.cuMulticastBindMem(mc, 0, hm, 0, 2 * MiB, 0))
else:
    result = err(cu.cuMemMap(va, 2 * MiB, 0, mc, 0))
""")
    assert r == "CUDA_ERROR_TIMEOUT"


def test_release_ends_own_bindings(spawn):
    a, b = team(spawn)
    a("check(cu.cuMulticastAddDevice(mc, 0))")
    b("check(cu.cuMulticastAddDevice(mc, 1)); hm = check(cu.cuMemCreate(2 * MiB, prop(), 0))")
    bind = "result = err(cu.cuMulticastBindMem_v2(mc, 1, 0, hm, 0, 2 * MiB, 0))"
    assert b(bind) == "CUDA_SUCCESS"
    b("check(cu.cuMemRelease(mc))")
    # The team outlives b's handle (a holds it); b's binding is gone with b's last reference.
    r = a("""
fd = check(cu.cuMemExportToShareableHandle(mc, POSIX, 0)); send_fd(fd); os.close(fd)
""")
    assert r is None
    hand_over(a, b)
    assert (
        b("""
fd = recv_fd(); mc = check(cu.cuMemImportFromShareableHandle(fd, POSIX)); os.close(fd)
result = err(cu.cuMulticastBindMem_v2(mc, 1, 0, hm, 0, 2 * MiB, 0))
""")
        == "CUDA_SUCCESS"
    )


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@sim_only
def test_writes_through_the_object_reach_every_bound_member(spawn):
    """A store through a multicast mapping lands in the memory bound at those offsets
    on every device of the team, whichever process bound it; BIND_ADDR lands at the
    member offset the address names; unbound ranges are left alone, and an unbind
    stops the traffic to that member."""
    a, b = team(spawn)
    a("check(cu.cuMulticastAddDevice(mc, 0))")
    b("check(cu.cuMulticastAddDevice(mc, 1))")
    for w in (a, b):
        w("""
hm, mva = alloc(8 * MiB)
write(mva, bytes(8 * MiB))
""")
    # a binds [0, 4 MiB) from its member's offset 0; b binds [2, 6 MiB) by address,
    # from its member's offset 4 MiB.
    a("check(cu.cuMulticastBindMem(mc, 0, hm, 0, 4 * MiB, 0))")
    b("check(cu.cuMulticastBindAddr_v2(mc, 1, 2 * MiB, int(mva) + 4 * MiB, 4 * MiB, 0))")
    a("""
cva = check(cu.cuMemAddressReserve(8 * MiB, 0, 0, 0))
check(cu.cuMemMap(cva, 8 * MiB, 0, mc, 0)); access(cva, 8 * MiB)
write(cva, pattern(5, 8 * MiB))
""")
    whole = pattern_bytes(5, 8 * MiB)
    zero = sha(bytes(2 * MiB))
    assert a("result = sha(mva, 4 * MiB)") == sha(whole[: 4 * MiB])
    assert a("result = sha(mva, 4 * MiB, 4 * MiB)") == sha(bytes(4 * MiB))
    assert b("result = sha(mva, 4 * MiB, 4 * MiB)") == sha(whole[2 * MiB : 6 * MiB])
    assert b("result = sha(mva, 2 * MiB)") == zero
    # After b unbinds, a memset through the object reaches a's member only.
    b("check(cu.cuMulticastUnbind(mc, 1, 2 * MiB, 4 * MiB))")
    a("check(cu.cuMemsetD8(cva, 0x5A, 8 * MiB))")
    assert a("result = sha(mva, 4 * MiB)") == sha(b"\x5a" * (4 * MiB))
    assert b("result = sha(mva, 4 * MiB, 4 * MiB)") == sha(whole[2 * MiB : 6 * MiB])
