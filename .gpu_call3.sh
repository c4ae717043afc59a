set -u
source .gpu-deps/env.sh && export NCCL_NVLS_ENABLE=0
R=$OUT/results.txt
{
echo "== build"; date
timeout 300 cmake -S . -B build-cuda -G Ninja -DCMAKE_BUILD_TYPE=Release $RP_CMAKE_ARGS > $OUT/build.log 2>&1 && timeout 300 cmake --build build-cuda -j16 >> $OUT/build.log 2>&1; echo "build rc=$?"; tail -2 $OUT/build.log
echo "== suite"; date
RP_SUITE_BLOCK=0 RP_SUITE_RUNS="configs/qwen3-1.7b.toml
configs/qwen3-1.7b.toml --set schedule.layer_major_forward=auto
configs/qwen3-4b.toml
configs/qwen3-4b.toml --set schedule.layer_major_forward=auto
configs/qwen3-1.7b.toml --set schedule.layer_major_forward=auto
configs/qwen3-1.7b.toml" timeout 400 bench/h200_suite.sh build-cuda $1 $OUT/suite.jsonl list 2>&1 | tail -8
date
} > $R 2>&1
cat $R
