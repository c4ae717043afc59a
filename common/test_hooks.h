// SPDX-License-Identifier: Apache-2.0
// Test-only fault switches, shared by the hooks that fake a hang or a CUDA fault.
//
// Contract: ClaimTestHookOnce("RP_TEST_X") is true in exactly one process of a run: the first to
// create the marker file named by the environment variable (O_EXCL). Replacement processes
// inherit the same environment but find the marker, so a fault fires once per run. False when the
// variable is unset (production).
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <cstdlib>

namespace rp {

inline bool ClaimTestHookOnce(const char* env_var) {
  const char* path = std::getenv(env_var);
  if (path == nullptr) return false;
  const int fd = ::open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) return false;
  ::close(fd);
  return true;
}

}  // namespace rp
