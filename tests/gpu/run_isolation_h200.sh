#!/usr/bin/env bash
# Issue 28 §1 on one H200: an importer of a legacy IPC handle reaches only the range it
# was handed. tools/probe_isolation.py: two 4 KiB cuMemAllocs A, B (B = A + 4096 under
# the driver), A shared to an importer, its copies at A' + 4096 and of the 2 MiB around
# A' must fail as under the driver (driver alone, shim default: the small request is the
# driver's), and never show B's bytes (shim with SNAPSHOT_SHIM_OWN_SMALL=1: a granularity
# each). Then what the ownership choices cost in device memory (bench/owned_alloc.py:
# 20000 x 512 B, 2000 x 64 KiB, 200 x 1 MiB, 100 x (2 MiB + 64 KiB), a CuPy-like job of
# 1000 small arrays; driver, shim not owning, owning by default, owning small ones too;
# with --torch the PyTorch job with and without ownership).
#
#   OUT=/path/to/results [WHEELS=.whl] tests/gpu/run_isolation_h200.sh
#
# Results in $OUT: build.log, isolation.json (one line per setup, "verdict": "ok"
# expected in each), owned-alloc.json, owned-alloc.log. Multicast is never created.
set -uo pipefail
cd "$(dirname "$0")/../.."
. tests/gpu/h200_env.sh
status=0
h200_build || exit 1

timeout 120 python3 tools/probe_isolation.py --out "$OUT/isolation.json" \
  >"$OUT/isolation.log" 2>&1 || status=1
cat "$OUT/isolation.log" | cut -c1-400
timeout "${ALLOC_S:-240}" python3 bench/owned_alloc.py --torch --out "$OUT/owned-alloc.json" \
  2>&1 | tee "$OUT/owned-alloc.log" | grep -E "asked|torch"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
echo "status $status"
exit "$status"
