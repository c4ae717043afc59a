// SPDX-License-Identifier: Apache-2.0
// HostState: the run's host memory, one part of the coordinator. It creates the state segment
// (what workers fetch: compute copies or the fp32 masters, layer versions, token, activation and
// gradient slots) and the optimizer segment (masters unless workers fetch them, moments), and
// fills them once: from a training checkpoint on resume, else from model.path, lora.init_from or
// the seeded init.
//
// Contract:
//  * Create() checks that /dev/shm has room for both segments (and the workers' pools) before it
//    creates anything. Both names are removed when the HostState is destroyed, after the
//    mappings, on every path (shm::Unlinker): this process is the only one that unlinks them.
//  * Fill() runs once, before any worker is welcomed, and sets the header's ready flag last.
//  * Weights(p, version) and ReadFrozen(f) read the current weights (for the export at the end).
//  * Not thread-safe: the coordinator's loop owns it. The optimizer writes the segments through
//    the pointers state().data() and optim().data().
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/status.h"
#include "config/job_config.h"
#include "config/model_spec.h"
#include "coordinator/checkpoint_writer.h"
#include "optim/grad_arena.h"
#include "optim/training_state.h"
#include "io/data.h"
#include "planning/plan.h"
#include "shm/layout.h"
#include "shm/segment.h"

namespace rp::coord {

class HostState {
 public:
  // `cfg`, `spec`, `plan` and `layout` must outlive the HostState.
  static StatusOr<std::unique_ptr<HostState>> Create(const core::JobConfig& cfg,
                                                     const core::ModelSpec& spec,
                                                     const core::PipelinePlan& plan,
                                                     const shm::ArenaLayout& layout,
                                                     const std::string& run_id, int workers);

  // `resume_from`: the checkpoint to load (its hash must be `state_hash`), holding `first_step`
  // updates; without it a fresh start. `eval_data` fills the eval slots (null: no eval set).
  Status Fill(const std::optional<StateFile>& resume_from, uint64_t state_hash, int64_t first_step,
              core::Dataset* eval_data);

  // Parameter p's whole fp32 weights holding `version` updates (the run's last): the masters (in
  // the optimizer segment, or in the state segment when workers fetch them). With sharded state
  // the optimizer segment holds this node's share only, and the compute copy of that version,
  // gathered from every node and fp32 (sharded state needs fp32, core::CheckNodes), is read.
  const float* Weights(int p, int64_t version) const;
  // Frozen parameter f (LoRA base) as fp32, from its compute copy.
  void ReadFrozen(int f, float* out) const;
  // What a training checkpoint holds (optim/training_state.h).
  std::vector<StateSection> Sections();
  // Per parameter, where its bytes lie in Sections() (master, moments, each compute-copy buffer):
  // what a partial checkpoint copy holds back parameter by parameter. Empty with sharded state,
  // whose compute shares are packed.
  std::vector<std::vector<CheckpointWriter::Placement>> Placements() const;

  shm::Segment& state() { return *state_; }
  shm::Segment& optim() { return *optim_; }
  GradArena& grad_arena() { return *grad_arena_; }

 private:
  HostState(const core::JobConfig& cfg, const core::ModelSpec& spec, const core::PipelinePlan& plan,
            const shm::ArenaLayout& layout, const std::string& run_id);
  Status FillFresh();

  const core::JobConfig& cfg_;
  const core::ModelSpec& spec_;
  const core::PipelinePlan& plan_;
  const shm::ArenaLayout& layout_;
  shm::Unlinker state_unlinker_, optim_unlinker_;  // declared before the segments: unmapped first
  std::optional<shm::Segment> state_, optim_;
  std::unique_ptr<GradArena> grad_arena_;
};

}  // namespace rp::coord
