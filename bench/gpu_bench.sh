#!/usr/bin/env bash
# Runs one benchmark job and prints one JSON line (append it to bench/results.jsonl).
#   bench/gpu_bench.sh BUILD_DIR WORKERS JOB [--set ...]
# Env: RP_COMMIT (the commit measured), RP_MACHINE (free text), RP_BENCH_OUT (the directory to run
# in, kept afterwards: a run split with train.stop_after is continued by passing --resume among
# the arguments with the same RP_BENCH_OUT). Each line describes the steps this command ran
# (summary.json's first_step..last_step; "losses" lists every step of the run so far).
# Steady-state figures skip the first two of them (allocator and page warm-up; 2-3 steps skip
# only the first, one step is kept and "steps" says so); whole-run figures include them and the
# drain.
# host_bytes_per_param counts both segments at their full size plus the coordinator's peak
# anonymous RSS; host_bytes_per_param_touched counts the peak of /dev/shm pages actually in use.
set -euo pipefail
build=$1; n=$2; job=$3; shift 3
if [ -n "${RP_BENCH_OUT:-}" ]; then out=$(realpath -m "$RP_BENCH_OUT"); mkdir -p "$out"; else out=$(mktemp -d /tmp/rp-bench-XXXXXX); fi
# One log per command in a kept directory (log, log.2, ...): the line reads only its own.
log=$out/log; k=1; while [ -e "$log" ]; do k=$((k + 1)); log=$out/log.$k; done
cmd="$build/bin/rp-launch --gpus $n $job --set job.output_dir=$out/run $*"
$cmd > "$log" 2>&1 &
launcher=$!
peak_coord_anon=0; peak_worker_rss=0; peak_shm=0; peak_gpu_mib=0
while kill -0 $launcher 2>/dev/null; do
  c=$(pgrep -P $launcher -f rp-coordinator || true)
  if [ -n "$c" ]; then
    a=$(awk '/RssAnon/ {print $2}' /proc/$c/status 2>/dev/null || echo 0)
    [ "${a:-0}" -gt "$peak_coord_anon" ] && peak_coord_anon=$a
  fi
  w=0
  for p in $(pgrep -P $launcher -f rp-worker || true); do
    r=$(awk '/VmRSS/ {print $2}' /proc/$p/status 2>/dev/null || echo 0); w=$((w + ${r:-0}))
  done
  [ "$w" -gt "$peak_worker_rss" ] && peak_worker_rss=$w
  s=$(du -sk /dev/shm 2>/dev/null | cut -f1); [ "${s:-0}" -gt "$peak_shm" ] && peak_shm=$s
  # Device memory per process as the driver sees it (the caching allocator's reserve included).
  g=$(nvidia-smi --query-compute-apps=used_memory --format=csv,noheader,nounits 2>/dev/null | sort -n | tail -1 || true)
  [ -n "$g" ] && [ "$g" -gt "$peak_gpu_mib" ] 2>/dev/null && peak_gpu_mib=$g
  sleep 1
done
wait $launcher || { echo "bench: run failed" >&2; tail -30 "$log" >&2; exit 1; }
python3 - "$out" "$n" "$job" "$cmd" "$peak_coord_anon" "$peak_worker_rss" "$peak_shm" "$peak_gpu_mib" "$log" <<'PY'
import json, sys, datetime, os, re, subprocess
out, n, job, cmd, coord_anon_kb, worker_rss_kb, shm_kb, gpu_mib, log = sys.argv[1:]
every_step = [json.loads(l) for l in open(out + "/run/metrics.jsonl")]
summ = json.load(open(out + "/run/summary.json"))
first, last = summ.get("first_step", 1), summ.get("last_step", len(every_step))
steps = [s for s in every_step if first <= s["step"] <= last]
# Short runs (2-3 steps, e.g. the 8B) still drop the first step, whose start-up would otherwise
# dominate; one-step runs keep it (and say so through "steps").
# A step's time runs from the previous step's report to its own, and steps overlap (stale1 most:
# the next step's first jobs run before this step's last), so each interval holds part of the
# next step's work, except the last step's: runs of 5 steps or more leave it out (in stale1 it
# measured 30% shorter than the others, lifting a 3-step window by 10%).
steady = steps[2:-1] if len(steps) >= 5 else steps[2:] if len(steps) > 3 else steps[1:] if len(steps) > 1 else steps
tok = sum(s["tokens"] for s in steady); t = sum(s["step_time_s"] for s in steady)
params = summ["trainable_params"]
total = params + summ.get("frozen_params", 0)  # LoRA: the frozen base computes too
tps = tok / t
seg = summ["segment_bytes"] + summ.get("optim_segment_bytes", 0)
try:
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True).stdout.strip().splitlines()[0]
except Exception:
    gpu = "unknown"
