#!/usr/bin/env bash
# The GPU round from the installed wheel, on whichever card the machine has (an H100 or
# an H200): the wheel built by `pip wheel .` is pip-installed (tests/gpu/h200_env.sh,
# CUINTERPOSE_WHEEL) and every step runs the installed package, its shim and its
# `cuinterpose` command, never the checkout's:
#   rules      tools/probe_driver_rules.py on the bare driver, compared case by case with
#              specs/records/2026-11-29-h200-driver-rules.jsonl (what the simulator follows)
#   pidns      tools/probe_pid_namespace.py: the native calls on a process in a pod of its
#              own, by host pid and by namespace pid, two pods with the same namespace pid
#   fidelity   tests/gpu/run_fidelity_h200.sh (the bare driver against the shim)
#   pytest     tests/gpu/run_h200.sh with BENCHES=none (the GPU tests)
#   programs   tests/gpu/test_running_programs.py alone: torch training, transformers,
#              JAX, numba and CuPy suspended while they run
#   keep       the kept host copy's GPU tests: the chunk hash's PTX against the known
#              answers, the shim's own kernel and DMA path (tests/gpu/test_keep_*.py)
#   keepbench  bench/staging.py on $SHAPES (default 1x8GiB and 2048x2MiB), the kept host
#              copy off and on with 1 GiB rewritten before each later suspend, against the
#              DtoH/HtoD ceilings and the native checkpoint of the same run
#   readme     tests/gpu/run_readme_h200.sh (README's session, outside the checkout)
#   isolation  tests/gpu/run_isolation_h200.sh (legacy IPC isolation; owned memory's cost)
#
#   OUT=/path CUINTERPOSE_WHEEL=.whl/pkg/cuinterpose-*.whl [WHEELS=.whl] [STEPS="rules ..."] \
#     tests/gpu/run_installed.sh
#
# Results in $OUT: summary.txt (one line a step: its exit status and seconds),
# rules-diff.txt, and round.tar.gz (every step's files and log). Each step has its own
# time limit; round.tar.gz is rewritten after each, so a call cut short keeps what ran. Multicast is never created.
set -uo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?set OUT to the directory that receives the results}"
: "${CUINTERPOSE_WHEEL:?name the wheel to install: CUINTERPOSE_WHEEL=path/to/cuinterpose-*.whl}"
export CUINTERPOSE_WHEEL
root=$OUT
work=/tmp/round
rm -rf "$work" && mkdir -p "$work"
status=0
STEPS=${STEPS:-rules pidns fidelity pytest readme isolation}

step() {  # step NAME LIMIT_S COMMAND...: run it with its own $OUT, note its status
  local name=$1 limit=$2 started rc
  shift 2
  mkdir -p "$work/$name"
  started=$(date +%s)
  if declare -F "$1" >/dev/null; then  # a function of this script: timeout needs a program
    OUT=$work/$name timeout "$limit" bash -c "$(declare -f "$1"); $1" >"$work/$name/run.log" 2>&1
  else
    OUT=$work/$name timeout "$limit" "$@" >"$work/$name/run.log" 2>&1
  fi
  rc=$?
  echo "$name exit $rc in $(($(date +%s) - started)) s" | tee -a "$root/summary.txt"
  [ "$rc" -eq 0 ] || { status=1; tail -15 "$work/$name/run.log"; }
  # After each step: what a call cut short at its own limit still brings back.
  tar -czf "$root/round.tar.gz" -C /tmp round
}

probe_rules() {
  . tests/gpu/h200_env.sh
  h200_build || return 1
  python3 tools/probe_driver_rules.py >"$OUT/rules.jsonl" || return 1
  python3 - "$OUT/rules.jsonl" specs/records/2026-11-29-h200-driver-rules.jsonl \
    >"$OUT/rules-diff.txt" <<'PY'
import json, sys
here, record = ({json.loads(l)["case"]: json.loads(l)["result"] for l in open(p) if l.strip()}
                for p in sys.argv[1:3])
for case in sorted(set(here) | set(record)):
    a, b = here.get(case, "(not asked)"), record.get(case, "(not recorded)")
    print(("same " if a == b else "DIFF ") + case + ": here " + json.dumps(a)
          + ("" if a == b else " / recorded on the H200 " + json.dumps(b)))
PY
}

keep_tests() {
  . tests/gpu/h200_env.sh
  h200_build || return 1
  python3 -m pytest -p no:cacheprovider -v -rs -s tests/gpu/test_keep_hash.py \
    tests/gpu/test_keep_gpu.py 2>&1 | tee "$OUT/pytest-keep.log"
  return "${PIPESTATUS[0]}"
}

keep_bench() {
  . tests/gpu/h200_env.sh
  h200_build || return 1
  local only=() shape
  for shape in ${SHAPES:-1x8GiB 2048x2MiB}; do only+=(--only "$shape"); done
  python3 bench/staging.py --repeat "${REPEAT:-2}" --native-repeat 1 --load-floor-repeat 0 \
    --floor-gib 0 --variant keep:SNAPSHOT_SHIM_KEEP_HOST_COPY=1 --rewrite-mib 1024 "${only[@]}" \
    --out "$OUT/staging-keep.json" >"$OUT/staging-keep.log" 2>"$OUT/staging-keep.stderr"
}

probe_pidns() {
  . tests/gpu/h200_env.sh
  h200_build || return 1
  python3 tools/probe_pid_namespace.py >"$OUT/pidns.jsonl"
}

{ nvidia-smi; uname -r; nproc; echo "wheel $CUINTERPOSE_WHEEL"; } >"$root/environment.txt" 2>&1
for name in $STEPS; do
  case $name in
    rules) step rules 150 probe_rules ;;
    pidns) step pidns 120 probe_pidns ;;
    fidelity) step fidelity 150 tests/gpu/run_fidelity_h200.sh ;;
    pytest) step pytest 300 env BENCHES=none GPU_TESTS_S=280 tests/gpu/run_h200.sh ;;
    programs) step programs "${PROGRAMS_S:-400}" env BENCHES=none GPU_TESTS_S="${PROGRAMS_S:-400}" \
      GPU_TESTS=tests/gpu/test_running_programs.py tests/gpu/run_h200.sh ;;
    keep) step keep "${KEEP_S:-120}" keep_tests ;;
    keepbench) step keepbench "${KEEPBENCH_S:-300}" keep_bench ;;
    readme) step readme 200 tests/gpu/run_readme_h200.sh ;;
    isolation) step isolation 200 env ALLOC_S=120 tests/gpu/run_isolation_h200.sh ;;
    *) echo "unknown step $name" | tee -a "$root/summary.txt"; status=1 ;;
  esac
done
cp "$work/rules/rules-diff.txt" "$root/" 2>/dev/null
echo "status $status" | tee -a "$root/summary.txt"
exit "$status"
