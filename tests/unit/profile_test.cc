// SPDX-License-Identifier: Apache-2.0
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>

#include <nlohmann/json.hpp>

#include "planning/profile.h"

namespace rp::core {
namespace {

JobConfig Small(int layers) {
  JobConfig c;
  c.model.num_layers = layers;
  c.model.vocab_size = 4096;
  c.job.device = core::DeviceKind::kCpu;
  return c;
}

std::string TempPath(const std::string& name) {
  return ::testing::TempDir() + "/profile_test_" + name;
}

TEST(Profile, BuilderTakesMediansAndFillsMissingPhases) {
  JobConfig c = Small(3);  // pipeline layers 0..4, head = 4
  ProfileBuilder b(5);
  for (double s : {1.0, 9.0, 2.0}) {
    for (int l = 0; l < 4; ++l) {
      b.AddLayer(l, 1, s, 100.0);     // recompute
      b.AddLayer(l, 2, 2 * s, -1.0);  // backward
    }
    for (int l = 0; l < 3; ++l) b.AddLayer(l, 0, 0.5 * s, -1.0);  // layer 3 is in the tail only
    b.AddLayer(4, 1, 3 * s, -1.0);  // the head: forward + loss + backward
  }
  b.AddLink(10.0, 20.0);
  b.AddMicrobatch(5.0, 4.0);
  b.AddOptimizer(100.0, 2.0, 20.0);
  auto p = b.Build(c);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(p->source, "measured");
  EXPECT_DOUBLE_EQ(p->layers[1].recompute_s, 2.0);  // median of 1, 9, 2
  EXPECT_DOUBLE_EQ(p->layers[1].backward_s, 4.0);
  EXPECT_DOUBLE_EQ(p->layers[1].forward_s, 1.0);
  EXPECT_DOUBLE_EQ(p->layers[1].saved_bytes, 100.0);
  EXPECT_FALSE(p->layers[1].filled);
  // Layer 3's forward comes from the blocks' forward/recompute ratio (0.5).
  EXPECT_TRUE(p->layers[3].filled);
  EXPECT_DOUBLE_EQ(p->layers[3].forward_s, 1.0);
  EXPECT_DOUBLE_EQ(p->layers[4].recompute_s, 6.0);
  EXPECT_DOUBLE_EQ(p->layers[4].backward_s, 0.0);
  EXPECT_DOUBLE_EQ(p->h2d_bytes_per_s, 10.0);
  EXPECT_DOUBLE_EQ(p->d2h_bytes_per_s, 20.0);
  EXPECT_DOUBLE_EQ(p->microbatch_overhead_s, 1.0);
  EXPECT_DOUBLE_EQ(p->optimizer_params_per_s, 50.0);
  EXPECT_DOUBLE_EQ(p->optimizer_pass_bytes, 20.0);

  ProfileBuilder missing(5);
  missing.AddLayer(0, 0, 1.0, -1.0);
  auto bad = missing.Build(c);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("layer 1 was never timed"), std::string::npos);
}

// The cost model charges a sparse block for its router and the k experts a token runs through,
// not for every expert it streams: with the attention's cost the same in both kinds of block, a
// sparse block's forward exceeds a dense one's by the difference of their MLPs' FLOPs.
TEST(Profile, CostModelCountsTheActiveExpertsOfSparseBlocks) {
  JobConfig c = Small(3);
  c.model.moe.num_experts = 16;
  c.model.moe.experts_per_token = 2;
  c.model.moe.expert_intermediate_size = 40;
  c.model.moe.dense_layers = {1};  // blocks 0 and 2 sparse (pipeline layers 1 and 3), block 1 dense
  const double flops_per_s = 1e9;
  const Profile p = CostModelProfile(c, flops_per_s, 5e9, 1e8);
  const double H = static_cast<double>(c.model.hidden_size),
               I = static_cast<double>(c.model.intermediate_size);
  const double tokens = static_cast<double>(c.TokensPerMicrobatch());
  const double sparse_mlp = H * 16 + 2 * 3 * H * 40, dense_mlp = 3 * H * I;
  EXPECT_NEAR(p.layers[1].forward_s - p.layers[2].forward_s,
              2.0 * tokens * (sparse_mlp - dense_mlp) / flops_per_s, 1e-12);
  EXPECT_DOUBLE_EQ(p.layers[1].forward_s, p.layers[3].forward_s);
  EXPECT_NE(WorkloadKey(c), WorkloadKey(Small(3)))
      << "a profile of the dense model must not be taken for it";
}

// A product with a weight costs twice its forward backwards; the attention core costs 2.5x on
// the GPU (the fused backward recomputes the scores) and 2x on the CPU (which keeps them).
TEST(Profile, CostModelChargesTheFusedAttentionBackwardItsRecomputedScores) {
  JobConfig c = Small(2);
  c.data.seq_len = 4096;
  const double flops_per_s = 1e9;
  const double attention = 2.0 * static_cast<double>(c.TokensPerMicrobatch()) * 4096.0 *
                           static_cast<double>(c.model.num_heads * c.model.head_dim) / flops_per_s;
  const Profile cpu = CostModelProfile(c, flops_per_s, 5e9, 1e8);
  EXPECT_DOUBLE_EQ(cpu.layers[1].backward_s, 2.0 * cpu.layers[1].forward_s);
  c.job.device = DeviceKind::kCuda;
  const Profile gpu = CostModelProfile(c, flops_per_s, 5e9, 1e8);
  EXPECT_DOUBLE_EQ(gpu.layers[1].forward_s, cpu.layers[1].forward_s);
  EXPECT_NEAR(gpu.layers[1].backward_s, 2.0 * gpu.layers[1].forward_s + 0.5 * attention,
              1e-9 * attention);
  EXPECT_GT(attention, 0.1 * gpu.layers[1].forward_s)
      << "the attention core should matter at this length";
  // The head has no attention core.
  EXPECT_DOUBLE_EQ(gpu.layers[3].recompute_s, cpu.layers[3].recompute_s);
}

TEST(Profile, SavesAndLoadsAndRejectsWhatDoesNotFit) {
  JobConfig c = Small(2);
  Profile p = CostModelProfile(c, 1e9, 5e9, 1e8);
  p.source = "measured";
  p.layers[2].saved_bytes = 1234.0;
  p.optimizer_pass_bytes = 18.0;
  const std::string path = TempPath("round.json");
  ASSERT_TRUE(SaveProfile(path, p).ok());
  auto back = LoadProfile(path, c);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  ASSERT_EQ(back->layers.size(), p.layers.size());
  for (size_t l = 0; l < p.layers.size(); ++l) {
    EXPECT_DOUBLE_EQ(back->layers[l].forward_s, p.layers[l].forward_s);
    EXPECT_DOUBLE_EQ(back->layers[l].backward_s, p.layers[l].backward_s);
  }
  EXPECT_DOUBLE_EQ(back->layers[2].saved_bytes, 1234.0);
  EXPECT_DOUBLE_EQ(back->h2d_bytes_per_s, 5e9);
  EXPECT_DOUBLE_EQ(back->optimizer_pass_bytes, 18.0);

  auto expect_bad = [&](const std::string& text, const char* needle, const JobConfig& cfg) {
    const std::string bad = TempPath("bad.json");
    std::ofstream(bad) << text;
    auto r = LoadProfile(bad, cfg);
    ASSERT_FALSE(r.ok()) << text;
    EXPECT_NE(r.status().message().find(needle), std::string::npos) << r.status().message();
    EXPECT_NE(r.status().message().find(bad), std::string::npos) << "names the file";
  };
  const auto good = nlohmann::json::parse(ProfileToJson(p));
  expect_bad("{not json", "not JSON", c);
  JobConfig other = c;
  other.train.microbatch_size = 7;
  expect_bad(good.dump(), "measured for workload", other);
  auto j = good;
  j["layers"].erase(0);
  expect_bad(j.dump(), "must list 4 pipeline layers", c);
  j = good;
  j["layers"][1]["backward_s"] = -1.0;
  expect_bad(j.dump(), "negative time", c);
  j = good;
  j.erase("h2d_bytes_per_s");
  expect_bad(j.dump(), "h2d_bytes_per_s", c);
  j = good;
  j["optimizer_pass_bytes"] = -4.0;
  expect_bad(j.dump(), "must be >= 0", c);
  j = good;
  j["optimizer_pass_bytes"] = "many";
  expect_bad(j.dump(), "optimizer_pass_bytes", c);
  // A profile written before the passes were recorded reads as not recording them.
  j = good;
  j.erase("optimizer_pass_bytes");
  {
    const std::string older = TempPath("older.json");
    std::ofstream(older) << j.dump();
    auto r = LoadProfile(older, c);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_DOUBLE_EQ(r->optimizer_pass_bytes, 0.0);
  }
  j = good;
  j["format_version"] = 99;
  expect_bad(j.dump(), "format_version", c);
  EXPECT_EQ(LoadProfile(TempPath("absent.json"), c).status().code(), StatusCode::kNotFound);
}

}  // namespace
}  // namespace rp::core
