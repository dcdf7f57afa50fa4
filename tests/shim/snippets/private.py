"""PRIVATE of tests/shim/test_private.py: a snippet the worker runs (tests/snippet.py)."""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tests.shim.snippets.worker_setup import (
        H,
        access,
        digest,
        expected,
        fill,
        gran,
        map_rw,
        prop,
        reserve,
    )
    from tests.snippet import check, cu

    SEED = ...  # set by the test before this snippet

READ = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READ
def get_access(va, device):
    loc = cu.CUmemLocation()
    loc.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    loc.id = device
    return int(check(cu.cuMemGetAccess(loc, va)))
P = []
H['a'] = check(cu.cuMemCreate(3 * gran, prop(), 0))           # exportable, never exported
P.append(('a', map_rw(H['a'], 3 * gran), 3 * gran, SEED))
hb = check(cu.cuMemCreate(2 * gran, prop(ht=0), 0))           # not exportable
P.append(('b', map_rw(hb, 2 * gran), 2 * gran, SEED + 1))
check(cu.cuMemRelease(hb))                                    # only the mapping holds it
H['c'] = check(cu.cuMemCreate(gran, prop(device=1), 0))      # on device 1, mapped twice
vc = map_rw(H['c'], gran)
check(access(vc, gran, 1))
vc2 = reserve(gran)
check(cu.cuMemMap(vc2, gran, 0, H['c'], 0))
check(access(vc2, gran, 0, READ))
P.append(('c', vc, gran, SEED + 2))
H['d'] = check(cu.cuMemCreate(gran, prop(), 0))               # read-only for the application
vd = map_rw(H['d'], gran)
fill(vd, gran, SEED + 3)
check(access(vd, gran, 0, READ))
for name, va, size, seed in P:
    fill(va, size, seed)
P.append(('d', vd, gran, SEED + 3))
def props(va):
    h = check(cu.cuMemRetainAllocationHandle(va))
    p = check(cu.cuMemGetAllocationPropertiesFromHandle(h))
    check(cu.cuMemRelease(h))
    return [int(p.requestedHandleTypes), int(p.location.id)]
def state():
    return {
        'bytes': [digest(va, size) == expected(seed, size) for _, va, size, seed in P],
        'props': [props(va) for _, va, _, _ in P],
        'access': [get_access(vc, 0), get_access(vc, 1), get_access(vc2, 0),
                   get_access(vc2, 1), get_access(vd, 0)],
    }
result = sum(size for _, _, size, _ in P)
