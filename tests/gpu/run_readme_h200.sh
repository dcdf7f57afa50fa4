#!/usr/bin/env bash
# README.md's "Using it" session on one H200, as a newcomer would type it there: its
# app.py and its shell session taken from the README (tests/readme_session.py), with
# `--driver sim` read as `--driver system`; then the same program suspended and resumed
# with a person's output (`--progress human`), to see what suspend says it released.
# Results in $OUT: build.log, session.log, human.log, status.txt.
#
# Not yet seen through on an H200: the first try found `python` (then a link to the
# image's python3) without cuda-bindings; the second outlived the call and brought
# nothing back, most likely an app.py left looping by a failed step (it ends only
# when ./stop exists, which every exit of this script now creates).
#
#   OUT=/path [WHEELS=.whl] tests/gpu/run_readme_h200.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
. tests/gpu/h200_env.sh
status=0
h200_build || { echo "status 1" | tee "$OUT/status.txt"; exit 1; }
# No wheel is installed there: `cuinterpose` and `python` as the README expects them.
mkdir -p /tmp/bin
printf '#!/bin/sh\nexec python3 -m cuinterpose "$@"\n' >/tmp/bin/cuinterpose
# A wrapper, not a link: a link to a virtual environment's python3 loses its packages.
printf '#!/bin/sh\nexec python3 "$@"\n' >/tmp/bin/python
chmod +x /tmp/bin/cuinterpose /tmp/bin/python
export PATH=/tmp/bin:$PATH
rm -rf /tmp/readme && mkdir -p /tmp/readme
# app.py runs until ./stop exists: whatever step fails, nothing is left running.
trap 'touch /tmp/readme/stop' EXIT
python3 - <<'PY' || status=1
from pathlib import Path
from tests.readme_session import blocks
app, session = blocks()
Path("/tmp/readme/app.py").write_text(app)
Path("/tmp/readme/session.sh").write_text(session.replace("--driver sim", "--driver system"))
PY
(cd /tmp/readme && timeout 150 bash -e session.sh) >"$OUT/session.log" 2>&1 || status=1
cat /tmp/readme/app.log >>"$OUT/session.log" 2>/dev/null
grep -q "bytes intact" /tmp/readme/app.log || status=1
touch /tmp/readme/stop
# A person's view of the same steps.
timeout 150 bash -s >"$OUT/human.log" 2>&1 <<'SH' || status=1
  set -e
  cd /tmp/readme && rm -f stop app.log app.pid && rm -rf ckpt
  export SNAPSHOT_CONTROL_DIR=/tmp/cuinterpose-human
  cuinterpose launch --driver system --pidfile app.pid -- python app.py >app.log &
  launcher=$!
  until grep -q ready app.log; do kill -0 "$launcher"; sleep 0.1; done
  cuinterpose suspend --progress human --checkpoint-dir ckpt --pid "$(cat app.pid)"
  cuinterpose status
  cuinterpose resume --progress human --checkpoint-dir ckpt
  touch stop && wait "$launcher"
  cat app.log
SH
echo "status $status" | tee "$OUT/status.txt"
exit "$status"
