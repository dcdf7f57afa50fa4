#!/usr/bin/env bash
# The round trip through CRIU on one H200 (specs/criu.md): suspend, criu dump, criu
# restore (into an emptied control directory), resume, for the creator/importer group,
# a torch.multiprocessing producer/consumer pair with expandable segments, and the same
# pair on the default allocator (bench/criu.py). The machine has no CRIU and no
# network: the bundle made here with tools/bundle_criu.sh travels in .criu/ (gitignored:
# carry it). Results in $OUT (at most 8 files): environment.txt, build.log,
# criu-check.txt, criu.json, criu.log, criu-logs.tar.gz (CRIU's own dump and restore
# logs), status.txt; after a failure also criu-bounce0.json, the group again without
# pinned bounce buffers. Within the device's 10 minutes a command: CRIU_S=360 s for the
# three scenarios, CRIU_AGAIN_S=150 s for the second try.
#
#   tools/bundle_criu.sh .criu /opt/criu/sbin/criu          # here, once
#   OUT=/path [WHEELS=.whl] [CRIU_MIB=1024] tests/gpu/run_criu_h200.sh   # there
#
# Set up like tests/gpu/run_h200.sh (the machine's python3 with torch and
# cuda-bindings, the wheels in $WHEELS in /tmp/site, the package laid out in /tmp/pkg).
set -uo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?set OUT to the directory that receives the results}"
WHEELS=${WHEELS:-.whl}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export CUINTERPOSE_ALLOW_MULTICAST=0 CUINTERPOSE_TEST_DRIVER=system PYTHONUNBUFFERED=1
export CUINTERPOSE_CRIU=${CUINTERPOSE_CRIU:-$PWD/.criu/criu}
[ -d .criu ] && chmod +x .criu/criu .criu/bin/criu .criu/lib/ld-linux* 2>/dev/null
status=0
finish() {
  tar -czf "$OUT/criu-logs.tar.gz" -C /tmp criu-logs 2>/dev/null
  echo "status $status" | tee "$OUT/status.txt"
  exit "$status"
}
if compgen -G "$WHEELS/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$WHEELS"/*.whl || exit 1
fi
rm -rf /tmp/pkg && mkdir -p /tmp/pkg && cp -r frontends /tmp/pkg/cuinterpose \
  && cp -r engine /tmp/pkg/cuinterpose/engine && cp -r phases /tmp/pkg/cuinterpose/phases
export PYTHONPATH=/tmp/site:/tmp/pkg:$PWD CUINTERPOSE_BUILD_DIR=$PWD/build
{ nvidia-smi; uname -r; nproc; cat /etc/os-release; ldd --version | head -1
  python3 -c 'import torch, cuda.bindings, cuinterpose.engine
print("torch", torch.__version__, "gpus", torch.cuda.device_count())
print("cuda-bindings", cuda.bindings.__version__)'; } >"$OUT/environment.txt" 2>&1 \
  || { cat "$OUT/environment.txt"; status=1; finish; }
{ cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCUINTERPOSE_CUDA_INCLUDE=/usr/local/cuda/include \
    -DPython_EXECUTABLE="$(command -v python3)" && cmake --build build -j16; } >"$OUT/build.log" 2>&1 \
  || { tail -30 "$OUT/build.log"; status=1; finish; }
# Only CRIU's own answer decides; the plugin directory and cuda-checkpoint are noted.
{ "$CUINTERPOSE_CRIU" --version && "$CUINTERPOSE_CRIU" check; } >"$OUT/criu-check.txt" 2>&1 \
  || { cat "$OUT/criu-check.txt"; status=1; finish; }
{ ls /usr/lib/criu; command -v cuda-checkpoint || echo "no cuda-checkpoint"; } \
  >>"$OUT/criu-check.txt" 2>&1
rm -rf /tmp/criu-logs && mkdir -p /tmp/criu-logs
timeout "${CRIU_S:-360}" python3 bench/criu.py --driver system --mib "${CRIU_MIB:-1024}" \
  --scenario group --scenario torch --scenario torch-default --work /tmp \
  --logs /tmp/criu-logs --out "$OUT/criu.json" 2>&1 | tee "$OUT/criu.log"
if [ "${PIPESTATUS[0]}" -ne 0 ]; then
  status=1
  # A dump refused on the shim's pinned bounce buffers (kept across the native
  # checkpoint) would pass without them: say which it was.
  echo "=== the group again with SNAPSHOT_SHIM_STAGING_BOUNCE_MIB=0" | tee -a "$OUT/criu.log"
  SNAPSHOT_SHIM_STAGING_BOUNCE_MIB=0 timeout "${CRIU_AGAIN_S:-150}" python3 bench/criu.py \
    --driver system --mib "${CRIU_MIB:-1024}" --scenario group --work /tmp \
    --logs /tmp/criu-logs/bounce0 --out "$OUT/criu-bounce0.json" 2>&1 | tee -a "$OUT/criu.log"
fi
finish
