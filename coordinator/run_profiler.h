// SPDX-License-Identifier: Apache-2.0
// RunProfiler: profiling and re-planning, one part of the coordinator. Over a window of
// schedule.profile_steps steps the workers time every layer (LayerTime) and the link
// (LinkProbe); when the window is reported and updated, the profile goes to
// OUTPUT_DIR/profile.json with a prediction for the plan in use. Afterwards measured step times
// are compared with the prediction (drift: three steps off by more than schedule.drift profile
// again). With schedule.partition = "auto" a search over every plan for the new profile runs on
// its own thread, and its verdict can ask the run to stop and resume on a faster plan.
//
// Contract:
//  * StartWindow() opens a window at `begin`; Profiled(step) says whether a step's jobs time their
//    layers (RunJob::profile).
//  * OnLayerTime() checks the report against its job (ProtocolError otherwise); OnMicrobatch()
//    takes a profiled microbatch's interval: what the layer times and the modelled transfers do
//    not explain is per-microbatch overhead, which the simulator adds to every stage.
//  * MaybeFinish() is called on every loop turn; it does its work once the window's last step is
//    reported and updated. The search calls `on_search_done` from its own thread once its result
//    is in (the coordinator wakes its loop with it).
//  * TakeBetterPlan() returns the search's verdict once, when it names a plan faster than the
//    prediction for the plan in use by schedule.replan_gain (or a test hook forces one).
//  * Not thread-safe apart from the search: owned by the coordinator's loop.
#pragma once

#include <cstdint>
#include <functional>
#include <future>
#include <map>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/status.h"
#include "config/job_config.h"
#include "config/model_spec.h"
#include "optim/async_optimizer.h"
#include "planning/partitioner.h"
#include "planning/plan.h"
#include "planning/profile.h"
#include "planning/simulator.h"
#include "protocol/messages.h"

namespace rp::coord {

class RunProfiler {
 public:
  RunProfiler(const core::JobConfig& cfg, const core::ExecutionPlan& execution,
              const core::ModelSpec& spec, const core::PipelinePlan& plan, int workers,
              std::function<void()> on_search_done);
  ~RunProfiler();  // waits for a search still running

  void StartWindow(int64_t begin, int64_t stop_step);
  bool Profiled(int64_t step) const { return step >= begin_ && step < end_; }

  Status OnLayerTime(const proto::RunJob& job, int microbatches, const proto::LayerTime& t);
  void OnMicrobatch(const proto::RunJob& job, int mb, double interval_s, bool layer_major);
  void OnLinkProbe(int rank, const proto::LinkProbe& p);

  Status MaybeFinish(int64_t next_to_report, const AsyncOptimizer& optimizer);
  std::optional<core::PlanChoice> TakeBetterPlan();
  bool searching() const { return search_.valid(); }
  // Joins the search's thread (its result stays for TakeBetterPlan).
  void WaitForSearch();

  // A reported step's time and bubble; `eval_nearby`: an evaluation's time lands in it, so it is
  // no measure of the plan.
  void OnStepReported(int64_t step, double step_time_s, double bubble_ratio, bool eval_nearby,
                      int64_t next_to_dispatch, int64_t stop_step);

  double predicted_step_s() const { return prediction_ ? prediction_->step_seconds : 0.0; }
  int profiles_written() const { return profiles_written_; }
  // The prediction against the measured medians, for summary.json (null without a prediction).
  nlohmann::json Summary() const;

 private:
  const core::JobConfig& cfg_;
  // schedule.partition = "auto" with a replan_gain: a fresh profile starts a plan search.
  const bool replans_;
  // What the optimizer's passes move, for the profile's record of the pass its rate timed.
  const core::UpdatePassBytes pass_bytes_;
  const core::ModelSpec& spec_;
  const core::PipelinePlan& plan_;
  int workers_;
  std::function<void()> on_search_done_;
  core::ProfileBuilder builder_;
  std::vector<core::SimStage> sim_stages_;  // per stage: transfer volumes (explain mb intervals)
  int64_t begin_ = -1, end_ = -1;           // steps [begin, end) are timed
  bool pending_ = false;
  std::map<std::pair<int64_t, int>, double> mb_layer_seconds_;  // (job, mb) -> timed compute
  std::optional<core::PlanChoice> prediction_;  // the plan in use, from the newest profile
  int64_t predicted_from_ = -1;                 // steps from here on are compared with it
  std::pair<int64_t, int64_t> predicted_window_{-1,
                                                -1};  // the steps its profile timed, [begin, end)
  std::vector<double> measured_step_s_, measured_bubble_;
  int drift_streak_ = 0;
  int profiles_written_ = 0;
  // The planner's search over every plan for the newest profile (partition = auto). It runs on
  // its own thread: a search over a real job's thousand-odd plans takes a tenth of a second of a
  // core, which, run on the loop, held back the workers' next inputs and commits that long.
  // The result is set before on_search_done runs, so the woken loop finds it.
  std::future<StatusOr<core::PlanChoice>> search_;
  std::thread search_thread_;
};

}  // namespace rp::coord
