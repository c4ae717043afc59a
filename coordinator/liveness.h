// SPDX-License-Identifier: Apache-2.0
// WorkerLiveness: when each worker was last heard from, and which ones are hung. One part of the
// coordinator, kept free of processes and clocks (callers pass monotonic seconds) so it is
// tested in-process.
//
// Contract:
//  * Heard(rank, now) records a message from `rank`.
//  * Listening(now) is called when the coordinator's loop starts to wait for messages, and
//    ListenedUntil(now) when the wait ends: the wait itself is listening time, however long.
//    When the previous wait ended more than `max_listen_gap_s` before this one starts, the
//    coordinator was busy in between (a checkpoint written on its loop, a slow save) and could
//    not hear anyone: that time is not counted against any worker. Liveness is measured only
//    over time the coordinator was listening.
//  * Hung(now, grace_s) lists the workers silent for longer than the timeout, each once: a
//    worker judged hung is not judged again for `grace_s` (its replacement's start). With a
//    timeout <= 0 nobody is ever hung.
//  * Not thread-safe; the coordinator's loop owns it.
#pragma once

#include <vector>

namespace rp::coord {

class WorkerLiveness {
 public:
  // Handling one message takes well under a millisecond; a longer gap between two waits is
  // work that kept the loop deaf.
  static constexpr double kMaxListenGapS = 0.5;

  WorkerLiveness(int workers, double timeout_s, double now, double max_listen_gap_s = kMaxListenGapS);

  void Heard(int rank, double now);
  void Listening(double now);
  void ListenedUntil(double now) { last_turn_ = now; }

  struct Verdict {
    int rank;
    double silent_s;
  };
  std::vector<Verdict> Hung(double now, double grace_s);

  double SilentFor(int rank, double now) const { return now - last_seen_[rank]; }
  double timeout_s() const { return timeout_s_; }

 private:
  double timeout_s_;
  double max_listen_gap_s_;
  double last_turn_;  // when the loop last listened
  std::vector<double> last_seen_;  // per worker: when last heard, shifted by deaf intervals
};

}  // namespace rp::coord
