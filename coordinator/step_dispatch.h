// SPDX-License-Identifier: Apache-2.0
// StepDispatch: the stage jobs of the steps in flight, one part of the coordinator. It sends each
// step's jobs round-robin (stage job k runs on worker k mod N, planning/plan.h), feeds each call's
// token slots when their previous contents are consumed, forwards a finished microbatch's
// readiness to the next stage's job, and grants gradient commits in an order that makes the sums
// independent of timing.
//
// Steps overlap: step t + 1 is dispatched while step t drains, and its stages start as soon as
// their layers' weights reach the version they need.
//
// Contract:
//  * Dispatch(step) sends the step's RunJobs in core::StepJobOrder. Indices come from one counter
//    shared with the evaluations (TakeJobIndex), so every worker's queue order is the index
//    order. TryFeed() fills the token slots of every dispatched call whose slots are free
//    (RunWindow::next_to_dispatch says which calls are dispatched); call it after Dispatch and
//    whenever a job is retired.
//  * TryCommits() grants CommitGrads: per stage in call order (the first overwrites, later ones
//    add); a step's first commit of a stage only once the previous step's update has given that
//    stage's slots back (in stale1 mode, and before a checkpoint, once the whole previous update
//    is done; with device updates, once its first passes are all done), and only when the
//    gradient arena has room; with gradients waiting in the workers
//    (ExecutionPlan::gradients_wait_in_workers), none of a step's before every gradient job of it
//    has written its squares and the optimizer has the norm, and then first layers first, except
//    that stages inside the device-updated blocks (ExecutionPlan::device_update_blocks) go last.
//    Called on every loop turn.
//  * OnJobDone() checks and marks a job done and returns it; the coordinator acts on its
//    finality (checkpoint, final slots), then calls Retire(), which says whether the step is done.
//  * Resend() gives a replacement worker its rank's unfinished jobs and eval jobs in index order,
//    with the inputs that are already in place; an accumulating commit cut short stops the run.
//  * Every message naming a job is checked against the jobs in flight and the rank that runs
//    them (ProtocolError otherwise). Not thread-safe: owned by the coordinator's loop.
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <utility>
#include <vector>

#include "common/status.h"
#include "config/job_config.h"
#include "config/model_spec.h"
#include "optim/grad_arena.h"
#include "coordinator/input_routing.h"
#include "optim/async_optimizer.h"
#include "coordinator/run_profiler.h"
#include "coordinator/run_window.h"
#include "coordinator/worker_table.h"
#include "io/data.h"
#include "planning/plan.h"
#include "protocol/messages.h"
#include "shm/layout.h"
#include "shm/segment.h"

namespace rp::coord {

// One stage job of a step in flight.
struct StageJob {
  int64_t index = 0;  // the run's job counter
  int64_t step = 0;
  int call = 0;  // call inside the step
  int stage = 0;
  int worker = 0;
  int next_mb = 0;  // microbatches reported done
  int mb_hw = 0;    // most microbatches ever reported: a replacement re-running the job replays
                    // [0, mb_hw) without counting or forwarding them again
  bool slots_placed = false;  // its gradient slots are in the arena (placed once, kept on re-runs)
  proto::RunJob run{};        // as sent, for re-dispatch
  bool grads_ready = false;
  bool commit_sent = false;
  bool done = false;
  int64_t start_us = 0, fetch_end_us = 0, end_us = 0;
  std::vector<std::pair<int64_t, int64_t>> mb_times;
};

// What the coordinator reports of a step.
struct StepProgress {
  std::vector<int64_t> job_at;  // [call * stages + stage] -> job index (core::StepJobOrder)
  double loss_scale = 0.0;
  double loss_sum = 0.0;
  int64_t targets = 0;
  int jobs_done = 0;
  double busy_s = 0.0;
  double done_at = -1.0;    // all jobs done (monotonic seconds)
  bool norm_given = false;  // gradients wait in the workers: the optimizer has the step's norm
};

class StepDispatch {
 public:
  // Everything it reads or drives; all of it outlives the StepDispatch.
  struct Parts {
    const core::JobConfig& cfg;
    const core::ExecutionPlan& execution;
    const core::RoundShape& round;
    const core::ModelSpec& spec;
    const core::PipelinePlan& plan;
    const shm::ArenaLayout& layout;
    shm::Segment& state;
    core::Dataset& data;
    GradArena& grads;
    AsyncOptimizer& optimizer;
    WorkerTable& workers;
    RunProfiler& profiler;
    const RunWindow& window;
  };
  explicit StepDispatch(Parts parts);

  int64_t TakeJobIndex() { return job_counter_++; }
  Status Dispatch(int64_t step);
  Status TryFeed();
  Status TryCommits();

  StatusOr<StageJob*> Find(int rank, int64_t index, const char* what);
  Status OnMicrobatchDone(int rank, const proto::MicrobatchDone& d);
  Status OnGradsReady(int rank, const proto::GradsReady& g);
  StatusOr<StageJob> OnJobDone(int rank, const proto::JobDone& d);
  StatusOr<bool> Retire(const StageJob& job);
  Status Resend(int rank, std::map<int64_t, const proto::RunEval*> evals);

  // Null once the step is forgotten (reported).
  StepProgress* Progress(int64_t step);
  // Stage jobs that ran layer by layer over their microbatches (for summary.json).
  int64_t layer_major_jobs() const { return layer_major_jobs_; }
  // Stage and eval jobs sent again to replacement workers.
  int64_t jobs_redispatched() const { return jobs_redispatched_; }
  void Forget(int64_t step) { steps_.erase(step); }

 private:
  // RP_TEST_POISON_CHECKPOINT (common/test_hooks.h): after microbatch `mb` of a forward job.
  void PoisonCheckpointForTest(const StageJob& job, int mb);
  int64_t JobIndex(int64_t step, int call, int stage) const {
    return steps_.at(step).job_at[static_cast<size_t>(call) * parts_.plan.stages.size() + stage];
  }
  Status FeedCall(int64_t global_call);
  // The rows of `step`'s input tokens over all its calls, ascending (core::SortedTokenRows).
  std::vector<int64_t> StepRows(int64_t step);
  Status TryCommitsOf(int64_t step);
  bool FirstCommitMayGo(int64_t step, int stage) const;
  // ExecutionPlan::gradients_wait_in_workers: true once every gradient job of `step` has reported
  // its squares; the first time, adds them up (the optimizer's order) and gives the optimizer the
  // norm.
  bool NormFromWorkers(int64_t step);
  std::vector<int> StageGradSlots(int stage) const;

  Parts parts_;
  InputRouting routing_;
  std::map<int64_t, StepProgress> steps_;
  std::map<int64_t, StageJob> jobs_;       // by job index
  std::map<int64_t, int> call_jobs_done_;  // by global call index
  std::set<int64_t> fed_calls_;
  // The current step's input token rows over the calls fed so far (AsyncOptimizer::SetTouchedRows).
  std::set<int64_t> step_rows_;
  int64_t job_counter_ = 0;            // stage and eval jobs share it: one queue order
  int64_t stage_jobs_dispatched_ = 0;  // stage job k runs on worker k mod N
  int64_t layer_major_jobs_ = 0, jobs_redispatched_ = 0;
};

}  // namespace rp::coord
