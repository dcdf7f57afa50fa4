#!/usr/bin/env bash
# Issue 30 (items 1, 2, 3, 5) on one H200 with this repository copied (the device tool),
# in < 7 minutes: the host's provisioning floor beside the pinned copy ceiling and the
# four staging shapes against min(ceiling, floor) (bench/staging.py: the first, cold,
# run apart, medians of the next 3), a short sweep of the staging pipeline's settings on
# 1x8GiB and 96x6MiB, then a process with 100 000 cudaMallocs of 4 KiB and one with
# 20 000 of 2 MiB through suspend and resume, bytes checked (bench/many_allocs.py).
#
#   OUT=/path/to/results [WHEELS=.whl] bench/run_bytes_h200.sh
#
# Results in $OUT (7 files): environment.txt, build.log, staging.{log,json,stderr},
# many.{log,json}. The sweep's variants (the defaults run first):
#   depth2   SNAPSHOT_SHIM_STAGING_DEPTH=2 (the double buffer before this change)
#   ahead4   SNAPSHOT_SHIM_STAGING_POPULATE_THREADS=4 (fault staging memory in ahead)
#   spread1  SNAPSHOT_SHIM_STAGING_CHUNKS_PER_THREAD=1 (one long chunk per thread)
# Multicast stays off: CUINTERPOSE_ALLOW_MULTICAST=0 and NVLS off (h200_env.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
. tests/gpu/h200_env.sh
status=0
{ nvidia-smi -L; nvidia-smi --query-gpu=driver_version,memory.total --format=csv; uname -r
  nproc; free -g; cat /sys/kernel/mm/transparent_hugepage/enabled \
    /sys/kernel/mm/transparent_hugepage/defrag \
    /sys/kernel/mm/transparent_hugepage/khugepaged/defrag 2>&1
  python3 -c 'import cuda.bindings; print("cuda-bindings", cuda.bindings.__version__)'
} >"$OUT/environment.txt" 2>&1
h200_build || exit 1
echo "== staging (floor, ceiling, four shapes, sweep)"
timeout "${STAGING_S:-270}" python3 bench/staging.py --repeat 4 --native-repeat 1 \
  --out "$OUT/staging.json" \
  --variant depth2:SNAPSHOT_SHIM_STAGING_DEPTH=2 \
  --variant ahead4:SNAPSHOT_SHIM_STAGING_POPULATE_THREADS=4 \
  --variant spread1:SNAPSHOT_SHIM_STAGING_CHUNKS_PER_THREAD=1 \
  --variant-only 1x8GiB --variant-only 96x6MiB \
  >"$OUT/staging.log" 2>"$OUT/staging.stderr" || { echo "staging failed"; status=1; }
grep -E "^(device|ceiling|floor|SAVE is|==|--|  SAVE warm|  LOAD warm|  depth)" "$OUT/staging.log"
tail -3 "$OUT/staging.stderr"
echo "== many allocations"
timeout "${MANY_S:-150}" python3 bench/many_allocs.py --repeat 2 --out "$OUT/many.json" \
  >"$OUT/many.log" 2>&1 || { echo "many_allocs failed"; status=1; }
grep -E "made|verified|us/allocation|Error|error" "$OUT/many.log" | head -20
echo "status $status"
exit $status
