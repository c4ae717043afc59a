#!/usr/bin/env bash
# Scratch driver for the device: build against torch 2.11 and run the GPU suite.
set -uo pipefail
export NCCL_NVLS_ENABLE=0
source deps/offline-env.sh
t0=$(date +%s)
cmake -S . -B build-cuda -G Ninja -DCMAKE_BUILD_TYPE=Release $RP_CMAKE_ARGS > $OUT/cmake.log 2>&1
timeout 200 cmake --build build-cuda -j16 > $OUT/build.log 2>&1; echo "build rc=$? $(( $(date +%s) - t0 )) s"
tail -3 $OUT/build.log
timeout 330 ctest --test-dir build-cuda -L gpu --timeout 300 > $OUT/gpu.log 2>&1; echo "gpu ctest rc=$?"
grep -E "tests passed|Failed|\*\*\*|Passed|Skipped" $OUT/gpu.log | tail -40
