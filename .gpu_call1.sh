set -u
source .gpu-deps/env.sh && export NCCL_NVLS_ENABLE=0
R=$OUT/results.txt
{
echo "== build"; date
timeout 300 cmake -S . -B build-cuda -G Ninja -DCMAKE_BUILD_TYPE=Release -DRP_BUILD_TESTS=ON $RP_CMAKE_ARGS > $OUT/build.log 2>&1 && timeout 300 cmake --build build-cuda -j16 >> $OUT/build.log 2>&1; echo "build rc=$?"; tail -3 $OUT/build.log
echo "== gpu tests"; date
(cd build-cuda && timeout 200 ctest -L gpu --output-on-failure 2>&1 | tail -15)
echo "== suite"; date
RP_SUITE_BLOCK=0 RP_SUITE_AB="--set schedule.layer_major_forward=auto" timeout 330 bench/h200_suite.sh build-cuda $1 $OUT/suite.jsonl ab 2>&1 | tail -12
date
} > $R 2>&1
cat $R
