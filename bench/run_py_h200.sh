#!/usr/bin/env bash
# One Python benchmark on one H200, after the release build: for run_many_h200.sh, whose
# specs cannot hold an argument with a space (NAME=SECONDS:[VAR=val ]SCRIPT ARGS, each
# word its own). Writes $OUT/environment.txt, build.log, run.log (stdout and stderr) and
# passes --out $OUT/run.json to the script.
#
#   OUT=/path [WHEELS=.whl] bench/run_py_h200.sh bench/torch_staging.py --only=single …
set -uo pipefail
cd "$(dirname "$0")/.."
. tests/gpu/h200_env.sh
[ $# -ge 1 ] || { sed -n '2,7p' "$0" >&2; exit 2; }
# The NUMA layout beside the GPU's: where LOAD's memcpy and copies may cross sockets
# (issue 30's lead: one H200, 2026-12-02, commit c53ba93, docs/benchmarks.md).
{ nvidia-smi -L; nproc; free -g; lscpu | grep -iE '^(model name|socket|numa)'
  nvidia-smi topo -m; } >"$OUT/environment.txt" 2>&1
h200_build || exit 1
python3 "$@" --out "$OUT/run.json" >"$OUT/run.log" 2>&1
status=$?
grep -vE "^\[(torch|many)\]   " "$OUT/run.log" | tail -25
echo "status $status"
exit "$status"
