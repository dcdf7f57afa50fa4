#!/usr/bin/env bash
# On a fresh H200 machine (two GPUs for the NCCL test) with this repository copied:
# build the release libraries against the system cuda.h, run the real-GPU tests
# (three processes, raw-import refusal, two-rank NCCL job; GPU_TESTS names others) recording their traces,
# then the one-command suspend/resume next to the native checkpoint
# (bench/suspend.py), the staging benchmark (bench/staging.py) and the gate's cost
# per call (tests/gpu/quiesce_bench.py). Results in $OUT (at most 8 files):
# environment.txt, build.log, pytest-gpu.log, suspend.json, staging.json,
# staging.log, traces.tar.gz (traces, figures, the gate's cost), status.txt.
#
#   OUT=/path/to/results [WHEELS=.whl] [BENCHES="suspend staging gate"] tests/gpu/run_h200.sh
#
# Uses the machine's python3 (torch, cuda-bindings, pytest, rich are in the image);
# the wheels in $WHEELS (cattrs, transitions, attrs) are installed into /tmp/site.
# cuinterpose is not installed: its three folders are put together under /tmp/pkg as
# the wheel lays them out. Multicast is never created: CUINTERPOSE_ALLOW_MULTICAST=0
# and NVLS off for NCCL, PyTorch and NVSHMEM.
set -uo pipefail
cd "$(dirname "$0")/../.."
. tests/gpu/h200_env.sh
status=0
finish() {
  tar -czf "$OUT/traces.tar.gz" -C /tmp traces 2>/dev/null
  echo "status $status" | tee "$OUT/status.txt"
  exit "$status"
}
{ nvidia-smi; uname -r; nproc; python3 -c 'import torch, cuda.bindings, cuinterpose.engine
print("torch", torch.__version__, "nccl", torch.cuda.nccl.version(), "gpus", torch.cuda.device_count())
print("cuda-bindings", cuda.bindings.__version__)'; } >"$OUT/environment.txt" 2>&1 \
  || { cat "$OUT/environment.txt"; status=1; finish; }
h200_build || { status=1; finish; }

mkdir -p /tmp/traces
CUINTERPOSE_TRACE_OUT=/tmp/traces timeout "${GPU_TESTS_S:-240}" python3 -m pytest -p no:cacheprovider \
  -v -rs -s ${GPU_TESTS:-tests/gpu} 2>&1 | tee "$OUT/pytest-gpu.log" | grep -E "PASS|FAIL|SKIP|ERROR|passed|failed"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
grep -Eq "[0-9]+ passed" "$OUT/pytest-gpu.log" || { echo "no GPU test ran"; status=1; }

BENCHES=${BENCHES:-suspend staging gate}
if [[ " $BENCHES " == *" gate "* ]]; then
  timeout "${GATE_S:-120}" python3 tests/gpu/quiesce_bench.py --driver system --repeats 3 \
    2>&1 | tee /tmp/traces/gate.log
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
if [[ " $BENCHES " == *" suspend "* ]]; then
  timeout "${SUSPEND_S:-150}" python3 bench/suspend.py --gib "${SUSPEND_GIB:-4}" \
    --out "$OUT/suspend.json" 2>&1 | tee /tmp/traces/suspend.log
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

if [[ " $BENCHES " == *" staging "* ]]; then
  timeout "${BENCH_S:-240}" python3 bench/staging.py --repeat "${REPEAT:-3}" --out "$OUT/staging.json" \
    >"$OUT/staging.log" 2>/tmp/traces/staging.stderr || status=1
  cat "$OUT/staging.log"
fi
finish
