// SPDX-License-Identifier: Apache-2.0
// WorkerLiveness: when each worker was last heard from, and which ones are hung. One part of the
// coordinator, kept free of processes and clocks (callers pass monotonic seconds) so it is
// tested in-process.
//
// Contract:
//  * Heard(rank, now) records a message from `rank`.
//  * Listening(now) is called when the coordinator's loop starts to wait for messages, and
//    ListenedUntil(now, timeout_s, caught_up) when the wait ends: the wait itself is listening
//    time, however long. When the previous wait ended more than `max_listen_gap_s` before this
//    one starts, the coordinator was busy in between (a checkpoint written on its loop, a slow
//    save) and could not hear anyone: that time is not counted against any worker. Likewise
//    the part of a wait past its own `timeout_s` (and the gap): a wait outlives its timeout only
//    when the coordinator itself was stopped (SIGSTOP, a debugger) or starved of the CPU.
//    Liveness is measured only over time the coordinator was listening.
//  * `caught_up`: the wait ended with nothing to read, so every message sent before it has been
//    heard. Silence is measured up to the last such moment: a loop that falls behind its
//    messages (a slow disk under each turn) judges no one by messages it has not read yet.
//  * Hung(now, grace_s) lists the workers silent for longer than the timeout, each once: a
//    worker judged hung is not judged again for `grace_s` (its replacement's start). With a
//    timeout <= 0 nobody is ever hung.
//  * Excuse(rank, now): `rank` is not to be judged for its silence so far (it is stopped, and
//    waited for): its clock starts again at `now`.
//  * Not thread-safe; the coordinator's loop owns it.
#pragma once

#include <vector>

namespace rp::coord {

class WorkerLiveness {
 public:
  // Handling one message takes well under a millisecond; a longer gap between two waits is
  // work that kept the loop deaf.
  static constexpr double kMaxListenGapS = 0.5;

  WorkerLiveness(int workers, double timeout_s, double now,
                 double max_listen_gap_s = kMaxListenGapS);

  void Heard(int rank, double now);
  void Listening(double now);
  void ListenedUntil(double now, double timeout_s, bool caught_up);
  void Excuse(int rank, double now) { last_seen_[rank] = now; }

  struct Verdict {
    int rank;
    double silent_s;
  };
  std::vector<Verdict> Hung(double now, double grace_s);

  double SilentFor(int rank) const { return caught_up_ - last_seen_[rank]; }
  double timeout_s() const { return timeout_s_; }

 private:
  double timeout_s_;
  double max_listen_gap_s_;
  // Shifts every worker's last sign of life by `deaf_s` during which nobody could be heard.
  void Deaf(double deaf_s);

  double last_turn_;               // when the loop last listened
  double wait_began_;              // when the current wait began
  double caught_up_;               // when the loop last had read every message
  std::vector<double> last_seen_;  // per worker: when last heard, shifted by deaf intervals
};

}  // namespace rp::coord
