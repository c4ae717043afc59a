// SPDX-License-Identifier: Apache-2.0
#include "coordinator/progress_beacon.h"

#include <fcntl.h>
#include <sys/stat.h>

#include <chrono>

#include "common/time_util.h"
#include "common/unique_fd.h"

namespace rp::coord {

ProgressBeacon::ProgressBeacon(std::string path, double timeout_s)
    : path_(std::move(path)), timeout_s_(timeout_s) {
  if (timeout_s_ <= 0) return;
  thread_ = std::thread([this] { Run(); });
}

ProgressBeacon::~ProgressBeacon() {
  {
    std::lock_guard<std::mutex> l(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void ProgressBeacon::EnterLoop(double now) {
  last_turn_.store(now, std::memory_order_relaxed);
  in_loop_.store(true, std::memory_order_relaxed);
}

bool ProgressBeacon::Progressing(double now) const {
  if (!in_loop_.load(std::memory_order_relaxed) || working_.load() > 0) return true;
  return now - last_turn_.load(std::memory_order_relaxed) < timeout_s_;
}

void ProgressBeacon::Run() {
  std::unique_lock<std::mutex> l(mu_);
  while (!stopping_) {
    if (Progressing(MonoSeconds())) {
      // Created on the first beat; afterwards only its times change. O_NOFOLLOW: the runtime
      // directory is private (0700), but a beat never writes through a link.
      const UniqueFd fd(::open(path_.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600));
      if (fd.get() >= 0) ::futimens(fd.get(), nullptr);
    }
    cv_.wait_for(l, std::chrono::milliseconds(500), [&] { return stopping_; });
  }
}

}  // namespace rp::coord
