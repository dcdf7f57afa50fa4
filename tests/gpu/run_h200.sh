#!/usr/bin/env bash
# On a fresh H200 machine with this repository copied: build the C libraries, run the
# real-GPU tests and the checkpoint benchmark, and collect everything under $OUT.
#
#   PYTHON=/path/to/python OUT=/path/to/results tests/gpu/run_h200.sh
#
# PYTHON must already have the dependencies (cuda-bindings, cuda-pathfinder,
# nvidia-cuda-runtime headers, pytest, attrs, cattrs, transitions) and cuinterpose
# installed (pip install -e . from carried wheels); nothing is downloaded here.
# Never runs a multicast case (CUINTERPOSE_ALLOW_MULTICAST is forced off).
# Exit status: 0 only if the build, the tests and the benchmark all passed.
set -uo pipefail
cd "$(dirname "$0")/../.."
: "${PYTHON:?set PYTHON to a python with the dependencies and cuinterpose installed}"
: "${OUT:?set OUT to the directory that receives the results}"
mkdir -p "$OUT/traces"
export CUINTERPOSE_TEST_DRIVER=system CUINTERPOSE_TRACE_OUT="$OUT/traces"
export CUINTERPOSE_ALLOW_MULTICAST=0 CUINTERPOSE_BUILD_DIR="$PWD/build"
status=0

{ nvidia-smi; "$PYTHON" -c 'import cuda.bindings, cuinterpose; print("cuda-bindings", cuda.bindings.__version__)'; } \
  >"$OUT/environment.txt" 2>&1 || { echo "environment check failed, see $OUT/environment.txt"; exit 1; }

# make build without its venv step: the stamp counts as up to date, tools come from $PYTHON.
make -o .venv/.installed build BIN="$(dirname "$PYTHON")" >"$OUT/build.log" 2>&1 \
  || { echo "make build failed, see $OUT/build.log"; tail -20 "$OUT/build.log"; exit 1; }

timeout 1800 "$PYTHON" -m pytest -v -rs tests/gpu 2>&1 | tee "$OUT/pytest-gpu.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
grep -q " passed" "$OUT/pytest-gpu.log" && ! grep -q "SKIPPED" "$OUT/pytest-gpu.log" || {
  echo "GPU tests did not run (skipped or collected nothing)"; status=1; }

timeout 1800 "$PYTHON" bench/checkpoint.py --out "$OUT/bench.json" --keep "$OUT/bench-logs" \
  2>&1 | tee "$OUT/bench.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "results in $OUT (status $status)"
exit "$status"
