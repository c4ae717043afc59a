// SPDX-License-Identifier: Apache-2.0
#include "coordinator/step_dispatch.h"

#include <algorithm>
#include <limits>

#include "common/logging.h"
#include "common/test_hooks.h"
#include "common/time_util.h"

namespace rp::coord {

StepDispatch::StepDispatch(Parts parts)
    : parts_(parts),
      routing_(parts.plan, parts.layout, static_cast<int>(parts.round.microbatches)) {}

StepProgress* StepDispatch::Progress(int64_t step) {
  auto it = steps_.find(step);
  return it == steps_.end() ? nullptr : &it->second;
}

StatusOr<StageJob*> StepDispatch::Find(int rank, int64_t index, const char* what) {
  auto it = jobs_.find(index);
  if (it == jobs_.end())
    return Status::ProtocolError(std::string(what) + " from worker " + std::to_string(rank) +
                                 " names job " + std::to_string(index) +
                                 ", which is not in flight");
  StageJob* j = &it->second;
  if (j->worker != rank)
    return Status::ProtocolError(std::string(what) + " for job " + std::to_string(index) +
                                 " came from worker " + std::to_string(rank) + ", but worker " +
                                 std::to_string(j->worker) + " runs it");
  return j;
}

Status StepDispatch::Dispatch(int64_t step) {
  const int64_t targets = parts_.data.CountStepTargets(step);
  if (targets == 0)
    return Status::InvalidArgument("data: step " + std::to_string(step) + " has no target tokens");
  StepProgress& st = steps_[step];
  st.loss_scale = 1.0 / static_cast<double>(targets);
  const int K = static_cast<int>(parts_.round.calls);
  const int S = static_cast<int>(parts_.plan.stages.size());
  st.job_at.assign(static_cast<size_t>(K) * S, -1);
  const int64_t version = std::max<int64_t>(0, step - parts_.execution.weight_version_lag);
  for (const auto [c, s] : core::StepJobOrder(parts_.plan, K, parts_.execution.interleave_calls)) {
    StageJob j;
    j.index = TakeJobIndex();
    j.step = step;
    j.call = c;
    j.stage = s;
    j.worker = core::WorkerForJob(stage_jobs_dispatched_++, 0, parts_.workers.size());
    j.run = proto::RunJob{j.index,
                          step,
                          c,
                          s,
                          static_cast<int32_t>((step * K + c) % parts_.layout.parities),
                          static_cast<int32_t>(parts_.round.microbatches),
                          st.loss_scale,
                          version,
                          parts_.profiler.Profiled(step) ? 1 : 0,
                          0};
    st.job_at[static_cast<size_t>(c) * S + s] = j.index;
    RP_RETURN_IF_ERROR(parts_.workers.Send(j.worker, j.run));
    jobs_.emplace(j.index, std::move(j));
  }
  return Status::Ok();
}

Status StepDispatch::FeedCall(int64_t g) {
  const int64_t K = parts_.round.calls;
  const int64_t step = g / K, call = g % K;
  const int parity = static_cast<int>(g % parts_.layout.parities);
  std::vector<const int64_t*> call_tokens;
  for (int mb = 0; mb < parts_.round.microbatches; ++mb) {
    int64_t* tokens = parts_.state.At<int64_t>(parts_.layout.TokenSlot(parity, mb));
    parts_.data.Fill(step, call, mb, tokens,
                     parts_.state.At<int64_t>(parts_.layout.LabelSlot(parity, mb)),
                     parts_.state.At<int64_t>(parts_.layout.PositionSlot(parity, mb)));
    call_tokens.push_back(tokens);
  }
  // Every row the embedding's lookup gradient can touch this step, given before any of its jobs
  // run. Collected call by call: with three calls or more a call's token slots are refilled (by
  // call + 2) before the step's last call is fed.
  if (call == 0) step_rows_.clear();
  const auto rows = core::SortedTokenRows(call_tokens, parts_.cfg.TokensPerMicrobatch(),
                                          parts_.cfg.model.vocab_size);
  if (parts_.cfg.nodes.count > 1) {
    // The gradient summed across the nodes touches every node's rows.
    if (call == 0) parts_.optimizer.SetTouchedRows(step, StepRows(step));
  } else if (K == 1) {
    parts_.optimizer.SetTouchedRows(step, rows);
  } else {
    step_rows_.insert(rows.begin(), rows.end());
    if (call == K - 1)
      parts_.optimizer.SetTouchedRows(step,
                                      std::vector<int64_t>(step_rows_.begin(), step_rows_.end()));
  }
  // Rows first (AsyncOptimizer): the next step's rows, known before this step's norm is.
  if (parts_.layout.lookup_from_host && call == K - 1 && step + 1 < parts_.window.stop_step)
    parts_.optimizer.SetTouchedRows(step + 1, StepRows(step + 1));
  const StageJob& first = jobs_.at(JobIndex(step, static_cast<int>(call), 0));
  for (int mb = 0; mb < parts_.round.microbatches; ++mb)
    RP_RETURN_IF_ERROR(parts_.workers.Send(first.worker, routing_.For(first.run, mb)));
  fed_calls_.insert(g);
  return Status::Ok();
}

std::vector<int64_t> StepDispatch::StepRows(int64_t step) {
  // Dataset::Fill is a pure function of (step, call, microbatch): drawing ahead changes nothing.
  // Every node's microbatches: the rows of the gradient summed across the nodes.
  const int64_t per_mb = parts_.cfg.TokensPerMicrobatch();
  const core::RoundShape whole = core::GlobalRound(parts_.cfg);
  const int64_t count = whole.calls * whole.microbatches;
  std::vector<int64_t> tokens(static_cast<size_t>(count * per_mb)),
      labels(static_cast<size_t>(per_mb));
  std::vector<const int64_t*> slots;
  for (int64_t i = 0; i < count; ++i) {
    int64_t* t = tokens.data() + i * per_mb;
    parts_.data.FillStepMicrobatch(step, i, t, labels.data());
    slots.push_back(t);
  }
  return core::SortedTokenRows(slots, per_mb, parts_.cfg.model.vocab_size);
}

Status StepDispatch::TryFeed() {
  // Global call g uses slot parity g % P, so it may be fed once call g - P is completely done.
  const int64_t K = parts_.round.calls;
  const int S = static_cast<int>(parts_.plan.stages.size());
  for (int64_t g = parts_.window.next_to_report * K; g < parts_.window.next_to_dispatch * K; ++g) {
    if (fed_calls_.count(g)) continue;
    auto prev = call_jobs_done_.find(g - parts_.layout.parities);
    const bool free = g < parts_.window.first_step * K + parts_.layout.parities ||
                      (prev != call_jobs_done_.end() && prev->second == S);
    if (!free) break;  // calls are fed in order
    RP_RETURN_IF_ERROR(FeedCall(g));
  }
  return Status::Ok();
}

std::vector<int> StepDispatch::StageGradSlots(int stage) const {
  std::vector<int> slots;
  const auto& st = parts_.plan.stages[stage];
  for (int l = st.begin; l < st.end; ++l)
    for (const auto& use : parts_.spec.layer_uses[l]) slots.push_back(use.grad_slot);
  return slots;
}

bool StepDispatch::FirstCommitMayGo(int64_t step, int stage) const {
  // The first commit of a step places the stage's slots: the previous step's update must have
  // given them back. In exact mode that is all it needs (the optimizer's second passes run while
  // this step computes, and each slot comes back when its parameter's update is complete). In
  // stale1 mode, and before a checkpoint (which must hold step - 1 whole and nothing of this
  // step), the whole previous update must be complete.
  if ((!parts_.execution.NextStepWaitsForUpdate() ||
       PeriodicCheckpointAfter(parts_.cfg, step - 1)) &&
      !parts_.optimizer.Updated(step - 1))
    return false;
  // Device updates: the step's forward took the covered blocks from the worker, not from the
  // host's update, so nothing else orders this commit after that update; the optimizer takes a
  // step's first slot only once the previous step is published.
  if (parts_.execution.device_update_blocks > 0 && !parts_.optimizer.Published(step - 1))
    return false;
  // Also when Updated: the optimizer counts a parameter just before it gives its slots back.
  for (int slot : StageGradSlots(stage))
    if (parts_.grads.IsPlaced(slot)) return false;
  return true;
}

Status StepDispatch::TryCommits() {
  for (const auto& [step, progress] : steps_) RP_RETURN_IF_ERROR(TryCommitsOf(step));
  return Status::Ok();
}

Status StepDispatch::TryCommitsOf(int64_t step) {
  // Gradients of one stage are written in call order (the first overwrites, later ones add), so
  // the float sums do not depend on which worker finishes first.
  const int S = static_cast<int>(parts_.plan.stages.size());
  const int positions = S * static_cast<int>(parts_.round.calls);
  // Gradients waiting in the workers are all ready once the norm is known (one round per step):
  // granted from the last stage back, so the first layers, which the next step's forward needs
  // first, are committed and updated first.
  // With device updates (ExecutionPlan::device_update_blocks) the stages inside blocks 1..N go
  // after all others: the worker updates those blocks itself, and the host's copy is wanted later.
  const bool first_layers_first = parts_.execution.gradients_wait_in_workers;
  if (first_layers_first && !NormFromWorkers(step)) return Status::Ok();
  const int device_blocks = parts_.execution.device_update_blocks;
  auto device_updated = [&](int pos) {
    const core::Stage& st = parts_.plan.stages[pos % S];
    return parts_.execution.DeviceUpdatesLayer(st.begin) &&
           parts_.execution.DeviceUpdatesLayer(st.end - 1);
  };
  std::vector<int> order;
  for (int i = 0; i < positions; ++i) order.push_back(first_layers_first ? positions - 1 - i : i);
  if (first_layers_first && device_blocks > 0)
    std::stable_partition(order.begin(), order.end(),
                          [&](int pos) { return !device_updated(pos); });
  for (const int pos : order) {
    auto it = jobs_.find(steps_.at(step).job_at[pos]);
    if (it == jobs_.end()) continue;
    StageJob& j = it->second;
    if (!j.grads_ready || j.commit_sent) continue;
    // (A job re-dispatched after a worker died may have placed its slots already.) When the
    // optimizer gives the slots back it wakes the loop, which tries again.
    if (j.call == 0 && !j.slots_placed && step > 0 && !FirstCommitMayGo(step, j.stage)) continue;
    if (j.call > 0) {
      auto prev = jobs_.find(JobIndex(step, j.call - 1, j.stage));
      if (prev != jobs_.end() && !prev->second.done) continue;
    }
    // The first call's commit places the stage's slots in the gradient arena; with the arena
    // full it waits for an update to release space. Gradients waiting in the workers keep their
    // grant order then: otherwise a smaller stage further down the order takes the space first
    // and its layers are updated before those the next forward needs sooner (with device
    // updates, the covered blocks' stages would push the fused tail's, whose head the next tail
    // stage waits for, to the end).
    if (j.call == 0 && !j.slots_placed) {
      if (!parts_.grads.Place(StageGradSlots(j.stage))) {
        if (first_layers_first) break;
        continue;
      }
      j.slots_placed = true;
    }
    j.commit_sent = true;
    RP_RETURN_IF_ERROR(
        parts_.workers.Send(j.worker, proto::CommitGrads{j.index, j.call > 0 ? 1 : 0, 0}));
  }
  return Status::Ok();
}

bool StepDispatch::NormFromWorkers(int64_t step) {
  StepProgress& st = steps_.at(step);
  if (st.norm_given) return true;
  for (int64_t index : st.job_at) {
    auto it = jobs_.find(index);
    // A gradient job leaves jobs_ only after its commit, which waits for this.
    if (it == jobs_.end() || parts_.plan.stages[it->second.stage].kind == core::StageKind::kForward)
      continue;
    if (!it->second.grads_ready) return false;
  }
  const double* squares = parts_.layout.GradSquares(parts_.state.data(), step);
  double total = 0.0;
  for (int64_t c = 0; c < parts_.layout.square_chunks; ++c)
    total += squares[c];  // the optimizer's order
  parts_.optimizer.SetNormSquares(step, total);
  st.norm_given = true;
  return true;
}

Status StepDispatch::OnMicrobatchDone(int rank, const proto::MicrobatchDone& d) {
  RP_ASSIGN_OR_RETURN(StageJob * j, Find(rank, d.job_index, "MicrobatchDone"));
  if (d.microbatch != j->next_mb)
    return Status::ProtocolError(
        "worker " + std::to_string(rank) + " finished microbatch " + std::to_string(d.microbatch) +
        " of job " + std::to_string(d.job_index) + ", expected " + std::to_string(j->next_mb));
  j->next_mb++;
  j->mb_times.emplace_back(d.start_us, d.end_us);
  if (d.microbatch < j->mb_hw) return Status::Ok();  // a replacement's replay: already counted
  j->mb_hw = j->next_mb;
  if (d.microbatch == 0 && (d.flags & proto::kMicrobatchLayerMajor) != 0) layer_major_jobs_++;
  const double interval_s = static_cast<double>(d.end_us - d.start_us) * 1e-6;
  parts_.profiler.OnMicrobatch(j->run, d.microbatch, interval_s,
                               (d.flags & proto::kMicrobatchLayerMajor) != 0);
  StepProgress& st = steps_.at(j->step);
  st.busy_s += interval_s;
  // Several nodes: the tail's JobDone brings the loss summed over every node instead.
  if (parts_.plan.stages[j->stage].kind == core::StageKind::kFusedTail &&
      parts_.cfg.nodes.count == 1) {
    st.loss_sum += d.loss_sum;
    st.targets += d.targets;
  }
  routing_.Recorded(j->run, d.microbatch, rank);
  PoisonCheckpointForTest(*j, d.microbatch);
  if (static_cast<size_t>(j->stage) + 1 < parts_.plan.stages.size()) {
    const StageJob& next = jobs_.at(JobIndex(j->step, j->call, j->stage + 1));
    RP_RETURN_IF_ERROR(parts_.workers.Send(next.worker, routing_.For(next.run, d.microbatch)));
  }
  return Status::Ok();
}

void StepDispatch::PoisonCheckpointForTest(const StageJob& job, int mb) {
  static const PoisonedCheckpoint poison = TestPoisonedCheckpoint();
  const core::Stage& s = parts_.plan.stages[job.stage];
  if (poison.step != job.step || s.kind != core::StageKind::kForward ||
      !(poison.layer > s.begin && poison.layer < s.end) ||
      parts_.layout.activations != core::Activations::kHost ||
      parts_.layout.compute_elem_bytes != 4)
    return;
  const int idx = parts_.plan.HiddenSlot(poison.layer);
  if (idx < 0) return;
  auto* x = reinterpret_cast<float*>(parts_.state.data() +
                                     parts_.layout.HiddenSlot(job.run.parity, mb, idx));
  for (uint64_t i = 0; i < parts_.layout.act_elems; ++i) x[i] += 1.0f;
}

Status StepDispatch::OnGradsReady(int rank, const proto::GradsReady& g) {
  RP_ASSIGN_OR_RETURN(StageJob * j, Find(rank, g.job_index, "GradsReady"));
  if (parts_.plan.stages[j->stage].kind == core::StageKind::kForward ||
      j->next_mb != parts_.round.microbatches)
    return Status::ProtocolError("unexpected GradsReady for job " + std::to_string(g.job_index));
  j->grads_ready = true;
  return TryCommitsOf(j->step);
}

StatusOr<StageJob> StepDispatch::OnJobDone(int rank, const proto::JobDone& d) {
  RP_ASSIGN_OR_RETURN(StageJob * j, Find(rank, d.job_index, "JobDone"));
  const bool needs_commit = parts_.plan.stages[j->stage].kind != core::StageKind::kForward;
  if (j->done || j->next_mb != parts_.round.microbatches || (needs_commit && !j->commit_sent))
    return Status::ProtocolError("premature JobDone for job " + std::to_string(d.job_index));
  j->done = true;
  if (parts_.plan.stages[j->stage].kind == core::StageKind::kFusedTail &&
      parts_.cfg.nodes.count > 1) {
    StepProgress& st = steps_.at(j->step);
    st.loss_sum += d.nodes_loss_sum;
    st.targets += d.nodes_targets;
  }
  j->start_us = d.start_us;
  j->fetch_end_us = d.fetch_end_us;
  j->end_us = d.end_us;
  return *j;
}

StatusOr<bool> StepDispatch::Retire(const StageJob& job) {
  RP_RETURN_IF_ERROR(TryCommitsOf(job.step));
  jobs_.erase(job.index);
  call_jobs_done_[job.step * parts_.round.calls + job.call]++;
  StepProgress& st = steps_.at(job.step);
  if (++st.jobs_done < static_cast<int>(parts_.plan.stages.size() * parts_.round.calls))
    return false;
  st.done_at = MonoSeconds();
  return true;
}

Status StepDispatch::Resend(int rank, std::map<int64_t, const proto::RunEval*> evals) {
  // The dead worker's unfinished jobs, in their original order (so the new worker's queue has the
  // same dependency order the round-robin schedule gave the old one), each with the inputs that
  // are already in their slots. What the old worker wrote is overwritten with the same values;
  // its gradients reached shared memory only through a commit, which is redone. An accumulating
  // commit (call > 0) cut short cannot be undone, so that case stops the run.
  const int64_t K = parts_.round.calls;
  const int M = static_cast<int>(parts_.round.microbatches);
  int resent = 0;
  // Eval jobs interleave with stage jobs by index; the replacement's queue must keep that order.
  auto send_evals_before = [&](int64_t index) -> Status {
    while (!evals.empty() && evals.begin()->first < index) {
      RP_RETURN_IF_ERROR(parts_.workers.Send(rank, *evals.begin()->second));
      evals.erase(evals.begin());
      resent++;
    }
    return Status::Ok();
  };
  for (auto& [index, j] : jobs_) {
    if (j.worker != rank || j.done) continue;
    RP_RETURN_IF_ERROR(send_evals_before(index));
    if (j.commit_sent && j.call > 0)
      return Status::Unavailable(
          "worker " + std::to_string(rank) + " died while adding job " + std::to_string(index) +
          "'s gradients into the shared slots (accumulation call > 0); a partial sum "
          "cannot be undone");
    j.next_mb = 0;
    j.grads_ready = j.commit_sent = false;
    j.mb_times.clear();
    RP_RETURN_IF_ERROR(parts_.workers.Send(rank, j.run));
    resent++;
    int ready = 0;
    if (j.stage == 0) {
      ready = fed_calls_.count(j.step * K + j.call) ? M : 0;
    } else {
      auto prev = jobs_.find(JobIndex(j.step, j.call, j.stage - 1));
      ready = prev == jobs_.end() ? M : prev->second.mb_hw;
    }
    for (int mb = 0; mb < ready; ++mb)
      RP_RETURN_IF_ERROR(parts_.workers.Send(rank, routing_.For(j.run, mb)));
  }
  RP_RETURN_IF_ERROR(send_evals_before(std::numeric_limits<int64_t>::max()));
  jobs_redispatched_ += resent;
  RP_LOG(WARNING) << "worker " << rank << " replaced by pid " << parts_.workers.pid(rank)
                  << ": re-dispatched " << resent << " unfinished jobs";
  return Status::Ok();
}

}  // namespace rp::coord
