// SPDX-License-Identifier: Apache-2.0
// Wall-clock helpers shared by processes: trace timestamps must be comparable across processes,
// so they come from CLOCK_REALTIME in microseconds.
#pragma once

#include <cstdint>

namespace rp {
// Microseconds since the Unix epoch (comparable across processes on one host).
int64_t WallMicros();
// Monotonic seconds, for durations inside one process.
double MonoSeconds();
}  // namespace rp
