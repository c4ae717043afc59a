// SPDX-License-Identifier: Apache-2.0
// fp16's dynamic loss scale: the rule that takes the scaler's state after one step to the state
// after the next (core::LossScaling says what it is for).
//
// Contract: pure functions. NextLossScaler is torch.amp.GradScaler's update (torch's
// _amp_update_scale_) on one step's "found inf": the scale is an fp32 value multiplied in double
// and rounded to fp32, it grows only to a finite value, and the growth tracker restarts at 0
// after every change. So a sequence of found-inf flags gives GradScaler's scale sequence exactly.
#pragma once

#include <cmath>

#include "config/execution_plan.h"
#include "config/job_config.h"
#include "shm/layout.h"

namespace rp::coord {

// The state before the first step (step -1).
inline shm::LossScalerState InitialLossScaler(const core::LossScaling& c) {
  return {-1, static_cast<double>(static_cast<float>(c.init)), 0, 0};
}

inline shm::LossScalerState NextLossScaler(const shm::LossScalerState& s, bool found_inf,
                                           const core::LossScaling& c) {
  shm::LossScalerState n = s;
  n.step = s.step + 1;
  if (found_inf) {
    n.scale = static_cast<double>(static_cast<float>(s.scale * c.backoff_factor));
    n.growth_tracker = 0;
    n.skipped = s.skipped + 1;
    return n;
  }
  if (s.growth_tracker + 1 == c.growth_interval) {
    const float grown = static_cast<float>(s.scale * c.growth_factor);
    if (std::isfinite(grown)) n.scale = static_cast<double>(grown);
    n.growth_tracker = 0;
  } else {
    n.growth_tracker = s.growth_tracker + 1;
  }
  return n;
}

// How many steps after a step's own the scale it produced is first used: the workers of step s
// compute with the weights of version s (exact) or s - 1 (stale1), published once the norm of the
// step before that version is known, so step s's scale is the state after step s - 1 - lag.
inline int LossScaleLag(const core::ExecutionPlan& x) { return x.weight_version_lag; }

}  // namespace rp::coord
