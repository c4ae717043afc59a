// SPDX-License-Identifier: Apache-2.0
#include "coordinator/liveness.h"

namespace rp::coord {

WorkerLiveness::WorkerLiveness(int workers, double timeout_s, double now, double max_listen_gap_s)
    : timeout_s_(timeout_s), max_listen_gap_s_(max_listen_gap_s), last_turn_(now), last_seen_(workers, now) {}

void WorkerLiveness::Heard(int rank, double now) { last_seen_[rank] = now; }

void WorkerLiveness::Listening(double now) {
  const double gap = now - last_turn_;
  last_turn_ = now;
  if (gap <= max_listen_gap_s_) return;
  for (double& t : last_seen_) t += gap;  // deaf time: nobody's silence
}

std::vector<WorkerLiveness::Verdict> WorkerLiveness::Hung(double now, double grace_s) {
  std::vector<Verdict> hung;
  if (timeout_s_ <= 0) return hung;
  for (int r = 0; r < static_cast<int>(last_seen_.size()); ++r) {
    const double silent = now - last_seen_[r];
    if (silent <= timeout_s_) continue;
    hung.push_back({r, silent});
    last_seen_[r] = now + grace_s;
  }
  return hung;
}

}  // namespace rp::coord
