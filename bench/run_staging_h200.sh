#!/usr/bin/env bash
# On a fresh two-GPU H200 machine with this repository copied (the device tool): build
# the release shim against the system cuda.h, run tests/gpu (the NCCL two-rank test
# included) and bench/staging.py, results in $OUT (at most 8 files).
#
#   OUT=/path/to/results [WHEELS=.whl] bench/run_staging_h200.sh
#
# GPU_TESTS=none skips the tests, BENCH_S=0 the benchmark; BENCH_ARGS are passed to
# bench/staging.py (e.g. --variant NAME:VAR=VALUE,...). environment.txt also holds the
# interpreter's bare start and the `cuinterpose --help` start; importtime.txt what
# each import costs.
#
# Uses the machine's python3 (torch, cuda-bindings, attrs, pytest are in the image);
# cattrs and transitions come as wheels from $WHEELS. cuinterpose is not installed: its
# three folders are put together under /tmp/pkg as the wheel would (pyproject.toml).
# Multicast stays off: CUINTERPOSE_ALLOW_MULTICAST=0 and NCCL/PyTorch/NVSHMEM NVLS off.
set -uo pipefail
cd "$(dirname "$0")/.."
. tests/gpu/h200_env.sh
status=0
{ nvidia-smi; uname -r; nproc; cat /sys/kernel/mm/transparent_hugepage/enabled \
    /sys/kernel/mm/transparent_hugepage/defrag; python3 -c 'import torch, cuda.bindings;
print("torch", torch.__version__, "nccl", torch.cuda.nccl.version(), "gpus", torch.cuda.device_count());
print("cuda-bindings", cuda.bindings.__version__)'
    for i in 1 2 3; do TIMEFORMAT="python3 -c pass: %R s"; time python3 -c pass
      TIMEFORMAT="python3 -m cuinterpose --help: %R s"; time python3 -m cuinterpose --help >/dev/null
    done; } >"$OUT/environment.txt" 2>&1
python3 -X importtime -m cuinterpose --help 2>"$OUT/importtime.txt" >/dev/null
h200_build || exit 1
mkdir -p /tmp/traces
if [ "${GPU_TESTS:-tests/gpu}" != none ]; then
  CUINTERPOSE_TRACE_OUT=/tmp/traces timeout "${GPU_TESTS_S:-200}" python3 -m pytest -p no:cacheprovider \
    -v -rs -s ${GPU_TESTS:-tests/gpu} 2>&1 | tee "$OUT/pytest-gpu.log" | grep -E "PASS|FAIL|SKIP|ERROR|passed|failed"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
if [ "${BENCH_S:-300}" -gt 0 ]; then
  timeout "${BENCH_S:-300}" python3 bench/staging.py --repeat "${REPEAT:-3}" \
    --out "$OUT/staging.json" ${BENCH_ARGS:-} >"$OUT/staging.log" 2>"$OUT/staging.stderr" || status=1
  cat "$OUT/staging.log"; tail -5 "$OUT/staging.stderr"
fi
tar -czf "$OUT/traces.tar.gz" -C /tmp traces 2>/dev/null
echo "status $status"
exit $status
