#!/usr/bin/env bash
# Issue 30 §4 on one H200 (the device tool, kind nvidia-h200), under ~4 minutes: what a
# `cuinterpose` command costs of its own before its first byte (bench/startup.py). Each
# verb against `python3 -c pass`, with the bytecode that tests/gpu/h200_env.sh compiles
# and without any (every module compiled from source, the standard library's too); the
# first native call in a fresh interpreter (import cuda.bindings.driver, then cuInit(0)
# on the system driver: nothing else is called on the GPU); one shimmed process on the
# simulated driver (the release build): status, suspend and resume by command and by
# library, each split into its steps and the rest. Results in $OUT: environment.txt,
# build.log, startup.{json,log}, startup-nobytecode.{json,log}, startup-group.{json,log},
# status.txt.
#
#   OUT=/path/to/results [WHEELS=.whl] bash bench/run_startup_h200.sh
#
# RUNS (10) runs of each command (5 without bytecode and for the group). Multicast is never created (CUINTERPOSE_ALLOW_MULTICAST=0).
set -uo pipefail
cd "$(dirname "$0")/.."
. tests/gpu/h200_env.sh
status=0
runs=${RUNS:-10}
{ nvidia-smi -L; uname -r; nproc; python3 -c 'import sys, cuda.bindings
print("python", sys.version.split()[0], "dont_write_bytecode", sys.flags.dont_write_bytecode)
print("cuda-bindings", cuda.bindings.__version__)'; env | grep -E '^PYTHON' | sort; } \
  >"$OUT/environment.txt" 2>&1
cat "$OUT/environment.txt"
bench() {  # NAME SECONDS RUNS ARGS...: bench/startup.py ARGS, its JSON and log in $OUT
  local name=$1 seconds=$2 n=$3
  shift 3
  timeout "$seconds" python3 bench/startup.py --runs "$n" --out "$OUT/$name.json" "$@" \
    >"$OUT/$name.log" 2>&1 || { echo "$name failed (exit $?)" >>"$OUT/$name.log"; status=1; }
  cat "$OUT/$name.log"
}
bench startup 90 "$runs" --native system
bench startup-nobytecode 90 5 --without-bytecode
if h200_build; then
  bench startup-group 120 5 --group
else
  echo "build failed: no group run (build.log)"; status=1
fi
echo "status $status" | tee "$OUT/status.txt"
exit $status
