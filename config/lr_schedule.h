// SPDX-License-Identifier: Apache-2.0
// Learning rate at optimizer step t (0-based): linear warmup to `lr` over warmup_steps, then a
// cosine decay to min_lr at the last step. Pure function; shared by coordinator and reference.
#pragma once

#include <cmath>
#include <cstdint>

#include "config/job_config.h"

namespace rp::core {

inline double LearningRate(const OptimizerConfig& o, int64_t step, int64_t total_steps) {
  if (o.warmup_steps > 0 && step < o.warmup_steps)
    return o.lr * static_cast<double>(step + 1) / static_cast<double>(o.warmup_steps);
  const int64_t decay = total_steps - o.warmup_steps;
  if (decay <= 1) return o.lr;
  const double progress =
      static_cast<double>(step - o.warmup_steps) / static_cast<double>(decay - 1);
  return o.min_lr + 0.5 * (o.lr - o.min_lr) * (1.0 + std::cos(M_PI * progress));
}

}  // namespace rp::core
