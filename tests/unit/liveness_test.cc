// SPDX-License-Identifier: Apache-2.0
// The coordinator's liveness part, in-process with made-up clocks.
#include "coordinator/liveness.h"

#include <gtest/gtest.h>

namespace rp::coord {
namespace {

// The loop turning every 10 ms from `from` to `to` while `talk` workers keep talking.
void Turn(WorkerLiveness& l, double from, double to, const std::vector<int>& talk) {
  for (double t = from; t <= to; t += 0.01) {
    for (int r : talk) l.Heard(r, t);
    l.Listening(t);
  }
}

TEST(WorkerLiveness, ASilentWorkerIsHungOnceTheTimeoutPasses) {
  WorkerLiveness l(3, /*timeout_s=*/2.0, /*now=*/0.0);
  Turn(l, 0.0, 1.9, {0, 2});
  EXPECT_TRUE(l.Hung(1.9, 10.0).empty());
  Turn(l, 1.9, 2.5, {0, 2});
  const auto hung = l.Hung(2.5, 10.0);
  ASSERT_EQ(hung.size(), 1u);
  EXPECT_EQ(hung[0].rank, 1);
  EXPECT_GT(hung[0].silent_s, 2.0);
  // Once judged, its replacement gets the grace period before it can be judged again.
  Turn(l, 2.5, 12.0, {0, 2});
  EXPECT_TRUE(l.Hung(12.0, 10.0).empty());
  Turn(l, 12.0, 15.0, {0, 2});
  EXPECT_EQ(l.Hung(15.0, 10.0).size(), 1u);
}

TEST(WorkerLiveness, TimeTheCoordinatorCouldNotListenIsNobodysSilence) {
  // A 30 s checkpoint written on the loop: no turn, no message heard. Afterwards every worker
  // is as fresh as it was when the loop stopped listening.
  WorkerLiveness l(2, /*timeout_s=*/2.0, 0.0);
  Turn(l, 0.0, 1.0, {0, 1});
  l.Listening(31.0);  // the first turn after the write
  EXPECT_TRUE(l.Hung(31.0, 10.0).empty());
  EXPECT_LT(l.SilentFor(0, 31.0), 0.1);
  // A worker that stays silent while the loop listens is still caught.
  Turn(l, 31.0, 33.5, {0});
  const auto hung = l.Hung(33.5, 10.0);
  ASSERT_EQ(hung.size(), 1u);
  EXPECT_EQ(hung[0].rank, 1);
}

TEST(WorkerLiveness, NoTimeoutMeansNobodyIsEverHung) {
  WorkerLiveness l(2, /*timeout_s=*/0.0, 0.0);
  Turn(l, 0.0, 100.0, {});
  EXPECT_TRUE(l.Hung(100.0, 1.0).empty());
}

}  // namespace
}  // namespace rp::coord
