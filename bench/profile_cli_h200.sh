#!/usr/bin/env bash
# Where a command's own time goes on one H200 (issue 30 item 4): README's program under
# the shim, then `cuinterpose suspend` / `resume` five times each (seconds, and the
# steps' own from the summary), the third of each under cProfile (the 40 costliest
# calls by cumulative time), and `python -X importtime` of one suspend (the 25 costliest
# imports); `cuinterpose status` and `python -c pass` five times each beside them.
# bench/startup.py first (each verb against python3 -c pass: startup.{json,log}).
# Results in $OUT: build.log, startup.{json,log}, times.txt, profile-suspend.txt, profile-resume.txt,
# importtime.txt, app.log.
#
#   OUT=/path [WHEELS=.whl] bench/profile_cli_h200.sh
set -uo pipefail
cd "$(dirname "$0")/.."
. tests/gpu/h200_env.sh
h200_build || exit 1
# Each verb against python3 -c pass, and the first native call (bench/startup.py).
timeout "${STARTUP_S:-90}" python3 bench/startup.py --runs "${RUNS:-10}" --native system \
  --out "$OUT/startup.json" >"$OUT/startup.log" 2>&1 || echo "startup.py failed (exit $?)"
tail -25 "$OUT/startup.log"
W=/tmp/profile-cli && rm -rf "$W" && mkdir -p "$W"
export SNAPSHOT_CONTROL_DIR=$W/control
python3 - <<'PY' || exit 1
from pathlib import Path
from tests.readme_session import blocks
Path("/tmp/profile-cli/app.py").write_text(blocks()[0])
PY
cd "$W" || exit 1
python3 -m cuinterpose launch --pidfile app.pid -- python3 app.py >app.log 2>launch.err &
for _ in $(seq 600); do grep -q ready app.log 2>/dev/null && break; sleep 0.1; done
grep -q ready app.log || { cat launch.err app.log; exit 1; }
pid=$(cat app.pid)
cat >"$W/steps.py" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    if line.startswith("{"):
        e = json.loads(line)
        if e.get("event") == "summary":
            print(" ".join(f"{t['phase']}={t['seconds']:.3f}" for t in e.get("timings", [])))
PY
clock() { python3 -c 'import time; print(time.perf_counter())'; }
{
  for i in 1 2 3 4 5; do
    for verb in suspend resume; do
      args=(--checkpoint-dir "$W/ckpt" --progress json)
      [ "$verb" = suspend ] && args+=(--pid "$pid")
      if [ "$i" = 3 ]; then
        pre=(python3 -m cProfile -o "$W/$verb.prof" -m cuinterpose)
      else
        pre=(python3 -m cuinterpose)
      fi
      t0=$(clock); "${pre[@]}" "$verb" "${args[@]}" >"$W/$verb.out" 2>&1 || { echo "$verb failed"; cat "$W/$verb.out"; }
      t1=$(clock)
      steps=$(python3 "$W/steps.py" "$W/$verb.out")
      echo "$verb $i $(python3 -c "print(f'{$t1 - $t0:.3f}')") s: $steps"
    done
  done
  for i in 1 2 3 4 5; do
    t0=$(clock); python3 -m cuinterpose status >/dev/null 2>&1; t1=$(clock)
    t2=$(clock); python3 -c pass; t3=$(clock)
    echo "status $(python3 -c "print(f'{$t1 - $t0:.3f}')") s, python -c pass $(python3 -c "print(f'{$t3 - $t2:.3f}')") s"
  done
} | tee "$OUT/times.txt"
for verb in suspend resume; do
  python3 -c 'import pstats,sys; pstats.Stats(sys.argv[1]).sort_stats("cumulative").print_stats(40)' \
    "$W/$verb.prof" >"$OUT/profile-$verb.txt" 2>&1
done
python3 -X importtime -m cuinterpose suspend --checkpoint-dir "$W/ckpt2" --pid "$pid" \
  2>"$W/imp.txt" >/dev/null
python3 -m cuinterpose resume --checkpoint-dir "$W/ckpt2" >/dev/null 2>&1
sort -t'|' -k2 -n -r "$W/imp.txt" | head -25 >"$OUT/importtime.txt"
touch "$W/stop"; sleep 1; cp app.log "$OUT/app.log"
kill -9 "$pid" 2>/dev/null
grep -q "bytes intact" "$OUT/app.log" && echo "bytes intact" || echo "app did not say bytes intact"
