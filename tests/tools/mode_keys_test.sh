#!/usr/bin/env bash
# optimizer.mode is decided in config/ only: code outside it asks the decisions derived from the
# mode there (core::WeightVersionLag, core::NextStepWaitsForUpdate in config/job_config.h), never
# the mode itself, so the lag of stale1 has one definition. The one exception records the key's
# value as a key (the checkpoint's identity of the run), allowed by name below.
#   tests/tools/mode_keys_test.sh SOURCE_DIR
set -euo pipefail
cd "$1"
dirs=(common io planning protocol model shm nodes optim coordinator gpu_worker launcher tools bench)
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  mapfile -t files < <(git ls-files -- "${dirs[@]/%//}" | grep -E '\.(cc|h|cu|cuh)$')
else
  mapfile -t files < <(find "${dirs[@]}" -type f | grep -E '\.(cc|h|cu|cuh)$')
fi
((${#files[@]} > 0)) || { echo "mode_keys_test: no sources found under $PWD" >&2; exit 1; }
pattern='optimizer\.mode\b|OptimizerMode::'
allowed=("optim/training_state.cc: core::EnumName(c.optimizer.mode)")
for probe in 'if (c.optimizer.mode == core::OptimizerMode::kStale1) {}' 'x = cfg.optimizer.mode;'; do
  grep -qP "$pattern" <<< "$probe" || { echo "mode_keys_test: the pattern misses: $probe" >&2; exit 1; }
done
hits=$(grep -nP "$pattern" "${files[@]}" | grep -vP '^[^:]+:[0-9]+:\s*//' || true)
for a in "${allowed[@]}"; do  # drop the lines of that file that carry that text
  hits=$(awk -v f="${a%%: *}:" -v t="${a#*: }" 'index($0, f) != 1 || index($0, t) == 0' <<< "$hits")
done
hits=$(sed '/^$/d' <<< "$hits")
if [ -n "$hits" ]; then
  echo "mode_keys_test: optimizer.mode read outside config/; ask core::WeightVersionLag or core::NextStepWaitsForUpdate:" >&2
  echo "$hits" >&2
  exit 1
fi
echo "mode_keys_test: ${#files[@]} files leave optimizer.mode to config/"
