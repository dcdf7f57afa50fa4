#!/usr/bin/env bash
# Issue 47 on one H100 or H200 (the device tool): build the release shim, the hash
# kernel's GPU test (the PTX the shim carries against the known answers), then one part of
# the measurements, results in $OUT:
#
#   OUT=/path PART=shapes bench/run_sleep_wake_h200.sh   # bench/staging.py, the 4 shapes,
#       # the kept host copy off and on, 1 GiB rewritten before each later suspend
#   OUT=/path PART=native,off bench/run_sleep_wake_h200.sh   # bench/sleep_wake.py parts
#   OUT=/path PART=on,vllm,gen MERGE=/path/of/the/first/sleep-wake.json bench/run_sleep_wake_h200.sh
#
# Each call stays inside the device's 10 minutes a command: the 49 GiB job's native
# checkpoint alone takes about a minute a cycle. GIB (49), CYCLES (20), REPEAT (3) and
# BENCH_S (560, the timeout of the benchmark) change it; MERGE names an earlier part's
# sleep-wake.json (copy it into the tree first) so that this one reports all parts.
# PART=shapes: SHAPES="1x8GiB 100x20MiB" runs only those (two calls for the four, if one
# does not fit), FLOOR_REPEAT (1) the driver's own LOAD pace per shape (bench/load_floor.py:
# what LOAD of the small shapes is held against).
set -uo pipefail
cd "$(dirname "$0")/.."
. tests/gpu/h200_env.sh
status=0
{ nvidia-smi; nproc; free -g; cat /sys/kernel/mm/transparent_hugepage/enabled; } \
  >"$OUT/environment.txt" 2>&1
h200_build || exit 1
timeout 180 python3 -m pytest -p no:cacheprovider -v -rs -s tests/gpu/test_keep_hash.py \
  tests/gpu/test_keep_gpu.py 2>&1 \
  | tee "$OUT/pytest-keep-hash.log" | grep -E "PASS|FAIL|SKIP|ERROR|passed|failed"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
PART=${PART:-shapes}
if [ "$PART" = shapes ]; then
  shapes=()
  for w in ${SHAPES:-}; do shapes+=(--only "$w"); done
  timeout "${BENCH_S:-560}" python3 bench/staging.py --repeat "${REPEAT:-4}" --native-repeat 1 \
    --load-floor-repeat "${FLOOR_REPEAT:-1}" --floor-gib 0 ${shapes[@]+"${shapes[@]}"} \
    --variant keep:SNAPSHOT_SHIM_KEEP_HOST_COPY=1 --rewrite-mib 1024 \
    --out "$OUT/staging-keep.json" >"$OUT/staging-keep.log" 2>"$OUT/staging-keep.stderr" \
    || status=1
  cat "$OUT/staging-keep.log"; tail -5 "$OUT/staging-keep.stderr"
else
  only=()
  for p in ${PART//,/ }; do only+=(--only "$p"); done
  timeout "${BENCH_S:-560}" python3 bench/sleep_wake.py --gib "${GIB:-49}" \
    --cycles "${CYCLES:-20}" --repeat "${REPEAT:-3}" "${only[@]}" ${MERGE:+--merge "$MERGE"} \
    --out "$OUT/sleep-wake.json" >"$OUT/sleep-wake.log" 2>"$OUT/sleep-wake.stderr" || status=1
  cat "$OUT/sleep-wake.log"; tail -5 "$OUT/sleep-wake.stderr"
fi
exit $status
