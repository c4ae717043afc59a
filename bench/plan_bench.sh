#!/usr/bin/env bash
# Predicted against measured step time for a job's plan and for the auto plan (the planner
# benchmark). No sampling of the processes while they run (on a small CPU machine the sampling
# itself would slow the workers down); prints one JSON line per run for bench/results.jsonl.
#   bench/plan_bench.sh BUILD_DIR WORKERS JOB [--set ...]
# 1. runs the job as configured: its profile (steps 2-3) predicts its later steps;
# 2. rp-plan picks the auto plan from that profile and writes its prediction (before any of its
#    steps run); 3. runs the auto plan planned from the same profile and measures it.
# Env: RP_COMMIT, RP_MACHINE.
set -euo pipefail
build=$1; n=$2; job=$3; shift 3
out=$(mktemp -d /tmp/rp-planbench-XXXXXX)
trap 'rm -rf "$out"' EXIT
line() {  # run-dir, command, label, [rp-plan prediction json]
  python3 - "$@" <<'PY'
import json, sys, datetime, os
run, cmd, label = sys.argv[1:4]
plan_json = json.loads(sys.argv[4]) if len(sys.argv) > 4 else None
steps = [json.loads(l) for l in open(run + "/metrics.jsonl")]
summ = json.load(open(run + "/summary.json"))
p = summ.get("prediction", {})
rec = {"date": datetime.date.today().isoformat(), "commit": os.environ.get("RP_COMMIT", "?"),
       "machine": os.environ.get("RP_MACHINE", "?"), "command": cmd, "workload": label,
       "workers": summ["num_workers"], "steps": len(steps), "plan": summ["plan"],
       "tokens_per_s_whole_run": round(summ["tokens_per_s"], 1), "prediction": p}
if plan_json:
    rec["rp_plan_prediction_before_run"] = {k: plan_json[k] for k in ("plan", "predicted_step_s", "predicted_bubble_ratio")}
    rec["measured_over_rp_plan_prediction"] = p.get("measured_median_step_s", -1) / plan_json["predicted_step_s"]
print(json.dumps(rec))
PY
}
cmd1="$build/bin/rp-launch --gpus $n $job --set job.output_dir=$out/own $*"
$cmd1 > "$out/own.log" 2>&1 || { tail -20 "$out/own.log" >&2; exit 1; }
line "$out/own" "$cmd1" "$(basename "$job"), the job's plan"
pj=$("$build/bin/rp-plan" "$job" --gpus "$n" --profile "$out/own/profile.json" --json "$@")
cmd2="$build/bin/rp-launch --gpus $n $job --set job.output_dir=$out/auto $* --set schedule.partition=auto --set schedule.replan_gain=0 --set schedule.profile=$out/own/profile.json"
# auto refuses explicit cuts: a job that has them gets the planner's choice via --set above only
# when it has none, so the script is for jobs with stage counts (the demo and the workloads).
$cmd2 > "$out/auto.log" 2>&1 || { tail -20 "$out/auto.log" >&2; exit 1; }
line "$out/auto" "$cmd2" "$(basename "$job"), auto plan from the first run's profile" "$pj"
