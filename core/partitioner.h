// SPDX-License-Identifier: Apache-2.0
// The planner behind schedule.partition = "auto" and rp-plan.
//
// It searches the fused tail's size and the number of forward and backward stages; for each it
// tries the equal-layer split and the exact min-max split (dynamic programming over contiguous
// cuts, minimizing the slowest stage), simulates the round-robin schedule (core/simulator.h) with
// per-layer costs from a FLOP model, drops plans whose estimated per-worker memory exceeds
// schedule.gpu_memory_gb, and keeps the fastest (fewer stages on ties). Deterministic: every
// process of a run gets the same plan. Not yet: measured per-layer profiles and transfer times.
#pragma once

#include <vector>

#include "common/status.h"
#include "core/job_config.h"
#include "core/plan.h"

namespace rp::core {

struct PlanChoice {
  PipelinePlan plan;
  double step_seconds = 0.0;       // predicted, one step from idle, cost model
  double bubble_ratio = 0.0;       // predicted
  double peak_memory_bytes = 0.0;  // estimated, per worker
  double flops_per_second = 0.0;   // the rate the cost model assumed per worker
  int candidates = 0;              // plans evaluated
};

// Contiguous split of costs[0..n) into `parts` non-empty ranges minimizing the largest range
// sum; returns the start index of each range (first is 0). Exact.
std::vector<int> MinMaxPartition(const std::vector<double>& costs, int parts);

StatusOr<PlanChoice> ChoosePlan(const JobConfig& config, int workers);

// Estimated peak bytes on one worker for a plan: two stages' weights (current + prefetch), fp32
// gradient accumulators, and the activations a stage keeps for its backward.
double EstimatePeakMemory(const JobConfig& config, const PipelinePlan& plan);

}  // namespace rp::core
