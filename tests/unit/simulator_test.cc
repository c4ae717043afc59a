// SPDX-License-Identifier: Apache-2.0
#include <gtest/gtest.h>

#include "core/simulator.h"

namespace rp::core {
namespace {

TEST(Simulator, IsolatedRoundMatchesTheClosedForm) {
  // S = v * N equal stages of time t, M >= N: makespan = v*M*t + (N-1)*t and
  // bubble = (N-1) / (v*M + N-1).
  for (int n : {1, 2, 3, 4})
    for (int v : {1, 2, 3})
      for (int m = n; m <= n + 3; ++m) {
        const double t = 0.5;
        auto r = SimulateRoundRobin(std::vector<double>(v * n, t), n, m, 1);
        EXPECT_NEAR(r.makespan, v * m * t + (n - 1) * t, 1e-12) << n << " " << v << " " << m;
        EXPECT_NEAR(r.bubble_ratio, (n - 1.0) / (v * m + n - 1.0), 1e-12);
      }
}

TEST(Simulator, FewerMicrobatchesThanWorkersLeaveGaps) {
  // N = 4, M = 2, S = 8 equal stages of 1 s, by hand: job k's microbatch 0 ends at k + 1 and its
  // microbatch 1 at k + 2 (each waits for the previous job's same microbatch; workers free up in
  // time), so the last job (7) ends at 9; busy 16 of 4 x 9 worker-seconds.
  auto r = SimulateRoundRobin(std::vector<double>(8, 1.0), 4, 2, 1);
  EXPECT_DOUBLE_EQ(r.makespan, 9.0);
  EXPECT_NEAR(r.bubble_ratio, 1.0 - 16.0 / 36.0, 1e-12);
}

TEST(Simulator, ManyCallsAmortizeFill) {
  const std::vector<double> stages(6, 1.0);
  auto one = SimulateRoundRobin(stages, 3, 4, 1);
  auto many = SimulateRoundRobin(stages, 3, 4, 8);
  EXPECT_LT(many.bubble_ratio, one.bubble_ratio);
  EXPECT_NEAR(many.makespan, 8 * 6 * 4 / 3.0 + 2.0, 1e-9);  // busy/N + one fill
}

TEST(Simulator, StageFlopsWeighBackwardThreeTimes) {
  JobConfig c;
  c.model.num_layers = 4;
  c.schedule.forward_stages = 1;
  c.schedule.backward_stages = 1;
  c.schedule.tail_blocks = 0;
  auto plan = MakePlan(c);
  ASSERT_TRUE(plan.ok());
  auto f = StageFlops(c, *plan);
  ASSERT_EQ(f.size(), 3u);  // F[0,5) T[5,6) B[0,5)
  EXPECT_NEAR(f[2], 3.0 * f[0], 1e-6 * f[2]);
  EXPECT_GT(f[1], 0.0);
}

}  // namespace
}  // namespace rp::core
