// SPDX-License-Identifier: Apache-2.0
// ProgressBeacon: how the launcher knows the coordinator is alive and not stuck. A thread touches
// <runtime dir>/coordinator.alive every half second while the coordinator makes progress; the
// launcher ends the run when the file is older than job.worker_timeout_s and the coordinator is
// running (stuck), or once it has been stopped (SIGSTOP, a debugger) for job.stopped_timeout_s.
//
// Contract:
//  * Outside the event loop (start-up, the end) every beat is sent.
//  * Inside it, LoopTurned() is called on every turn (at least every 200 ms); the beat stops once
//    the loop has not turned for `timeout_s`, unless a Working scope is open (a checkpoint being
//    written: long, but progress).
//  * With timeout_s <= 0 the beacon does nothing (no deadline to keep).
//  * The destructor stops and joins the thread; nothing throws.
#pragma once

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>

namespace rp::coord {

class ProgressBeacon {
 public:
  ProgressBeacon(std::string path, double timeout_s);
  ~ProgressBeacon();
  ProgressBeacon(const ProgressBeacon&) = delete;
  ProgressBeacon& operator=(const ProgressBeacon&) = delete;

  void EnterLoop(double now);
  void LoopTurned(double now) { last_turn_.store(now, std::memory_order_relaxed); }
  void LeaveLoop() { in_loop_.store(false, std::memory_order_relaxed); }

  class Working {
   public:
    explicit Working(ProgressBeacon& b) : b_(b) { b_.working_.fetch_add(1); }
    ~Working() { b_.working_.fetch_sub(1); }
    Working(const Working&) = delete;
    Working& operator=(const Working&) = delete;

   private:
    ProgressBeacon& b_;
  };

 private:
  void Run();
  bool Progressing(double now) const;

  std::string path_;
  double timeout_s_;
  std::atomic<bool> in_loop_{false};
  std::atomic<double> last_turn_{0.0};
  std::atomic<int> working_{0};
  std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;  // GUARDED_BY(mu_)
  std::thread thread_;     // last: started after the state above
};

}  // namespace rp::coord
