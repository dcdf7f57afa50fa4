#!/usr/bin/env bash
# What the stored parts' sums cost on one H200 (specs/criu.md, "What the sums cost"):
# bench/stored_sums.py with the default build (build/, sums on) and a measurement build
# without sums (build-nosums/, -DCUINTERPOSE_STORED_NO_SUMS=ON), taking turns round by
# round on the real driver, 16 parts as on 16 CPUs; then one core's XXH64 rate
# (bench/xxh64_rate.c). Results in $OUT: build.log, build-nosums.log, sums.json,
# sums.log, xxh64.txt, status.txt.
#
#   OUT=/path [WHEELS=.whl] [SUMS_GIB=8] [SUMS_REPEAT=5] [SUMS_PARTS=16] bench/run_sums_h200.sh
set -uo pipefail
cd "$(dirname "$0")/.."
. tests/gpu/h200_env.sh
status=0
h200_build || { echo "status 1" | tee "$OUT/status.txt"; exit 1; }
{ cmake -S . -B build-nosums -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCUINTERPOSE_CUDA_INCLUDE=/usr/local/cuda/include -DCUINTERPOSE_BUILD_TESTS=OFF \
    -DCUINTERPOSE_STORED_NO_SUMS=ON -DPython_EXECUTABLE="$(command -v python3)" \
    && cmake --build build-nosums -j16; } >"$OUT/build-nosums.log" 2>&1 \
  || { tail -30 "$OUT/build-nosums.log"; echo "status 1" | tee "$OUT/status.txt"; exit 1; }
timeout 500 python3 bench/stored_sums.py --driver system --gib "${SUMS_GIB:-8}" \
  --parts "${SUMS_PARTS:-16}" --repeat "${SUMS_REPEAT:-5}" --dir /tmp \
  --out "$OUT/sums.json" 2>&1 | tee "$OUT/sums.log" || status=1
{ cc -O2 -I shim_c bench/xxh64_rate.c -o /tmp/xxh64_rate \
    && for _ in 1 2 3; do /tmp/xxh64_rate 8; done; } 2>&1 | tee "$OUT/xxh64.txt" || status=1
echo "status $status" | tee "$OUT/status.txt"
exit "$status"
