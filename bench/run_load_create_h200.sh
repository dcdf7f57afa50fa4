#!/usr/bin/env bash
# Issue 30 items 3 and 2 on one H200 with this repository copied (the device tool), in
# about 4 minutes (at most 40 s of build + PROBE_S=40 + SWEEP_S=140 + RUNS_S=60 +
# SPREAD_S=50, under 6 minutes):
#  1. bench/vmm_probe.py, no shim: LOAD's three VMM calls for 2048 x 2 MiB, each call's
#     time on one thread, the wall time from 1, 2, 4 and 8 threads (does the driver run
#     them in parallel?), and one cuMemSetAccess over 32 allocations mapped back to back
#     in one reservation and across 32 adjacent reservations, against 32 calls (could
#     one access call per run of contiguous mappings replace them?);
#  2. bench/staging.py on 2048 x 2 MiB with LOAD's creator threads swept
#     (SNAPSHOT_SHIM_LOAD_CREATE_THREADS: the default 0, the control thread, then 1, 2,
#     4, 8), every variant's bytes checked; 96 x 6 MiB with the default beside it;
#  3. 2048 x 2 MiB with SNAPSHOT_SHIM_LOAD_ACCESS_RUNS=1 (one cuMemSetAccess per run of
#     mappings side by side), alone and with 4 creator threads, after the defaults; its
#     own call, last but one, as the driver may refuse the spanning call (LOAD then fails,
#     named in runs.log, and only this step is lost);
#  4. issue 30 item 2: 96 x 6 MiB SAVE with fewer, longer chunks per copy thread
#     (SNAPSHOT_SHIM_STAGING_CHUNKS_PER_THREAD=1 and 2 against the default 4: each 9 MiB
#     chunk's first copy and last memcpy overlap nothing) and with resident staging
#     memory (SNAPSHOT_SHIM_STAGING_RESIDENT_MIB=1024: no first touch).
#
#   OUT=/path/to/results [WHEELS=.whl] bench/run_load_create_h200.sh
#
# Results in $OUT: environment.txt, build.log, vmm_probe.{json,log}, staging.log,
# staging.json, runs.log, runs.json, spread.log, spread.json. What to read:
# vmm_probe.json "threads_wall_s" against "1" (below it: the driver overlaps the calls),
# "adjacent_reservations" "one_call" (CUDA_SUCCESS: one access call may span
# reservations) and its one_call_s against each_s; staging.log's "LOAD warm" line per
# variant (its fraction of HtoD; the goal is >= 0.85) and "LOAD s" (setup, thread-s
# create); runs.log's "access runs per LOAD" (64 when the 2048 reservations lie side by
# side, ascending; 2048 when none do) and its LOAD lines; spread.log's "SAVE warm" and
# "SAVE s" per variant.
# Multicast stays off: CUINTERPOSE_ALLOW_MULTICAST=0 and NVLS off (h200_env.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
. tests/gpu/h200_env.sh
status=0
{ nvidia-smi -L; nvidia-smi --query-gpu=driver_version,memory.total --format=csv; uname -r
  nproc; free -g
  python3 -c 'import cuda.bindings; print("cuda-bindings", cuda.bindings.__version__)'
} >"$OUT/environment.txt" 2>&1
h200_build || exit 1
echo "== vmm probe: 2048 x 2 MiB, no shim"
timeout "${PROBE_S:-40}" python3 bench/vmm_probe.py --count 2048 --mib 2 --run 32 \
  --threads 1 2 4 8 --out "$OUT/vmm_probe.json" >"$OUT/vmm_probe.log" 2>&1 \
  || { echo "vmm probe failed (rc $?)"; tail -5 "$OUT/vmm_probe.log"; status=1; }
[ -s "$OUT/vmm_probe.json" ] && cat "$OUT/vmm_probe.json"
echo "== staging: 2048 x 2 MiB, LOAD's creator threads 0 (default), 1, 2, 4, 8; 96 x 6 MiB"
timeout "${SWEEP_S:-140}" python3 bench/staging.py --repeat 4 --native-repeat 0 \
  --floor-gib 0 --only 2048x2MiB --only 96x6MiB --out "$OUT/staging.json" \
  --variant create1:SNAPSHOT_SHIM_LOAD_CREATE_THREADS=1 \
  --variant create2:SNAPSHOT_SHIM_LOAD_CREATE_THREADS=2 \
  --variant create4:SNAPSHOT_SHIM_LOAD_CREATE_THREADS=4 \
  --variant create8:SNAPSHOT_SHIM_LOAD_CREATE_THREADS=8 \
  --variant-only 2048x2MiB >"$OUT/staging.log" 2>&1 \
  || { echo "staging failed or cut short (rc $?)"; status=1; }
grep -E "^(device|ceiling|==|--|  LOAD warm|  LOAD s)" "$OUT/staging.log"
grep -E "failed|timed out|Error" "$OUT/staging.log" | head -5
echo "== 2048 x 2 MiB LOAD: one cuMemSetAccess per run of mappings side by side (may fail:"
echo "   the driver may refuse one call across reservations; then LOAD fails, named here)"
timeout "${RUNS_S:-60}" python3 bench/staging.py --repeat 3 --native-repeat 0 \
  --floor-gib 0 --only 2048x2MiB --out "$OUT/runs.json" \
  --variant runs:SNAPSHOT_SHIM_LOAD_ACCESS_RUNS=1 \
  --variant runs-create4:SNAPSHOT_SHIM_LOAD_ACCESS_RUNS=1,SNAPSHOT_SHIM_LOAD_CREATE_THREADS=4 \
  >"$OUT/runs.log" 2>&1 || { echo "access runs failed or cut short (rc $?)"; status=1; }
grep -E "^(==|--|  depth|  LOAD warm|  LOAD s)" "$OUT/runs.log"
grep -E "failed|timed out|Error" "$OUT/runs.log" | head -5
echo "== 96 x 6 MiB SAVE: chunks per thread 4 (default), 2, 1; resident staging memory"
timeout "${SPREAD_S:-50}" python3 bench/staging.py --repeat 4 --native-repeat 0 \
  --floor-gib 0 --only 96x6MiB --out "$OUT/spread.json" \
  --variant spread2:SNAPSHOT_SHIM_STAGING_CHUNKS_PER_THREAD=2 \
  --variant spread1:SNAPSHOT_SHIM_STAGING_CHUNKS_PER_THREAD=1 \
  --variant resident:SNAPSHOT_SHIM_STAGING_RESIDENT_MIB=1024 >"$OUT/spread.log" 2>&1 \
  || { echo "spread sweep failed or cut short (rc $?)"; status=1; }
grep -E "^(==|--|  SAVE warm|  SAVE s)" "$OUT/spread.log"
grep -E "failed|timed out|Error" "$OUT/spread.log" | head -5
echo "status $status"
exit $status