print(json.dumps({
  "date": datetime.date.today().isoformat(), "commit": os.environ.get("RP_COMMIT", "?"),
  "machine": os.environ.get("RP_MACHINE", gpu), "command": cmd, "workload": os.path.basename(job),
  "workers": int(n), "steps": len(steps), "first_step": first,
  "steady_steps": [steady[0]["step"], steady[-1]["step"]],
  "tokens_per_s_steady": round(tps, 1), "tokens_per_s_whole_run": round(summ["tokens_per_s"], 1),
  # MFU on the H100/H200 dense bf16 peak papers use (989 TFLOP/s), said in the row.
  "mfu_peak_tflops": 989,
  "mfu_steady": round(6 * total * tps / (989e12 * int(n)), 4),  # per GPU, all model parameters
  # The same with causal attention's matmuls (QK^T and PV over s/2 keys on average, forward and
  # backward): 6 N + 6 L s d_attn per token; long sequences are judged by this one.
  "mfu_attention_steady": round((6 * total + 6 * summ.get("num_layers", 0) * summ.get("seq_len", 0) *
                                 summ.get("attention_dim", 0)) * tps / (989e12 * int(n)), 4),
  "bubble_ratio_steady": round(sum(s.get("bubble_ratio", 0) for s in steady) / len(steady), 4),
  "h2d_gb_per_s_steady": round(sum(s.get("h2d_bytes", 0) for s in steady) / t / 1e9, 2),
  "step_time_s_steady": round(t / len(steady), 3), "trainable_params": params, "model_params": total,
  "host_bytes_per_param": round((seg + int(coord_anon_kb) * 1024) / params, 2),
  "host_bytes_per_model_param": round((seg + int(coord_anon_kb) * 1024) / total, 2),
  "host_bytes_per_param_touched": round((int(shm_kb) * 1024 + int(coord_anon_kb) * 1024) / params, 2),
  "segment_bytes": seg, "shm_peak_touched_bytes": int(shm_kb) * 1024,
  "grad_arena_bytes": summ.get("grad_arena_bytes"), "grads_streamed": summ.get("grads_streamed"),
  "grad_arena_peak_bytes": summ.get("grad_arena_peak_bytes"),
  "merged_calls": summ.get("merged_calls", 1),
  "coordinator_anon_rss_bytes": int(coord_anon_kb) * 1024,
  "worker_rss_bytes_total": int(worker_rss_kb) * 1024,
  "peak_gpu_memory_bytes_per_worker": int(gpu_mib) * 1024 * 1024,
  # The workers' own figures at exit (caching allocator: allocated peak, reserved peak), GiB.
  "worker_device_memory_peaks_gib": [[float(x) for x in re.findall(r"device memory peak: ([0-9.]+) GiB allocated by tensors, ([0-9.]+) GiB reserved", l)[0]]
                                     for l in open(log) if "device memory peak" in l],
  "plan": summ.get("plan"), "prediction": summ.get("prediction"),
  "losses": [round(s["loss"], 4) for s in every_step],
  # Per step of this command: profiled steps (prediction.profiled_steps) time every layer and run
  # slower, so a short run's steady window may hold one.
  "step_times_s": [round(s["step_time_s"], 3) for s in steps],
}))
PY
[ -n "${RP_BENCH_KEEP:-}" ] && cp -r "$out/run" "$RP_BENCH_KEEP"
[ -n "${RP_BENCH_OUT:-}" ] || rm -rf "$out"
