#!/usr/bin/env bash
# Several H200 run scripts in one device call, each under its own time limit, so that
# one call builds once and measures together (the device returns at most 8 files: each
# script's results come back as one NAME.tar.gz, and summary.txt says how each ended).
#
#   OUT=/path [WHEELS=.whl] tests/gpu/run_many_h200.sh NAME=SECONDS:SCRIPT [ARGS…] …
#
# e.g. tests/gpu/run_many_h200.sh fidelity=240:tests/gpu/run_fidelity_h200.sh \
#        criu=360:tests/gpu/run_criu_h200.sh
# A script that outlives its SECONDS is killed (its process group with it) and reads
# "timed out" in summary.txt; the next one still runs. Variables for one script go
# before the script in the argument (NAME=SECONDS:VAR=value SCRIPT), read by env.
set -uo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?set OUT to the directory that receives the results}"
[ $# -ge 1 ] || { sed -n '2,12p' "$0" >&2; exit 2; }
summary=$OUT/summary.txt
: >"$summary"
overall=0
for spec in "$@"; do
  name=${spec%%=*} rest=${spec#*=}
  limit=${rest%%:*} command=${rest#*:}
  [[ $name =~ ^[A-Za-z0-9_-]+$ && $limit =~ ^[0-9]+$ && -n $command ]] \
    || { echo "bad spec '$spec': NAME=SECONDS:SCRIPT" | tee -a "$summary"; overall=2; continue; }
  dir=/tmp/run-many/$name
  rm -rf "$dir" && mkdir -p "$dir"
  start=$(date +%s.%N)
  # timeout puts itself and the script in a process group of their own and signals the
  # whole group on expiry: the script's workloads end with it.
  # shellcheck disable=SC2086
  OUT=$dir timeout -k 10 "$limit" env $command >"$dir/console.log" 2>&1
  rc=$?
  took=$(python3 -c "import time; print(f'{time.time() - $start:.0f}')")
  case $rc in
    0) verdict="passed" ;;
    124 | 137) verdict="timed out after ${limit} s" ;;
    *) verdict="failed (exit $rc)" ;;
  esac
  [ "$rc" -eq 0 ] || overall=1
  echo "$name: $verdict in ${took} s ($command)" | tee -a "$summary"
  tail -5 "$dir/console.log" | sed 's/^/    /' | tee -a "$summary"
  tar -czf "$OUT/$name.tar.gz" -C /tmp/run-many "$name"
done
exit "$overall"
