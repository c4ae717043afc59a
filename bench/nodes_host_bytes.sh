#!/usr/bin/env bash
# Host bytes per trainable parameter per node, at 1, 2 and 3 nodes on one machine (CPU workers,
# loopback): a 125M-parameter Qwen3-shaped job, by default with streamed gradients (no clipping, one call per
# step). Per node: both shared-memory segments at their full size (summary.json) plus that node's
# coordinator's peak anonymous RSS; worker RSS is reported apart. Also rp-plan --nnodes's
# predicted step, from the one-node run's profile, against the median measured step after the
# first, and each node's own prediction from its own profile (summary.json). Prints one JSON line per node count, for bench/results.jsonl.
# Further arguments are job overrides for every run (--set optimizer.state=sharded, say).
#   bench/nodes_host_bytes.sh BUILD_DIR [STEPS] [--set section.key=value ...]
set -euo pipefail
build=${1:?usage: nodes_host_bytes.sh BUILD_DIR [STEPS] [--set section.key=value ...]}
steps=${2:-5}
shift $(($# >= 2 ? 2 : $#))
extra=("$@")
here=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d /tmp/rp-nodes-bench-XXXXXX)
sets=(--set model.vocab_size=32000 --set model.hidden_size=768 --set model.intermediate_size=2048
      --set model.num_layers=12 --set model.num_heads=12 --set model.num_kv_heads=4 --set model.head_dim=64
      --set model.tie_embeddings=false --set data.format=random --set data.seq_len=64
      --set train.microbatch_size=1 --set train.microbatches=6 --set train.accum_calls=1 --set train.grad_clip=0
      --set train.steps="$steps" --set metrics.trace=false "${extra[@]}")
for nodes in 1 2 3; do
  out=$work/n$nodes
  port=$((29700 + nodes))
  pids=()
  for ((r = 0; r < nodes; r++)); do
    flags=()
    ((nodes > 1)) && flags=(--nnodes "$nodes" --node-rank "$r" --master "127.0.0.1:$port")
    GLOO_SOCKET_IFNAME=lo "$build/bin/rp-launch" --gpus 1 "$here/configs/tiny.toml" "${sets[@]}" \
      --set job.output_dir="$out" "${flags[@]}" >"$work/n$nodes-$r.log" 2>&1 &
    pids+=($!)
  done
  declare -A coord_peak=() worker_peak=()
  while kill -0 "${pids[0]}" 2>/dev/null; do
    for p in "${pids[@]}"; do
      for c in $(pgrep -P "$p" 2>/dev/null); do
        a=$(awk '/RssAnon/ {print $2}' /proc/$c/status 2>/dev/null || echo 0)
        rss=$(awk '/VmRSS/ {print $2}' /proc/$c/status 2>/dev/null || echo 0)
        case "$(cat /proc/$c/comm 2>/dev/null)" in
          rp-coordinator) [ "${a:-0}" -gt "${coord_peak[$p]:-0}" ] && coord_peak[$p]=$a ;;
          rp-worker) [ "${rss:-0}" -gt "${worker_peak[$p]:-0}" ] && worker_peak[$p]=$rss ;;
        esac
      done
    done
    sleep 0.2
  done
  for p in "${pids[@]}"; do wait "$p"; done
  predicted=$("$build/bin/rp-plan" "$here/configs/tiny.toml" --gpus 1 --nnodes "$nodes" "${sets[@]}" \
    --profile "$work/n1/profile.json" --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["job_plan"]["predicted_step_s"])')
  coords=""; workers=""
  for p in "${pids[@]}"; do coords+="${coord_peak[$p]:-0},"; workers+="${worker_peak[$p]:-0},"; done
  python3 - "$out" "$nodes" "${coords%,}" "${workers%,}" "$(git -C "$here" rev-parse --short HEAD)" "$predicted" "${extra[*]}" <<'PY'
import datetime, json, statistics, sys
out, nodes, coords, workers, commit, predicted, extra = sys.argv[1:]
nodes = int(nodes)
coords = [int(x) * 1024 for x in coords.split(",")]
workers = [int(x) * 1024 for x in workers.split(",")]
rows = []
for r in range(nodes):
    s = json.load(open(out + ("" if r == 0 else f"/node-{r}") + "/summary.json"))
    seg = s["segment_bytes"] + s["optim_segment_bytes"]
    rows.append({"node": r, "segment_bytes": seg, "coordinator_anon_bytes": coords[r],
                 "host_bytes_per_param": round((seg + coords[r]) / s["trainable_params"], 2),
                 "worker_rss_bytes": workers[r], "tokens_per_s": round(s["tokens_per_s"], 1),
                 # The run's own prediction from its own profile (this node's share, with the sums).
                 "measured_over_predicted": s.get("prediction", {}).get("measured_over_predicted")})
times = [json.loads(l)["step_time_s"] for l in open(out + "/metrics.jsonl")][1:]
measured = statistics.median(times)
print(json.dumps({"date": datetime.date.today().isoformat(), "commit": commit, "machine": "2-core CPU machine",
                  "command": f"bench/nodes_host_bytes.sh build {extra} (nodes = {nodes})".replace("  ", " "),
                  "workload": "Qwen3-shaped 125M (hidden 768, 12 layers, vocab 32000), CPU workers, " +
                              ("streamed gradients" if s.get("grads_streamed") else "whole gradient slots"),
                  "nodes": nodes, "trainable_params": s["trainable_params"],
                  "host_bytes_per_param_max": max(x["host_bytes_per_param"] for x in rows),
                  "step_time_s_measured_median": round(measured, 3), "step_time_s_predicted": round(float(predicted), 3),
                  "prediction_error": round(float(predicted) / measured - 1, 3), "per_node": rows}))
PY
done
rm -rf "$work"
