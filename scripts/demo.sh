#!/usr/bin/env bash
# Sets up, builds, and trains the demo job (configs/tiny.toml) on 2 CPU workers. The run's files
# go to runs/tiny-<time>/ (metrics.jsonl, summary.json, trace.json).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
out="runs/tiny-$(date +%Y%m%d-%H%M%S)"
build/bin/rp-launch --gpus 2 configs/tiny.toml --set job.output_dir="$PWD/$out" "$@"
echo "demo: first and last step of $out/metrics.jsonl:"
head -n 1 "$out/metrics.jsonl"
tail -n 1 "$out/metrics.jsonl"
