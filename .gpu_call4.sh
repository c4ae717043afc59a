set -u
source .gpu-deps/env.sh && export NCCL_NVLS_ENABLE=0
R=$OUT/results.txt
{
echo "== build"; date
timeout 300 cmake -S . -B build-cuda -G Ninja -DCMAKE_BUILD_TYPE=Release -DRP_BUILD_TESTS=ON $RP_CMAKE_ARGS > $OUT/build.log 2>&1 && timeout 300 cmake --build build-cuda -j16 >> $OUT/build.log 2>&1; echo "build rc=$?"; grep -E "error" $OUT/build.log | head; tail -2 $OUT/build.log
echo "== gpu tests"; date
(cd build-cuda && timeout 150 ctest -L gpu --output-on-failure 2>&1 | grep -E "Failed|FAILED|tests passed|Expected|Which is|error" | head -30)
echo "== block"; date
for j in configs/qwen3-1.7b.toml configs/qwen3-4b.toml; do for f in "" "--set train.fused_norms=false"; do timeout 60 build-cuda/bin/rp-block-bench $j --reps 10 $f >> $OUT/block.jsonl 2>>$OUT/block.err; done; done
cat $OUT/block.jsonl | cut -c1-400
echo "== suite"; date
RP_SUITE_BLOCK=0 RP_SUITE_RUNS="configs/qwen3-1.7b.toml
configs/qwen3-1.7b.toml --set train.fused_norms=false
configs/qwen3-4b.toml
configs/qwen3-4b.toml --set train.fused_norms=false
configs/qwen3-1.7b.toml" timeout 330 bench/h200_suite.sh build-cuda $1 $OUT/suite.jsonl list 2>&1 | tail -8
date
} > $R 2>&1
cat $R
