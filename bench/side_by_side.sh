#!/usr/bin/env bash
# Our jobs and the published Python RoundPipe's, in one order on one host: the side-by-side
# comparisons of docs/benchmarks.md ("Side by side in one run").
#   bench/side_by_side.sh BUILD_DIR OUT_DIR PLAN_FILE
# PLAN_FILE holds one run per line, run in order (blank lines and lines starting with # skipped):
#   ours LABEL TIMEOUT_S JOB.toml [--set key=value ...]   (bench/gpu_bench.sh BUILD_DIR 1 ...)
#   published LABEL TIMEOUT_S ARGS...                    (bench/published_roundpipe.py ARGS...)
# Every run's JSON line goes to OUT_DIR/rows.jsonl with "label" added. Our runs also leave
# metrics.jsonl, summary.json, profile.json, the launcher's log (launch.log) and a gzipped
# trace.json in OUT_DIR/LABEL/, for bench/boundary_profile.py and a look at where a step's idle
# time went (and, in the log, how long start-up took); the published runs leave
# their log in OUT_DIR/LABEL.log. A run that fails or runs out of time is reported on stderr and
# the next one runs. Exit status: the number of runs that gave no line (at most 100).
# Env: RP_COMMIT and RP_MACHINE (stamped on our lines, as gpu_bench.sh does), RP_PUBLISHED_DIR
# (the published system's checkout, for bench/published_roundpipe.py).
set -uo pipefail
set -f  # plan lines carry TOML arrays such as [1,2,3]: no filename expansion
if [ $# -ne 3 ]; then
  sed -n '2,15p' "$0" >&2
  exit 2
fi
build=$1; out=$(realpath -m "$2"); plan=$3
here=$(cd "$(dirname "$0")" && pwd)
[ -x "$build/bin/rp-launch" ] || { echo "side_by_side: no $build/bin/rp-launch (build first)" >&2; exit 2; }
[ -r "$plan" ] || { echo "side_by_side: cannot read the plan file $plan" >&2; exit 2; }
mkdir -p "$out"
t0=$(date +%s)
say() { echo "[$(( $(date +%s) - t0 )) s] $*" >&2; }
# Adds "label" to the JSON line on stdin.
label() { python3 -c 'import json, sys; d = json.loads(sys.stdin.read()); d["label"] = sys.argv[1]; print(json.dumps(d))' "$1"; }
# Runs a command in its own process group and stops the whole group (rp-launch, its coordinator
# and workers; the Python runner) after LIMIT seconds: SIGTERM, then SIGKILL 20 s later.
run_limited() {
  local limit=$1; shift
  setsid "$@" &
  local pid=$!
  ( sleep "$limit"; kill -TERM -- "-$pid" 2>/dev/null; sleep 20; kill -KILL -- "-$pid" 2>/dev/null ) &
  local watcher=$!
  wait "$pid"
  local rc=$?
  kill "$watcher" 2>/dev/null
  return $rc
}
missing=0
while read -r kind name limit rest; do
  case "$kind" in ''|'#'*) continue ;; esac
  if ! [[ "$name" =~ ^[A-Za-z0-9._-]+$ ]] || ! [[ "$limit" =~ ^[0-9]+$ ]]; then
    say "bad plan line: '$kind $name $limit $rest' (want: ours|published LABEL TIMEOUT_S ...)"; missing=$((missing + 1)); continue
  fi
  s=$(date +%s)
  line=""
  shm_before=$(ls /dev/shm 2>/dev/null | grep -E '^rp-' || true)
  if [ "$kind" = ours ]; then
    runs=$(mktemp -d /tmp/rp-sbs-XXXXXX)
    # shellcheck disable=SC2086  # the job and its --set arguments are words of the plan line
    run_limited "$limit" env RP_BENCH_OUT="$runs" "$here/gpu_bench.sh" "$build" 1 $rest > "$runs/line" 2> "$out/$name.err"
    line=$(tail -1 "$runs/line")
    mkdir -p "$out/$name"
    for f in metrics.jsonl summary.json profile.json; do [ -f "$runs/run/$f" ] && cp "$runs/run/$f" "$out/$name/"; done
    [ -f "$runs/log" ] && cp "$runs/log" "$out/$name/launch.log"
    [ -f "$runs/run/trace.json" ] && gzip -c "$runs/run/trace.json" > "$out/$name/trace.json.gz"
    [ -f "$runs/run/trace.json" ] && python3 "$here/boundary_profile.py" "$runs/run" > "$out/$name/boundary.json" 2>/dev/null
    rm -rf "$runs"
  elif [ "$kind" = published ]; then
    tmp=$(mktemp /tmp/rp-sbs-XXXXXX.jsonl)
    # shellcheck disable=SC2086
    run_limited "$limit" python3 "$here/published_roundpipe.py" $rest --out "$tmp" > "$out/$name.log" 2>&1
    line=$(tail -1 "$tmp" 2>/dev/null)
    rm -f "$tmp"
  else
    say "bad plan line: kind '$kind' is neither ours nor published"; missing=$((missing + 1)); continue
  fi
  if [ -n "$line" ]; then
    echo "$line" | label "$name" >> "$out/rows.jsonl"
    say "$name: $(echo "$line" | python3 -c 'import json, sys; d = json.loads(sys.stdin.read()); print(d.get("tokens_per_s_steady", d.get("tokens_per_s")), "tokens/s")') ($(( $(date +%s) - s )) s)"
  else
    say "$name: no result after $(( $(date +%s) - s )) s (see $out/$name.$([ "$kind" = ours ] && echo err || echo log))"
    missing=$((missing + 1))
  fi
  # A run stopped at its time limit may leave its shared-memory segments behind: remove those
  # that appeared during it, not another run's.
  ls /dev/shm 2>/dev/null | grep -E '^rp-' | while read -r seg; do
    grep -qxF "$seg" <<< "$shm_before" || rm -f "/dev/shm/$seg"
  done
done < "$plan"
say "done: rows in $out/rows.jsonl"
exit $(( missing > 100 ? 100 : missing ))
