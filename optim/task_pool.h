// SPDX-License-Identifier: Apache-2.0
// TaskPool: the optimizer's threads and its two queues.
//
// Contract:
//  * Submit() queues a task any thread may take; SubmitRest() queues a batch of tasks only the
//    first `rest_threads` threads take (an update's second passes: they move the bytes nothing
//    waits for, so they must not crowd out first passes the next step's forward waits for).
//    Every thread prefers the first queue.
//  * Tasks run in queue order per queue; a task may submit more tasks.
//  * The destructor waits until every submitted task has run (no torn update), then joins.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace rp::coord {

class TaskPool {
 public:
  TaskPool(int threads, int rest_threads);
  ~TaskPool();
  TaskPool(const TaskPool&) = delete;
  TaskPool& operator=(const TaskPool&) = delete;

  void Submit(std::function<void()> task);
  void SubmitRest(std::vector<std::function<void()>> tasks);

 private:
  void Loop(int index);

  int rest_threads_;
  std::mutex mu_;
  std::condition_variable work_cv_, idle_cv_;
  std::deque<std::function<void()>> queue_;       // GUARDED_BY(mu_)
  std::deque<std::function<void()>> rest_queue_;  // GUARDED_BY(mu_)
  bool stopping_ = false;                         // GUARDED_BY(mu_)
  int pending_ = 0;                               // GUARDED_BY(mu_): submitted, not yet run
  std::vector<std::thread> threads_;              // last: started after the state above
};

}  // namespace rp::coord
