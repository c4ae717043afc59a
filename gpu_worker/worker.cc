// SPDX-License-Identifier: Apache-2.0
#include "gpu_worker/worker.h"
#include "common/environment.h"

#include <unistd.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <deque>
#include <future>
#include <map>
#include <optional>
#include <thread>
#include <chrono>
#include <cstring>

#include "common/logging.h"
#include "common/test_hooks.h"
#include "common/session.h"
#include "common/time_util.h"
#include "config/job_config.h"
#include "config/model_spec.h"
#include "planning/run_spec.h"
#include "planning/plan.h"
#include "gpu_worker/device.h"
#include "gpu_worker/device_update.h"
#include "gpu_worker/executor.h"
#include "gpu_worker/kernel_trace.h"
#include "gpu_worker/guarded.h"
#include "gpu_worker/share_gatherer.h"
#include "nodes/node_reduction.h"
#include "nodes/store_seal.h"
#include "protocol/channel.h"
#include "protocol/codec.h"
#include "shm/layout.h"
#include "shm/segment.h"

namespace rp::worker {
namespace {

constexpr double kHeartbeatSeconds = 1.0;
constexpr uint64_t kLinkProbeBytes = 64ull << 20;  // long enough to reach the link's plateau
std::atomic<bool> g_stop{false};

struct ActiveJob {
  proto::RunJob job;  // job.job_index orders the queue for eval jobs too
  bool eval = false;  // a RunEval (fields in `run_eval`), not a stage job
  proto::RunEval run_eval{};
  int next_mb = 0;
  bool begun = false;
  bool prefetched = false;
  int64_t start_us = 0, fetch_end_us = 0;
};

class Worker {
 public:
  explicit Worker(WorkerOptions o) : opts_(std::move(o)) {}
  Status Run();

 private:
  // Run's parts, in order: the resolved run and its layout; CUDA or CPU; the groups that sum
  // across nodes (joined in the background); Hello until Welcome and the segment; the device and
  // what runs on it; the activation pool's handle and the host link's probe; the job loop.
  Status ReadSpec();
  Status ChooseBackend(int gpus);
  void StartNodeGroups(int gpus);
  Status JoinCoordinator(int gpus);
  Status OpenDevice(int gpus);
  Status AnnounceResources(int gpus);
  Status Loop();
  Status Handle(const proto::Message& m);
  // Makes as much progress on the head job as its inputs allow. Returns true if it did work.
  StatusOr<bool> Progress();
  // The head of the queue is an eval job: runs it once its weights are published.
  StatusOr<bool> RunEval(ActiveJob& a);
  void MaybeHangForTest();
  Status Fail(int64_t job, const Status& s);
  // Stage and eval jobs share one index sequence; the queue runs them in it.
  Status CheckQueueOrder(const char* what, int64_t job_index) const;

  WorkerOptions opts_;
  core::JobConfig cfg_;
  core::ExecutionPlan execution_;   // the run spec's: how this run executes
  int64_t round_microbatches_ = 0;  // core::Round(cfg_).microbatches, decided once in Run
  core::ModelSpec spec_;
  core::PipelinePlan plan_;
  shm::ArenaLayout layout_;
  std::optional<proto::DealerChannel> channel_;
  std::optional<shm::Segment> segment_;
  bool use_cuda_ = false;
  // optimizer.device_update_blocks: before the device, which pins part of its read-only mapping
  // of the optimizer segment until the device goes.
  std::unique_ptr<DeviceUpdate> device_update_;
  std::unique_ptr<Device> device_;
  std::unique_ptr<Executor> exec_;
  // Sharded optimizer state: gathers the other nodes' shares of this rank's layers (its thread
  // stops before the segment is unmapped: declared after it).
  ShareGatherer::Joiner join_gather_;  // forms the gathers' group (sharded state; set with sums_)
  std::unique_ptr<ShareGatherer> gatherer_;
  std::optional<KernelTrace>
      trace_;  // RP_TRACE_KERNELS (kernel_trace.h); destroyed before the device

