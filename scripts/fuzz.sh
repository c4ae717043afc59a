#!/usr/bin/env bash
# Builds the libFuzzer targets (fuzz/) with clang, AddressSanitizer and UndefinedBehaviorSanitizer
# into build-fuzz/, and runs each from its committed corpus for SECONDS (default 60). A crash,
# a leak, undefined behaviour or an input that runs past 10 s fails it; the input is kept in
# build-fuzz/ (crash-*, timeout-*) to replay: build-fuzz/bin/<target> build-fuzz/crash-...
# Usage: scripts/fuzz.sh [SECONDS]
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-60}
if ! command -v clang++ >/dev/null; then
  echo "fuzz: clang++ is missing (apt-get install clang)" >&2
  exit 1
fi
cmake -S . -B build-fuzz -G Ninja -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DRP_FUZZ=ON -DRP_BUILD_TESTS=OFF -DRP_FUZZ_SECONDS="$seconds" >/dev/null
cmake --build build-fuzz --target rp_fuzzers -j "$(nproc)"
ctest --test-dir build-fuzz -L fuzz --output-on-failure
