// SPDX-License-Identifier: Apache-2.0
// Evaluations: the held-out loss (train.eval_every), one part of the coordinator, and the gate
// that keeps updates from overwriting weights an evaluation still reads.
//
// The eval after step s reads the weights holding s + 1 updates. Its jobs are dispatched when
// step s is done, before step s + 2's jobs, so in every worker's queue they precede every job
// that could wait on them. Until they are done the update that would overwrite the compute
// buffer they read (step s + compute_buffers') is held back: its gradient slots are final but
// the optimizer hears of it later, in order.
//
// Contract:
//  * Due(step) says whether an eval follows `step`; Expect(step) is called when the step is
//    dispatched, so that the gate holds from then on; Dispatch(step) sends its jobs (one per
//    eval microbatch, taking turns among the workers on their own counter so stage jobs keep
//    the phase the planner assumed).
//  * FinalizeSlot() is the only way a final gradient slot reaches the optimizer: at once, or
//    queued behind a held one. A held slot of a step a stop abandoned (>= stop_step) is dropped.
//  * Take(step) returns a finished eval's loss once (summed in eval-slot order, as rp-train-ref
//    does, so it does not depend on timing).
//  * Not thread-safe: owned by the coordinator's loop.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <optional>
#include <utility>

#include "common/status.h"
#include "config/job_config.h"
#include "optim/async_optimizer.h"
#include "coordinator/run_window.h"
#include "coordinator/worker_table.h"
#include "protocol/messages.h"
#include "shm/layout.h"

namespace rp::coord {

class Evaluations {
 public:
  Evaluations(const core::JobConfig& cfg, const shm::ArenaLayout& layout, const RunWindow& window,
              AsyncOptimizer& optimizer, WorkerTable& workers);

  bool Due(int64_t step) const;
  void Expect(int64_t step) { evals_[step]; }
  // `next_job_index` hands out indices from the run's one job counter.
  Status Dispatch(int64_t step, const std::function<int64_t()>& next_job_index);
  Status OnEvalDone(int rank, const proto::EvalDone& d);
  bool Finished(int64_t step) const;
  struct Result {
    double loss = 0.0;
    int64_t targets = 0;
  };
  std::optional<Result> Take(int64_t step);
  // Rank's eval jobs not yet done, by job index (a replacement gets them again, in order).
  std::map<int64_t, const proto::RunEval*> Unfinished(int rank) const;

  void FinalizeSlot(int64_t step, int slot);
  // The newest step the optimizer has been given a final slot of (-1: none).
  int64_t last_final_step() const { return last_final_step_; }

 private:
  bool UpdateHeld(int64_t step) const;
  void GiveToOptimizer(int64_t step, int slot);
  void ReleaseHeld();

  struct EvalJob {
    proto::RunEval run{};
    int worker = 0;
    bool done = false;
    double loss_sum = 0.0;
    int64_t targets = 0;
  };
  struct EvalState {
    std::map<int64_t, EvalJob> jobs;  // by job index
    int left = 0;
    double loss = -1.0;  // set when every job is done
    int64_t targets = 0;
  };

  const core::JobConfig& cfg_;
  const shm::ArenaLayout& layout_;
  const RunWindow& window_;
  AsyncOptimizer& optimizer_;
  WorkerTable& workers_;
  std::map<int64_t, EvalState> evals_;               // by step
  std::deque<std::pair<int64_t, int>> held_finals_;  // (step, slot) held back
  int64_t last_final_step_ = -1;
  int64_t jobs_dispatched_ = 0;
};

}  // namespace rp::coord
