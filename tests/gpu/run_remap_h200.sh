#!/usr/bin/env bash
# Issue 32 on one H200: the identity GPU mapping given explicitly through the whole
# suspend/resume path (tests/gpu/test_remap_torch.py with CUINTERPOSE_REMAP_TO=0): a
# torch.multiprocessing pair on the default allocator and with expandable segments,
# each suspended and resumed without a mapping, with --gpu-map 0=0 and with
# --gpu-map GPU-<uuid>=GPU-<uuid>; a single process's matmuls and CUDA graph with
# --gpu-map 0=0; the creator/importer group (cudaMalloc memory shared by legacy IPC)
# through the library with --gpu-map 0=0; a process without the shim through the
# native checkpoint alone, with and without the pair GPU-<uuid>=GPU-<uuid> as gpuPairs.
# Multicast is never created.
#
#   OUT=/path/to/results [WHEELS=.whl] tests/gpu/run_remap_h200.sh
#
# Results in $OUT: environment.txt, build.log, pytest.log, remap.json (every cycle's
# suspend and resume seconds, the mapping, the GPUs the manifest recorded, where each
# process runs after it), status.txt. Ends within REMAP_S (240 s) after the build.
set -uo pipefail
cd "$(dirname "$0")/../.."
. tests/gpu/h200_env.sh
status=0
{ nvidia-smi -L; python3 -c 'import torch, cuda.bindings
print("torch", torch.__version__, "gpus", torch.cuda.device_count())
print("cuda-bindings", cuda.bindings.__version__)'; } >"$OUT/environment.txt" 2>&1 \
  || { cat "$OUT/environment.txt"; echo "status 1" | tee "$OUT/status.txt"; exit 1; }
h200_build || { echo "status 1" | tee "$OUT/status.txt"; exit 1; }
CUINTERPOSE_REMAP_TO=0 CUINTERPOSE_TRACE_OUT="$OUT" timeout "${REMAP_S:-240}" \
  python3 -m pytest -p no:cacheprovider -v -rs -s tests/gpu/test_remap_torch.py \
  >"$OUT/pytest.log" 2>&1
[ $? -eq 0 ] || status=1
grep -E "PASS|FAIL|SKIP|ERROR|passed|failed|skipped|Error" "$OUT/pytest.log" | tail -30
echo "status $status" | tee "$OUT/status.txt"
exit "$status"
