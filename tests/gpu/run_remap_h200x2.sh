#!/usr/bin/env bash
# Issue 33 on two H200s of one host: a group suspended on GPU 0 and resumed on GPU 1
# (tests/gpu/test_remap_torch.py with CUINTERPOSE_REMAP_TO=1). Multicast stays off
# (tests/gpu/h200_env.sh sets CUINTERPOSE_ALLOW_MULTICAST=0, NCCL_NVLS_ENABLE=0,
# TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1): cuMulticastCreate is
# never called.
#
# - a torch.multiprocessing producer/consumer pair on GPU 0, default allocator (owned
#   cudaMalloc memory, legacy IPC), then again with expandable segments (VMM, POSIX
#   FD): suspend and resume without a mapping (the reference times), then suspend and
#   resume with --gpu-map 0=1 (the ordinals resolve to GPU 0's and GPU 1's UUIDs, the
#   native restore's gpuPairs); after it every tensor's bytes, both processes' contexts
#   on GPU 1's UUID as the driver answers (torch's cached UUID is recorded beside it),
#   the consumer's write reaching the producer, a new share, a matmul;
# - a single process's matmuls and a captured CUDA graph, replayed after the move;
# - a process without the shim, through the native checkpoint alone, restored without
#   pairs and then with the same gpuPairs GPU 0 -> GPU 1: the driver's own cost;
# - a group spread on both GPUs (a creator on GPU 0 sharing cudaMalloc memory by legacy
#   IPC with an importer on GPU 1, which reaches it over NVLink) moved with the GPUs
#   swapped, --gpu-map 0=1,1=0 (on one GPU, run_remap_h200.sh: both on GPU 0, 0=0).
#
#   OUT=/path/to/results [WHEELS=.whl] tests/gpu/run_remap_h200x2.sh
#
# Results in $OUT: environment.txt (nvidia-smi -L: both UUIDs), build.log, pytest.log,
# remap.json (per cycle: the mapping, suspend_s, resume_s, the GPUs the manifest
# recorded, "where" after the move; native_plain and native_map), status.txt. Ends
# within REMAP_S (300 s) after the build. Not covered here: a two-rank NCCL job
# swapped, and the CRIU verbs onto GPU 1 (issue 33 items 3 and 4).
set -uo pipefail
cd "$(dirname "$0")/../.."
. tests/gpu/h200_env.sh
status=0
{ nvidia-smi -L; nvidia-smi topo -m; python3 -c 'import torch, cuda.bindings
print("torch", torch.__version__, "gpus", torch.cuda.device_count())
print("cuda-bindings", cuda.bindings.__version__)'; } >"$OUT/environment.txt" 2>&1 \
  || { cat "$OUT/environment.txt"; echo "status 1" | tee "$OUT/status.txt"; exit 1; }
if [ "$(nvidia-smi -L | grep -c '^GPU ')" -lt 2 ]; then
  echo "two GPUs needed" | tee -a "$OUT/environment.txt"
  echo "status 1" | tee "$OUT/status.txt"
  exit 1
fi
h200_build || { echo "status 1" | tee "$OUT/status.txt"; exit 1; }
CUINTERPOSE_REMAP_TO=1 CUINTERPOSE_TRACE_OUT="$OUT" timeout "${REMAP_S:-300}" \
  python3 -m pytest -p no:cacheprovider -v -rs -s tests/gpu/test_remap_torch.py \
  >"$OUT/pytest.log" 2>&1
[ $? -eq 0 ] || status=1
grep -E "PASS|FAIL|SKIP|ERROR|passed|failed|skipped|Error" "$OUT/pytest.log" | tail -30
echo "status $status" | tee "$OUT/status.txt"
exit "$status"
