#!/usr/bin/env bash
# rp-plan --nnodes against a measured run of several nodes on one machine (CPU workers, Gloo over
# loopback): the tiny job with 512-token sequences, one worker per node, so that at 2 nodes on a
# 2-core machine each node's worker has a core of its own as it would on a host of its own
# (nodes that share cores are not modelled: more nodes than cores run slower than predicted).
# A one-node run writes the profile; rp-plan --nnodes N predicts one node's step from it; the
# N-node run measures it (median of node 0's steps after the first). Prints one JSON line for
# bench/results.jsonl and exits 1 when the prediction is off by more than 15% (2 when a launch
# fails, its logs kept).
#   bench/nodes_prediction.sh BUILD_DIR [NODES]
set -euo pipefail
build=${1:?usage: nodes_prediction.sh BUILD_DIR [NODES]}
nodes=${2:-2}
here=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d /tmp/rp-nodes-prediction-XXXXXX)
# The logs stay when a launch fails (set -e stops before the removal at the end).
fail() { echo "nodes_prediction: $1 failed; logs in $work" >&2; exit 2; }
sets=(--set data.format=random --set data.seq_len=512 --set train.microbatch_size=2 --set train.microbatches=6
      --set train.accum_calls=1 --set train.steps=6 --set train.grad_clip=0 --set metrics.trace=false)
"$build/bin/rp-launch" --gpus 1 "$here/configs/tiny.toml" "${sets[@]}" --set job.output_dir="$work/one" >"$work/one.log" 2>&1 ||
  fail "the one-node run"
pids=()
for ((r = 0; r < nodes; r++)); do
  GLOO_SOCKET_IFNAME=lo "$build/bin/rp-launch" --gpus 1 "$here/configs/tiny.toml" "${sets[@]}" \
    --set job.output_dir="$work/many" --nnodes "$nodes" --node-rank "$r" --master "127.0.0.1:$((29720 + nodes))" \
    >"$work/many-$r.log" 2>&1 &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p" || fail "a node of the $nodes-node run"; done
predicted=$("$build/bin/rp-plan" "$here/configs/tiny.toml" --gpus 1 --nnodes "$nodes" "${sets[@]}" \
  --profile "$work/one/profile.json" --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["job_plan"]["predicted_step_s"])')
rc=0
python3 - "$work" "$nodes" "$predicted" "$(git -C "$here" rev-parse --short HEAD)" <<'PY' || rc=$?
import datetime, json, os, statistics, sys
work, nodes, predicted, commit = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
def median_after_first(path):
    return statistics.median([json.loads(l)["step_time_s"] for l in open(path)][1:])
measured = median_after_first(work + "/many/metrics.jsonl")
error = predicted / measured - 1
print(json.dumps({"date": datetime.date.today().isoformat(), "commit": commit, "machine": f"{os.cpu_count()}-core CPU machine",
                  "command": f"bench/nodes_prediction.sh build {nodes}",
                  "workload": "configs/tiny.toml, 6 x 2 sequences of 512 tokens per step, one CPU worker per node",
                  "nodes": nodes, "cores": os.cpu_count(), "step_time_s_one_node": round(median_after_first(work + "/one/metrics.jsonl"), 3),
                  "step_time_s_measured_median": round(measured, 3), "step_time_s_predicted": round(predicted, 3),
                  "prediction_error": round(error, 3), "within_15_percent": abs(error) <= 0.15}))
sys.exit(0 if abs(error) <= 0.15 else 1)
PY
rm -rf "$work"
exit $rc
