#!/usr/bin/env bash
# Issue 18 on one H200: build the release shim against the system cuda.h, run the owned
# memory tests (a torch.multiprocessing pair with the default allocator, paused and
# running; a single process's matmuls and CUDA graph) and the earlier single-GPU tests,
# then what ownership costs (bench/owned_alloc.py --torch) and whether an IPC event
# stays linked across the native checkpoint (tools/probe_legacy_ipc.py event-link).
#
#   OUT=/path/to/results [WHEELS=.whl] tests/gpu/run_owned_h200.sh
#
# Results in $OUT: build.log, pytest.log, owned-torch.json, owned-alloc.json,
# owned-alloc.log, event-link.txt. Multicast is never created.
set -uo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?set OUT to the directory that receives the results}"
WHEELS=${WHEELS:-.whl}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export CUINTERPOSE_ALLOW_MULTICAST=0 CUINTERPOSE_TEST_DRIVER=system PYTHONUNBUFFERED=1
status=0
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site "$WHEELS"/*.whl || exit 1
rm -rf /tmp/pkg && mkdir -p /tmp/pkg && cp -r frontends /tmp/pkg/cuinterpose \
  && cp -r engine /tmp/pkg/cuinterpose/engine && cp -r phases /tmp/pkg/cuinterpose/phases
export PYTHONPATH=/tmp/site:/tmp/pkg:$PWD CUINTERPOSE_BUILD_DIR=$PWD/build
{ cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCUINTERPOSE_CUDA_INCLUDE=/usr/local/cuda/include \
    -DPython_EXECUTABLE="$(command -v python3)" && cmake --build build -j16; } >"$OUT/build.log" 2>&1 \
  || { tail -30 "$OUT/build.log"; exit 1; }

mkdir -p /tmp/figures
CUINTERPOSE_TRACE_OUT=/tmp/figures timeout "${GPU_TESTS_S:-300}" python3 -m pytest \
  -p no:cacheprovider -v -rs tests/gpu/test_owned_torch.py tests/gpu/test_gpu_checkpoint.py \
  2>&1 | tee "$OUT/pytest.log" | grep -E "PASS|FAIL|SKIP|ERROR|passed|failed|Error"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
cp /tmp/figures/owned-torch.json "$OUT/" 2>/dev/null
timeout "${ALLOC_S:-180}" python3 bench/owned_alloc.py --torch --out "$OUT/owned-alloc.json" \
  2>&1 | tee "$OUT/owned-alloc.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
timeout 90 python3 tools/probe_legacy_ipc.py event-link >"$OUT/event-link.txt" 2>&1 || status=1
grep -E "event_query|native" "$OUT/event-link.txt" | cut -c1-160
echo "status $status"
exit "$status"
