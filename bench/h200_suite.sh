#!/usr/bin/env bash
# The H200 benchmark set in one command, for one run on a GPU host. Every figure goes to ONE
# file of JSON lines, easy to copy back from a remote host. Each line carries the commit passed
# in, because the tree being measured need not be a clean checkout of any commit.
#   bench/h200_suite.sh BUILD_DIR COMMIT OUT_FILE [quick]
# For each job (RP_SUITE_JOBS, default the Qwen3-1.7B and 4B jobs):
#  * rp-block-bench with and without the weight-gradient sinks;
#  * exact mode at the defaults (10 steps, steps 3-10 steady) and stale1 (6 steps), each run's
#    line with its boundary profile (bench/boundary_profile.py) under "boundary".
# `quick`: exact mode only, 6 steps. `ab`: exact mode, 8 steps, at the defaults and then with the
# --set arguments in RP_SUITE_AB (one A/B pair per job, on the same host). `list`: one 8-step
# run per line of RP_SUITE_RUNS ("job.toml [--set key=value ...]"), in order, instead of the
# jobs. RP_SUITE_BLOCK=0 skips the block bench; RP_SUITE_TRACES=DIR keeps each run's trace.json
# there as trace-runN.json (N counts runs from 1). Append OUT_FILE's lines to bench/results.jsonl, with a "note", once they are
# back. Progress and a summary go to stderr.
set -uo pipefail
if [ $# -lt 3 ]; then
  sed -n '2,12p' "$0" >&2
  exit 2
fi
build=$1; commit=$2; out=$3; quick=${4:-}
here=$(cd "$(dirname "$0")" && pwd)
jobs=${RP_SUITE_JOBS:-"configs/qwen3-1.7b.toml configs/qwen3-4b.toml"}
export RP_COMMIT=$commit
keep=$(mktemp -d /tmp/rp-suite-XXXXXX)
trap 'rm -rf "$keep"' EXIT
t0=$(date +%s)
say() { echo "[$(( $(date +%s) - t0 )) s] $*" >&2; }
failed=0

# Adds the date, commit and command to a JSON line on stdin (rp-block-bench prints neither).
stamp() {
  python3 -c '
import datetime, json, sys
d = json.loads(sys.stdin.read())
d.update({"date": datetime.date.today().isoformat(), "commit": sys.argv[1], "command": sys.argv[2]})
print(json.dumps(d))' "$commit" "$1"
}

for job in $jobs; do
  [ "${RP_SUITE_BLOCK:-1}" = 0 ] && break
  for flag in "" --no-weight-grad-sinks; do
    cmd="$build/bin/rp-block-bench $job --reps 10 $flag"
    if line=$($cmd 2>>"$keep/stderr") && [ -n "$line" ]; then
      echo "$line" | stamp "$cmd" >> "$out"
      say "block bench $job $flag"
    else
      say "block bench $job $flag FAILED"; failed=1
    fi
  done
done

n=0
run() {  # steps job [--set ...]
  local steps=$1; shift
  n=$((n + 1))
  local dir="$keep/run$n"
  if ! line=$(RP_BENCH_KEEP="$dir" "$here/gpu_bench.sh" "$build" 1 "$@" --set train.steps="$steps" 2>>"$keep/stderr"); then
    say "run $* FAILED (last lines of its errors follow)"; tail -20 "$keep/stderr" >&2; failed=1; return
  fi
  local boundary
  boundary=$(python3 "$here/boundary_profile.py" "$dir" 2>/dev/null || echo null)
  [ -n "${RP_SUITE_TRACES:-}" ] && cp "$dir/trace.json" "$RP_SUITE_TRACES/trace-run$n.json"
  python3 -c '
import json, sys
d = json.loads(sys.argv[1]); d["boundary"] = json.loads(sys.argv[2]); print(json.dumps(d))' "$line" "$boundary" >> "$out"
  say "run $* done"
}
if [ "$quick" = list ]; then
  jobs=""
  while read -r spec; do
    # shellcheck disable=SC2086  # a job file and its --set arguments
    [ -n "$spec" ] && run 8 $spec
  done <<< "${RP_SUITE_RUNS:-}"
fi
for job in $jobs; do
  if [ "$quick" = quick ]; then
    run 6 "$job"
  elif [ "$quick" = ab ]; then
    run 8 "$job"
    # shellcheck disable=SC2086  # RP_SUITE_AB is a list of arguments
    run 8 "$job" ${RP_SUITE_AB:-}
  else
    run 10 "$job"
    run 6 "$job" --set optimizer.mode=stale1
  fi
done

python3 - "$out" "$commit" <<'PY' >&2
import json, sys
for l in open(sys.argv[1]):
    d = json.loads(l)
    if d.get("commit") != sys.argv[2] or "tokens_per_s_steady" not in d:
        continue
    sets = [a for a in d["command"].split("--set ")[1:] if not a.startswith(("job.output_dir", "train.steps"))]
    mode = " ".join(a.strip() for a in sets) or "defaults"
    print(f'{d["workload"]:18} {mode:24} {d["tokens_per_s_steady"]:9.1f} tokens/s  bubble {d["bubble_ratio_steady"]:.3f}  '
          f'{d["peak_gpu_memory_bytes_per_worker"] / 2**30:5.1f} GiB  {d["host_bytes_per_param"]:5.2f} host B/param  '
          f'measured/predicted {(d.get("prediction") or {}).get("measured_over_predicted", float("nan")):.3f}')
PY
exit $failed
