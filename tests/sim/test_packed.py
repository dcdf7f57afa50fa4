"""Small cuMemAlloc requests packed into shared 2 MiB chunks, as the H200 places them
(shim_c/sim/README.md, "Packed allocations"): each still answers as an allocation of
its own (range, attributes, free, legacy IPC), a checkpoint keeps every one's bytes,
and cuMemGetInfo counts chunks."""

from __future__ import annotations

from tests import snippet
from tests.sim.simtest import MiB, psha, sim_only
from tests.sim.test_checkpoint import controller

IPC = snippet.load(__file__, "ipc")
INVALID = "CUDA_ERROR_INVALID_VALUE"


def test_small_requests_lie_side_by_side_and_answer_as_their_own(spawn):
    a = spawn()
    r = a("""
A = int(check(cu.cuMemAlloc(4096))); B = int(check(cu.cuMemAlloc(4096)))
def attr(name, p):
    return int(check(cu.cuPointerGetAttribute(getattr(cu.CUpointer_attribute, name), p)))
C, pitch = check(cu.cuMemAllocPitch(1000, 2, 4)); C = int(C)
base, size = check(cu.cuMemGetAddressRange(B + 8))
ids = [attr("CU_POINTER_ATTRIBUTE_BUFFER_ID", p) for p in (A, B)]
result = [B - A, int(base) == B, size, attr("CU_POINTER_ATTRIBUTE_RANGE_START_ADDR", B + 8) == B,
          ids[0] != ids[1], [C - B, int(check(cu.cuMemGetAddressRange(C + 2047))[1])],
          err(cu.cuMemGetAddressRange(C + 2048)), err(cu.cuMemFree(B + 512)), err(cu.cuMemFree(A)),
          err(cu.cuMemGetAddressRange(A)), err(cu.cuMemFree(A)),
          int(check(cu.cuMemGetAddressRange(B))[1])]
""")
    freed = ["CUDA_SUCCESS", "CUDA_ERROR_NOT_FOUND", INVALID]
    past_c = "CUDA_ERROR_NOT_FOUND"  # the pitched request is 2 x 1024 bytes
    assert r == [4096, True, 4096, True, True, [4096, 2048], past_c, INVALID, *freed, 4096]


@sim_only
def test_memory_in_use_counts_chunks_not_requests(spawn):
    """20 000 x 512 B take 5 chunks (+2.4 % over what was asked), 2000 x 64 KiB 63
    (+0.8 %), 200 x 1 MiB 100 (+0 %), as on the H200 (docs/benchmarks.md); a chunk goes
    with its last request."""
    a = spawn()
    r = a("""
def used():
    free, total = check(cu.cuMemGetInfo())
    return int(total) - int(free)
out = []
for n, size in ((20000, 512), (2000, 64 * 1024), (200, 1024 * 1024)):
    before = used()
    P = [int(check(cu.cuMemAlloc(size))) for _ in range(n)]
    out.append(used() - before)
    for p in P:
        check(cu.cuMemFree(p))
    out.append(used() - before)
result = out
""")
    assert r == [5 * 2 * MiB, 0, 63 * 2 * MiB, 0, 100 * 2 * MiB, 0]


def test_an_ipc_open_reaches_its_request_only(spawn):
    """The H200: an importer of A copies within A; at A'+4096 (B's place) or over the
    2 MiB around A' it answers INVALID_VALUE. B's own handle opens B."""
    a, b = spawn(), spawn()
    a(IPC)
    b(IPC)
    text = a("""
A = int(check(cu.cuMemAlloc(4096))); B = int(check(cu.cuMemAlloc(4096)))
write(A, pattern(1, 4096)); write(B, pattern(2, 4096))
result = [B - A, mem_handle(A), mem_handle(B)]
""")
    assert text[0] == 4096
    r = b(f"""
p = int(check(ipc_open({text[1]!r})))
q = int(check(ipc_open({text[2]!r})))
base, size = check(cu.cuMemGetAddressRange(p + 8))
buf = ctypes.create_string_buffer(2 * MiB)
lo = p - p % (2 * MiB)
result = [sha(p, 4096), sha(q, 4096), int(base) == p, size,
          err(cu.cuMemcpyDtoH(ctypes.addressof(buf), p + 4096, 16)),
          err(cu.cuMemcpyDtoH(ctypes.addressof(buf), lo, 2 * MiB)),
          err(cu.cuIpcCloseMemHandle(p + 8)),
          err(cu.cuIpcCloseMemHandle(p)), err(cu.cuIpcCloseMemHandle(q))]
""")
    closed = ["CUDA_SUCCESS", "CUDA_SUCCESS"]
    assert r == [psha(1, 4096), psha(2, 4096), True, 4096, INVALID, INVALID, INVALID, *closed]


def test_a_native_checkpoint_keeps_every_packed_request_at_its_address(spawn):
    """Requests of 4 KiB and 700 B, some freed between them, each with bytes of its own:
    after the driver's checkpoint and restore every one is where it was, bytes intact."""
    a = spawn()
    c = controller(spawn)
    a("""
P = [int(check(cu.cuMemAlloc(4096 if k % 3 else 700))) for k in range(600)]
for p in P[::7]:
    check(cu.cuMemFree(p))
P = [p for k, p in enumerate(P) if k % 7]
for k, p in enumerate(P):
    write(p, pattern(k, 512))
WANT = [sha(p, 512) for p in P]
""")
    r = c(f"result = [f({a.pid}) for f in (lock, ckpt, restore, unlock)]")
    assert r == ["CUDA_SUCCESS"] * 4
    r = a("""
result = [len(P), [sha(p, 512) for p in P] == WANT,
          all(int(check(cu.cuMemGetAddressRange(p))[0]) == p for p in P)]
""")
    assert r == [514, True, True]
