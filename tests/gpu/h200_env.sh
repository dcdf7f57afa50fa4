# Sourced (from the repository's root) by every H200 run script: tests/gpu/run_*.sh,
# bench/run_*_h200.sh. The machine's python3 holds torch and cuda-bindings; the wheels in
# $WHEELS (cattrs, transitions, attrs: what the image lacks) go into /tmp/site; cuinterpose
# is not installed: its three folders are put together under /tmp/pkg as the wheel lays
# them out (pyproject.toml). Multicast stays off: CUINTERPOSE_ALLOW_MULTICAST=0 and NVLS
# off for NCCL, PyTorch and NVSHMEM. h200_build builds the release libraries against the
# system cuda.h into build/ (its log in $OUT/build.log).
: "${OUT:?set OUT to the directory that receives the results}"
WHEELS=${WHEELS:-.whl}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export CUINTERPOSE_ALLOW_MULTICAST=0 CUINTERPOSE_TEST_DRIVER=system PYTHONUNBUFFERED=1
if compgen -G "$WHEELS/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$WHEELS"/*.whl || exit 1
fi
rm -rf /tmp/pkg && mkdir -p /tmp/pkg && cp -r frontends /tmp/pkg/cuinterpose \
  && cp -r engine /tmp/pkg/cuinterpose/engine && cp -r phases /tmp/pkg/cuinterpose/phases
# Their bytecode, as pip leaves it for an installed package: a command reads it instead of
# compiling every module it imports (each time, where PYTHONDONTWRITEBYTECODE is set; on
# the 2-core machine 55 ms against 200 ms for `cuinterpose status`, bench/startup.py).
for compiled in /tmp/site /tmp/pkg; do
  [ ! -d "$compiled" ] || python3 -m compileall -q -j 0 "$compiled" >/dev/null \
    || echo "h200_env.sh: compileall $compiled failed: its modules compile at each import" >&2
done
export PYTHONPATH=/tmp/site:/tmp/pkg:$PWD CUINTERPOSE_BUILD_DIR=$PWD/build

h200_build() {
  { cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo \
      -DCUINTERPOSE_CUDA_INCLUDE=/usr/local/cuda/include \
      -DPython_EXECUTABLE="$(command -v python3)" && cmake --build build -j16; } \
    >"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; return 1; }
}
