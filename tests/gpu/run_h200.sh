#!/usr/bin/env bash
# On a fresh H200 machine with this repository copied: build the C libraries, run the
# real-GPU tests and the checkpoint benchmark, and put the results in $OUT.
#
#   PYTHON=/path/to/python OUT=/path/to/results tests/gpu/run_h200.sh
#
# PYTHON must already have the dependencies (cuda-bindings, cuda-pathfinder, the
# nvidia-cuda-runtime headers, pytest, attrs, cattrs, transitions; rich only for the
# CLI's human output, which nothing here uses) and cuinterpose
# installed (e.g. pip install --no-deps --no-build-isolation -e .); nothing is
# downloaded here. Never runs a multicast case (CUINTERPOSE_ALLOW_MULTICAST=0).
# $OUT receives at most 7 files: environment.txt, build.log, pytest-gpu.log,
# bench.log, bench.json, traces.tar.gz (capture/restore traces, figures, worker logs)
# and status.txt. Exit status 0 only if the build, the tests and the benchmark passed.
set -uo pipefail
cd "$(dirname "$0")/../.."
: "${PYTHON:?set PYTHON to a python with the dependencies and cuinterpose installed}"
: "${OUT:?set OUT to the directory that receives the results}"
WORK=$(mktemp -d /tmp/cuinterpose-h200.XXXXXX)
mkdir -p "$OUT" "$WORK/traces"
export CUINTERPOSE_TEST_DRIVER=system CUINTERPOSE_TRACE_OUT="$WORK/traces"
export CUINTERPOSE_ALLOW_MULTICAST=0 CUINTERPOSE_BUILD_DIR="$PWD/build" PYTHONUNBUFFERED=1
# Nor may a library create multicast objects on its own (NVLink SHARP).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
status=0
finish() {
  tar -czf "$OUT/traces.tar.gz" -C "$WORK" traces bench-logs 2>/dev/null \
    || tar -czf "$OUT/traces.tar.gz" -C "$WORK" traces
  echo "status $status" >"$OUT/status.txt"
  echo "results in $OUT (status $status)"
  exit "$status"
}

{ nvidia-smi; "$PYTHON" -c 'import cuda.bindings, cuinterpose.engine.demo; print("cuda-bindings", cuda.bindings.__version__)'; } \
  >"$OUT/environment.txt" 2>&1 || { echo "environment check failed:"; cat "$OUT/environment.txt"; status=1; finish; }

# make build without its venv step: the stamp counts as up to date, tools come from $PYTHON.
make -o .venv/.installed build BIN="$(dirname "$PYTHON")" >"$OUT/build.log" 2>&1 \
  || { echo "make build failed:"; tail -20 "$OUT/build.log"; status=1; finish; }

timeout 300 "$PYTHON" -m pytest -v -rs tests/gpu 2>&1 | tee "$OUT/pytest-gpu.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
# A run where everything skipped (no GPU seen, shim not built) is a failure here.
grep -Eq "[0-9]+ passed" "$OUT/pytest-gpu.log" || { echo "no GPU test ran"; status=1; }

timeout 240 "$PYTHON" bench/checkpoint.py --out "$OUT/bench.json" --keep "$WORK/bench-logs" \
  2>&1 | tee "$OUT/bench.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
# One-command suspend/resume of a creator/importer group through the CLI, next to the
# native checkpoint of the same bytes (its JSON goes with the traces).
timeout 240 "$PYTHON" bench/suspend.py --out "$WORK/traces/suspend.json" 2>&1 | tee -a "$OUT/bench.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
finish
