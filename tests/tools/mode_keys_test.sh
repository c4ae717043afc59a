#!/usr/bin/env bash
# The mode keys (core::ModeKey in config/job_config.h) are read in the resolution only: a read
# needs the grant of config/mode_key_access.h, which only the files listed below include (the job
# file's reader and writers, its checks, ResolveExecution, and the spellings a run spec and a
# checkpoint record). Everything else asks the core::ExecutionPlan. The compiler refuses a read
# without the grant; this check refuses the grant anywhere else, in every folder (tests and
# benchmarks included), and a comparison with a mode value in production code outside config/
# (a test may compare its own parameters).
#   tests/tools/mode_keys_test.sh SOURCE_DIR
set -euo pipefail
cd "$1"
dirs=(common config io planning protocol model shm nodes optim coordinator gpu_worker launcher tools
      bench tests fuzz)
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  mapfile -t files < <(git ls-files -- "${dirs[@]/%//}" | grep -E '\.(cc|h|cu|cuh)$')
else
  mapfile -t files < <(find "${dirs[@]}" -type f | grep -E '\.(cc|h|cu|cuh)$')
fi
((${#files[@]} > 0)) || { echo "mode_keys_test: no sources found under $PWD" >&2; exit 1; }
granted=(config/mode_key_access.h config/job_config.h config/job_config.cc config/cross_checks.cc
         config/execution_plan.cc planning/run_spec.cc optim/training_state.cc)
grant='mode_key_access\.h|ModeKeyGrant|ModeKeyAccess'
# A mode value compared or switched on outside config/ reads a key through some other door.
compare='(==|!=)\s*(core::)?(OptimizerMode|OptimizerState|GradientsWait|WeightsSource|EmbeddingLookup|Partition)::|case\s+(core::)?(OptimizerMode|OptimizerState|GradientsWait|WeightsSource|EmbeddingLookup|Partition)::'
for probe in '#include "config/mode_key_access.h"' 'c.optimizer.mode.Read(ModeKeyGrant::Access())'; do
  grep -qP "$grant" <<< "$probe" || { echo "mode_keys_test: the grant pattern misses: $probe" >&2; exit 1; }
done
for probe in 'if (m == core::OptimizerMode::kStale1) {}' 'case Partition::kAuto:'; do
  grep -qP "$compare" <<< "$probe" || { echo "mode_keys_test: the comparison pattern misses: $probe" >&2; exit 1; }
done
for f in "${granted[@]}"; do
  [ -f "$f" ] || { echo "mode_keys_test: $f is listed but missing" >&2; exit 1; }
done
status=0
for f in "${files[@]}"; do
  allowed=0
  for g in "${granted[@]}"; do [ "$f" = "$g" ] && allowed=1; done
  if ((allowed == 0)); then
    hits=$(grep -nP "$grant" "$f" | grep -vP '^[0-9]+:\s*//' || true)
    if [ -n "$hits" ]; then
      echo "mode_keys_test: $f reads mode keys; ask core::ExecutionPlan (config/execution_plan.h):" >&2
      echo "$hits" >&2
      status=1
    fi
  fi
  case "$f" in config/* | tests/* | fuzz/*) continue ;; esac
  hits=$(grep -nP "$compare" "$f" | grep -vP '^[0-9]+:\s*//' || true)
  if [ -n "$hits" ]; then
    echo "mode_keys_test: $f compares a mode value outside config/; ask core::ExecutionPlan:" >&2
    echo "$hits" >&2
    status=1
  fi
done
((status == 0)) || exit 1
echo "mode_keys_test: ${#files[@]} files leave the mode keys to the resolution (${#granted[@]} granted)"
