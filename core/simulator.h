// SPDX-License-Identifier: Apache-2.0
// Simulator of the round-robin schedule: predicts makespan and bubble ratio of a step.
//
// Model (the runtime's rules, in pure form): a step is K calls of the stage chain; job k (counted
// over calls) runs on worker k mod N; each job processes microbatches 0..M-1 in order; microbatch
// m of job k starts when (a) microbatch m of the previous job in its call's chain is done, (b) the
// job's own microbatch m-1 is done, and (c) for m = 0, the worker's previous job is done. Calls
// depend on each other only through the workers (the optimizer, transfers and slot reuse are not
// modelled). Pure and deterministic.
#pragma once

#include <cstdint>
#include <vector>

#include "core/job_config.h"
#include "core/plan.h"

namespace rp::core {

struct SimResult {
  double makespan = 0.0;
  std::vector<double> busy;  // per worker
  double bubble_ratio = 0.0; // idle / (N x makespan)
};

// stage_time[s]: seconds per microbatch of chain stage s.
SimResult SimulateRoundRobin(const std::vector<double>& stage_time, int workers, int microbatches,
                             int calls);

// Relative per-microbatch cost of each stage of `plan` from FLOPs (forward 1x, recompute + backward
// 3x, the fused tail's forward + backward 3x; attention counted): a cost model for planning
// without a profile.
std::vector<double> StageFlops(const JobConfig& cfg, const PipelinePlan& plan);

}  // namespace rp::core
