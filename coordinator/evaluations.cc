// SPDX-License-Identifier: Apache-2.0
#include "coordinator/evaluations.h"

#include <algorithm>

#include "planning/plan.h"

namespace rp::coord {

Evaluations::Evaluations(const core::JobConfig& cfg, const shm::ArenaLayout& layout,
                         const RunWindow& window, AsyncOptimizer& optimizer, WorkerTable& workers)
    : cfg_(cfg), layout_(layout), window_(window), optimizer_(optimizer), workers_(workers) {}

bool Evaluations::Due(int64_t step) const {
  const int64_t every = cfg_.train.eval_every;
  return every > 0 && step < window_.stop_step &&
         ((step + 1) % every == 0 || step + 1 == cfg_.train.steps);
}

Status Evaluations::Dispatch(int64_t step, const std::function<int64_t()>& next_job_index) {
  EvalState& e = evals_[step];
  // Several nodes may split the eval microbatches: this node's block of the slots.
  int first = 0, count = layout_.eval_slots;
  if (core::EvalSplitAcrossNodes(cfg_)) {
    count /= static_cast<int>(cfg_.nodes.count);
    first = static_cast<int>(cfg_.nodes.rank) * count;
  }
  for (int k = first; k < first + count; ++k) {
    EvalJob j;
    j.run = proto::RunEval{next_job_index(), step, step + 1, k, 0};
    j.worker = core::WorkerForJob(jobs_dispatched_++, 0, workers_.size());
    RP_RETURN_IF_ERROR(workers_.Send(j.worker, j.run));
    e.jobs.emplace(j.run.job_index, j);
  }
  e.left = count;
  return Status::Ok();
}

Status Evaluations::OnEvalDone(int rank, const proto::EvalDone& d) {
  for (auto& [step, e] : evals_) {
    auto it = e.jobs.find(d.job_index);
    if (it == e.jobs.end()) continue;
    EvalJob& j = it->second;
    if (j.worker != rank || j.done)
      return Status::ProtocolError(
          "EvalDone for eval job " + std::to_string(d.job_index) + " from worker " +
          std::to_string(rank) + (j.done ? ", which is already done" : ", which does not run it"));
    j.done = true;
    j.loss_sum = d.loss_sum;
    j.targets = d.targets;
    if (--e.left > 0) return Status::Ok();
    // The set has targets: HostState::Fill checked it, and it is the same at every evaluation.
    double sum = 0.0;
    for (const auto& [index, job] : e.jobs) {
      sum += job.loss_sum;
      e.targets += job.targets;
    }
    e.loss = sum / static_cast<double>(e.targets);
    ReleaseHeld();
    return Status::Ok();
  }
  return Status::ProtocolError("EvalDone for unknown eval job " + std::to_string(d.job_index));
}

bool Evaluations::Finished(int64_t step) const {
  auto it = evals_.find(step);
  return it != evals_.end() && it->second.loss >= 0;
}

std::optional<Evaluations::Result> Evaluations::Take(int64_t step) {
  auto it = evals_.find(step);
  if (it == evals_.end() || it->second.loss < 0) return std::nullopt;
  Result r{it->second.loss, it->second.targets};
  evals_.erase(it);
  return r;
}

std::map<int64_t, const proto::RunEval*> Evaluations::Unfinished(int rank) const {
  std::map<int64_t, const proto::RunEval*> out;
  for (const auto& [step, e] : evals_)
    for (const auto& [index, j] : e.jobs)
      if (j.worker == rank && !j.done) out.emplace(index, &j.run);
  return out;
}

bool Evaluations::UpdateHeld(int64_t step) const {
  // Step u's update writes compute buffer (u + 1) % B; an eval after step s reads (s + 1) % B.
  for (const auto& [s, e] : evals_)
    if (e.loss < 0 && step >= s + layout_.compute_buffers) return true;
  return false;
}

void Evaluations::FinalizeSlot(int64_t step, int slot) {
  // Once one is held, later ones queue behind it: the optimizer takes steps in order.
  if (!held_finals_.empty() || UpdateHeld(step)) {
    held_finals_.emplace_back(step, slot);
    return;
  }
  GiveToOptimizer(step, slot);
}

void Evaluations::GiveToOptimizer(int64_t step, int slot) {
  optimizer_.SlotFinal(step, slot);
  last_final_step_ = std::max(last_final_step_, step);
}

void Evaluations::ReleaseHeld() {
  while (!held_finals_.empty() && !UpdateHeld(held_finals_.front().first)) {
    const auto [step, slot] = held_finals_.front();
    held_finals_.pop_front();
    // A stop (signal, re-plan) moved stop_step below it: that step is abandoned, and its update
    // must not reach the checkpoint written at the stop.
    if (step >= window_.stop_step) continue;
    GiveToOptimizer(step, slot);
  }
}

}  // namespace rp::coord
