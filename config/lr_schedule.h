// SPDX-License-Identifier: Apache-2.0
// Learning rate at optimizer step t (0-based) of total_steps: a linear warmup to `lr` over
// warmup_steps (step t gets lr * (t + 1) / warmup_steps), then optimizer.lr_schedule over the
// remaining steps: "cosine" decays to min_lr at the last step along half a cosine, "linear" decays
// to min_lr at the last step along a line, "constant" stays at lr. With one step or none left
// after warmup, that step runs at lr. Pure function; shared by coordinator and reference.
#pragma once

#include <cmath>
#include <cstdint>

#include "config/job_config.h"

namespace rp::core {

inline double LearningRate(const OptimizerConfig& o, int64_t step, int64_t total_steps) {
  if (o.warmup_steps > 0 && step < o.warmup_steps)
    return o.lr * static_cast<double>(step + 1) / static_cast<double>(o.warmup_steps);
  const int64_t decay = total_steps - o.warmup_steps;
  if (decay <= 1 || o.lr_schedule == LrSchedule::kConstant) return o.lr;
  const double progress =
      static_cast<double>(step - o.warmup_steps) / static_cast<double>(decay - 1);
  if (o.lr_schedule == LrSchedule::kLinear) return o.lr + (o.min_lr - o.lr) * progress;
  return o.min_lr + 0.5 * (o.lr - o.min_lr) * (1.0 + std::cos(M_PI * progress));
}

}  // namespace rp::core
