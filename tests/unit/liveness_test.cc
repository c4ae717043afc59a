// SPDX-License-Identifier: Apache-2.0
// The coordinator's liveness part, in-process with made-up clocks.
#include "coordinator/liveness.h"

#include <gtest/gtest.h>

namespace rp::coord {
namespace {

// The loop turning every 10 ms from `from` to `to` while `talk` workers keep talking.
void Turn(WorkerLiveness& l, double from, double to, const std::vector<int>& talk) {
  for (double t = from; t <= to; t += 0.01) {
    l.Listening(t);
    for (int r : talk) l.Heard(r, t);
    l.ListenedUntil(t, 0.01, /*caught_up=*/true);
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
  EXPECT_LT(l.SilentFor(0), 0.1);
  // A worker that stays silent while the loop listens is still caught.
  Turn(l, 31.0, 33.5, {0});
  const auto hung = l.Hung(33.5, 10.0);
  ASSERT_EQ(hung.size(), 1u);
  EXPECT_EQ(hung[0].rank, 1);
}

TEST(WorkerLiveness, AWaitThatOutlivesItsTimeoutIsNobodysSilence) {
  // The coordinator stopped for 45 s inside a 100 ms wait (SIGSTOP): the wait returns late with
  // one worker's queued heartbeat; the others' are still queued, and none of them is hung.
  WorkerLiveness l(3, /*timeout_s=*/2.0, 0.0);
  Turn(l, 0.0, 1.0, {0, 1, 2});
  l.Listening(1.0);
  l.Heard(0, 46.0);
  l.ListenedUntil(46.0, 0.1, /*caught_up=*/false);
  EXPECT_TRUE(l.Hung(46.0, 10.0).empty());
  Turn(l, 46.0, 46.1, {1, 2});
  EXPECT_TRUE(l.Hung(46.1, 10.0).empty());
  // A wait that ends within its timeout plus the gap is listening time, as before.
  Turn(l, 46.1, 48.5, {0, 1});
  ASSERT_EQ(l.Hung(48.5, 10.0).size(), 1u);
}

TEST(WorkerLiveness, SilenceIsMeasuredUpToTheLastTimeTheLoopHadReadEverything) {
  // A loop that falls behind its messages (each turn slowed by a write) reads a backlog: a worker
  // whose heartbeat is still queued is not judged by it.
  WorkerLiveness l(2, /*timeout_s=*/2.0, 0.0);
  Turn(l, 0.0, 1.0, {0, 1});
  for (double t = 1.0; t < 5.0; t += 0.3) {  // every wait returns a queued message from worker 0
    l.Listening(t);
    l.Heard(0, t);
    l.ListenedUntil(t, 0.1, /*caught_up=*/false);
    EXPECT_TRUE(l.Hung(t, 10.0).empty()) << t;
  }
  // Caught up: worker 1's heartbeats were read on the way (heard at 5.0); nobody is hung.
  l.Listening(5.0);
  l.Heard(1, 5.0);
  l.ListenedUntil(5.0, 0.1, false);
  l.Listening(5.0);
  l.ListenedUntil(5.1, 0.1, /*caught_up=*/true);
  EXPECT_TRUE(l.Hung(5.1, 10.0).empty());
  // Had worker 1 sent nothing, catching up shows it.
  WorkerLiveness m(2, 2.0, 0.0);
  Turn(m, 0.0, 1.0, {0, 1});
  Turn(m, 1.0, 3.5, {0});
  ASSERT_EQ(m.Hung(3.5, 10.0).size(), 1u);
}

TEST(WorkerLiveness, AnExcusedWorkerIsJudgedAfreshFromThen) {
  WorkerLiveness l(2, /*timeout_s=*/2.0, 0.0);
  Turn(l, 0.0, 2.5, {0});
  ASSERT_EQ(l.Hung(2.5, 0.0).size(), 1u);
  l.Excuse(1, 2.5);
  Turn(l, 2.5, 4.4, {0});
  EXPECT_TRUE(l.Hung(4.4, 0.0).empty());
  Turn(l, 4.4, 4.7, {0});
  EXPECT_EQ(l.Hung(4.7, 0.0).size(), 1u);
}

TEST(WorkerLiveness, NoTimeoutMeansNobodyIsEverHung) {
  WorkerLiveness l(2, /*timeout_s=*/0.0, 0.0);
  Turn(l, 0.0, 100.0, {});
  EXPECT_TRUE(l.Hung(100.0, 1.0).empty());
}

}  // namespace
}  // namespace rp::coord
