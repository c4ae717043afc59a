// SPDX-License-Identifier: Apache-2.0
// The gradient arena's size: a pure function of the job, its model and its plan, shared by the
// shared-memory layout (shm::ComputeLayout places the arena) and the schedule simulator (a
// streamed arena delays commits that wait for the norm).
//
// A slot is placed when the commit that first writes it in a step is granted and released when
// its parameter's update is done. The arena must hold every slot at once when a slot stays live
// across the whole step: with gradient clipping (no update may start before the global norm,
// i.e. before the last gradient) unless the gradients wait for it in the workers, or with K > 1
// accumulation calls (a stage's slots take a commit per call). Otherwise updates follow the
// backward pass stage by stage and the arena needs only the largest stage's slots plus the slots
// a tied parameter keeps until its last use (the LM head's gradient waits for the embedding's);
// `auto` (optimizer.grad_buffer_mb = 0) doubles the stage part so one stage can commit while the
// previous stage's update runs.
#pragma once

#include <cstdint>
#include <vector>

#include "common/status.h"
#include "config/execution_plan.h"
#include "config/job_config.h"
#include "config/model_spec.h"
#include "planning/plan.h"

namespace rp::core {

// The arena's placement unit: every offset and size in it is a multiple of this.
inline constexpr uint64_t kGradArenaAlign = 4096;

// fp32 bytes of gradient slot `slot`, 256-aligned: what the arena places for it (a compact
// lookup slot holds only its rows, CompactLookupRows; sharded gradients this node's share).
uint64_t GradSlotBytes(const JobConfig& config, const ExecutionPlan& execution,
                       const ModelSpec& spec, int slot);

struct GradArenaSizing {
  uint64_t all_slots = 0;  // every slot at once (no streaming)
  uint64_t minimum = 0;    // smallest arena that always makes progress
  uint64_t chosen = 0;     // what the layout uses, a multiple of kGradArenaAlign
  uint64_t shared = 0;     // of those, the tied parameters' slots, held until their last use
  bool must_hold_all = false;
};
// Fails for an explicit optimizer.grad_buffer_mb below the minimum, naming why. With
// `stage_bytes_by_owner`, also what each stage's commit places in the arena (leaving out
// `shared`), per owner layer (the host releases them with that layer's update): one row of
// plan.num_layers entries per stage, zeros for a forward stage.
StatusOr<GradArenaSizing> SizeGradArena(
    const JobConfig& config, const ExecutionPlan& execution, const ModelSpec& spec,
    const PipelinePlan& plan, std::vector<std::vector<uint64_t>>* stage_bytes_by_owner = nullptr);

}  // namespace rp::core
