# Sourced (from the repository's root) by every GPU run script: tests/gpu/run_*.sh,
# bench/run_*_h200.sh, on an H200 or an H100. The machine's python3 holds torch and
# cuda-bindings; the wheels in $WHEELS (cattrs, transitions, attrs: what the image lacks)
# go into /tmp/site. Two ways to run cuinterpose there:
# - the checkout (default): its three folders are put together under /tmp/pkg as the
#   wheel lays them out (pyproject.toml), and h200_build builds the release libraries
#   against the system cuda.h into build/ (its log in $OUT/build.log);
# - CUINTERPOSE_WHEEL=path/to/cuinterpose-*.whl: that wheel is installed into /tmp/site as
#   a user's `pip install` would (its libraries as built into it, nothing compiled),
#   `cuinterpose` comes from /tmp/site/bin, and h200_build only checks that the package,
#   the shim and the command all come from the installation, not from the checkout.
# The wheel lies in a folder of its own (.whl/pkg/), not among $WHEELS, which are
# installed on every run: a checkout run must not import the wheel's package.
# cuip_shim prints the shim's path either way. Multicast stays off:
# CUINTERPOSE_ALLOW_MULTICAST=0 and NVLS off for NCCL, PyTorch and NVSHMEM.
: "${OUT:?set OUT to the directory that receives the results}"
WHEELS=${WHEELS:-.whl}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export CUINTERPOSE_ALLOW_MULTICAST=0 CUINTERPOSE_TEST_DRIVER=system PYTHONUNBUFFERED=1
if compgen -G "$WHEELS/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$WHEELS"/*.whl || exit 1
fi
if [ -n "${CUINTERPOSE_WHEEL:-}" ]; then
  [ -f "$CUINTERPOSE_WHEEL" ] || { echo "h200_env.sh: no wheel at $CUINTERPOSE_WHEEL" >&2; exit 1; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$CUINTERPOSE_WHEEL" || exit 1
  CUINTERPOSE_WHEEL=$(cd "$(dirname "$CUINTERPOSE_WHEEL")" && pwd)/$(basename "$CUINTERPOSE_WHEEL")
  rm -rf /tmp/pkg
fi
if [ -z "${CUINTERPOSE_WHEEL:-}" ]; then
  rm -rf /tmp/pkg && mkdir -p /tmp/pkg && cp -r frontends /tmp/pkg/cuinterpose \
    && cp -r engine /tmp/pkg/cuinterpose/engine && cp -r phases /tmp/pkg/cuinterpose/phases
fi
# Their bytecode, as pip leaves it for an installed package: a command reads it instead of
# compiling every module it imports (each time, where PYTHONDONTWRITEBYTECODE is set; on
# the 2-core machine 55 ms against 200 ms for `cuinterpose status`, bench/startup.py).
for compiled in /tmp/site /tmp/pkg; do
  [ ! -d "$compiled" ] || python3 -m compileall -q -j 0 "$compiled" >/dev/null \
    || echo "h200_env.sh: compileall $compiled failed: its modules compile at each import" >&2
done

if [ -n "${CUINTERPOSE_WHEEL:-}" ]; then
  # $PWD stays on the path for the tests' own helpers (tests.*): the checkout has no
  # cuinterpose/ folder, so the package can only come from /tmp/site.
  export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
  unset CUINTERPOSE_BUILD_DIR
  h200_build() {
    {
      echo "installed wheel: $CUINTERPOSE_WHEEL"
      (cd / && python3 - <<'PY'
import shutil, subprocess
import cuinterpose, cuinterpose.engine
where = cuinterpose.__file__
command = shutil.which("cuinterpose") or ""
shim = subprocess.run(["cuinterpose", "shim-path"], capture_output=True, text=True,
                      check=True).stdout.strip()
print("package", where, "version", cuinterpose.__version__)
print("command", command)
print("shim", shim)
for what, path in (("package", where), ("command", command), ("shim", shim)):
    if not path.startswith("/tmp/site/"):
        raise SystemExit(f"the {what} is not the installed one: {path}")
PY
      )
    } >"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; return 1; }
  }
  cuip_shim() { (cd / && cuinterpose shim-path); }
else
  export PYTHONPATH=/tmp/site:/tmp/pkg:$PWD CUINTERPOSE_BUILD_DIR=$PWD/build
  h200_build() {
    { cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo \
        -DCUINTERPOSE_CUDA_INCLUDE=/usr/local/cuda/include \
        -DPython_EXECUTABLE="$(command -v python3)" && cmake --build build -j16; } \
      >"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; return 1; }
  }
  cuip_shim() { echo "$PWD/build/shim_c/libcuinterpose.so"; }
fi