  std::deque<ActiveJob> queue_;
  // Microbatches enqueued on the device and not yet reported: MicrobatchDone goes out once the
  // device has completed one (its stores are then in shared memory or the pool), in order.
  // Bounded so the host runs at most this many microbatches ahead of the device.
  static constexpr size_t kMicrobatchesInFlight = 2;
  struct InFlight {
    proto::MicrobatchDone done;
    MicrobatchResult result;
    double enqueued_s = 0.0;  // MonoSeconds()
  };
  std::deque<InFlight> in_flight_;
  struct Logged {
    bool layer_major = false;           // the first layer-major job is logged once
    bool layer_major_profiled = false;  // and the first profiled one
    bool frozen_kept = false;           // the frozen base first kept on the device
  } logged_;
  int64_t last_done_end_us_ = 0;    // end of the last microbatch reported
  double last_completion_s_ = 0.0;  // MonoSeconds() when the device last completed a microbatch
  // A device that stops completing work (a stuck kernel) would otherwise leave this loop
  // spinning and heartbeating forever: once the oldest microbatch in flight has made no progress
  // for job.worker_timeout_s, heartbeats stop and the coordinator replaces this worker, as for
  // a hung process.
  bool DeviceStalled() const {
    if (in_flight_.empty() || cfg_.job.worker_timeout_s <= 0) return false;
    const double since = std::max(in_flight_.front().enqueued_s, last_completion_s_);
    return MonoSeconds() - since > cfg_.job.worker_timeout_s;
  }
  bool InFlightFor(int64_t job) const {
    return std::any_of(in_flight_.begin(), in_flight_.end(),
                       [job](const InFlight& f) { return f.done.job_index == job; });
  }
  // Jobs whose microbatches are all enqueued: each announces itself (GradsReady, or JobDone for
  // a forward stage) once its last microbatch is reported; a gradient job then waits for its
  // commit grant and its commit's copy.
  struct Finishing {
    ActiveJob job;
    bool has_grads = false;
    bool announced = false;
    bool reducing = false;  // several nodes: its gradients are being summed across them
    bool reduced = false;   // ... and are summed
    at::Tensor loss;        // ... and, for a fused tail, its loss sum and target count (fp64)
    bool committing = false;
    uint64_t ticket = 0;
    bool squaring = false;  // its gradients' squares are being summed (Device::StartChunkSquares)
    uint64_t squares_ticket = 0;
  };
  std::deque<Finishing> finishing_;
  // Reports completed microbatches, announces drained jobs, starts and finishes commits.
  StatusOr<bool> Finish();
  // job -> microbatches whose input is ready, with the pools holding it (activation pools)
  std::map<int64_t, std::map<int, InputSources>> ready_;
  std::map<int64_t, bool> commit_granted_;  // job -> accumulate
  // Several nodes (core::NodesConfig): the group of this rank's workers of every node, joined in
  // the background from the start of the run (the other nodes may start later); a job's
  // gradients are summed across it once complete, one job at a time, in job order, and
  // committed once summed and granted.
  std::future<StatusOr<std::unique_ptr<nodes::NodeReduction>>> joining_;
  std::unique_ptr<nodes::NodeReduction> reduction_;
  bool sums_ = false;               // decided once in Run: this worker sums across the nodes
  at::TensorOptions sums_options_;  // where its sums' tensors live: its GPU (NCCL) or host (Gloo)
  // core::EvalSplitAcrossNodes: the group that sums each eval job's loss across the nodes (its
  // own group, so eval sums keep their order beside the gradient sums).
  std::future<StatusOr<std::unique_ptr<nodes::NodeReduction>>> joining_eval_;
  std::unique_ptr<nodes::NodeReduction> eval_sums_;
  // Sums an eval job's loss and target count across the nodes, beating while it waits.
  Status SumEvalAcrossNodes(double* loss_sum, int64_t* targets);
  void BeatIfDue();
  std::map<int64_t, std::pair<double, int64_t>>
      job_loss_;  // several nodes: job -> this node's loss, targets
  // JobDone for `f`, with its loss summed over the nodes when it has one.
  proto::JobDone DoneMessage(const Finishing& f) const;
  // Starts the cross-node sum of the gradients of `f`; false while the group is still being
  // joined.
  StatusOr<bool> StartReduction(Finishing& f);
  // Starts `f`'s sum if it has not started (`*started` then true) and polls it: true once it is
  // done, false while the group is being joined or the sum runs.
  StatusOr<bool> AdvanceReduction(Finishing& f, bool* started);
  // Starts summing the squares of f's gradients into its step's table (Device::StartChunkSquares).
  Status StartSquares(Finishing& f);
  // True once f's gradient squares, if any were started, are written (and then forgets them).
  StatusOr<bool> SquaresDone(Finishing& f);
  bool shutdown_ = false;
  bool waiting_for_weights_ = false;
  double last_heartbeat_ = 0.0;
  int jobs_begun_ = 0;
  int shutdown_code_ = 0;
};

Status Worker::Handle(const proto::Message& m) {
  switch (proto::TypeOfMessage(m)) {
    case proto::MsgType::kRunJob: {
      const auto& r = std::get<proto::RunJob>(m);
      RP_RETURN_IF_ERROR(CheckQueueOrder("RunJob", r.job_index));
      queue_.push_back(ActiveJob{r});
      return Status::Ok();
    }
    case proto::MsgType::kRunEval: {
      const auto& r = std::get<proto::RunEval>(m);
      RP_RETURN_IF_ERROR(CheckQueueOrder("RunEval", r.job_index));
      ActiveJob a{};
      a.job.job_index = r.job_index;
      a.eval = true;
      a.run_eval = r;
      queue_.push_back(a);
      return Status::Ok();
    }
    case proto::MsgType::kInputReady: {
      const auto& r = std::get<proto::InputReady>(m);
      if (r.microbatch < 0 || r.microbatch >= round_microbatches_) {
        RP_LOG(WARNING) << "dropped InputReady with microbatch " << r.microbatch;
        return Status::Ok();
      }
      ready_[r.job_index][r.microbatch] = InputSources{r.hidden_rank, r.grad_rank};
      return Status::Ok();
    }
    case proto::MsgType::kActivationPool: {
      const auto& p = std::get<proto::ActivationPool>(m);
      if (layout_.activations != core::Activations::kCudaIpc || p.rank < 0 ||
          p.rank >= opts_.num_workers || p.rank == opts_.rank)
        return Status::ProtocolError("ActivationPool for worker " + std::to_string(p.rank) +
                                     " does not fit this run (worker " +
                                     std::to_string(opts_.rank) + " of " +
                                     std::to_string(opts_.num_workers) + ")");
      Device::PoolHandle h;
      std::memcpy(h.data(), p.handle, h.size());
      // Reported as a setup failure (job -1), so the coordinator ends the run with the reason.
      if (Status s = device_->OpenPeerPool(p.rank, h, p.bytes, layout_.hash); !s.ok())
        return Fail(-1, s);
      return Status::Ok();
    }
    case proto::MsgType::kCommitGrads: {
      const auto& c = std::get<proto::CommitGrads>(m);
      commit_granted_[c.job_index] = c.accumulate != 0;
      return Status::Ok();
    }
    case proto::MsgType::kStepUpdate: {
      const auto& u = std::get<proto::StepUpdate>(m);
      if (Status s = exec_->ApplyStepUpdate(u); !s.ok()) return Fail(-1, s);
      return Status::Ok();
    }
    case proto::MsgType::kShutdown:
      shutdown_ = true;
      shutdown_code_ = std::get<proto::Shutdown>(m).exit_code;
      return Status::Ok();
    case proto::MsgType::kHello:
    case proto::MsgType::kWelcome:
    case proto::MsgType::kHeartbeat:
    case proto::MsgType::kMicrobatchDone:
    case proto::MsgType::kGradsReady:
    case proto::MsgType::kJobDone:
    case proto::MsgType::kJobFailed:
    case proto::MsgType::kLinkProbe:
    case proto::MsgType::kLayerTime:
    case proto::MsgType::kEvalDone:
      RP_LOG(WARNING) << "dropped unexpected " << proto::MsgTypeName(proto::TypeOfMessage(m));
      return Status::Ok();
  }
  return Status::Ok();
}

Status Worker::CheckQueueOrder(const char* what, int64_t job_index) const {
  if (!queue_.empty() && job_index <= queue_.back().job.job_index)
    return Status::ProtocolError(std::string(what) + " " + std::to_string(job_index) +
                                 " arrived out of order");
  return Status::Ok();
}

Status Worker::Fail(int64_t job, const Status& s) {
  proto::JobFailed f{};
  f.job_index = job;
  proto::CopyText(f.message, s.ToString());
  Status sent = channel_->Send(f);
  if (!sent.ok()) RP_LOG(ERROR) << "could not report the failure: " << sent.message();
  return s;
}

// Test hook for hang detection: with RP_TEST_HANG_ONCE=<marker path>, one worker of the run
// (common/test_hooks.h) stops making progress at its third job, as a stuck kernel or a deadlock
// would: no messages, no exit.
void Worker::MaybeHangForTest() {
  if (++jobs_begun_ != 3 || !ClaimTestHookOnce("RP_TEST_HANG_ONCE")) return;
  RP_LOG(WARNING) << "RP_TEST_HANG_ONCE: hanging on purpose";
  while (true) ::pause();
}

StatusOr<bool> Worker::Progress() {
  if (queue_.empty()) return false;
  ActiveJob& a = queue_.front();
  const int64_t id = a.job.job_index;
  if (a.eval) return RunEval(a);
  if (!a.begun) {
    // The optimizer may still be writing this step's weights (per layer, as gradients become
    // final); copy each layer as it is published and wait for the rest without blocking the
    // message loop.
    bool fetched = false;
    if (Status f = exec_->FetchReady(a.job, &fetched); !f.ok()) return Fail(id, f);
    // A forward stage may begin layer-major once every microbatch's input is here.
    auto inputs = ready_.find(id);
    const bool all_inputs =
        inputs != ready_.end() && static_cast<int>(inputs->second.size()) >= a.job.num_microbatches;
    if (!exec_->Startable(a.job, all_inputs)) {
      waiting_for_weights_ = true;
      return false;
    }
    waiting_for_weights_ = false;
    MaybeHangForTest();
    if (trace_) trace_->OnJobBegin(a.job.step);
    a.start_us = WallMicros();
    Status s = exec_->Begin(a.job, all_inputs);
    if (!s.ok()) return Fail(id, s);
    if (exec_->LayerMajorBegun() && queue_.size() > 1 && !queue_[1].eval)
      if (Status r = exec_->Reserve(queue_[1].job); !r.ok())
        return Fail(queue_[1].job.job_index, r);
    a.fetch_end_us = WallMicros();
    a.begun = true;
    if (!logged_.frozen_kept && exec_->FrozenKeptBytes() > 0) {
      RP_LOG(INFO) << "keeps the frozen base weights on its device (schedule.frozen_on_device, "
                   << exec_->FrozenKeptBytes() / 1000000
                   << " MB); its jobs copy only the trainable weights";
      logged_.frozen_kept = true;
    }
  }
  // Two jobs' weights on the device at most: the current one's and the next one's, whose copy
  // runs on the low-priority stream while this job computes.
  if (queue_.size() > 1 && !queue_[1].eval && !queue_[1].prefetched &&
      !exec_->LayerMajorCopying()) {
    bool fetched = false;
    Status s = exec_->FetchReady(queue_[1].job, &fetched);
    if (!s.ok()) return Fail(queue_[1].job.job_index, s);
    queue_[1].prefetched = fetched;
  }
  if (a.next_mb == 0 && exec_->LayerMajorBegun()) {
    auto it = ready_.find(id);
    if (it == ready_.end())
      return Fail(id, Status::Internal("a layer-major job began without its inputs"));
    if (!logged_.layer_major) {
      RP_LOG(INFO) << "job " << id << " (a forward stage) runs layer by layer over its "
                   << a.job.num_microbatches
                   << " microbatches, each layer as soon as it is published";
      logged_.layer_major = true;
    }
    if (a.job.profile && !logged_.layer_major_profiled) {
      RP_LOG(INFO) << "job " << id
                   << " (profiled) runs layer by layer, each layer of each microbatch timed";
      logged_.layer_major_profiled = true;
    }
    bool done = false;
    auto r = exec_->ForwardLayers(it->second, &done);
    if (!r.ok()) return Fail(id, r.status());
    waiting_for_weights_ = !done;
    if (!done) return false;
    if (const double slow = TestSlowdownSeconds(a.job.step); slow > 0)
      std::this_thread::sleep_for(std::chrono::duration<double>(slow * a.job.num_microbatches));
    for (int mb = 0; mb < a.job.num_microbatches; ++mb) {
      proto::MicrobatchDone d{};
      d.job_index = id;
      d.microbatch = mb;
      d.start_us = exec_->StallEndUs();
      in_flight_.push_back({d, std::move((*r)[mb]), MonoSeconds()});
    }
    it->second.clear();
    a.next_mb = a.job.num_microbatches;
    return true;
  }
  if (a.next_mb < a.job.num_microbatches) {
    auto it = ready_.find(id);
    if (it == ready_.end()) return false;
    auto input = it->second.find(a.next_mb);
    if (input == it->second.end()) return false;
    if (in_flight_.size() >= kMicrobatchesInFlight) return false;
    proto::MicrobatchDone d{};
    d.job_index = id;
    d.microbatch = a.next_mb;
    d.start_us = WallMicros();
    auto r = exec_->Microbatch(a.next_mb, input->second);
    if (!r.ok()) return Fail(id, r.status());
    if (const double slow = TestSlowdownSeconds(a.job.step); slow > 0)
      std::this_thread::sleep_for(std::chrono::duration<double>(slow));
    it->second.erase(input);
    a.next_mb++;
    in_flight_.push_back({d, std::move(*r), MonoSeconds()});
    return true;
  }
  // Every microbatch is enqueued: the next job may begin while these finish on the device.
  // A gradient job's gradients wait (on the device) for the commit grant in the finishing list.
  const bool grads = exec_->HasGrads();
  if (grads) {
    if (Status d = exec_->Detach(); !d.ok()) return Fail(id, d);
  } else {
    exec_->End();
  }
  Finishing f;
  f.job = a;
  f.has_grads = grads;
  finishing_.push_back(std::move(f));
  ready_.erase(id);
  queue_.pop_front();
  return true;
}

void Worker::BeatIfDue() {
  if (MonoSeconds() - last_heartbeat_ < kHeartbeatSeconds) return;
  if (Status s = channel_->Send(proto::Heartbeat{WallMicros()}); !s.ok())
    RP_LOG(WARNING) << "heartbeat between layers: " << s.message();
  last_heartbeat_ = MonoSeconds();
}

Status Worker::SumEvalAcrossNodes(double* loss_sum, int64_t* targets) {
  if (!eval_sums_) {
    while (joining_eval_.wait_for(std::chrono::milliseconds(10)) != std::future_status::ready)
      BeatIfDue();
    RP_ASSIGN_OR_RETURN(eval_sums_, joining_eval_.get());
  }
  at::Tensor sums = at::empty({2}, sums_options_.dtype(at::kDouble));
  sums[0] = *loss_sum;
  sums[1] = static_cast<double>(*targets);
  RP_RETURN_IF_ERROR(eval_sums_->Start(at::Tensor(), sums));
  for (;;) {
    RP_ASSIGN_OR_RETURN(bool done, eval_sums_->Poll());
    if (done) break;
    BeatIfDue();
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  *loss_sum = sums[0].item<double>();
  *targets = static_cast<int64_t>(sums[1].item<double>());
  return Status::Ok();
}

StatusOr<bool> Worker::RunEval(ActiveJob& a) {
  // Earlier jobs report their microbatches first (an eval blocks until it is done).
  if (!in_flight_.empty()) return false;
  if (!exec_->WeightsReady(a.run_eval)) {
    waiting_for_weights_ = true;
    return false;
  }
  waiting_for_weights_ = false;
  proto::EvalDone d{};
  d.job_index = a.run_eval.job_index;
  // Test hook: one worker of the run fails its first eval job (the replacement must re-run it).
  if (ClaimTestHookOnce("RP_TEST_FAIL_EVAL_ONCE"))
    return Fail(d.job_index,
                Status::Internal("RP_TEST_FAIL_EVAL_ONCE: failing an eval job on purpose"));
  d.start_us = WallMicros();
  auto r = exec_->Evaluate(a.run_eval, [this] { BeatIfDue(); });
  if (!r.ok()) return Fail(d.job_index, r.status());
  if (core::EvalSplitAcrossNodes(cfg_))
    if (Status s = SumEvalAcrossNodes(&r->loss_sum, &r->targets); !s.ok())
      return Fail(d.job_index, s);
  if (const double slow = TestEvalDelaySeconds(); slow > 0)
    std::this_thread::sleep_for(std::chrono::duration<double>(slow));
  d.end_us = WallMicros();
  d.loss_sum = r->loss_sum;
  d.targets = r->targets;
  queue_.pop_front();
  RP_RETURN_IF_ERROR(channel_->Send(d));
  return true;
}

StatusOr<bool> Worker::Finish() {
  bool worked = false;
  while (!in_flight_.empty()) {
    InFlight& f = in_flight_.front();
    bool done = false;
    Status s = Guarded([&] { return "microbatch " + std::to_string(f.done.microbatch); },
                       [&] {
                         done = device_->Completed(f.result.fence);
                         return Status::Ok();
                       });
    if (!s.ok()) return Fail(f.done.job_index, s);
    if (!done) break;
    last_completion_s_ = MonoSeconds();
    s = Guarded(
        [&] { return "reading microbatch " + std::to_string(f.done.microbatch) + "'s timings"; },
        [&] {
          f.result.Resolve(*device_);
          return Status::Ok();
        });
    if (!s.ok()) return Fail(f.done.job_index, s);
    // The device runs microbatches back to back: this one started when it was enqueued or when
    // the one before it ended, whichever was later. The intervals then tile the device's busy
    // time (to within this loop's 1 ms poll) and the coordinator's bubble ratio stays true.
    const int64_t now_us = WallMicros();
    // A layer-major job's: the device computed it for busy_s, ending about now.
    if (f.result.busy_s >= 0)
      f.done.start_us = now_us - static_cast<int64_t>(f.result.busy_s * 1e6);
    f.done.start_us = std::max(f.done.start_us, last_done_end_us_);
    f.done.end_us = std::max(now_us, f.done.start_us);
    last_done_end_us_ = f.done.end_us;
    f.done.loss_sum = f.result.loss_sum;
    f.done.targets = f.result.targets;
    if (sums_ && f.done.targets > 0) {
      auto& [loss, targets] = job_loss_[f.done.job_index];
      loss += f.done.loss_sum;
      targets += f.done.targets;
    }
    if (f.result.layer_major) f.done.flags |= proto::kMicrobatchLayerMajor;
    for (const auto& t : f.result.layer_times) RP_RETURN_IF_ERROR(channel_->Send(t));
    RP_RETURN_IF_ERROR(channel_->Send(f.done));
    const bool had_marks = !f.result.layer_times.empty() || f.result.busy_s >= 0;
    in_flight_.pop_front();
    // Marks are numbered per device: forget them once no microbatch in flight has any pending,
    // nor a begun layer-major job.
    if (had_marks && !exec_->HoldsMarks() &&
        std::none_of(in_flight_.begin(), in_flight_.end(),
                     [](const InFlight& g) { return g.result.HasPendingMarks(); }))
      device_->ClearMarks();
    worked = true;
  }
  bool reduction_busy = false;  // an earlier job's cross-node sum is pending
  for (auto it = finishing_.begin(); it != finishing_.end();) {
    const int64_t id = it->job.job.job_index;
    if (!it->announced) {
      if (InFlightFor(id)) {
        ++it;
        continue;
      }
      if (!it->has_grads) {
        RP_RETURN_IF_ERROR(channel_->Send(DoneMessage(*it)));
        it = finishing_.erase(it);
        worked = true;
        continue;
      }
      if (execution_.gradients_wait_in_workers) {
        // The coordinator adds these up for the step's norm before it grants any of its commits.
        // Summed while this loop goes on queueing the next job.
        if (!it->squaring) {
          if (Status sq = StartSquares(*it); !sq.ok()) return Fail(id, sq);
          worked = true;
        }
        auto summed = SquaresDone(*it);
        if (!summed.ok()) return Fail(id, summed.status());
        if (!*summed) {
          ++it;
          continue;
        }
      }
      it->announced = true;
      worked = true;
      RP_RETURN_IF_ERROR(channel_->Send(proto::GradsReady{id}));
    }
    if (sums_ && !it->committing && !it->reduced) {
      // Every node's same-rank worker sums the same jobs in the same order: job order, one at a
      // time (a job behind one whose sum is unfinished waits). A sum starts when the job's
      // gradients are complete, not when the commit is granted: grants follow each node's own
      // arena and timing, and a sum waiting for one could wait for another node's grant that
      // waits for this node's commit.
      bool summed = false;
      if (!reduction_busy || it->reducing) {
        bool started = false;
        auto r = AdvanceReduction(*it, &started);
        if (!r.ok()) return Fail(id, r.status());
        summed = *r;
        worked = worked || started;
      }
      if (!summed) {
        reduction_busy = true;
        ++it;
        continue;
      }
      it->reduced = true;
    }
    if (!it->committing) {
      auto grant = commit_granted_.find(id);
      if (grant == commit_granted_.end()) {
        ++it;
        continue;
      }
      if (layout_.sharded_grads) {
        // The slots take this node's share of the summed gradients; the step's norm needs the
        // squares of the whole, which every node's worker has after the sum. The optimizer reads
        // them once the commit is reported done, which waits for them below.
        if (Status sq = StartSquares(*it); !sq.ok()) return Fail(id, sq);
      }
      auto ticket = exec_->StartCommit(id, grant->second);
      if (!ticket.ok()) return Fail(id, ticket.status());
      it->ticket = *ticket;
      it->committing = true;
      commit_granted_.erase(grant);
      worked = true;
    }
    bool done = false;
    Status s = Guarded([&] { return "committing job " + std::to_string(id) + "'s gradients"; },
                       [&] {
                         done = device_->CommitDone(it->ticket);
                         return Status::Ok();
                       });
    if (!s.ok()) return Fail(id, s);
    if (done) {
      auto summed = SquaresDone(*it);
      if (!summed.ok()) return Fail(id, summed.status());
      done = *summed;
    }
    if (!done) {
      ++it;
      continue;
    }
    RP_RETURN_IF_ERROR(channel_->Send(DoneMessage(*it)));
    it = finishing_.erase(it);
    worked = true;
  }
  return worked;
}

Status Worker::StartSquares(Finishing& f) {
  RP_ASSIGN_OR_RETURN(f.squares_ticket, exec_->StartChunkSquares(
                                            f.job.job.job_index,
                                            layout_.GradSquares(segment_->data(), f.job.job.step)));
  f.squaring = true;
  return Status::Ok();
}

StatusOr<bool> Worker::SquaresDone(Finishing& f) {
  if (!f.squaring) return true;
  bool done = false;
  Status s = Guarded(
      [&] {
        return "summing the squares of job " + std::to_string(f.job.job.job_index) + "'s gradients";
      },
      [&] {
        done = device_->SquaresDone(f.squares_ticket);
        return Status::Ok();
      });
  if (!s.ok()) return s;
  if (done) f.squaring = false;
  return done;
}

StatusOr<bool> Worker::AdvanceReduction(Finishing& f, bool* started) {
  if (!f.reducing) {
    RP_ASSIGN_OR_RETURN(const bool now, StartReduction(f));
    if (!now) return false;
    f.reducing = true;
    *started = true;
  }
  RP_ASSIGN_OR_RETURN(const bool summed, reduction_->Poll());
  if (summed) f.reducing = false;
  return summed;
}

StatusOr<bool> Worker::StartReduction(Finishing& f) {
  if (!reduction_) {
    if (joining_.wait_for(std::chrono::seconds(0)) != std::future_status::ready) return false;
    RP_ASSIGN_OR_RETURN(reduction_, joining_.get());
    RP_LOG(INFO) << "joined the cross-node reduction group of worker " << opts_.rank << " ("
                 << cfg_.nodes.count << (cfg_.nodes.count == 1 ? " node, " : " nodes, ")
                 << (use_cuda_ ? "NCCL" : "Gloo") << ")";
  }
  RP_ASSIGN_OR_RETURN(at::Tensor flat, exec_->GatherHeld(f.job.job.job_index));
  if (plan_.stages[f.job.job.stage].kind == core::StageKind::kFusedTail) {
    const auto [loss, targets] = job_loss_[f.job.job.job_index];
    job_loss_.erase(f.job.job.job_index);
    f.loss = at::empty({2}, sums_options_.dtype(at::kDouble));
    f.loss[0] = loss;
    f.loss[1] = static_cast<double>(targets);
  }
  RP_RETURN_IF_ERROR(reduction_->Start(std::move(flat), f.loss));
  return true;
}

proto::JobDone Worker::DoneMessage(const Finishing& f) const {
  proto::JobDone d{
      f.job.job.job_index,          f.job.start_us, f.job.fetch_end_us, WallMicros(), 0.0, 0,
      device_->PeakAllocatedBytes()};
  if (f.loss.defined()) {
    d.nodes_loss_sum = f.loss[0].item<double>();
    d.nodes_targets = static_cast<int64_t>(f.loss[1].item<double>());
  }
  return d;
}

Status Worker::Run() {
  RP_RETURN_IF_ERROR(ReadSpec());
  const int gpus = CudaDeviceCount();
  RP_RETURN_IF_ERROR(ChooseBackend(gpus));
  StartNodeGroups(gpus);
  RP_RETURN_IF_ERROR(JoinCoordinator(gpus));
  RP_RETURN_IF_ERROR(OpenDevice(gpus));
  RP_RETURN_IF_ERROR(AnnounceResources(gpus));
  return Loop();
}

Status Worker::ReadSpec() {
  // The job and its plan as rp-launch resolved them: a worker neither parses the job file nor
  // plans.
  RP_ASSIGN_OR_RETURN(core::RunSpec run, core::ReadRunSpecFor(opts_.spec_path, opts_.num_workers));
  cfg_ = std::move(run.job);
  execution_ = run.execution;
  plan_ = std::move(run.plan);
  round_microbatches_ = core::Round(cfg_).microbatches;
  spec_ = core::BuildModelSpec(cfg_.model, cfg_.lora);
  RP_ASSIGN_OR_RETURN(layout_, shm::ComputeLayout(cfg_, execution_, spec_, plan_));
  return Status::Ok();
}

Status Worker::ChooseBackend(int gpus) {
  use_cuda_ = cfg_.job.device == core::DeviceKind::kCuda ||
              (cfg_.job.device == core::DeviceKind::kAuto && gpus > 0);
  if (use_cuda_ && gpus == 0)
    return Status::InvalidArgument(
        "job.device: \"cuda\" requested, but no CUDA device is usable "
        "by this build");
  if (!use_cuda_ && core::Fp8Matmuls(cfg_))
    return Status::InvalidArgument(std::string("train.dtype: \"") +
                                   core::EnumName(cfg_.train.dtype) + "\" needs CUDA workers");
  return Status::Ok();
}

void Worker::StartNodeGroups(int gpus) {
  // Decided once: whether this worker sums its gradients across the nodes. A test hook forms a
  // group of this node alone, which runs every sum through the whole path and must change nothing.
  sums_ = cfg_.nodes.count > 1 || (cfg_.nodes.count == 1 && TestNodeSumsAlone());
  if (!sums_) return;
  // The run's secret comes from rp-launch through the environment, never through a file.
  const std::string secret = EnvironmentValue(nodes::kRunSecretVariable).value_or("");
  nodes::NodeGroup group{static_cast<int>(cfg_.nodes.count),
                         static_cast<int>(cfg_.nodes.rank),
                         cfg_.nodes.store_host,
                         static_cast<int>(cfg_.nodes.store_port),
                         cfg_.job.node_timeout_s,
                         secret};
  const int rank = opts_.rank;
  // CUDA workers sum on their GPU over NCCL, CPU workers in host memory over Gloo.
  const int device = use_cuda_ ? opts_.rank % gpus : -1;
  sums_options_ = at::TensorOptions().device(
      use_cuda_ ? at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(device))
                : at::Device(at::kCPU));
  auto join = [group, rank, device](const std::string& purpose) {
    return device >= 0 ? JoinNcclGroup(group, rank, purpose, device)
                       : nodes::NodeReduction::Join(group, rank, purpose);
  };
  join_gather_ = [join] { return join("gather"); };
  joining_ = std::async(std::launch::async, [join] { return join("reduce"); });
  if (core::EvalSplitAcrossNodes(cfg_) && cfg_.train.eval_every > 0)
    joining_eval_ = std::async(std::launch::async, [join] { return join("eval"); });
}

Status Worker::JoinCoordinator(int gpus) {
  RP_ASSIGN_OR_RETURN(
      auto ch, proto::DealerChannel::Connect(ControlEndpoint(opts_.runtime_dir), opts_.rank));
  channel_.emplace(std::move(ch));
  RP_RETURN_IF_ERROR(
      channel_->Send(proto::Hello{opts_.rank, static_cast<int32_t>(::getpid()), layout_.hash,
                                  use_cuda_ ? opts_.rank % gpus : -1, 0}));

  // The coordinator binds its control socket only once the run's shared state is filled: tens of
  // GB initialized or read from a checkpoint, minutes for a large model. Until then the Hello
  // waits in the socket's queue and the launcher, which ends the run if the coordinator dies,
  // bounds the wait; the deadline for Welcome counts from the bind. A worker started without
  // rp-launch has no such guard and counts from its Hello.
  const double waiting_since = MonoSeconds();
  const std::string control_socket = ControlSocketPath(opts_.runtime_dir);
  std::optional<double> deadline;
  double next_note = waiting_since + 60.0;
  while (!segment_) {
    if (g_stop) return Status::Cancelled("stopped by signal before joining");
    if (LauncherGone()) return Status::Unavailable("launcher is gone");
    const double now = MonoSeconds();
    if (!deadline && (!StartedByLauncher() || ::access(control_socket.c_str(), F_OK) == 0))
      deadline = now + opts_.welcome_timeout_s;
    if (deadline && now > *deadline)
      return Status::DeadlineExceeded(
          "no Welcome from the coordinator within " + std::to_string(opts_.welcome_timeout_s) +
          " s of " + (StartedByLauncher() ? "its control socket's bind" : "this worker's Hello"));
    if (!deadline && now > next_note) {
      RP_LOG(INFO) << "waiting for the coordinator to fill the run's shared state ("
                   << static_cast<int>(now - waiting_since) << " s so far)";
      next_note = now + 60.0;
    }
    RP_ASSIGN_OR_RETURN(auto m, channel_->Receive(100));
    if (!m) continue;
    if (auto* s = std::get_if<proto::Shutdown>(&*m))
      return Status::Cancelled("coordinator refused: shutdown " + std::to_string(s->exit_code));
    auto* w = std::get_if<proto::Welcome>(&*m);
    if (!w) continue;
    RP_ASSIGN_OR_RETURN(auto seg, shm::Segment::Open(w->segment_name, layout_.hash));
    if (seg.header()->ready.load(std::memory_order_acquire) != 1)
      return Status::ProtocolError("segment " + seg.name() + " is not initialized");
    segment_.emplace(std::move(seg));
  }
  return Status::Ok();
}

Status Worker::OpenDevice(int gpus) {
  if (use_cuda_) {
    // Worker i uses GPU i mod the device count; N workers may share one GPU.
    RP_ASSIGN_OR_RETURN(
        device_,
        MakeCudaDevice(opts_.rank % gpus, segment_->data(), segment_->size(),
                       static_cast<uint64_t>(cfg_.job.device_memory_limit_gib * 1073741824.0)));
  } else {
    device_ = MakeCpuDevice();
  }
  if (core::Fp8Matmuls(cfg_) &&
      (device_->fused_kernels() == nullptr || !device_->fused_kernels()->E4m3MatmulSupported()))
    return Status::InvalidArgument(
        "train.dtype: \"fp8\" needs a GPU on which this LibTorch runs row-scaled e4m3 "
        "products (at::_scaled_mm; compute capability 8.9 or newer, LibTorch 2.5 or "
        "newer); a test product failed on " +
        device_->Describe());
  exec_ = std::make_unique<Executor>(cfg_, execution_, spec_, plan_, layout_, *segment_, *device_);
  if (execution_.device_update_blocks > 0) {
    RP_ASSIGN_OR_RETURN(device_update_,
                        DeviceUpdate::Create(cfg_, execution_, spec_, layout_, *segment_, *device_,
                                             exec_->weights_dtype()));
    exec_->UseDeviceUpdate(device_update_.get());
  }
  // The loop's own rule: no heartbeat while the device has stopped completing work.
  exec_->SetBetweenLayers([this] {
    if (!DeviceStalled()) BeatIfDue();
  });
  if (layout_.sharded)
    gatherer_ = ShareGatherer::Start(cfg_, spec_, layout_, segment_->data(), opts_.rank,
                                     opts_.num_workers, join_gather_, sums_options_.device());
  // The trace stops at a job of a later step: first everything enqueued must have run, or the
  // traced step's last kernels would be missing.
  trace_.emplace(opts_.rank, [this] {
    const uint64_t t = device_->CompletionFence();
    while (!device_->Completed(t)) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  });
  RP_LOG(INFO) << "joined: device " << device_->Describe() << ", segment " << segment_->name();
  return Status::Ok();
}

Status Worker::AnnounceResources(int gpus) {
  if (layout_.activations == core::Activations::kCudaIpc) {
    // Announced once; the coordinator relays every peer's handle before the first RunJob. A
    // failure is reported (job -1) so the coordinator ends the run with the reason.
    if (ClaimTestHookOnce("RP_TEST_FAIL_POOL_ONCE"))
      return Fail(-1,
                  Status::Internal(
                      "RP_TEST_FAIL_POOL_ONCE: failing the activation pool's setup on purpose"));
    auto handle = device_->CreatePool(opts_.rank, layout_.pool_bytes, layout_.hash,
                                      shm::PoolSegmentName(opts_.session, opts_.rank));
    if (!handle.ok()) return Fail(-1, handle.status());
    proto::ActivationPool p{};
    p.rank = opts_.rank;
    p.device_index = use_cuda_ ? opts_.rank % gpus : -1;
    p.bytes = layout_.pool_bytes;
    std::memcpy(p.handle, handle->data(), sizeof(p.handle));
    RP_RETURN_IF_ERROR(channel_->Send(p));
  }
  // One measurement of the host link for the planner's profile (planning/profile.h): reads the
  // start of the shared segment, writes only private memory.
  const uint64_t probe_bytes = std::min<uint64_t>(kLinkProbeBytes, segment_->size());
  RP_ASSIGN_OR_RETURN(auto link, device_->ProbeLink(segment_->data(), probe_bytes));
  RP_RETURN_IF_ERROR(channel_->Send(proto::LinkProbe{link.h2d_bytes_per_s, link.d2h_bytes_per_s,
                                                     static_cast<int64_t>(probe_bytes)}));
  return Status::Ok();
}

Status Worker::Loop() {
  while (!shutdown_) {
    if (g_stop) return Status::Cancelled("stopped by signal");
    if (LauncherGone()) return Status::Unavailable("launcher is gone");
    // Sign of life for the coordinator's hang detection (job.worker_timeout_s); withheld while
    // the device is stalled.
    if (MonoSeconds() - last_heartbeat_ >= kHeartbeatSeconds && !DeviceStalled()) {
      RP_RETURN_IF_ERROR(channel_->Send(proto::Heartbeat{WallMicros()}));
      last_heartbeat_ = MonoSeconds();
    }
    if (gatherer_)
      if (auto failed = gatherer_->Failed()) return Fail(-1, *failed);
    // Completions first: a microbatch's reported end is then not delayed by the next one's launch.
    RP_ASSIGN_OR_RETURN(bool finished, Finish());
    RP_ASSIGN_OR_RETURN(bool worked, Progress());
    worked = worked || finished;
    // Poll while a gradient copy or a sum of squares is in flight (each completes without a
    // message) and while the next job's weights are still being published layer by layer (so
    // each is copied when it appears).
    const bool prefetching =
        queue_.size() > 1 && queue_.front().begun && !queue_[1].eval && !queue_[1].prefetched;
    const bool polling =
        waiting_for_weights_ || prefetching || !in_flight_.empty() ||
        std::any_of(finishing_.begin(), finishing_.end(),
                    [](const Finishing& f) { return f.committing || f.reducing || f.squaring; }) ||
        (sums_ && !finishing_.empty());
    // Block only when nothing can move; otherwise just drain what has arrived.
    RP_ASSIGN_OR_RETURN(auto m, channel_->Receive(worked ? 0 : polling ? 1 : 100));
    while (m) {
      RP_RETURN_IF_ERROR(Handle(*m));
      RP_ASSIGN_OR_RETURN(m, channel_->Receive(0));
    }
  }
  if (const std::string mem = device_->MemoryReport(); !mem.empty()) RP_LOG(INFO) << mem;
  if (shutdown_code_ != 0) return Status::Cancelled("coordinator ended the run with an error");
  return Status::Ok();
}

}  // namespace

void RequestStop() { g_stop = true; }

Status RunWorker(const WorkerOptions& options) {
  // One intra-op thread per worker process: N workers share the host's cores, and a fixed
  // thread count keeps CPU results bit-reproducible.
  at::set_num_threads(1);
  Worker w(options);
  return w.Run();
}

}  // namespace rp::worker
