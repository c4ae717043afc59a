// SPDX-License-Identifier: Apache-2.0
#include "optim/task_pool.h"

#include <algorithm>

namespace rp::coord {

TaskPool::TaskPool(int threads, int rest_threads) : rest_threads_(rest_threads) {
  for (int t = 0; t < std::max(1, threads); ++t) threads_.emplace_back([this, t] { Loop(t); });
}

TaskPool::~TaskPool() {
  {
    std::unique_lock<std::mutex> l(mu_);
    idle_cv_.wait(l, [&] { return pending_ == 0; });
    stopping_ = true;
  }
  work_cv_.notify_all();
  for (auto& t : threads_) t.join();
}

void TaskPool::Submit(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> l(mu_);
    queue_.push_back(std::move(task));
    pending_++;
  }
  work_cv_.notify_one();
}

void TaskPool::SubmitRest(std::vector<std::function<void()>> tasks) {
  {
    std::lock_guard<std::mutex> l(mu_);
    for (auto& t : tasks) rest_queue_.push_back(std::move(t));
    pending_ += static_cast<int>(tasks.size());
  }
  // Only some threads take these: wake all (once per batch) so those see them.
  work_cv_.notify_all();
}

void TaskPool::Loop(int index) {
  const bool takes_rest = index < rest_threads_;
  while (true) {
    std::function<void()> task;
    {
      std::unique_lock<std::mutex> l(mu_);
      work_cv_.wait(
          l, [&] { return stopping_ || !queue_.empty() || (takes_rest && !rest_queue_.empty()); });
      auto& from = !queue_.empty() ? queue_ : rest_queue_;
      if (from.empty() || (&from == &rest_queue_ && !takes_rest))
        return;  // stopping, nothing left for it
      task = std::move(from.front());
      from.pop_front();
    }
    task();
    {
      std::lock_guard<std::mutex> l(mu_);
      pending_--;
    }
    idle_cv_.notify_all();
  }
}

}  // namespace rp::coord
