// SPDX-License-Identifier: Apache-2.0
#include "coordinator/liveness.h"

namespace rp::coord {

WorkerLiveness::WorkerLiveness(int workers, double timeout_s, double now, double max_listen_gap_s)
    : timeout_s_(timeout_s),
      max_listen_gap_s_(max_listen_gap_s),
      last_turn_(now),
      wait_began_(now),
      caught_up_(now),
      last_seen_(workers, now) {}

void WorkerLiveness::Heard(int rank, double now) { last_seen_[rank] = now; }

void WorkerLiveness::Deaf(double deaf_s) {
  for (double& t : last_seen_) t += deaf_s;
}

void WorkerLiveness::Listening(double now) {
  const double gap = now - last_turn_;
  last_turn_ = wait_began_ = now;
  if (gap > max_listen_gap_s_) Deaf(gap);  // busy between two waits
}

void WorkerLiveness::ListenedUntil(double now, double timeout_s, bool caught_up) {
  const double overrun = now - wait_began_ - timeout_s;
  if (overrun > max_listen_gap_s_) Deaf(overrun);  // stopped inside the wait
  last_turn_ = now;
  if (caught_up) caught_up_ = now;
}

std::vector<WorkerLiveness::Verdict> WorkerLiveness::Hung(double now, double grace_s) {
  std::vector<Verdict> hung;
  if (timeout_s_ <= 0) return hung;
  for (int r = 0; r < static_cast<int>(last_seen_.size()); ++r) {
    const double silent = caught_up_ - last_seen_[r];
    if (silent <= timeout_s_) continue;
    hung.push_back({r, silent});
    last_seen_[r] = now + grace_s;
  }
  return hung;
}

}  // namespace rp::coord
