#!/usr/bin/env bash
# Issue 32's figure on one H200: the 8 GiB torch pair through `cuinterpose criu dump` and
# `criu restore` with the staged bytes stored beside the images (bench/criu.py --mode
# beside), next to the storage's own parallel write and read rate measured the same way
# in the same directory just before (bench/storage_rate.py: 16 threads, no sync, as the
# shims store). Twice: each process's bytes in 16 files (one per shim copy thread, the
# default on 16 CPUs; CRIU_MODE=both adds the run with the bytes in the images) and in 1
# (as before the parts: one file per process), so that the store rate is compared on
# the same machine in the same call. The CRIU bundle travels in .criu/
# (tests/gpu/run_criu_h200.sh says how).
# Results in $OUT: build.log, storage.json, criu-16.json, criu-1.json, criu.log,
# status.txt; the last lines printed give each run's store rate and number of files.
#
#   OUT=/path [WHEELS=.whl] [CRIU_MIB=8192] [CRIU_S=130] [CRIU_MODE=beside|both] [CRIU_PARTS="16 1"]
#     [CRIU_SCENARIO=torch|torch-single|torch-default|group]
#     bench/run_criu_beside_h200.sh
set -uo pipefail
cd "$(dirname "$0")/.."
. tests/gpu/h200_env.sh
status=0
h200_build || { echo "status 1" | tee "$OUT/status.txt"; exit 1; }
chmod +x .criu/criu .criu/bin/criu .criu/lib/ld-linux* 2>/dev/null
export CUINTERPOSE_CRIU=${CUINTERPOSE_CRIU:-$PWD/.criu/criu}
mib=${CRIU_MIB:-8192}
timeout 60 python3 bench/storage_rate.py --dir /tmp --gib "$((mib / 1024))" --threads 16 \
  --out "$OUT/storage.json" || status=1
{ "$CUINTERPOSE_CRIU" --version && "$CUINTERPOSE_CRIU" check; } >"$OUT/criu.log" 2>&1 \
  || { echo "criu check failed"; status=1; }
for parts in ${CRIU_PARTS:-16 1}; do
  mode=beside
  [ "$parts" = 16 ] && mode=${CRIU_MODE:-beside}
  echo "== $parts files per process, --mode $mode" >>"$OUT/criu.log"
  timeout "${CRIU_S:-130}" python3 bench/criu.py --driver system --mib "$mib" \
    --scenario "${CRIU_SCENARIO:-torch}" --mode "$mode" --parts "$parts" --work /tmp \
    --out "$OUT/criu-$parts.json" >>"$OUT/criu.log" 2>&1 \
    || { echo "criu with $parts files per process failed"; status=1; }
done
grep -vE "^  (dump|restore) " "$OUT/criu.log" | tail -16
echo "status $status" | tee "$OUT/status.txt"
exit "$status"
