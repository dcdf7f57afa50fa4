#!/usr/bin/env bash
# README.md's "Using it" on one H200, as a newcomer types it there (issue 29): its app.py
# and its shell session taken from the README (tests/readme_session.py) and run as
# written, with no --driver anywhere: `launch` must say it runs on the system's driver,
# and cuDeviceGetName under `cuinterpose launch` must name the H200. Then the same
# program suspended in one shell (SNAPSHOT_CONTROL_DIR set there) and resumed from
# another (no SNAPSHOT_CONTROL_DIR) with no flag but the checkpoint directory.
#
# Results in $OUT: build.log, name.txt, session.log, shell_one.log, shell_two.log,
# manifest.json, summary.txt (one line per check), status.txt ("status 0": all held).
#
# Earlier tries: the first found `python` (a link to the image's python3) without
# cuda-bindings (the wrappers below fix it); the second outlived the call and brought
# nothing back, most likely an app.py left looping by a failed step: app.py ends only
# when ./stop exists, so every exit here creates it, and kills (-9) by its pid file
# whatever still runs after a grace second (a suspended app.py cannot read ./stop).
# Every step has its own timeout; the whole ends in well under 6 minutes.
#
#   OUT=/path [WHEELS=.whl] tests/gpu/run_readme_h200.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
. tests/gpu/h200_env.sh
W=/tmp/readme
status=0
note() { echo "$*" | tee -a "$OUT/summary.txt"; }
fail() { note "FAIL $*"; status=1; }
cleanup() {
  touch "$W/stop" "$W/two/stop" 2>/dev/null
  sleep 1
  for f in "$W/app.pid" "$W/two/app.pid"; do
    [ -s "$f" ] && kill -9 "$(cat "$f")" 2>/dev/null
  done
  rm -rf /tmp/cuinterpose-two
}
trap cleanup EXIT
: >"$OUT/summary.txt"
h200_build || { echo "status 1" | tee "$OUT/status.txt"; exit 1; }
# `cuinterpose` and `python` as the README expects them: the installed wheel's command
# where CUINTERPOSE_WHEEL names one, else the checkout's package run as a module.
mkdir -p /tmp/bin
[ -n "${CUINTERPOSE_WHEEL:-}" ] \
  || printf '#!/bin/sh\nexec python3 -m cuinterpose "$@"\n' >/tmp/bin/cuinterpose
# A wrapper, not a link: a link to a virtual environment's python3 loses its packages.
printf '#!/bin/sh\nexec python3 "$@"\n' >/tmp/bin/python
chmod +x /tmp/bin/*
export PATH=/tmp/bin:$PATH
rm -rf "$W" && mkdir -p "$W/two"
python3 - <<'PY' || fail "README blocks"
from pathlib import Path
from tests.readme_session import blocks
app, session = blocks()
assert "--driver" not in session, "README's session names a driver"
Path("/tmp/readme/app.py").write_text(app)
Path("/tmp/readme/two/app.py").write_text(app)
Path("/tmp/readme/session.sh").write_text(session)
PY

# 1. Which GPU a launched program sees.
(cd "$W" && timeout 60 cuinterpose launch -- python -c '
from cuda.bindings import driver as cu
cu.cuInit(0)
err, dev = cu.cuDeviceGet(0)
err, name = cu.cuDeviceGetName(128, dev)
print("device", name.split(b"\0")[0].decode())') >"$OUT/name.txt" 2>&1 || fail "launch of the name probe"
grep -q "cuinterpose launch: on the system's driver" "$OUT/name.txt" && note "ok launch says the system's driver" || fail "launch's driver line: $(head -1 "$OUT/name.txt")"
grep -Eq "^device NVIDIA (H100|H200)" "$OUT/name.txt" && note "ok $(grep '^device' "$OUT/name.txt")" || fail "cuDeviceGetName: $(grep '^device' "$OUT/name.txt")"

# 2. The session as written.
(cd "$W" && timeout 120 bash -e session.sh) >"$OUT/session.log" 2>&1 && note "ok the README session" || fail "the README session (exit $?)"
cat "$W/app.log" >>"$OUT/session.log" 2>/dev/null
grep -q "bytes intact" "$W/app.log" && note "ok app.py: bytes intact" || fail "app.py did not say bytes intact"
grep -q "on the system's driver" "$OUT/session.log" && note "ok the session's launch: system's driver" || fail "the session's launch did not run on the system's driver"
touch "$W/stop"

# 3. Suspend in one shell, resume in another with no flag but the checkpoint directory.
timeout 90 bash -s >"$OUT/shell_one.log" 2>&1 <<'SH' && note "ok shell one: launch + suspend" || fail "shell one (exit $?)"
  set -e
  cd /tmp/readme/two
  export SNAPSHOT_CONTROL_DIR=/tmp/cuinterpose-two
  cuinterpose launch --pidfile app.pid -- python app.py >app.log 2>launch.err &
  echo $! >launcher.pid
  for i in $(seq 600); do grep -q ready app.log 2>/dev/null && break; kill -0 "$(cat launcher.pid)"; sleep 0.1; done
  grep -q ready app.log
  cuinterpose suspend --checkpoint-dir ckpt --pid "$(cat app.pid)"
  cuinterpose status
SH
cp "$W/two/ckpt/manifest.json" "$OUT/manifest.json" 2>/dev/null
timeout 90 env -u SNAPSHOT_CONTROL_DIR bash -s >"$OUT/shell_two.log" 2>&1 <<'SH' && note "ok shell two: resume --checkpoint-dir ckpt" || fail "shell two (exit $?)"
  set -e
  cd /tmp/readme/two
  cuinterpose resume --checkpoint-dir ckpt
  touch stop
  for i in $(seq 300); do grep -q "bytes intact" app.log && break; sleep 0.1; done
  cat launch.err app.log
  grep -q "bytes intact" app.log
SH
grep -q '"outcome": "resumed"' "$OUT/shell_two.log" && note "ok resumed" || fail "no resumed summary"
echo "status $status" | tee "$OUT/status.txt"
exit "$status"
