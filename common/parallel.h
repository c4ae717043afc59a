// SPDX-License-Identifier: Apache-2.0
// One loop over threads for the host's bulk passes: the optimizer's per-layer updates, the
// start-up fill of a large model's state, a checkpoint's conversion.
#pragma once

#include <cstdint>
#include <functional>

namespace rp {

// Runs fn(i) for i in [0, n) on up to `threads` threads, the caller's included (work-stealing by
// an atomic counter, so a few huge tasks and many tiny ones both balance). Returns when every
// call has returned; fn must not throw.
void ParallelFor(int64_t n, int threads, const std::function<void(int64_t)>& fn);

}  // namespace rp
