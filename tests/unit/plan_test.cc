// SPDX-License-Identifier: Apache-2.0
#include <gtest/gtest.h>

#include <map>

#include "planning/partitioner.h"
#include "planning/plan.h"
#include "tests/testing/process_harness.h"

namespace rp::core {
namespace {

JobConfig Config(int layers, int fwd, int bwd, int tail, std::vector<int64_t> fcuts = {},
                 std::vector<int64_t> bcuts = {}) {
  JobConfig c;
  c.model.num_layers = layers;
  c.schedule.forward_stages = fwd;
  c.schedule.backward_stages = bwd;
  c.schedule.tail_blocks = tail;
  c.schedule.forward_cuts = fcuts;
  c.schedule.backward_cuts = bcuts;
  return c;
}

void ExpectCoversOnce(const PipelinePlan& p) {
  std::vector<int> f(p.num_layers, 0), b(p.num_layers, 0);
  for (auto& s : p.stages)
    for (int l = s.begin; l < s.end; ++l) {
      if (s.kind != StageKind::kBackward) f[l]++;
      if (s.kind != StageKind::kForward) b[l]++;
    }
  for (int l = 0; l < p.num_layers; ++l) {
    EXPECT_EQ(f[l], 1) << "layer " << l;
    EXPECT_EQ(b[l], 1) << "layer " << l;
  }
}

TEST(Plan, EqualCuts) {
  EXPECT_EQ(EqualCuts(7, 3), (std::vector<int>{0, 3, 5}));
  EXPECT_EQ(EqualCuts(4, 4), (std::vector<int>{0, 1, 2, 3}));
}

TEST(Plan, EqualSplitChainOrder) {
  auto p = MakePlan(Config(4, 2, 2, 1));
  ASSERT_TRUE(p.ok());
  // Layers: 0 embed, 1..4 blocks, 5 head. Tail = [4, 6).
  EXPECT_EQ(p->Describe(), "F[0,2) F[2,4) T[4,6) B[2,4) B[0,2)");
  EXPECT_EQ(p->hidden_boundaries, (std::vector<int>{2, 4}));
  EXPECT_EQ(p->grad_boundaries, (std::vector<int>{2, 4}));
  EXPECT_TRUE(p->IsCheckpoint(2));
  EXPECT_FALSE(p->IsCheckpoint(4));
  ExpectCoversOnce(*p);
}

TEST(Plan, AsymmetricExplicitCuts) {
  auto p = MakePlan(Config(6, 0, 0, 0, {4}, {2, 3, 5}));
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(p->Describe(), "F[0,4) F[4,7) T[7,8) B[5,7) B[3,5) B[2,3) B[0,2)");
  // Forward stage [0,4) must save checkpoints at 2 and 3 (backward stage starts) and its end 4.
  EXPECT_EQ(p->hidden_boundaries, (std::vector<int>{2, 3, 4, 5, 7}));
  EXPECT_EQ(p->grad_boundaries, (std::vector<int>{2, 3, 5, 7}));
  ExpectCoversOnce(*p);
}

TEST(Plan, RandomConfigsAlwaysCoverEveryLayerOnce) {
  for (int layers = 1; layers <= 9; ++layers)
    for (int tail = 0; tail <= layers; ++tail) {
      const int t = layers + 1 - tail;
      for (int f = 1; f <= t; ++f)
        for (int b = 1; b <= t; ++b) {
          auto p = MakePlan(Config(layers, f, b, tail));
          ASSERT_TRUE(p.ok()) << p.status().ToString();
          ExpectCoversOnce(*p);
          EXPECT_EQ(p->NumForward(), f);
          EXPECT_EQ(static_cast<int>(p->stages.size()), f + 1 + b);
        }
    }
}

TEST(Plan, RoundRobinDispatch) {
  for (int n = 1; n <= 5; ++n)
    for (int64_t k = 0; k < 40; ++k) EXPECT_EQ(WorkerForJob(k, 0, n), k % n);
  EXPECT_EQ(WorkerForJob(3, 2, 4), 1);
}

TEST(Plan, StepJobOrderRunsEveryJobOnceAfterWhatItNeeds) {
  PipelinePlan plan;
  plan.stages = {{StageKind::kForward, 0, 2},
                 {StageKind::kForward, 2, 4},
                 {StageKind::kFusedTail, 4, 6},
                 {StageKind::kBackward, 2, 4},
                 {StageKind::kBackward, 0, 2}};
  const int S = static_cast<int>(plan.stages.size());
  for (bool interleave : {false, true})
    for (int K : {1, 2, 3, 4, 5}) {
      auto order = StepJobOrder(plan, K, interleave);
      ASSERT_EQ(order.size(), static_cast<size_t>(K * S));
      std::map<std::pair<int, int>, int> pos;
      for (int i = 0; i < static_cast<int>(order.size()); ++i)
        EXPECT_TRUE(pos.emplace(std::make_pair(order[i].call, order[i].stage), i).second)
            << "duplicate";
      for (int c = 0; c < K; ++c)
        for (int s = 0; s < S; ++s) {
          const int at = pos.at({c, s});
          if (s > 0) {
            EXPECT_LT(pos.at({c, s - 1}), at) << "chain order, call " << c;
          }
          if (c > 0) {
            EXPECT_LT(pos.at({c - 1, s}), at) << "accumulation order, stage " << s;
          }
          // Two slot parities: call c's first stage is fed once call c - 2 is done.
          if (c > 1) {
            EXPECT_LT(pos.at({c - 2, S - 1}), pos.at({c, 0})) << "slot reuse, call " << c;
          }
        }
      if (!interleave || K == 1) {
        for (int i = 0; i < K * S; ++i) EXPECT_EQ(order[i].call * S + order[i].stage, i);
      } else {
        // Forward stages of calls 0 and 1 alternate before call 0's tail.
        EXPECT_EQ(order[1].call, 1);
        EXPECT_EQ(order[1].stage, 0);
        EXPECT_EQ(order[4].call, 0);
        EXPECT_EQ(order[4].stage, 2);
      }
    }
}

}  // namespace
}  // namespace rp::core
