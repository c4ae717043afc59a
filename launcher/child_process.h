// SPDX-License-Identifier: Apache-2.0
// ChildProcess: owns one child pid started with posix_spawn (no shell in between).
//
// Contract:
//  * Spawn() returns a running child or an IoError naming the binary. Move-only.
//  * The destructor never leaves a child behind: if it is still running it gets SIGTERM, then
//    SIGKILL after `grace`, and is reaped. It never throws.
//  * TryReap() is non-blocking; after it reports an exit, the object holds the exit description.
//  * Not thread-safe.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include "common/status.h"

namespace rp::launch {

struct ExitInfo {
  bool signaled = false;
  int code = 0;  // exit code, or signal number if signaled
  std::string Describe() const;
};

class ChildProcess {
 public:
  // `output_fd` >= 0 becomes the child's stdout and stderr.
  static StatusOr<ChildProcess> Spawn(const std::string& role, const std::vector<std::string>& argv,
                                      const std::vector<std::string>& extra_env,
                                      int output_fd = -1);
  ChildProcess(ChildProcess&& o) noexcept;
  ChildProcess& operator=(ChildProcess&& o) noexcept;
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;
  ~ChildProcess();

  pid_t pid() const { return pid_; }
  const std::string& role() const { return role_; }
  bool running() const { return pid_ > 0 && !exit_; }
  const std::optional<ExitInfo>& exit_info() const { return exit_; }

  // Reaps the child if it has exited; returns true if it has (now or before).
  bool TryReap();
  void Signal(int sig) const;
  // SIGTERM, wait up to `grace`, SIGKILL, reap.
  void Terminate(std::chrono::milliseconds grace);

 private:
  ChildProcess(std::string role, pid_t pid) : role_(std::move(role)), pid_(pid) {}
  std::string role_;
  pid_t pid_ = -1;
  std::optional<ExitInfo> exit_;
};

}  // namespace rp::launch
