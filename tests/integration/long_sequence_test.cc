// SPDX-License-Identifier: Apache-2.0
// Long sequences through real processes: a job whose dense MLPs run in tiles of tokens
// (train.mlp_tile_tokens, each tile recomputed in the backward) trains as rp-train-ref, which
// never tiles, does.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "tests/integration/launch_fixture.h"
#include "tests/testing/process_harness.h"

namespace rp {
namespace {

using testing::Losses;

void ExpectClose(const std::vector<double>& got, const std::vector<double>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t s = 0; s < got.size(); ++s)
    EXPECT_LE(std::abs(got[s] - want[s]) / want[s], 1e-5) << what << ", step " << s + 1;
}

// 512-token sequences, MLP tiles of 300 tokens (2 x 512 tokens per microbatch: tiles that do not
// divide it), on 1 to 3 CPU workers, and LoRA with dropout on every projection on 2.
TEST_F(LaunchTest, TiledMlpsMatchTheUntiledReferenceOnOneToThreeWorkers) {
  const std::vector<std::string> job = {"data.format=\"random\"", "data.seq_len=512", "train.steps=3",
                                        "train.microbatches=3", "train.accum_calls=1", "train.microbatch_size=2"};
  const std::vector<std::vector<std::string>> variants = {
      {}, {"lora.rank=4", "lora.dropout=0.1",
           "lora.target_modules=[\"q_proj\",\"k_proj\",\"v_proj\",\"o_proj\",\"gate_proj\",\"up_proj\",\"down_proj\"]"}};
  for (size_t v = 0; v < variants.size(); ++v) {
    const auto sets = With(job, variants[v]);
    const std::string tag = v == 0 ? "full" : "lora";
    auto ref = Ref(tmp_ + "/ref-" + tag, sets);
    ASSERT_EQ(ref.code, 0) << ref.output;
    const auto want = Losses(tmp_ + "/ref-" + tag + "/metrics.jsonl");
    ASSERT_EQ(want.size(), 3u);
    for (int n : v == 0 ? std::vector<int>{1, 2, 3} : std::vector<int>{2}) {
      const std::string out = tmp_ + "/tiled-" + tag + "-" + std::to_string(n);
      auto run = Launch(n, out, With(sets, {"train.mlp_tile_tokens=300"}));
      ASSERT_EQ(run.code, 0) << run.output;
      ExpectClose(Losses(out + "/metrics.jsonl"), want, tag + " on " + std::to_string(n) + " workers");
    }
  }
}

}  // namespace
}  // namespace rp
