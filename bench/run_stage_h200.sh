#!/usr/bin/env bash
# Issue 19 on one H200 (the device tool, kind nvidia-h200), under ~8 minutes: build the
# release shim against the system cuda.h, the three-process GPU test (the creator's
# private allocation is staged now), the staging benchmark (four shapes, the defaults
# and the old populate pass as a variant), and the torch jobs (bench/torch_staging.py:
# one process with 16 GiB of tensors, a producer/consumer pair; each against the native
# checkpoint alone, as commands and through the library). Results in $OUT (8 files at
# most): environment.txt, build.log, pytest-gpu.log, staging.json, staging.log,
# torch.json, torch.log, status.txt.
#
#   OUT=/path/to/results [WHEELS=.whl] bash bench/run_stage_h200.sh
#
# Time limits (seconds): GPU_TESTS_S (90), BENCH_S (180), TORCH_S (240); GPU_TESTS=none,
# BENCH_S=0 or TORCH_S=0 skip a part; STAGING_ARGS / TORCH_ARGS are passed on. Multicast
# is never created (CUINTERPOSE_ALLOW_MULTICAST=0, NVLS off).
set -uo pipefail
cd "$(dirname "$0")/.."
. tests/gpu/h200_env.sh
status=0
{ nvidia-smi; uname -r; nproc; free -g; cat /sys/kernel/mm/transparent_hugepage/enabled \
    /sys/kernel/mm/transparent_hugepage/defrag; python3 -c 'import torch, cuda.bindings
print("torch", torch.__version__, "gpus", torch.cuda.device_count())
print("cuda-bindings", cuda.bindings.__version__)'; } >"$OUT/environment.txt" 2>&1
h200_build || { echo "status 1" | tee "$OUT/status.txt"; exit 1; }
if [ "${GPU_TESTS:-tests/gpu/test_gpu_checkpoint.py}" != none ]; then
  timeout "${GPU_TESTS_S:-90}" python3 -m pytest -p no:cacheprovider -v -rs -s \
    ${GPU_TESTS:-tests/gpu/test_gpu_checkpoint.py} 2>&1 | tee "$OUT/pytest-gpu.log" \
    | grep -E "PASS|FAIL|SKIP|ERROR|passed|failed"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
if [ "${BENCH_S:-180}" -gt 0 ]; then
  timeout "${BENCH_S:-180}" python3 bench/staging.py --repeat "${REPEAT:-3}" --out "$OUT/staging.json" \
    ${STAGING_ARGS:-} \
    >"$OUT/staging.log" 2>/tmp/staging.stderr || status=1
  cat "$OUT/staging.log"; tail -5 /tmp/staging.stderr
fi
if [ "${TORCH_S:-240}" -gt 0 ]; then
  timeout "${TORCH_S:-240}" python3 bench/torch_staging.py --repeat "${REPEAT:-3}" \
    --out "$OUT/torch.json" ${TORCH_ARGS:-} >"$OUT/torch.log" 2>/tmp/torch.stderr || status=1
  cat "$OUT/torch.log"; tail -20 /tmp/torch.stderr
  cat /tmp/torch.stderr >>"$OUT/torch.log"
fi
echo "status $status" | tee "$OUT/status.txt"
exit $status
