#!/usr/bin/env bash
# Issues 30 (items 1, 2, 3, 5) and 32 (item 4) on one H200 with this repository copied
# (the device tool), in < 7 minutes:
#  1. bench/staging.py: the host's provisioning floor (bench/floor.py, 1 GiB per case,
#     medians of 3) beside the pinned copy ceiling, and the four staging shapes against
#     min(ceiling, floor): the first (cold) run apart, medians of the next 3; a short
#     sweep of the pipeline's settings on 1x8GiB and 96x6MiB (the defaults run first):
#       depth2  SNAPSHOT_SHIM_STAGING_DEPTH=2 (the double buffer of before)
#       ahead4  SNAPSHOT_SHIM_STAGING_POPULATE_THREADS=4 (staging memory faulted ahead)
#     then, 96x6MiB alone (where pinning weighs most; every variant's first run is a
#     process's first SAVE, which pins the bounce buffers):
#       pinreg        SNAPSHOT_SHIM_STAGING_BOUNCE_PIN=register (populate + register)
#       unkept        SNAPSHOT_SHIM_STAGING_BOUNCE_KEEP=0 (nothing pinned between cycles)
#       pinreg-unkept both
#  2. bench/many_allocs.py: 100 000 cudaMallocs of 4 KiB and 20 000 of 2 MiB through
#     suspend and resume, bytes checked, time per allocation;
#  3. with CRIU carried in .criu/ (tools/bundle_criu.sh .criu /opt/criu/sbin/criu, as
#     for tests/gpu/run_criu_h200.sh): the torch pair sharing an 8 GiB tensor through
#     cuinterpose criu dump / restore, the staged bytes in files beside the images, then
#     inside them (bench/criu.py --mode both).
#
#   OUT=/path/to/results [WHEELS=.whl] bench/run_bytes_h200.sh
#
# BYTES_QUICK=1: item 1 only, in one short call (about 40 s of build, then at most
# STAGING_S=200): the floor (1 GiB per case) and the four shapes, each with the defaults
# and ahead8 (SNAPSHOT_SHIM_STAGING_POPULATE_THREADS=8), 3 runs (the cold one and two
# warm) and one of the native path alone; each shape's lines are printed and
# staging.json rewritten as soon as that shape is done, so a timeout loses only the
# shape it cut. Results: environment.txt, build.log, staging.log, staging.json.
#
# Results in $OUT (8 files): environment.txt, build.log, staging.log (both staging runs
# and the many-allocations log), staging.json, staging-pin.json, many.json,
# criu.{log,json}. Time limits: STAGING_S=200, PIN_S=50, MANY_S=80, CRIU_S=120 (expected:
# about 40 s of build, 170, 35, 40 and 90 s).
# Multicast stays off: CUINTERPOSE_ALLOW_MULTICAST=0 and NVLS off (h200_env.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
. tests/gpu/h200_env.sh
status=0
{ nvidia-smi -L; nvidia-smi --query-gpu=driver_version,memory.total --format=csv; uname -r
  nproc; free -g; df -h /tmp; cat /sys/kernel/mm/transparent_hugepage/enabled \
    /sys/kernel/mm/transparent_hugepage/defrag \
    /sys/kernel/mm/transparent_hugepage/khugepaged/defrag 2>&1
  python3 -c 'import cuda.bindings; print("cuda-bindings", cuda.bindings.__version__)'
} >"$OUT/environment.txt" 2>&1
h200_build || exit 1
if [ "${BYTES_QUICK:-0}" = 1 ]; then
  echo "== staging (quick): floor, ceiling, four shapes, default and ahead8"
  timeout "${STAGING_S:-200}" python3 bench/staging.py --repeat 3 --native-repeat 1 \
    --floor-gib 1 --out "$OUT/staging.json" \
    --variant ahead8:SNAPSHOT_SHIM_STAGING_POPULATE_THREADS=8 >"$OUT/staging.log" 2>&1 \
    || { echo "staging failed or cut short (rc $?)"; status=1; }
  grep -E "^(device|ceiling|floor|SAVE is|==|--|  depth|  SAVE warm|  LOAD warm)" \
    "$OUT/staging.log"
  grep -E "failed|timed out|Error" "$OUT/staging.log" | head -5
  echo "status $status"
  exit $status
fi
echo "== staging: floor, ceiling, four shapes, sweep"
timeout "${STAGING_S:-200}" python3 bench/staging.py --repeat 4 --native-repeat 1 \
  --floor-gib 1 --out "$OUT/staging.json" \
  --variant depth2:SNAPSHOT_SHIM_STAGING_DEPTH=2 \
  --variant ahead4:SNAPSHOT_SHIM_STAGING_POPULATE_THREADS=4 \
  --variant-only 1x8GiB --variant-only 96x6MiB >"$OUT/staging.log" 2>&1 \
  || { echo "staging failed"; status=1; }
echo "== staging: pinning the bounce buffers (96x6MiB)" | tee -a "$OUT/staging.log"
timeout "${PIN_S:-50}" python3 bench/staging.py --repeat 4 --native-repeat 0 --floor-gib 0 \
  --only 96x6MiB --out "$OUT/staging-pin.json" \
  --variant pinreg:SNAPSHOT_SHIM_STAGING_BOUNCE_PIN=register \
  --variant unkept:SNAPSHOT_SHIM_STAGING_BOUNCE_KEEP=0 \
  --variant pinreg-unkept:SNAPSHOT_SHIM_STAGING_BOUNCE_PIN=register,SNAPSHOT_SHIM_STAGING_BOUNCE_KEEP=0 \
  >>"$OUT/staging.log" 2>&1 || { echo "staging (pinning) failed"; status=1; }
grep -E "^(device|ceiling|floor|SAVE is|==|--|  SAVE warm|  LOAD warm)" "$OUT/staging.log"
echo "== many allocations" | tee -a "$OUT/staging.log"
timeout "${MANY_S:-80}" python3 bench/many_allocs.py --repeat 2 --out "$OUT/many.json" \
  >>"$OUT/staging.log" 2>&1 || { echo "many_allocs failed"; status=1; }
grep -E "\[many\]" "$OUT/staging.log" | head -20
if [ -d .criu ]; then
  echo "== criu: the 8 GiB torch pair, bytes beside the images, then inside"
  chmod +x .criu/criu .criu/bin/criu .criu/lib/ld-linux* 2>/dev/null
  export CUINTERPOSE_CRIU=${CUINTERPOSE_CRIU:-$PWD/.criu/criu}
  { "$CUINTERPOSE_CRIU" --version && "$CUINTERPOSE_CRIU" check; } >"$OUT/criu.log" 2>&1 \
    || { echo "criu check failed"; status=1; }
  timeout "${CRIU_S:-120}" python3 bench/criu.py --driver system --mib "${CRIU_MIB:-8192}" \
    --scenario torch --mode both --work /tmp --out "$OUT/criu.json" >>"$OUT/criu.log" 2>&1 \
    || { echo "criu failed"; status=1; }
  grep -vE "^  (dump|restore) " "$OUT/criu.log" | tail -12
else
  echo "== criu: no .criu/ carried: skipped"
fi
echo "status $status"
exit $status
