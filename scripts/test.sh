#!/usr/bin/env bash
# Sets up, builds, and runs the whole CPU test suite (unit + integration). GPU tests (label gpu)
# run on a CUDA build: ctest --test-dir build-cuda -L gpu.
set -euo pipefail
cd "$(dirname "$0")/.."
# Chromium: tests/tools/report_browser_test.py renders rp-report's page in it. Clang: the
# fuzz targets (scripts/fuzz.sh) are libFuzzer's.
RP_EXTRA_PACKAGES="chromium fonts-dejavu-core clang" scripts/setup.sh
export OPENBLAS_NUM_THREADS=1
# Serial on purpose: integration tests start several processes each and assert on timing bounds.
ctest --test-dir build -L "unit|integration" --output-on-failure --timeout 900
left=$(ls /dev/shm | grep -E '^rp-' || true)
if [ -n "$left" ]; then
  echo "test: shared-memory segments left behind: $left" >&2
  exit 1
fi
# The readers of outside input (JSONL, token files, run-spec.json, checkpoints, config.json)
# under libFuzzer, 60 s each.
scripts/fuzz.sh 60
echo "test: all passed"
