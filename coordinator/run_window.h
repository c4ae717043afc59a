// SPDX-License-Identifier: Apache-2.0
// RunWindow: where the run stands, shared read-only by the coordinator's parts. Only the
// coordinator's loop writes it.
#pragma once

#include <cstdint>

#include "config/job_config.h"

namespace rp::coord {

struct RunWindow {
  int64_t first_step = 0;        // steps done before this invocation (resume)
  int64_t stop_step = 0;         // this invocation runs steps [first_step, stop_step)
  int64_t next_to_dispatch = 0;  // the next step whose jobs go out
  int64_t next_to_report = 0;    // the oldest step not yet written to metrics.jsonl
};

// A periodic training checkpoint is due after step t (0-based) completes.
inline bool PeriodicCheckpointAfter(const core::JobConfig& cfg, int64_t t) {
  return cfg.checkpoint.every > 0 && (t + 1) % cfg.checkpoint.every == 0;
}

}  // namespace rp::coord
