#!/usr/bin/env bash
# Document-isolated packing on one GPU: what 64K-token windows of 512-token documents cost
# against the same tokens as separate 512-token sequences, and against the same windows without
# isolation (one causal sequence of 64K).
#   bench/packing_gpu.sh BUILD_DIR OUT_DIR [--set ...]
# Writes OUT_DIR/records.jsonl (random 512-token records, Qwen3 vocabulary) and appends one
# bench/gpu_bench.sh line per run to OUT_DIR/packing.jsonl: "documents" (seq_len 65536, 2 windows
# per step), "pad" (seq_len 512, 256 sequences per step) and "stream" (seq_len 65536, no isolation).
# Every run is the Qwen3-1.7B job with 131,072 tokens per step and no kept blocks, so the three
# differ only in their windows.
set -euo pipefail
build=$1; out=$2; shift 2
mkdir -p "$out"
python3 - "$out/records.jsonl" <<'PY'
import json, random, sys
rng = random.Random(7)
with open(sys.argv[1], "w") as f:
    for _ in range(512):
        ids = [rng.randrange(151936) for _ in range(512)]
        f.write(json.dumps({"input_ids": ids}) + "\n")
PY
common=(--set data.format=jsonl --set "data.path=$out/records.jsonl" --set train.steps=6 --set train.accum_calls=1
        --set schedule.kept_blocks=0 --set metrics.trace=false "$@")
run() {
  local name=$1; shift
  echo "packing_gpu: $name" >&2
  "$(dirname "$0")/gpu_bench.sh" "$build" 1 configs/qwen3-1.7b.toml "${common[@]}" "$@" \
    >> "$out/packing.jsonl"
}
run documents --set data.packing=documents --set data.seq_len=65536 --set train.microbatch_size=1 --set train.microbatches=2
run pad --set data.packing=pad --set data.seq_len=512 --set train.microbatch_size=32 --set train.microbatches=8
run stream --set data.packing=stream --set data.seq_len=65536 --set train.microbatch_size=1 --set train.microbatches=2
