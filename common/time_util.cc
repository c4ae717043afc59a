// SPDX-License-Identifier: Apache-2.0
#include "common/time_util.h"

#include <time.h>

#include <cmath>
#include <cstdio>

namespace rp {
int64_t WallMicros() {
  timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000 + ts.tv_nsec / 1000;
}
double MonoSeconds() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}
std::string FormatSeconds(double s) {
  char buf[32];
  const double tenths = std::round(s * 10.0) / 10.0;
  std::snprintf(buf, sizeof(buf), tenths == std::round(tenths) ? "%.0f" : "%.1f", tenths);
  return buf;
}
}  // namespace rp
