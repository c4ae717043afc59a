#!/usr/bin/env bash
# Two builds of the project on the same jobs, alternated on one host: the check that a change
# costs no speed. The "new" side is the tree this script belongs to; the "base" side is another
# source tree of the project (for example `git archive BASE_COMMIT | tar -x -C DIR`).
#   bench/ab_builds.sh BASE_TREE ROUNDS OUT_FILE JOB_SPEC [JOB_SPEC ...]
# JOB_SPEC: "WORKERS JOB.toml [--set key=value ...]", one quoted argument. Each side runs the job
# file of its own tree (what that build shipped), through its own bench/gpu_bench.sh, with the
# same arguments. Round r runs every job spec; within a job the order alternates (base then new
# in odd rounds, new then base in even ones), so drift of the host shows up in both sides.
# Each run's JSON line goes to OUT_FILE with "ab_side" (base|new), "ab_round" and "ab_spec"; a
# summary per job spec (median steady tokens/s of each side, new / base) goes to stdout.
# Env: RP_AB_BASE_COMMIT, RP_COMMIT (the commits the lines name), RP_MACHINE, RP_CMAKE_ARGS
# (passed to both configures), RP_AB_BUILD (build directory name inside each tree, default
# build-ab; an existing build is reused after an incremental build), RP_AB_BUILT=1 (run the
# binaries already in both build directories, for example copied from an earlier host of the
# same image, without configuring or building), RP_AB_TIMEOUT (seconds per run, default 600).
set -uo pipefail
if [ $# -lt 4 ]; then
  sed -n '2,16p' "$0" >&2
  exit 2
fi
base_tree=$(realpath "$1"); rounds=$2; out=$(realpath -m "$3"); shift 3
new_tree=$(cd "$(dirname "$0")/.." && pwd)
build_name=${RP_AB_BUILD:-build-ab}
run_timeout=${RP_AB_TIMEOUT:-600}
[ -f "$base_tree/CMakeLists.txt" ] && [ -x "$base_tree/bench/gpu_bench.sh" ] ||
  { echo "ab_builds: $base_tree is not a source tree of this project (no CMakeLists.txt or bench/gpu_bench.sh)" >&2; exit 2; }
[[ "$rounds" =~ ^[1-9][0-9]*$ ]] || { echo "ab_builds: ROUNDS must be a positive integer, got '$rounds'" >&2; exit 2; }
t0=$(date +%s)
say() { echo "[$(( $(date +%s) - t0 )) s] $*" >&2; }

build() {  # $1 tree
  local tree=$1 log=$1/$build_name/ab-build.log
  if [ "${RP_AB_BUILT:-0}" = 1 ]; then
    local b
    for b in rp-launch rp-coordinator rp-worker; do
      [ -x "$tree/$build_name/bin/$b" ] || { echo "ab_builds: RP_AB_BUILT=1 but $tree/$build_name/bin/$b is missing" >&2; return 1; }
    done
    say "using the binaries in $tree/$build_name/bin"
    return 0
  fi
  mkdir -p "$tree/$build_name"
  say "building $tree"
  # shellcheck disable=SC2086  # RP_CMAKE_ARGS is a list of arguments
  if ! { cmake -S "$tree" -B "$tree/$build_name" -G Ninja -DCMAKE_BUILD_TYPE=Release ${RP_CMAKE_ARGS:-} &&
         cmake --build "$tree/$build_name" --target rp-launch rp-coordinator rp-worker; } > "$log" 2>&1; then
    echo "ab_builds: the build of $tree failed; the end of $log:" >&2
    tail -30 "$log" >&2
    return 1
  fi
}
build "$base_tree" || exit 1
build "$new_tree" || exit 1

keep=$(mktemp -d /tmp/rp-ab-XXXXXX)
trap 'rm -rf "$keep"' EXIT
failed=0
run() {  # $1 side, $2 round, $3 spec
  local side=$1 round=$2 spec=$3 tree commit
  if [ "$side" = base ]; then tree=$base_tree; commit=${RP_AB_BASE_COMMIT:-base}; else tree=$new_tree; commit=${RP_COMMIT:-new}; fi
  local -a words; read -ra words <<< "$spec"
  say "round $round, $side: $spec"
  if ! (cd "$tree" && RP_COMMIT=$commit timeout "$run_timeout" bench/gpu_bench.sh "$build_name" "${words[@]}") > "$keep/line" 2> "$keep/err"; then
    echo "ab_builds: $side run failed: $spec" >&2; tail -20 "$keep/err" >&2
    failed=1
    return
  fi
  python3 - "$keep/line" "$side" "$round" "$spec" >> "$out" <<'PY'
import json, sys
path, side, rnd, spec = sys.argv[1:]
line = [l for l in open(path).read().splitlines() if l.strip()][-1]
d = json.loads(line)
d.update({"ab_side": side, "ab_round": int(rnd), "ab_spec": spec})
print(json.dumps(d))
PY
}
for ((r = 1; r <= rounds; r++)); do
  for spec in "$@"; do
    if (( r % 2 )); then run base "$r" "$spec"; run new "$r" "$spec"; else run new "$r" "$spec"; run base "$r" "$spec"; fi
  done
done

python3 - "$out" "$@" <<'PY'
import json, statistics, sys
path, specs = sys.argv[1], sys.argv[2:]
rows = [json.loads(l) for l in open(path) if l.strip()]
for spec in specs:
    side = {s: [r["tokens_per_s_steady"] for r in rows if r.get("ab_spec") == spec and r.get("ab_side") == s
                and r.get("tokens_per_s_steady") is not None] for s in ("base", "new")}
    if not side["base"] or not side["new"]:
        print(json.dumps({"ab_spec": spec, "missing": [s for s in side if not side[s]]}))
        continue
    b, n = statistics.median(side["base"]), statistics.median(side["new"])
    print(json.dumps({"ab_spec": spec, "base_median": round(b, 1), "new_median": round(n, 1),
                      "new_over_base": round(n / b, 4), "base_runs": side["base"], "new_runs": side["new"]}))
PY
say "done"
exit $failed
