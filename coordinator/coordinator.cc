// SPDX-License-Identifier: Apache-2.0
#include "coordinator/coordinator.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>
#include <optional>
#include <thread>

#include <nlohmann/json.hpp>

#include "common/cores.h"
#include "common/exit_codes.h"
#include "common/logging.h"
#include "common/session.h"
#include "common/stop_agreement.h"
#include "common/test_hooks.h"
#include "common/time_util.h"
#include "config/job_config.h"
#include "config/model_spec.h"
#include "coordinator/checkpoint_writer.h"
#include "coordinator/evaluations.h"
#include "coordinator/host_state.h"
#include "optim/async_optimizer.h"
#include "coordinator/progress_beacon.h"
#include "coordinator/run_profiler.h"
#include "coordinator/run_trace.h"
#include "coordinator/run_window.h"
#include "coordinator/step_dispatch.h"
#include "optim/training_state.h"
#include "coordinator/worker_table.h"
#include "io/data.h"
#include "io/hf_model.h"
#include "io/peft.h"
#include "io/run_output.h"
#include "io/tensorboard.h"
#include "planning/plan.h"
#include "planning/run_spec.h"
#include "protocol/channel.h"
#include "protocol/codec.h"

namespace rp::coord {
namespace {

std::atomic<bool> g_stop{false};
std::atomic<bool> g_graceful_stop{false};
// The running coordinator's channel, so a signal handler can wake its loop.
std::atomic<proto::CoordinatorChannel*> g_channel{nullptr};

// How long the loop waits when nothing happens: it bounds only how late a hung worker is noticed
// (everything else it waits for wakes it: messages, the optimizer, the plan search, signals).
constexpr int kLoopWaitMs = 200;
// fp16: a skipped step that leaves the loss scale below fp16's smallest subnormal (2^-24) ends
// the run as diverged: no scaled gradient is large enough to overflow there, so what is not
// finite is the forward itself, and every later step would be skipped too.
constexpr double kLowestLossScale = 0x1p-24;

using proto::Message;

// This process's anonymous resident memory (RssAnon of /proc/self/status), or -1 if unreadable.
int64_t AnonymousResidentBytes() {
  std::ifstream in("/proc/self/status");
  std::string key;
  while (in >> key) {
    if (key == "RssAnon:") {
      int64_t kb = -1;
      in >> kb;
      return kb < 0 ? -1 : kb * 1024;
    }
    in.ignore(std::numeric_limits<std::streamsize>::max(), '\n');
  }
  return -1;
}

// The run's clocks and per-step constants for metrics.jsonl and summary.json.
struct RunTimes {
  double start = 0.0;        // the loop's start (monotonic seconds)
  double last_report = 0.0;  // when the previous step was reported
  double busy_s = 0.0;       // summed microbatch compute over every worker
  double makespan_s = 0.0;
  int64_t h2d_bytes_per_step = 0;  // the same every step: a function of the plan
};

// The glue between the parts: it turns messages into calls on them, decides what a finished job
// means for checkpoints, evaluations and the next step, and reports steps.
class Coordinator {
 public:
  Coordinator(CoordinatorOptions o, proto::CoordinatorChannel* channel)
      : opts_(std::move(o)), channel_(channel) {}
  Status Run();
  // The run stopped early (with a checkpoint) to be resumed on a better plan.
  bool replan_requested() const { return replan_to_.has_value(); }

 private:
  Status Setup();
  Status StartParts();
  Status Loop();
  Status Handle(int rank, const Message& m);
  Status OnJobDone(int rank, const proto::JobDone& d);
  Status OnJobFailed(int rank, const proto::JobFailed& f);
  // A replacement for a dead worker said Hello: welcome it and re-send the rank's unfinished jobs.
  Status OnReplacement(int rank, const proto::Hello& hello);
  // Sends step `step`'s jobs, and its evaluation's gate, and feeds what can be fed.
  Status DispatchStep(int64_t step);
  Status ReportSteps();
  Status MaybeReplan();
  // Writes the training state after `t + 1` steps if a checkpoint is due then. Called before the
  // optimizer sees step t + 1's first gradient, so masters and moments hold exactly t + 1 updates.
  Status MaybeCheckpoint(int64_t t);
  // Writes the exports after `t + 1` steps into <export_hf>-step-<t + 1> (and the adapter's
  // likewise) if checkpoint.export_every asks for them then; called where MaybeCheckpoint is, so
  // the weights hold exactly t + 1 updates. Training waits for the write.
  Status MaybeExport(int64_t t);
  void MaybeStartSnapshot();
  // The run's stop when step `step` (0-based) turned out non-finite, naming the step and the
  // newest checkpoint, which holds only finite weights.
  Status Diverged(int64_t step);
  // fp16: step `step`'s gradients were not finite and it updated nothing (not a divergence).
  bool SkippedStep(int64_t step) const {
    const auto s = optimizer_->Scaling(step);
    return s && s->skipped;
  }
  // The first step a stop requested now can end after (graceful stop, re-plan).
  int64_t EarliestStop() const;
  // Several nodes: reads the agreed stop step once the launcher wrote it, stops there and
  // dispatches what the wait held back.
  Status PollAgreedStop();
  // Device updates (ExecutionPlan::device_update_blocks): each step's update constants to the
  // workers, once the optimizer has the step's norm.
  Status SendStepUpdates();
  int64_t StepH2dBytes() const;
  // Activations live in workers (schedule.activations = "worker", or activation pools) and a
  // worker is gone (`what` happened): the run stops.
  bool ActivationsInWorkers() const { return layout_.activations != core::Activations::kHost; }
  Status ActivationsLost(const std::string& what) const;
  Status Finish(Status st);

