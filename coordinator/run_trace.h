// SPDX-License-Identifier: Apache-2.0
// RunTrace: the run's timeline, one part of the coordinator. It is recorded as the coordinator
// hears of finished stage jobs and written as OUTPUT_DIR/trace.json (the Chrome / Perfetto trace
// event format) when the run ends.
//
// Contract:
//  * AddJob() records one stage job as a span on its worker's row (pid = rank + 1, thread 0),
//    with its step, call, stage, layers, microbatch count, worker and weight-fetch time, and each
//    of its microbatches as a span on thread 1. AddOptimizerSpans() records per-layer updates
//    on the coordinator's row (pid 0).
//  * Write() emits the process names (the coordinator's and each worker's pid), then every event
//    in the order recorded, and the plan and worker count under otherData; the file is replaced
//    atomically (io/run_output.h). With tracing off (metrics.trace = false) nothing is recorded
//    or written.
//  * Owned by the coordinator's loop: not thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/status.h"
#include "optim/async_optimizer.h"
#include "planning/plan.h"

namespace rp::coord {

// What the trace needs of a finished stage job (wall-clock microseconds).
struct TracedJob {
  int64_t index = 0;  // the run's job counter
  int64_t step = 0;
  int call = 0;
  int stage = 0;
  int worker = 0;
  int worker_pid = 0;
  int64_t start_us = 0, fetch_end_us = 0, end_us = 0;
  std::vector<std::pair<int64_t, int64_t>> microbatches;  // (start_us, end_us) each
};

class RunTrace {
 public:
  RunTrace(bool enabled, const core::PipelinePlan& plan, int64_t microbatches_per_round,
           int workers);

  void AddJob(const TracedJob& job);
  void AddOptimizerSpans(const std::vector<AsyncOptimizer::LayerSpan>& spans);
  Status Write(const std::string& path, int coordinator_pid,
               const std::vector<int>& worker_pids) const;

  bool enabled() const { return enabled_; }
  size_t events() const { return events_.size(); }

 private:
  bool enabled_;
  const core::PipelinePlan& plan_;
  int64_t microbatches_per_round_;
  int workers_;
  nlohmann::json events_ = nlohmann::json::array();
};

}  // namespace rp::coord
