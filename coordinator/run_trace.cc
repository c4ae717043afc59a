// SPDX-License-Identifier: Apache-2.0
#include "coordinator/run_trace.h"

#include "io/run_output.h"

namespace rp::coord {

RunTrace::RunTrace(bool enabled, const core::PipelinePlan& plan, int64_t microbatches_per_round,
                   int workers)
    : enabled_(enabled),
      plan_(plan),
      microbatches_per_round_(microbatches_per_round),
      workers_(workers) {}

void RunTrace::AddJob(const TracedJob& j) {
  if (!enabled_) return;
  const auto& st = plan_.stages[j.stage];
  const std::string name = std::string(st.kind == core::StageKind::kForward    ? "F"
                                       : st.kind == core::StageKind::kBackward ? "B"
                                                                               : "T") +
                           std::to_string(j.stage);
  nlohmann::json args = {{"job_index", j.index},
                         {"step", j.step},
                         {"call", j.call},
                         {"stage", j.stage},
                         {"kind", core::StageKindName(st.kind)},
                         {"layers", {st.begin, st.end}},
                         {"microbatches", microbatches_per_round_},
                         {"worker_rank", j.worker},
                         {"worker_pid", j.worker_pid},
                         {"fetch_us", j.fetch_end_us - j.start_us}};
  events_.push_back({{"name", name},
                     {"cat", "job"},
                     {"ph", "X"},
                     {"ts", j.start_us},
                     {"dur", j.end_us - j.start_us},
                     {"pid", j.worker + 1},
                     {"tid", 0},
                     {"args", args}});
  for (size_t m = 0; m < j.microbatches.size(); ++m) {
    const auto& [start, end] = j.microbatches[m];
    events_.push_back({{"name", name + "/mb" + std::to_string(m)},
                       {"cat", "microbatch"},
                       {"ph", "X"},
                       {"ts", start},
                       {"dur", end - start},
                       {"pid", j.worker + 1},
                       {"tid", 1},
                       {"args", {{"job_index", j.index}, {"microbatch", m}}}});
  }
}

void RunTrace::AddOptimizerSpans(const std::vector<AsyncOptimizer::LayerSpan>& spans) {
  if (!enabled_) return;
  for (const auto& s : spans)
    events_.push_back({{"name", "update layer " + std::to_string(s.layer)},
                       {"cat", "optimizer"},
                       {"ph", "X"},
                       {"ts", s.start_us},
                       {"dur", s.end_us - s.start_us},
                       {"pid", 0},
                       {"tid", 0},
                       {"args", {{"step", s.step}, {"layer", s.layer}}}});
}

Status RunTrace::Write(const std::string& path, int coordinator_pid,
                       const std::vector<int>& worker_pids) const {
  if (!enabled_) return Status::Ok();
  nlohmann::json events = nlohmann::json::array();
  events.push_back(
      {{"name", "process_name"},
       {"ph", "M"},
       {"pid", 0},
       {"args", {{"name", "coordinator (pid " + std::to_string(coordinator_pid) + ")"}}}});
  for (int w = 0; w < workers_; ++w) {
    const int pid = w < static_cast<int>(worker_pids.size()) ? worker_pids[w] : 0;
    events.push_back(
        {{"name", "process_name"},
         {"ph", "M"},
         {"pid", w + 1},
         {"args",
          {{"name", "worker " + std::to_string(w) + " (pid " + std::to_string(pid) + ")"}}}});
  }
  for (const auto& e : events_) events.push_back(e);
  const nlohmann::json doc = {{"traceEvents", events},
                              {"displayTimeUnit", "ms"},
                              {"otherData",
                               {{"coordinator_pid", coordinator_pid},
                                {"num_workers", workers_},
                                {"cursor0", 0},
                                {"plan", plan_.Describe()}}}};
  return core::WriteFileAtomically(path, doc.dump());
}

}  // namespace rp::coord
