#!/usr/bin/env bash
# Build CRIU (4.0 or later) from its upstream source and install the one binary the
# round trip needs into PREFIX/sbin/criu (specs/criu.md). Debian 12's criu 3.17
# cannot run on recent kernels (`vdso: Unexpected rt vDSO area bounds`); where the
# package manager has CRIU >= 4.0 (Debian 13 does), install that instead.
#
#   tools/build_criu.sh [--deps] SRC PREFIX
#
#   SRC     a CRIU source tree, e.g. `git clone -b v4.2 https://github.com/checkpoint-restore/criu`
#           (or `git archive v4.2` of a mirror); only `make criu` is run: no docs,
#           no plugins (CRIU's CUDA plugin must not run: the agent does the native
#           checkpoint itself)
#   PREFIX  where it goes: PREFIX/sbin/criu; then point the suite and the verbs at it
#           with CUINTERPOSE_CRIU=PREFIX/sbin/criu (or put PREFIX/sbin on PATH)
#   --deps  first apt-get install the Debian build dependencies (needs root and the
#           package index: run `apt-get update` once before)
#
# Ends with `criu check`, which passes only as root (CRIU needs CAP_SYS_ADMIN and
# CAP_CHECKPOINT_RESTORE); the suite's CRIU tests skip, with its output as the
# reason, where it fails. tools/bundle_criu.sh copies the result to another machine.
set -euo pipefail
DEPS=(libprotobuf-dev libprotobuf-c-dev protobuf-c-compiler protobuf-compiler python3-protobuf
      libnl-3-dev libnet1-dev libcap-dev libbsd-dev libgnutls28-dev libnftables-dev uuid-dev
      libaio-dev pkg-config build-essential)
if [[ ${1:-} == --deps ]]; then
  shift
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${DEPS[@]}"
fi
[[ $# -eq 2 ]] || { sed -n '2,20p' "$0" >&2; exit 2; }
SRC=$(cd "$1" && pwd)
PREFIX=$2
major=$(sed -n 's/^CRIU_VERSION_MAJOR[[:space:]]*:=[[:space:]]*//p' "$SRC/Makefile.versions")
[[ ${major:-0} -ge 4 ]] || { echo "$SRC is CRIU ${major:-?}.x: 4.0 or later is needed" >&2; exit 1; }
make -C "$SRC" -j"$(nproc)" criu >"$SRC/build-criu.log" 2>&1 \
  || { tail -30 "$SRC/build-criu.log" >&2; echo "make criu failed: $SRC/build-criu.log" >&2; exit 1; }
install -D -m 0755 "$SRC/criu/criu" "$PREFIX/sbin/criu"
"$PREFIX/sbin/criu" --version
"$PREFIX/sbin/criu" check || echo "warning: \`criu check\` failed (not root?): the CRIU tests will skip" >&2
echo "installed $PREFIX/sbin/criu; use it with CUINTERPOSE_CRIU=$PREFIX/sbin/criu"
