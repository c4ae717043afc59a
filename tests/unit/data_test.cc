// SPDX-License-Identifier: Apache-2.0
#include <gtest/gtest.h>

#include <set>

#include "core/data.h"
#include "core/lr_schedule.h"
#include "core/model_spec.h"
#include "tests/testing/process_harness.h"

namespace rp::core {
namespace {

JobConfig BytesConfig() {
  JobConfig c;
  c.data.path = testing::SourceDir() + "/data/tiny_corpus.txt";
  c.data.seq_len = 32;
  c.train.microbatch_size = 2;
  return c;
}

TEST(Dataset, DeterministicShiftedAndCoordinateKeyed) {
  auto c = BytesConfig();
  auto d1 = Dataset::Open(c);
  auto d2 = Dataset::Open(c);
  ASSERT_TRUE(d1.ok() && d2.ok());
  std::vector<int64_t> t1(64), l1(64), t2(64), l2(64);
  d1->Fill(3, 1, 2, t1.data(), l1.data());
  d2->Fill(0, 0, 0, t2.data(), l2.data());  // a different draw first must not matter
  d2->Fill(3, 1, 2, t2.data(), l2.data());
  EXPECT_EQ(t1, t2);
  EXPECT_EQ(l1, l2);
  for (int i = 0; i + 1 < 32; ++i) EXPECT_EQ(l1[i], t1[i + 1]);
  d1->Fill(3, 1, 1, t2.data(), l2.data());
  EXPECT_NE(t1, t2);
  EXPECT_EQ(d1->CountStepTargets(0), c.train.accum_calls * c.train.microbatches * 64);
}

TEST(Dataset, EpochVisitsEveryWindowOnce) {
  auto c = BytesConfig();
  c.train.microbatch_size = 1;
  c.train.microbatches = 1;
  c.train.accum_calls = 1;
  auto d = Dataset::Open(c);
  ASSERT_TRUE(d.ok());
  std::set<std::vector<int64_t>> seen;
  std::vector<int64_t> t(32), l(32);
  for (int64_t s = 0; s < d->NumWindows(); ++s) {
    d->Fill(s, 0, 0, t.data(), l.data());
    seen.insert(t);
  }
  EXPECT_EQ(static_cast<int64_t>(seen.size()), d->NumWindows());
}

TEST(LearningRate, WarmupThenCosineToMin) {
  OptimizerConfig o;
  o.lr = 1.0;
  o.min_lr = 0.1;
  o.warmup_steps = 4;
  EXPECT_DOUBLE_EQ(LearningRate(o, 0, 20), 0.25);
  EXPECT_DOUBLE_EQ(LearningRate(o, 3, 20), 1.0);
  EXPECT_DOUBLE_EQ(LearningRate(o, 4, 20), 1.0);
  EXPECT_NEAR(LearningRate(o, 19, 20), 0.1, 1e-12);
  for (int s = 5; s < 20; ++s) EXPECT_LE(LearningRate(o, s, 20), LearningRate(o, s - 1, 20));
}

TEST(Init, DeterministicAndScaled) {
  ModelConfig m;
  auto spec = BuildModelSpec(m);
  std::vector<float> b(spec.params[1].numel);
  std::vector<float> a2(spec.params[0].numel), b2(spec.params[0].numel);
  InitParam(spec, 0, 7, a2.data());
  InitParam(spec, 0, 7, b2.data());
  EXPECT_EQ(a2, b2);
  double sum = 0, sq = 0;
  for (float x : a2) sum += x, sq += x * x;
  const double n = static_cast<double>(a2.size());
  EXPECT_NEAR(sum / n, 0.0, 0.002);
  EXPECT_NEAR(std::sqrt(sq / n), m.init_std, 0.002);
  InitParam(spec, 0, 8, b2.data());
  EXPECT_NE(a2, b2);
  InitParam(spec, 1, 7, b.data());  // input_layernorm: ones
  for (float x : b) EXPECT_EQ(x, 1.0f);
}

TEST(ModelSpec, HuggingFaceNamesAndTiedHead) {
  ModelConfig m;
  m.num_layers = 2;
  auto spec = BuildModelSpec(m);
  EXPECT_EQ(spec.params[0].name, "model.embed_tokens.weight");
  EXPECT_EQ(spec.params[2].name, "model.layers.0.self_attn.q_proj.weight");
  EXPECT_EQ(spec.NumLayers(), 4);
  EXPECT_EQ(spec.layer_uses[3].back().role, "lm_head");
  EXPECT_EQ(spec.layer_uses[3].back().param, 0);
  m.tie_embeddings = false;
  auto untied = BuildModelSpec(m);
  EXPECT_EQ(untied.params.back().name, "lm_head.weight");
}

}  // namespace
}  // namespace rp::core
