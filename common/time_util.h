// SPDX-License-Identifier: Apache-2.0
// Wall-clock helpers shared by processes: trace timestamps must be comparable across processes,
// so they come from CLOCK_REALTIME in microseconds.
#pragma once

#include <cstdint>
#include <string>

namespace rp {
// Microseconds since the Unix epoch (comparable across processes on one host).
int64_t WallMicros();
// Monotonic seconds, for durations inside one process.
double MonoSeconds();
// Seconds for a message: "2", "2.5", "45.3" (one decimal, none when whole).
std::string FormatSeconds(double s);
}  // namespace rp
