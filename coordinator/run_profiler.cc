// SPDX-License-Identifier: Apache-2.0
#include "coordinator/run_profiler.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>

#include "common/logging.h"
#include "common/test_hooks.h"
#include "io/run_output.h"
#include "shm/layout.h"

namespace rp::coord {

RunProfiler::RunProfiler(const core::JobConfig& cfg, const core::ExecutionPlan& execution,
                         const core::ModelSpec& spec, const core::PipelinePlan& plan, int workers,
                         std::function<void()> on_search_done)
    : cfg_(cfg),
      replans_(execution.planner_chooses_partition && cfg.schedule.replan_gain > 0),
      pass_bytes_(core::UpdateBytesPerParam(cfg, execution)),
      spec_(spec),
      plan_(plan),
      workers_(workers),
      on_search_done_(std::move(on_search_done)),
      builder_(plan.num_layers),
      sim_stages_(
          core::BuildSimInput(cfg, spec, plan, core::DefaultCostModel(cfg), workers, 1).stages) {}

RunProfiler::~RunProfiler() { WaitForSearch(); }

void RunProfiler::WaitForSearch() {
  if (search_thread_.joinable()) search_thread_.join();
}

void RunProfiler::StartWindow(int64_t begin, int64_t stop_step) {
  begin_ = begin;
  end_ = std::min(begin + cfg_.schedule.profile_steps, stop_step);
  pending_ = end_ > begin_;
  if (pending_)
    RP_LOG(INFO) << "profiling steps " << begin_ + 1 << "-" << end_ << " (per-layer times for "
                 << cfg_.job.output_dir << "/profile.json)";
}

Status RunProfiler::OnLayerTime(const proto::RunJob& job, int microbatches,
                                const proto::LayerTime& t) {
  const core::Stage& stage = plan_.stages[job.stage];
  if (!job.profile || t.layer < stage.begin || t.layer >= stage.end || t.microbatch < 0 ||
      t.microbatch >= microbatches || !(t.seconds >= 0))
    return Status::ProtocolError("LayerTime for job " + std::to_string(t.job_index) + " layer " +
                                 std::to_string(t.layer) + " microbatch " +
                                 std::to_string(t.microbatch) +
                                 " does not fit the job (not profiled, or out of range)");
  builder_.AddLayer(t.layer, t.phase, t.seconds, static_cast<double>(t.saved_bytes));
  mb_layer_seconds_[{t.job_index, t.microbatch}] += t.seconds;
  return Status::Ok();
}

void RunProfiler::OnMicrobatch(const proto::RunJob& job, int mb, double interval_s,
                               bool layer_major) {
  if (!job.profile) return;
  // A layer-major job's microbatches have no intervals of their own to take the overhead from;
  // the term then comes from the other stages' microbatches (with auto's plans on the H200
  // profiles: tail and backward stages only) and is applied to every stage.
  const auto key = std::make_pair(job.job_index, mb);
  if (!layer_major)
    builder_.AddMicrobatch(interval_s,
                           mb_layer_seconds_[key] + core::TransferSeconds(sim_stages_[job.stage],
                                                                          builder_.H2dBytesPerS(),
                                                                          builder_.D2hBytesPerS()));
  mb_layer_seconds_.erase(key);
}

void RunProfiler::OnLinkProbe(int rank, const proto::LinkProbe& p) {
  if (!(p.h2d_bytes_per_s >= 0) || !(p.d2h_bytes_per_s >= 0)) {
    RP_LOG(WARNING) << "dropped a LinkProbe with negative rates from worker " << rank;
    return;
  }
  builder_.AddLink(p.h2d_bytes_per_s, p.d2h_bytes_per_s);
  RP_LOG(INFO) << "worker " << rank << " host link: " << p.h2d_bytes_per_s / 1e9 << " GB/s in, "
               << p.d2h_bytes_per_s / 1e9 << " GB/s out (" << (p.probe_bytes >> 20)
               << " MiB probe)";
}

Status RunProfiler::MaybeFinish(int64_t next_to_report, const AsyncOptimizer& optimizer) {
  if (!pending_ || next_to_report < end_ || !optimizer.Updated(end_ - 1)) return Status::Ok();
  pending_ = false;
  // The optimizer's rate: parameters updated over the time the pool was busy with them (the
  // union of the per-layer spans; layers of one step may overlap).
  std::vector<double> owned(plan_.num_layers, 0.0);
  for (const auto& p : spec_.params) owned[p.owner_layer] += static_cast<double>(p.numel);
  for (int64_t t = begin_; t < end_; ++t) {
    auto spans = optimizer.SpansOfStep(t);
    std::sort(spans.begin(), spans.end(),
              [](const auto& a, const auto& b) { return a.start_us < b.start_us; });
    double busy = 0.0, params = 0.0;
    int64_t covered = std::numeric_limits<int64_t>::min();
    for (const auto& sp : spans) {
      const int64_t from = std::max(sp.start_us, covered);
      if (sp.end_us > from) busy += static_cast<double>(sp.end_us - from) * 1e-6;
      covered = std::max(covered, sp.end_us);
      params += owned[sp.layer];
    }
    builder_.AddOptimizer(params, busy, pass_bytes_.Publishing(optimizer.TwoPasses()));
    builder_.AddStep();
  }
  auto profile = builder_.Build(cfg_);
  if (!profile.ok()) {
    RP_LOG(WARNING) << "no profile written: " << profile.status().message();
    return Status::Ok();
  }
  const std::string path = cfg_.job.output_dir + "/profile.json";
  RP_RETURN_IF_ERROR(core::SaveProfile(path, *profile));
  profiles_written_++;
  prediction_ = core::PredictPlan(cfg_, plan_, *profile, workers_);
  predicted_from_ = end_;
  predicted_window_ = {begin_, end_};
  measured_step_s_.clear();
  measured_bubble_.clear();
  drift_streak_ = 0;
  RP_LOG(INFO) << "profile of steps " << begin_ + 1 << "-" << end_ << " written to " << path
               << "; prediction for " << plan_.Describe() << ": step " << prediction_->step_seconds
               << " s, bubble " << 100.0 * prediction_->bubble_ratio << "%, peak memory per worker "
               << prediction_->peak_memory_bytes / 1e9 << " GB";
  if (!replans_) return Status::Ok();
  // A search for an older profile (drift) is waited for and dropped: the new one supersedes it.
  WaitForSearch();
  std::promise<StatusOr<core::PlanChoice>> result;
  search_ = result.get_future();
  search_thread_ = std::thread([result = std::move(result), cfg = cfg_, workers = workers_,
                                p = *profile, done = on_search_done_]() mutable {
    try {
      result.set_value(core::ChoosePlan(cfg, workers, p, shm::SharedBytesFor(workers)));
    } catch (const std::exception& e) {
      result.set_value(Status::Internal(std::string("the planner's search threw: ") + e.what()));
    }
    if (done) done();
  });
  return Status::Ok();
}

std::optional<core::PlanChoice> RunProfiler::TakeBetterPlan() {
  if (!search_.valid() || search_.wait_for(std::chrono::seconds(0)) != std::future_status::ready)
    return std::nullopt;
  StatusOr<core::PlanChoice> best = search_.get();
  if (!best.ok()) {
    RP_LOG(WARNING) << "no re-plan check for the new profile: " << best.status().message();
    return std::nullopt;
  }
  const bool always = TestAlwaysReplan() || TestReplanOnce();
  if (!always &&
      (best->plan.Describe() == plan_.Describe() ||
       best->step_seconds >= prediction_->step_seconds * (1.0 - cfg_.schedule.replan_gain)))
    return std::nullopt;
  return std::move(best).value();
}

void RunProfiler::OnStepReported(int64_t step, double step_time_s, double bubble_ratio,
                                 bool eval_nearby, int64_t next_to_dispatch, int64_t stop_step) {
  if (!prediction_ || step < predicted_from_) return;
  // A step's time runs from the previous step's report to its own, so it holds part of the next
  // step's work (stale1 overlaps them; exact mode starts the next forward behind the update),
  // except for the last step of the run: measured alone it reads short (about a fifth, on a
  // stale1 job), so it joins the medians only when nothing else did.
  if (step + 1 == stop_step && !measured_step_s_.empty()) return;
  measured_bubble_.push_back(bubble_ratio);
  if (eval_nearby || pending_) return;
  measured_step_s_.push_back(step_time_s);
  if (cfg_.schedule.drift <= 0 || cfg_.schedule.profile_steps <= 0) return;
  const double off = std::abs(step_time_s / prediction_->step_seconds - 1.0);
  drift_streak_ = off > cfg_.schedule.drift ? drift_streak_ + 1 : 0;
  if (drift_streak_ < 3) return;
  RP_LOG(WARNING) << "step times drifted from the prediction (" << step_time_s << " s measured, "
                  << prediction_->step_seconds
                  << " s predicted, 3 steps in a row): profiling again";
  builder_.Clear();
  StartWindow(next_to_dispatch, stop_step);
}

nlohmann::json RunProfiler::Summary() const {
  if (!prediction_) return nullptr;
  const double measured = core::Median(measured_step_s_);
  if (measured > 0)
    RP_LOG(INFO) << "step time: measured " << measured << " s (median of "
                 << measured_step_s_.size() << " steps), predicted " << prediction_->step_seconds
                 << " s (" << 100.0 * (measured / prediction_->step_seconds - 1.0) << "%)";
  return {{"plan", prediction_->plan.Describe()},
          {"costs", prediction_->cost_source},
          {"profiled_steps", {predicted_window_.first + 1, predicted_window_.second}},
          {"predicted_step_s", prediction_->step_seconds},
          {"predicted_bubble_ratio", prediction_->bubble_ratio},
          {"predicted_peak_memory_bytes", prediction_->peak_memory_bytes},
          {"measured_steps", measured_step_s_.size()},
          {"measured_median_step_s", measured},
          {"measured_median_bubble_ratio", core::Median(measured_bubble_)},
          {"measured_over_predicted", measured > 0 ? measured / prediction_->step_seconds : -1.0}};
}

}  // namespace rp::coord
