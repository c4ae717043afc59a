// SPDX-License-Identifier: Apache-2.0
// The cores this process may run on: its CPU affinity (a container's or taskset's limit), not
// the host's count; every thread pool sized "one per core" uses this one figure.
#pragma once

#include <sched.h>

#include <algorithm>
#include <thread>

namespace rp {

inline int UsableCores() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

}  // namespace rp