  CoordinatorOptions opts_;
  proto::CoordinatorChannel* channel_;          // opts' socket, or a test's channel
  std::optional<proto::RouterChannel> router_;  // the socket, when this process binds it
  core::JobConfig cfg_;
  core::ExecutionPlan exec_;  // the run spec's: how this run executes
  core::RoundShape round_;    // how each step runs: decided once in Setup
  core::ModelSpec spec_;
  core::PipelinePlan plan_;
  shm::ArenaLayout layout_;
  RunWindow window_;
  std::optional<core::Dataset> data_, eval_data_;
  std::optional<core::MetricsWriter> metrics_;
  std::optional<core::TensorBoardWriter>
      tensorboard_;                 // metrics.tensorboard: the same lines as events
  int64_t device_peak_bytes_ = -1;  // the highest any worker has reported
  std::optional<RunTrace> trace_;   // the run's timeline (trace.json)
  struct Checkpoints {
    std::optional<StateFile> resume_from;
    uint64_t state_hash = 0;
    int64_t requested = -1;  // steps done in the newest checkpoint this invocation asked for
    int64_t exported = -1;   // steps done in the newest intermediate export
  } ckpt_;
  std::optional<core::SummaryFile> summary_;  // reserved at the start, written on every path
  std::unique_ptr<ProgressBeacon> beacon_;    // the launcher's sign that this process progresses
  std::unique_ptr<HostState> host_;
  std::unique_ptr<WorkerTable> workers_;
  std::unique_ptr<RunProfiler> profiler_;
  std::unique_ptr<AsyncOptimizer> optimizer_;
  std::unique_ptr<CheckpointWriter> writer_;  // after host_ and optimizer_: its threads use both
  std::unique_ptr<Evaluations> evals_;
  std::unique_ptr<StepDispatch> dispatch_;
  RunTimes times_;
  int64_t skipped_steps_ = 0;  // fp16 steps skipped for gradients not finite
  bool graceful_ = false;      // a graceful stop moved stop_step (SIGINT)
  // Several nodes, interrupted (common/stop_agreement.h): the step this node proposed to stop
  // after, which no dispatch passes until the nodes agree (-1: not waiting for an agreement), and
  // whether a dispatch was held back meanwhile.
  int64_t stop_hold_ = -1;
  bool dispatch_deferred_ = false;
  bool agreed_stop_ = false;              // the run stops after the step the nodes agreed on
  std::optional<std::string> replan_to_;  // the plan the run stopped to resume on
  // Node 0 alone writes checkpoints and exports: the replicas hold the same state.
  bool WritesOutputs() const { return cfg_.nodes.rank == 0; }
  // Sharded state: every node writes its own file of each checkpoint.
  bool WritesCheckpoints() const { return WritesOutputs() || layout_.sharded; }
  // Sharded state: waits until the workers have gathered every node's shares of every layer at
  // `version` (the export reads them, and another node's final gathers need this node's workers).
  Status AwaitGathered(int64_t version);
};

Status Coordinator::ActivationsLost(const std::string& what) const {
  const char* setting = layout_.activations == core::Activations::kWorker
                            ? "schedule.activations = \"worker\""
                            : "schedule.activations = \"cuda_ipc\"";
  return Status::Unavailable(
      what + "; with " + setting +
      " the step's hidden states and input gradients lived in that worker's memory, so its "
      "jobs cannot be re-run: resume from the last checkpoint (rp-launch --resume), or use "
      "schedule.activations = \"host\" to survive worker faults");
}

Status Coordinator::Setup() {
  RP_ASSIGN_OR_RETURN(core::RunSpec run, core::ReadRunSpecFor(opts_.spec_path, opts_.num_workers));
  cfg_ = std::move(run.job);
  exec_ = run.execution;
  plan_ = std::move(run.plan);
  round_ = core::Round(cfg_);
  spec_ = core::BuildModelSpec(cfg_.model, cfg_.lora);
  trace_.emplace(cfg_.metrics.trace, plan_, round_.microbatches, opts_.num_workers);
  RP_ASSIGN_OR_RETURN(layout_, shm::ComputeLayout(cfg_, exec_, spec_, plan_));
  if (layout_.activations == core::Activations::kWorker && opts_.num_workers != 1)
    return Status::InvalidArgument(
        "schedule.activations = \"worker\" keeps activations in the one worker's "
        "memory and needs --gpus 1 (this run has " +
        std::to_string(opts_.num_workers) + " workers); use \"host\"");
  times_.h2d_bytes_per_step = StepH2dBytes();
  RP_ASSIGN_OR_RETURN(auto data, core::Dataset::Open(cfg_));
  if (const std::string packing = data.PackingSummary(); !packing.empty()) RP_LOG(INFO) << packing;
  if (const std::string length = data.LengthSummary(); !length.empty()) RP_LOG(INFO) << length;
  data_.emplace(std::move(data));
  if (cfg_.train.eval_every > 0) {
    RP_ASSIGN_OR_RETURN(auto eval, core::Dataset::OpenEval(cfg_));
    eval_data_.emplace(std::move(eval));
  }
  ckpt_.state_hash = TrainingStateHash(cfg_, spec_, layout_);
  window_.stop_step = cfg_.train.stop_after > 0 ? cfg_.train.stop_after : cfg_.train.steps;
  if (opts_.resume) {
    auto found = FindLatestTrainingState(CheckpointDir(cfg_));
    if (!found.ok()) return Status::InvalidArgument("--resume: " + found.status().message());
    ckpt_.resume_from = *found;
    window_.first_step = ckpt_.requested = found->steps_done;
    if (window_.first_step >= cfg_.train.steps)
      return Status::InvalidArgument("--resume: " + found->path + " already holds all " +
                                     std::to_string(cfg_.train.steps) + " steps of this job");
    if (window_.first_step >= window_.stop_step)
      window_.stop_step = cfg_.train.steps;  // the stop that wrote it
    if (layout_.sharded)
      RP_RETURN_IF_ERROR(RemoveLaterShardFiles(
          CheckpointDir(cfg_), window_.first_step,
          {static_cast<int>(cfg_.nodes.rank), static_cast<int>(cfg_.nodes.count)}));
  }
  // A node that joins a resumed run (more nodes than before) starts its own output directory.
  std::error_code ec;
  const bool node_joins =
      cfg_.nodes.rank > 0 && !std::filesystem::exists(cfg_.job.output_dir + "/metrics.jsonl", ec);
  if (opts_.resume && !node_joins) {
    RP_RETURN_IF_ERROR(core::PrepareOutputDirForResume(cfg_, window_.first_step));
    RP_ASSIGN_OR_RETURN(auto mw,
                        core::MetricsWriter::OpenForAppend(cfg_.job.output_dir + "/metrics.jsonl"));
    metrics_.emplace(std::move(mw));
    if (cfg_.metrics.tensorboard) {
      RP_ASSIGN_OR_RETURN(auto tb,
                          core::TensorBoardWriter::Rebuild(cfg_.job.output_dir + "/tb",
                                                           cfg_.job.output_dir + "/metrics.jsonl"));
      tensorboard_.emplace(std::move(tb));
    }
  } else {
    core::JobConfig fresh = cfg_;
    // Checkpoint.dir is node 0's, which a resumed run reads from: only this node's files count.
    if (node_joins && opts_.resume) fresh.checkpoint.dir = "checkpoints";
    RP_RETURN_IF_ERROR(core::PrepareOutputDir(fresh));
    RP_ASSIGN_OR_RETURN(auto mw, core::MetricsWriter::Open(cfg_.job.output_dir + "/metrics.jsonl"));
    metrics_.emplace(std::move(mw));
    if (cfg_.metrics.tensorboard) {
      RP_ASSIGN_OR_RETURN(auto tb, core::TensorBoardWriter::Create(cfg_.job.output_dir + "/tb"));
      tensorboard_.emplace(std::move(tb));
    }
  }
  RP_ASSIGN_OR_RETURN(auto summary,
                      core::SummaryFile::Reserve(cfg_.job.output_dir + "/summary.json"));
  summary_.emplace(std::move(summary));
  // The run as resolved, beside its checkpoints: what rp-export reads them with.
  if (WritesOutputs())
    RP_RETURN_IF_ERROR(core::WriteRunSpec(cfg_.job.output_dir + "/run-spec.json",
                                          {cfg_, exec_, plan_, opts_.num_workers}));
  // The job as a job file (rp-launch --resume RUN_DIR).
  if (WritesOutputs())
    RP_RETURN_IF_ERROR(
        core::WriteFileAtomically(cfg_.job.output_dir + "/job.toml", core::JobToml(cfg_)));
  RP_LOG(INFO)
      << "model: " << spec_.params.size() << " tensors, " << spec_.TrainableParams()
      << " trainable parameters; plan " << plan_.Describe() << "; " << opts_.num_workers
      << " workers; segments: state " << layout_.total_bytes / (1 << 20) << " MiB (gradient arena "
      << layout_.grad_arena_bytes / (1 << 20) << " MiB"
      << (layout_.grads_streamed ? ", streamed" : ", every gradient") << "), optimizer "
      << layout_.optim_total_bytes / (1 << 20) << " MiB; workers fetch "
      << (layout_.masters_in_state ? "the fp32 masters (no compute copy)" : "a compute copy")
      << "; activations "
      << (layout_.activations == core::Activations::kWorker ? "kept in the worker's memory"
          : layout_.activations == core::Activations::kCudaIpc
              ? "in each worker's activation pool (" + std::to_string(layout_.pool_bytes >> 10) +
                    " KiB per worker, activations = cuda_ipc)"
              : "in shared-memory slots (" +
                    std::to_string((layout_.total_bytes - layout_.hidden) >> 10) + " KiB)");
  return Status::Ok();
}

// The optimizer's pool size: --optimizer-threads, else RP_OPTIMIZER_THREADS, else every core this
// process may run on. Leaving a core to each GPU worker's launch thread made no measurable
// difference (docs/benchmarks.md, "Measurements behind the code's choices"), so the pool takes
// them all.
int OptimizerThreads(const CoordinatorOptions& o, const core::JobConfig& cfg) {
  if (o.optimizer_threads > 0) return o.optimizer_threads;
  if (cfg.bench.optimizer_threads > 0) return static_cast<int>(cfg.bench.optimizer_threads);
  return UsableCores();
}

Status Coordinator::StartParts() {
  RP_ASSIGN_OR_RETURN(
      host_, HostState::Create(cfg_, spec_, plan_, layout_, opts_.session, opts_.num_workers));
  RP_RETURN_IF_ERROR(host_->Fill(ckpt_.resume_from, ckpt_.state_hash, window_.first_step,
                                 eval_data_ ? &*eval_data_ : nullptr));
  if (const double delay = TestFillDelaySeconds(); delay > 0)
    std::this_thread::sleep_for(std::chrono::duration<double>(delay));
  if (!channel_) {
    RP_ASSIGN_OR_RETURN(auto ch, proto::RouterChannel::Bind(ControlEndpoint(opts_.runtime_dir)));
    router_.emplace(std::move(ch));
    channel_ = &*router_;
  }
  g_channel.store(channel_);
  proto::CoordinatorChannel* wake = channel_;
  profiler_ = std::make_unique<RunProfiler>(cfg_, exec_, spec_, plan_, opts_.num_workers,
                                            [wake] { wake->Wake(); });
  WorkerTable::Setup table;
  table.workers = opts_.num_workers;
  table.layout_hash = layout_.hash;
  table.activation_pools = layout_.activations == core::Activations::kCudaIpc;
  table.pool_bytes = layout_.pool_bytes;
  table.segment_name = host_->state().name();
  table.segment_bytes = layout_.total_bytes;
  table.max_restarts = static_cast<int>(cfg_.job.max_worker_restarts);
  table.timeout_s = cfg_.job.worker_timeout_s;
  table.stopped_timeout_s = cfg_.job.stopped_timeout_s;
  table.grace_s = opts_.hello_timeout_s;
  workers_ = std::make_unique<WorkerTable>(*channel_, table);
  const int threads = OptimizerThreads(opts_, cfg_);
  RP_LOG(INFO) << "optimizer: " << threads << " threads";
  optimizer_ = std::make_unique<AsyncOptimizer>(cfg_, exec_, spec_, layout_, host_->state().data(),
                                                host_->optim().data(), &host_->grad_arena(),
                                                threads, [wake] { wake->Wake(); });
  RP_RETURN_IF_ERROR(optimizer_->StartAfter(window_.first_step));
  // The last stage's layers are the first the next step needs and the last whose gradients land.
  if (!plan_.stages.empty()) optimizer_->SpeculateFromLayer(plan_.stages.back().end);
  evals_ = std::make_unique<Evaluations>(cfg_, layout_, window_, *optimizer_, *workers_);
  dispatch_ = std::make_unique<StepDispatch>(
      StepDispatch::Parts{cfg_, exec_, round_, spec_, plan_, layout_, host_->state(), *data_,
                          host_->grad_arena(), *optimizer_, *workers_, *profiler_, window_});
  RP_RETURN_IF_ERROR(workers_->Register(
      opts_.hello_timeout_s, [] { return g_stop || g_graceful_stop; },
      [this](int rank, const proto::LinkProbe& p) { profiler_->OnLinkProbe(rank, p); }));
  // After registration: the copies are sized against the memory left once every worker has
  // started, and their allocation does not count against the workers' wait for Welcome.
  CheckpointWriter::Setup writer;
  writer.dir = CheckpointDir(cfg_);
  writer.state_hash = ckpt_.state_hash;
  writer.masters_in_state = layout_.masters_in_state;
  writer.run = core::RunDefiningValues(cfg_);
  writer.keep = static_cast<int>(cfg_.checkpoint.keep);
  // Else only a final checkpoint, written on the loop.
  writer.background = cfg_.checkpoint.every > 0 && WritesCheckpoints();
  if (layout_.sharded)
    writer.shard = {static_cast<int>(cfg_.nodes.rank), static_cast<int>(cfg_.nodes.count)};
  if (cfg_.checkpoint.memory_gb >= 0)
    writer.memory_bytes = static_cast<int64_t>(cfg_.checkpoint.memory_gb * 1e9);
  writer.params = host_->Placements();
  writer.update_order = optimizer_->UpdateOrder();
  writer_ =
      std::make_unique<CheckpointWriter>(writer, host_->Sections(), *optimizer_, ckpt_.requested);
  if (cfg_.checkpoint.every > 0)
    RP_LOG(INFO) << "checkpoints are written "
                 << (writer_->in_place_bytes() > 0
                         ? std::string("from a partial copy of the state and the live state")
                     : writer_->copies() > 0
                         ? "from " + std::to_string(writer_->copies()) +
                               " copies of the state, in the background"
                         : std::string("on the coordinator's loop (a copy of the state would not "
                                       "fit checkpoint.memory_gb or the host's available memory)"));
  return Status::Ok();
}

Status Coordinator::DispatchStep(int64_t step) {
  RP_RETURN_IF_ERROR(dispatch_->Dispatch(step));
  // The eval after this step holds back a later update from now on (Evaluations), even if a
  // later step's gradients were to become final before this step is done.
  if (evals_->Due(step)) evals_->Expect(step);
  window_.next_to_dispatch = step + 1;
  return dispatch_->TryFeed();
}

Status Coordinator::OnJobDone(int rank, const proto::JobDone& d) {
  device_peak_bytes_ = std::max(device_peak_bytes_, d.device_peak_bytes);
  RP_ASSIGN_OR_RETURN(StageJob job, dispatch_->OnJobDone(rank, d));
  trace_->AddJob({job.index, job.step, job.call, job.stage, job.worker, workers_->pid(job.worker),
                  job.start_us, job.fetch_end_us, job.end_us, job.mb_times});
  const auto& stage = plan_.stages[job.stage];
  // The last call's commit of a stage makes its layers' gradients final for the step.
  if (stage.kind != core::StageKind::kForward && job.call == round_.calls - 1 &&
      job.step < window_.stop_step) {
    if (job.step > 0) RP_RETURN_IF_ERROR(MaybeCheckpoint(job.step - 1));
    if (job.step > 0) RP_RETURN_IF_ERROR(MaybeExport(job.step - 1));
    for (int l = stage.begin; l < stage.end; ++l)
      for (const auto& use : spec_.layer_uses[l]) evals_->FinalizeSlot(job.step, use.grad_slot);
  }
  RP_ASSIGN_OR_RETURN(const bool step_done, dispatch_->Retire(job));
  if (step_done) {
    if (evals_->Due(job.step))
      RP_RETURN_IF_ERROR(evals_->Dispatch(job.step, [this] { return dispatch_->TakeJobIndex(); }));
    // Two steps in flight: the one draining and the next one.
    if (window_.next_to_dispatch < window_.stop_step) {
      if (stop_hold_ >= 0 && window_.next_to_dispatch >= stop_hold_) dispatch_deferred_ = true;
      else RP_RETURN_IF_ERROR(DispatchStep(window_.next_to_dispatch));
    }
  }
  return dispatch_->TryFeed();
}

Status Coordinator::OnJobFailed(int rank, const proto::JobFailed& f) {
  // Job -1: the worker's setup failed (its activation pools); a replacement would fail alike.
  if (f.job_index < 0)
    return Status::Unavailable("worker " + std::to_string(rank) +
                               " failed to set up: " + f.message);
  // The worker exits after JobFailed; with restarts allowed its replacement re-runs the job,
  // unless the step's activations lived in it.
  if (ActivationsInWorkers())
    return ActivationsLost("worker " + std::to_string(rank) + " failed job " +
                           std::to_string(f.job_index) + ": " + f.message);
  if (workers_->restarts_allowed()) {
    RP_LOG(WARNING) << "worker " << rank << " failed job " << f.job_index << ": " << f.message
                    << " (waiting for its replacement)";
    return Status::Ok();
  }
  return Status::Unavailable("worker " + std::to_string(rank) + " failed job " +
                             std::to_string(f.job_index) + ": " + f.message);
}

Status Coordinator::OnReplacement(int rank, const proto::Hello& hello) {
  if (!workers_->restarts_allowed()) {
    RP_LOG(WARNING) << "worker " << rank
                    << " said Hello again mid-run; ignored (job.max_worker_restarts = 0)";
    return Status::Ok();
  }
  if (ActivationsInWorkers())
    return ActivationsLost("worker " + std::to_string(rank) + " was replaced");
  RP_RETURN_IF_ERROR(workers_->Replace(rank, hello));
  return dispatch_->Resend(rank, evals_->Unfinished(rank));
}

Status Coordinator::Handle(int rank, const Message& m) {
  switch (proto::TypeOfMessage(m)) {
    case proto::MsgType::kMicrobatchDone:
      return dispatch_->OnMicrobatchDone(rank, std::get<proto::MicrobatchDone>(m));
    case proto::MsgType::kGradsReady:
      return dispatch_->OnGradsReady(rank, std::get<proto::GradsReady>(m));
    case proto::MsgType::kJobDone: return OnJobDone(rank, std::get<proto::JobDone>(m));
    case proto::MsgType::kJobFailed: return OnJobFailed(rank, std::get<proto::JobFailed>(m));
    case proto::MsgType::kHello: return OnReplacement(rank, std::get<proto::Hello>(m));
    case proto::MsgType::kHeartbeat: return Status::Ok();  // the WorkerTable noted the sign of life
    case proto::MsgType::kLayerTime: {
      const auto& t = std::get<proto::LayerTime>(m);
      RP_ASSIGN_OR_RETURN(StageJob * job, dispatch_->Find(rank, t.job_index, "LayerTime"));
      return profiler_->OnLayerTime(job->run, static_cast<int>(round_.microbatches), t);
    }
    case proto::MsgType::kEvalDone: return evals_->OnEvalDone(rank, std::get<proto::EvalDone>(m));
    case proto::MsgType::kLinkProbe:
      profiler_->OnLinkProbe(rank, std::get<proto::LinkProbe>(m));
      return Status::Ok();
    case proto::MsgType::kWelcome:
    case proto::MsgType::kRunJob:
    case proto::MsgType::kInputReady:
    case proto::MsgType::kCommitGrads:
    case proto::MsgType::kShutdown:
    case proto::MsgType::kRunEval:
    case proto::MsgType::kActivationPool:  // only during registration
    case proto::MsgType::kStepUpdate:
      RP_LOG(WARNING) << "dropped coordinator-bound " << proto::MsgTypeName(proto::TypeOfMessage(m))
                      << " from worker " << rank;
      return Status::Ok();
  }
  return Status::Ok();
}

Status Coordinator::SendStepUpdates() {
  if (exec_.device_update_blocks == 0) return Status::Ok();
  for (const auto& k : optimizer_->TakeStepConstants()) {
    // Every worker: a replacement that holds none of the step's gradients ignores it.
    for (int rank = 0; rank < workers_->size(); ++rank)
      RP_RETURN_IF_ERROR(
          workers_->Send(rank, proto::StepUpdate{k.step, k.adam_step, k.lr, k.grad_scale, 0}));
  }
  return Status::Ok();
}

Status Coordinator::PollAgreedStop() {
  RP_ASSIGN_OR_RETURN(const auto agreed, ReadStepFile(opts_.runtime_dir + "/" + kStopAgreedFile));
  if (!agreed) return Status::Ok();
  if (*agreed < stop_hold_)
    return Status::ProtocolError("the nodes agreed to stop after step " + std::to_string(*agreed) +
                                 ", before this node's proposal " + std::to_string(stop_hold_));
  window_.stop_step = std::min(window_.stop_step, *agreed);
  RP_LOG(WARNING) << "interrupted: the nodes stop after step " << window_.stop_step
                  << " with a checkpoint";
  stop_hold_ = -1;
  agreed_stop_ = true;
  if (dispatch_deferred_ && window_.next_to_dispatch < window_.stop_step)
    RP_RETURN_IF_ERROR(DispatchStep(window_.next_to_dispatch));
  dispatch_deferred_ = false;
  return Status::Ok();
}

int64_t Coordinator::EarliestStop() const {
  // Steps whose gradients already reached the optimizer must finish: their updates cannot be
  // taken back, and the checkpoint at the stop must hold whole steps.
  return std::max(window_.next_to_report, evals_->last_final_step()) + 1;
}

Status Coordinator::MaybeReplan() {
  auto better = profiler_->TakeBetterPlan();
  if (!better) return Status::Ok();
  if (cfg_.nodes.count > 1) {
    RP_LOG(INFO) << "the profile favours " << better->plan.Describe() << " (predicted step "
                 << better->step_seconds
                 << " s); the nodes of a multi-node run keep the plan they share";
    return Status::Ok();
  }
  // Restarting costs a checkpoint and a start-up: only worth it with steps left to gain on.
  const int64_t stop_after = EarliestStop();
  if (window_.stop_step - stop_after < 3) {
    RP_LOG(INFO) << "the profile favours " << better->plan.Describe() << " (predicted step "
                 << better->step_seconds << " s); too few steps remain to re-plan this run";
    return Status::Ok();
  }
  replan_to_ = better->plan.Describe();
  window_.stop_step = std::min(window_.stop_step, stop_after);
  RP_LOG(WARNING) << "re-planning: " << better->plan.Describe() << " predicts "
                  << better->step_seconds << " s per step against " << profiler_->predicted_step_s()
                  << " s for " << plan_.Describe() << "; stopping after step " << window_.stop_step
                  << " with a checkpoint to resume on it";
  return Status::Ok();
}

int64_t Coordinator::StepH2dBytes() const {
  // What the workers' executors read from host memory in one step: each job's stage weights
  // once, and per microbatch its inputs (tokens or a hidden state; labels for the tail; the
  // incoming gradient for backward stages). A frozen base kept on the devices
  // (ExecutionPlan::frozen_on_device) is copied once, in a worker's first jobs, and not counted.
  int64_t h2d = 0;
  const int frozen_elem = exec_.frozen_on_device ? 0 : layout_.compute_elem_bytes;
  const int64_t act = static_cast<int64_t>(layout_.act_elems) * layout_.compute_elem_bytes;
  const int64_t tok = static_cast<int64_t>(layout_.tokens_per_mb) * 8;
  for (const auto& st : plan_.stages) {
    for (int l = st.begin; l < st.end; ++l)
      h2d += spec_.LayerWeightBytes(l, layout_.weights_elem_bytes, frozen_elem);
    // Activations kept in the worker (schedule.activations) or moved between activation pools
    // never cross the host link.
    const int64_t hidden = ActivationsInWorkers() ? 0 : act;
    int64_t per_mb = st.begin == 0 ? tok : hidden;
    if (st.kind == core::StageKind::kFusedTail) per_mb += tok;
    if (st.kind == core::StageKind::kBackward) per_mb += hidden;
    h2d += per_mb * round_.microbatches;
  }
  return h2d * round_.calls;
}

Status Coordinator::MaybeCheckpoint(int64_t t) {
  const int64_t done = t + 1;
  if (!WritesCheckpoints() || t < window_.first_step || done <= ckpt_.requested)
    return Status::Ok();
  const bool periodic = PeriodicCheckpointAfter(cfg_, t);
  const bool last = done == window_.stop_step &&
                    (cfg_.checkpoint.every > 0 || window_.stop_step < cfg_.train.steps);
  if (!periodic && !last) return Status::Ok();
  if (!optimizer_->Updated(t))
    return Status::Internal("checkpoint after step " + std::to_string(done) +
                            " requested before its update finished");
  // Weights updated with a non-finite gradient are no checkpoint to resume from (a step fp16's
  // scaler skipped updated nothing).
  if (const auto norm = optimizer_->GradNorm(t); norm && !std::isfinite(*norm) && !SkippedStep(t))
    return Diverged(t);
  if (evals_->last_final_step() > t)
    return Status::Internal(
        "checkpoint after step " + std::to_string(done) + " requested after step " +
        std::to_string(evals_->last_final_step() + 1) + "'s gradients reached the optimizer");
  ckpt_.requested = done;
  // On the loop (no room for a copy) the write keeps the beacon beating; in the background it
  // only waits for the copy, which the loop started when step t's update was done.
  const ProgressBeacon::Working writing(*beacon_);
  return writer_->Write(done);
}

Status Coordinator::MaybeExport(int64_t t) {
  const int64_t done = t + 1, every = cfg_.checkpoint.export_every;
  if (every <= 0 || !WritesOutputs() || done % every != 0 || done >= cfg_.train.steps ||
      done <= ckpt_.exported || t < window_.first_step)
    return Status::Ok();
  ckpt_.exported = done;
  if (!optimizer_->Updated(t))
    return Status::Internal("export after step " + std::to_string(done) +
                            " requested before its update finished");
  // A step whose gradients were not finite is reported (and stops the run) on its own path.
  if (const auto norm = optimizer_->GradNorm(t); norm && !std::isfinite(*norm)) return Status::Ok();
  core::JobConfig at = cfg_;
  const std::string suffix = "-step-" + std::to_string(done);
  if (!at.checkpoint.export_hf.empty()) at.checkpoint.export_hf += suffix;
  if (!at.lora.export_dir.empty()) at.lora.export_dir += suffix;
  const ProgressBeacon::Working writing(*beacon_);
  RP_RETURN_IF_ERROR(core::ExportTrainedModel(
      at, spec_, [&](int p) { return host_->Weights(p, done); },
      [&](int f, float* out) { host_->ReadFrozen(f, out); }));
  RP_LOG(INFO) << "exported the model after step " << done << " (" << suffix.substr(1) << ")";
  return Status::Ok();
}

// A periodic checkpoint after step t is due and t's update is done: the copy can start while the
// next step computes (CheckpointWriter).
void Coordinator::MaybeStartSnapshot() {
  if (cfg_.checkpoint.every <= 0 || !WritesCheckpoints()) return;
  const int64_t every = cfg_.checkpoint.every;
  const int64_t done = (std::max(ckpt_.requested, window_.first_step) / every + 1) * every;
  if (done > window_.stop_step || !optimizer_->Updated(done - 1) ||
      evals_->last_final_step() >= done)
    return;
  writer_->Snapshot(done);
}

Status Coordinator::Diverged(int64_t step) {
  const auto norm = optimizer_->GradNorm(step);
  // A checkpoint still being written in the background is finished first: it holds finite steps.
  if (writer_) {
    const ProgressBeacon::Working waiting(*beacon_);
    if (Status pending = writer_->Finish(); !pending.ok()) RP_LOG(ERROR) << pending.message();
  }
  std::string newest = "none (rp-launch starts over)";
  if (const int64_t written = writer_ ? writer_->written() : ckpt_.requested; written > 0)
    newest = "the one after step " + std::to_string(written);
  return Status::NonFinite(
      "step " + std::to_string(step + 1) + ": the gradient norm is " +
      (norm ? std::to_string(*norm) : std::string("unknown")) +
      " (not finite): training diverged, so the run stops and writes no checkpoint from this "
      "step on. Newest checkpoint: " +
      newest + "; rp-launch --resume continues from it (with a lower optimizer.lr, say)");
}

Status Coordinator::ReportSteps() {
  // A step is reported when its jobs are done and its gradient norm is known. Its time is the
  // interval since the previous step was reported (since the start for the first), so the sum
  // of step times is the run's wall time and overlap between steps is not counted twice.
  while (window_.next_to_report < window_.stop_step) {
    const int64_t s = window_.next_to_report;
    StepProgress* st = dispatch_->Progress(s);
    if (!st || st->done_at < 0) return Status::Ok();
    auto norm = optimizer_->GradNorm(s);
    if (!norm) return Status::Ok();
    const auto scaling = optimizer_->Scaling(s);
    if (evals_->Due(s) && !evals_->Finished(s)) return Status::Ok();
    const double now = MonoSeconds();
    core::StepMetrics m;
    m.step = s + 1;
    m.loss = st->loss_sum / static_cast<double>(st->targets);
    m.lr = optimizer_->LearningRate(s);
    m.grad_norm = *norm;
    m.tokens = round_.calls * round_.microbatches * cfg_.TokensPerMicrobatch() *
               cfg_.nodes.count;  // every node's
    m.step_time_s = now - times_.last_report;
    m.bubble_ratio = std::max(0.0, 1.0 - st->busy_s / (m.step_time_s * opts_.num_workers));
    m.h2d_bytes = times_.h2d_bytes_per_step;
    m.checkpoints = writer_->TakeCompleted();
    if (auto eval = evals_->Take(s)) {
      m.eval_loss = eval->loss;
      m.eval_tokens = eval->targets;
    }
    if (core::ScalesLoss(cfg_)) {
      m.loss_scale = scaling->scale;
      m.skipped = scaling->skipped;
    }
    times_.busy_s += st->busy_s;
    times_.last_report = now;
    // A diverged step's metrics are not written: metrics.jsonl keeps the steps a resume repeats.
    // fp16: a step whose gradients overflowed was skipped (the scale falls and training goes on),
    // unless the scale has fallen so far that no fp16 gradient is left to overflow.
    if (m.skipped) {
      skipped_steps_++;
      if (scaling->scale_after < kLowestLossScale) return Diverged(s);
      RP_LOG(WARNING) << "step " << m.step << ": gradients not finite at loss scale "
                      << m.loss_scale << "; step skipped, scale now " << scaling->scale_after;
    } else if (!std::isfinite(m.loss) || !std::isfinite(m.grad_norm)) {
      return Diverged(s);
    }
    m.device_peak_bytes = device_peak_bytes_;
    const int64_t anon = AnonymousResidentBytes();
    if (anon >= 0)
      m.host_bytes =
          static_cast<int64_t>(shm::SharedMemoryBytes(layout_, cfg_, opts_.num_workers)) + anon;
    nlohmann::json line;
    RP_RETURN_IF_ERROR(metrics_->Append(m, &line));
    if (tensorboard_) RP_RETURN_IF_ERROR(tensorboard_->Append(line));
    // An evaluation's time lands in its step and the next one: not a drift of the plan.
    profiler_->OnStepReported(s, m.step_time_s, m.bubble_ratio,
                              evals_->Due(s) || (s > 0 && evals_->Due(s - 1)),
                              window_.next_to_dispatch, window_.stop_step);
    RP_LOG(INFO) << "step " << m.step << "/" << cfg_.train.steps << " loss " << m.loss << " lr "
                 << m.lr << " grad_norm " << m.grad_norm
                 << (m.eval_loss >= 0 ? " eval_loss " + std::to_string(m.eval_loss) : std::string())
                 << " " << static_cast<int64_t>(static_cast<double>(m.tokens) / m.step_time_s)
                 << " tokens/s bubble " << static_cast<int>(m.bubble_ratio * 100) << "% ETA "
                 << static_cast<int64_t>((now - times_.start) /
                                         static_cast<double>(m.step - window_.first_step) *
                                         static_cast<double>(window_.stop_step - m.step))
                 << " s";
    dispatch_->Forget(s);
    window_.next_to_report++;
  }
  return Status::Ok();
}

Status Coordinator::Loop() {
  times_.start = times_.last_report = MonoSeconds();
  workers_->StartWatching(MonoSeconds());
  window_.next_to_report = window_.next_to_dispatch = window_.first_step;
  // The first step of a start is warm-up (allocator, kernel selection, page faults): timed only
  // when it is the only one.
  if (cfg_.schedule.profile_steps > 0)
    profiler_->StartWindow(
        window_.stop_step - window_.first_step >= 2 ? window_.first_step + 1 : window_.first_step,
        window_.stop_step);
  RP_RETURN_IF_ERROR(DispatchStep(window_.first_step));
  if (window_.first_step + 1 < window_.stop_step)
    RP_RETURN_IF_ERROR(DispatchStep(window_.first_step + 1));
  // Done when every step is reported and the last update is in shared memory (the final drain).
  beacon_->EnterLoop(MonoSeconds());
  while (window_.next_to_report < window_.stop_step ||
         !optimizer_->Updated(window_.stop_step - 1)) {
    beacon_->LoopTurned(MonoSeconds());
    if (g_stop)
      return Status::Cancelled("stopped by signal at step " +
                               std::to_string(window_.next_to_report + 1));
    if (g_graceful_stop && !graceful_) {
      graceful_ = true;
      if (cfg_.nodes.count > 1) {
        // Every node must stop after the same step: propose the steps dispatched (none is
        // abandoned, since the other nodes' workers may already sum its gradients with this
        // node's), dispatch no later one, and stop after the largest proposal of any node.
        stop_hold_ = std::min(window_.stop_step, window_.next_to_dispatch);
        RP_RETURN_IF_ERROR(WriteStepFile(opts_.runtime_dir + "/" + kStopProposalFile, stop_hold_));
        RP_LOG(WARNING) << "interrupted: proposing to stop after step " << stop_hold_
                        << "; waiting for the other nodes to agree";
      } else {
        // Finish the step being drained; a step already dispatched behind it is abandoned (its
        // gradients never reach the optimizer), then the checkpoint below the loop is written.
        window_.stop_step = std::min(window_.stop_step, EarliestStop());
        RP_LOG(WARNING) << "interrupted: stopping after step " << window_.stop_step
                        << " with a checkpoint";
      }
    }
    if (stop_hold_ >= 0) RP_RETURN_IF_ERROR(PollAgreedStop());
    RP_ASSIGN_OR_RETURN(auto env, workers_->Receive(kLoopWaitMs));
    if (env) RP_RETURN_IF_ERROR(Handle(env->rank, env->message));
    RP_RETURN_IF_ERROR(workers_->CheckHung());
    // A commit may have been waiting for the optimizer to give slots back (StepDispatch).
    RP_RETURN_IF_ERROR(dispatch_->TryCommits());
    RP_RETURN_IF_ERROR(SendStepUpdates());
    RP_RETURN_IF_ERROR(ReportSteps());
    RP_RETURN_IF_ERROR(profiler_->MaybeFinish(window_.next_to_report, *optimizer_));
    RP_RETURN_IF_ERROR(MaybeReplan());
    MaybeStartSnapshot();
    RP_RETURN_IF_ERROR(writer_->Poll());
  }
  beacon_->LeaveLoop();
  times_.makespan_s = MonoSeconds() - times_.start;
  // A search still running when the last step is done has no steps left to gain on; its verdict
  // is only logged (after the makespan, which it is no part of).
  if (profiler_->searching()) {
    profiler_->WaitForSearch();
    RP_RETURN_IF_ERROR(MaybeReplan());
  }
  RP_RETURN_IF_ERROR(MaybeCheckpoint(window_.stop_step - 1));
  RP_RETURN_IF_ERROR(writer_->Finish());
  if (replan_to_) return Status::Ok();  // resumed by rp-launch on the new plan
  if (graceful_ && window_.stop_step < cfg_.train.steps)
    return Status::Cancelled("interrupted after step " + std::to_string(window_.stop_step) +
                             "; checkpoint written, rp-launch --resume continues");
  return Status::Ok();
}

Status Coordinator::AwaitGathered(int64_t version) {
  const auto* gathered = host_->state().At<std::atomic<uint64_t>>(layout_.gathered_versions);
  // The other nodes' workers are alive or the launchers stop the run within job.node_timeout_s.
  const double deadline = MonoSeconds() + cfg_.job.node_timeout_s + 60.0;
  for (const auto& p : spec_.params) {
    const int l = p.owner_layer;
    while (gathered[l].load(std::memory_order_acquire) < static_cast<uint64_t>(version)) {
      if (g_stop)
        return Status::Cancelled("stopped by signal while the workers gathered the last update");
      if (MonoSeconds() > deadline)
        return Status::DeadlineExceeded(
            "layer " + std::to_string(l) + "'s shares of the update after step " +
            std::to_string(version) + " were not gathered from the other nodes within " +
            std::to_string(cfg_.job.node_timeout_s + 60.0) + " s");
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  return Status::Ok();
}

Status Coordinator::Finish(Status st) {
  if (beacon_) beacon_->LeaveLoop();  // what follows (trace, export) is progress, however long
  // The other nodes' last gathers need this node's workers: also after a stop the nodes agreed on
  // (which ends Cancelled, exit 3, and must stay so).
  const bool agreed_stop = agreed_stop_ && !g_stop && st.code() == StatusCode::kCancelled;
  if ((st.ok() || agreed_stop) && layout_.sharded && workers_) {
    Status gathered = AwaitGathered(window_.stop_step);
    if (!gathered.ok()) st = gathered;
  }
  // Workers exit with the run's code: 3 after a (graceful) interrupt, which the launcher expects.
  if (workers_)
    workers_->ShutdownAll(st.ok() ? 0 : st.code() == StatusCode::kCancelled ? kExitInterrupted : 1);
  // Outputs that fail to write after the training itself succeeded (a full disk) still fail the
  // run, and summary.json (whose room was reserved at the start) names them.
  std::vector<std::string> write_errors;
  if (optimizer_) trace_->AddOptimizerSpans(optimizer_->TakeLayerSpans());
  if (trace_ && workers_) {
    Status trace = trace_->Write(cfg_.job.output_dir + "/trace.json", ::getpid(), workers_->pids());
    if (!trace.ok()) {
      RP_LOG(ERROR) << "trace.json: " << trace.message();
      write_errors.push_back("trace.json: " + trace.message());
    }
  }
  if (st.ok() && WritesOutputs() &&
      (!cfg_.checkpoint.export_hf.empty() ||
       (spec_.lora.enabled() && !cfg_.lora.export_dir.empty()))) {
    st = core::ExportTrainedModel(
        cfg_, spec_, [&](int p) { return host_->Weights(p, window_.stop_step); },
        [&](int f, float* out) { host_->ReadFrozen(f, out); });
    if (st.ok()) RP_LOG(INFO) << "exported the trained model to " << cfg_.job.output_dir;
  }
  if (st.ok() && !write_errors.empty())
    st = Status::IoError("training finished, but writing its outputs failed: " +
                         write_errors.front());
  if (summary_) {
    nlohmann::json summary = {
        {"status", st.ok()                               ? "ok"
                   : st.code() == StatusCode::kCancelled ? "interrupted"
                                                         : "failed"},
        {"steps", cfg_.train.steps},
        {"first_step", window_.first_step + 1},
        {"last_step", window_.next_to_report},
        {"num_workers", opts_.num_workers},
        {"plan", plan_.Describe()},
        {"trainable_params", spec_.TrainableParams()},
        {"frozen_params", spec_.FrozenParams()},
        {"segment_bytes", layout_.total_bytes},
        {"optim_segment_bytes", layout_.optim_total_bytes},
        {"grad_arena_bytes", layout_.grad_arena_bytes},
        {"grads_streamed", layout_.grads_streamed},
        {"update_passes", optimizer_ && optimizer_->TwoPasses() ? 2 : 1},
        // RP_MERGE_CALLS: the job file's calls that ran as this one round (1 = as written).
        {"merged_calls", round_.merged_calls},
        {"nodes", cfg_.nodes.count},
        {"node_rank", cfg_.nodes.rank},
        // The shape attention's FLOPs grow with (bench/gpu_bench.sh's MFU counting them).
        {"seq_len", cfg_.data.seq_len},
        {"num_layers", cfg_.model.num_layers},
        {"attention_dim", cfg_.model.num_heads * cfg_.model.head_dim}};
    if (cfg_.train.eval_every >
        0)  // several nodes may split the eval set (core::EvalSplitAcrossNodes)
      summary["eval_microbatches_here"] = core::EvalSplitAcrossNodes(cfg_)
                                              ? cfg_.train.eval_microbatches / cfg_.nodes.count
                                              : cfg_.train.eval_microbatches;
    if (!st.ok()) summary["error"] = st.ToString();
    if (!write_errors.empty()) summary["write_errors"] = write_errors;
    if (host_) summary["grad_arena_peak_bytes"] = host_->grad_arena().PeakBytes();
    // What the run did, for whoever checks it (tests, scripts) without reading logs.
    summary["workers_fetch"] = layout_.masters_in_state ? "masters" : "compute_copy";
    if (optimizer_ && exec_.speculative_update) {
      const auto spec = optimizer_->Speculation();
      summary["speculative_updates"] = {{"confirmed", spec.confirmed}, {"redone", spec.redone}};
    }
    summary["activations"] = layout_.activations == core::Activations::kWorker    ? "worker"
                             : layout_.activations == core::Activations::kCudaIpc ? "cuda_ipc"
                                                                                  : "host";
    if (workers_) {
      summary["worker_replacements"] = workers_->replacements();
      summary["workers_hung"] = workers_->hung();
    }
    if (dispatch_) {
      summary["layer_major_jobs"] = dispatch_->layer_major_jobs();
      summary["jobs_redispatched"] = dispatch_->jobs_redispatched();
    }
    if (profiler_) summary["profiles_written"] = profiler_->profiles_written();
    if (writer_) {
      writer_->TakeCompleted();
      auto all = writer_->all_completed();
      std::sort(all.begin(), all.end(),
                [](const auto& a, const auto& b) { return a.after_step < b.after_step; });
      for (const auto& c : all) summary["checkpoints"].push_back(core::CheckpointJson(c));
    }
    if (st.ok()) {
      const double wall = times_.makespan_s;
      const int64_t tokens = (window_.stop_step - window_.first_step) * round_.calls *
                             round_.microbatches * cfg_.TokensPerMicrobatch() * cfg_.nodes.count;
      summary["last_step"] = window_.stop_step;
      summary["wall_s"] = wall;
      summary["tokens_per_s"] = static_cast<double>(tokens) / wall;
      summary["busy_s"] = times_.busy_s;
      if (core::ScalesLoss(cfg_)) summary["skipped_steps"] = skipped_steps_;
      if (auto prediction = profiler_->Summary(); !prediction.is_null())
        summary["prediction"] = prediction;
      if (replan_to_) summary["replan_to"] = *replan_to_;
    }
    // Error text can carry bytes from anywhere (a worker's message cut mid-character, a path):
    // invalid UTF-8 is replaced, never thrown on.
    if (Status w = summary_->Write(
            summary.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n");
        !w.ok()) {
      RP_LOG(ERROR) << w.message();
      if (st.ok()) st = w;
    }
  }
  // Give the Shutdown frames a moment to leave before the socket closes with LINGER 0.
  if (workers_) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  return st;
}

Status Coordinator::Run() {
  RP_RETURN_IF_ERROR(Setup());
  beacon_ = std::make_unique<ProgressBeacon>(opts_.runtime_dir + "/" + kBeaconFile,
                                             cfg_.job.worker_timeout_s);
  Status st = StartParts();
  if (st.ok()) st = Loop();
  // From here on nothing waits on the channel; a signal must not reach it once it is destroyed.
  g_channel.store(nullptr);
  return Finish(std::move(st));
}

}  // namespace

void RequestStop() {
  g_stop = true;
  if (auto* c = g_channel.load()) c->Wake();
}

void RequestGracefulStop() {
  g_graceful_stop = true;
  if (auto* c = g_channel.load()) c->Wake();
}

Status RunCoordinator(const CoordinatorOptions& options, bool* replan,
                      proto::CoordinatorChannel* channel) {
  Coordinator c(options, channel);
  Status s = c.Run();
  if (replan) *replan = s.ok() && c.replan_requested();
  return s;
}

}  // namespace rp::coord
