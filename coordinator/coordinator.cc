// SPDX-License-Identifier: Apache-2.0
#include "coordinator/coordinator.h"

#include <sched.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <future>
#include <map>
#include <optional>
#include <set>
#include <thread>

#include <nlohmann/json.hpp>

#include "common/exit_codes.h"
#include "common/logging.h"
#include "common/session.h"
#include "common/test_hooks.h"
#include "common/time_util.h"
#include "coordinator/grad_arena.h"
#include "coordinator/optim/async_optimizer.h"
#include "coordinator/liveness.h"
#include "coordinator/run_trace.h"
#include "coordinator/training_state.h"
#include "coordinator/optim/optimizer_step.h"
#include "io/data.h"
#include "io/hf_model.h"
#include "io/peft.h"
#include "config/job_config.h"
#include "config/lr_schedule.h"
#include "config/model_spec.h"
#include "planning/partitioner.h"
#include "planning/run_spec.h"
#include "planning/plan.h"
#include "planning/profile.h"
#include "io/run_output.h"
#include "planning/simulator.h"
#include "protocol/channel.h"
#include "protocol/codec.h"
#include "shm/segment.h"

namespace rp::coord {
namespace {

std::atomic<bool> g_stop{false};
std::atomic<bool> g_graceful_stop{false};

using proto::Message;

// One stage job of the current step.
struct JobState {
  int64_t index = 0;  // global launch counter
  int64_t step = 0;
  int call = 0;       // call inside the step
  int stage = 0;
  int worker = 0;
  int next_mb = 0;    // microbatches reported done
  int mb_hw = 0;      // most microbatches ever reported: a replacement re-running the job replays
                      // [0, mb_hw) without counting or forwarding them again
  bool slots_placed = false;  // its gradient slots are in the arena (placed once, kept on re-runs)
  proto::RunJob run{};        // as sent, for re-dispatch
  bool grads_ready = false;
  bool commit_sent = false;
  bool done = false;
  int64_t start_us = 0, fetch_end_us = 0, end_us = 0;
  std::vector<std::pair<int64_t, int64_t>> mb_times;
};

class Coordinator {
 public:
  explicit Coordinator(CoordinatorOptions o) : opts_(std::move(o)) {}
  Status Run();
  // The run stopped early (with a checkpoint) to be resumed on a better plan.
  bool replan_requested() const { return replan_; }

 private:
  Status Setup();
  Status InitState();
  // Frozen parameter f (LoRA base) as fp32, from its compute copy.
  void ReadFrozen(int f, float* out) const;
  // Parameter p's fp32 master: in the optimizer segment, or in the state segment when workers
  // fetch the masters (shm::ArenaLayout::masters_in_state).
  float* Master(int p) const {
    return (layout_.masters_in_state ? *segment_ : *optim_segment_).At<float>(layout_.master[p]);
  }
  Status AcceptWorkers();
  Status Dispatch(int64_t step);
  // Step `step`'s job for (call, stage); indices follow dispatch order (core::StepJobOrder).
  int64_t JobIndex(int64_t step, int call, int stage) const {
    return steps_.at(step).job_at[static_cast<size_t>(call) * plan_.stages.size() + stage];
  }
  Status TryFeed();
  Status Loop();
  Status ReportSteps();
  // The run's stop when step `step` (0-based) turned out non-finite, naming the step and the
  // newest checkpoint, which holds only finite weights.
  Status Diverged(int64_t step) const;
  // Writes the training state after `t + 1` steps if a checkpoint is due then. Called before the
  // optimizer sees step t + 1's first gradient, so masters and moments hold exactly t + 1 updates.
  Status MaybeCheckpoint(int64_t t);
  bool PeriodicCheckpointAfter(int64_t t) const;
  bool FirstCommitMayGo(int64_t step, int stage) const;
  std::vector<StateSection> StateSections();
  int64_t StepH2dBytes() const;
  Status Handle(int rank, const Message& m);
  Status OnMicrobatchDone(int rank, const proto::MicrobatchDone& d);
  Status OnGradsReady(int rank, const proto::GradsReady& g);
  Status OnJobDone(int rank, const proto::JobDone& d);
  Status OnLayerTime(int rank, const proto::LayerTime& t);
  // Evaluation (train.eval_every). The eval after step s reads the weights holding s + 1
  // updates. Its jobs are dispatched when step s is done, before step s + 2's jobs, so in every
  // worker's queue they precede every job that could wait on them. Until they are done the
  // update that would overwrite the compute buffer they read (step s + compute_buffers') is held
  // back: its gradient slots are final but the optimizer hears of it later, in order.
  bool EvalDue(int64_t step) const;
  Status DispatchEval(int64_t step);
  Status OnEvalDone(int rank, const proto::EvalDone& d);
  void FinalizeSlot(int64_t step, int slot);
  void GiveToOptimizer(int64_t step, int slot);
  bool UpdateHeld(int64_t step) const;
  void ReleaseHeldUpdates();
  // The first step a stop requested now can end after (graceful stop, re-plan).
  int64_t EarliestStop() const;
  void OnLinkProbe(int rank, const proto::LinkProbe& p);
  // Profiling (planning/profile.h): the window of timed steps, the profile and prediction written
  // when it is over, the drift check afterwards, and the re-plan decision.
  void SetProfileWindow(int64_t begin);
  Status MaybeFinishProfile();
  // Applies the planner's verdict on a fresh profile once its search (replan_search_) is done.
  Status MaybeReplan();
  void CheckDrift(int64_t step, double step_time_s);
  Status FeedCall(int64_t global_call);
  // The rows of `step`'s input tokens over all its calls, ascending (core::SortedTokenRows).
  std::vector<int64_t> StepRows(int64_t step);
  Status TryCommits(int64_t step);
  StatusOr<JobState*> FindJob(int rank, int64_t index, const char* what);
  std::vector<int> StageGradSlots(int stage) const;
  // Sends to a worker; with restarts allowed a worker that is gone is not an error (its jobs are
  // re-sent to its replacement).
  Status SendTo(int rank, const Message& m);
  bool RestartsAllowed() const { return cfg_.job.max_worker_restarts > 0; }
  // A replacement for a dead worker said Hello: map it and re-send the rank's unfinished jobs.
  Status OnReplacement(int rank, const proto::Hello& hello);
  // Activations live in workers (schedule.activations = "worker", or activation pools) and a
  // worker is gone (`what` happened): the run stops.
  bool ActivationsInWorkers() const { return layout_.activations_in_worker || layout_.activations_in_pools; }
  Status ActivationsLost(const std::string& what) const {
    const char* setting = layout_.activations_in_worker ? "schedule.activations = \"worker\""
                                                        : "schedule.activations = \"cuda_ipc\"";
    return Status::Unavailable(what + "; with " + setting + " the step's hidden states and input gradients "
                               "lived in that worker's memory, so its jobs cannot be re-run: resume from the "
                               "last checkpoint (rp-launch --resume), or use schedule.activations = \"host\" "
                               "to survive worker faults");
  }
  // Activation pools: which worker's pool holds each slot's current contents (-1: none yet), so
  // an InputReady can name the pool a consumer copies from. Indexed like the pool's slots.
  std::vector<int> hidden_owner_, grad_owner_;
  void RecordPoolWrites(const JobState& j, int mb, int rank);
  proto::InputReady InputFor(const JobState& j, int mb) const;
  // Registration with activation pools: every worker's handle, relayed to the others once all
  // have arrived (before any RunJob, so a worker opens its peers' pools before it needs them).
  std::vector<std::optional<proto::ActivationPool>> pools_;
  Status OnActivationPool(int rank, const proto::ActivationPool& p);
  // Tells a worker (first start or replacement) which segment to map.
  Status SendWelcome(int rank);
  // Kills workers silent for longer than job.worker_timeout_s (hung); their replacements take
  // over. Without restarts a hung worker ends the run.
  Status CheckHeartbeats();
  void ShutdownWorkers(int exit_code);

  CoordinatorOptions opts_;
  core::JobConfig cfg_;
  core::RoundShape round_;  // round_, how each step runs: decided once in Setup
  core::ModelSpec spec_;
  core::PipelinePlan plan_;
  shm::ArenaLayout layout_;
  std::optional<shm::Unlinker> unlinker_, optim_unlinker_;  // before the segments: unmapped first
  std::optional<shm::Segment> segment_, optim_segment_;
  std::unique_ptr<GradArena> grad_arena_;
  std::optional<core::Dataset> data_;
  std::optional<proto::RouterChannel> channel_;
  std::optional<core::MetricsWriter> metrics_;
  std::vector<int> worker_pids_;
  std::optional<WorkerLiveness> liveness_;  // who was heard when; hung workers (from Loop on)

  // In-flight work. Steps overlap: step t + 1 is dispatched while step t drains, and its stages
  // start as soon as their layers' weights reach version t + 1.
  struct StepState {
    std::vector<int64_t> job_at;  // [call * stages + stage] -> job index (core::StepJobOrder)
    double loss_scale = 0.0;
    double loss_sum = 0.0;
    int64_t targets = 0;
    int jobs_done = 0;
    double busy_s = 0.0;
    double done_at = -1.0;  // all jobs done (monotonic seconds)
  };
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
    double loss = -1.0;               // set when every job is done
    int64_t targets = 0;
  };
  std::map<int64_t, EvalState> evals_;                   // by step
  std::deque<std::pair<int64_t, int>> held_finals_;      // (step, slot) SlotFinal calls held back
  int64_t last_final_step_ = -1;  // the newest step the optimizer has been given a final slot of
  bool commit_waits_for_optimizer_ = false;  // the last TryCommits pass held a first commit back
  std::optional<core::Dataset> eval_data_;
  std::map<int64_t, StepState> steps_;
  std::map<int64_t, JobState> jobs_;           // by global job index
  std::map<int64_t, int> call_jobs_done_;      // by global call index
  std::set<int64_t> fed_calls_;
  // The current step's input token rows over the calls fed so far (AsyncOptimizer::SetTouchedRows).
  std::set<int64_t> step_rows_;
  int64_t job_counter_ = 0;          // every job's index (stage and eval jobs share it: one queue order)
  int64_t stage_jobs_dispatched_ = 0;  // stage job k runs on worker k mod N (planning/plan.h)
  int64_t eval_jobs_dispatched_ = 0;
  int64_t first_step_ = 0;    // steps done before this invocation (resume)
  int64_t stop_step_ = 0;     // this invocation runs steps [first_step_, stop_step_)
  int64_t checkpointed_ = -1; // steps done in the newest checkpoint written by this invocation
  bool graceful_ = false;     // a graceful stop moved stop_step_ (SIGINT)
  std::optional<StateFile> resume_from_;
  uint64_t state_hash_ = 0;
  int64_t next_step_to_dispatch_ = 0;
  int64_t next_step_to_report_ = 0;
  double run_start_ = 0.0, last_report_at_ = 0.0;
  std::unique_ptr<AsyncOptimizer> optimizer_;

  std::optional<RunTrace> trace_;  // the run's timeline (trace.json), from Setup on
  double busy_s_ = 0.0, makespan_s_ = 0.0;
  int64_t h2d_bytes_per_step_ = 0;  // the same every step: a function of the plan

  // Profiling state.
  std::optional<core::ProfileBuilder> profile_builder_;
  std::vector<core::SimStage> sim_stages_;  // per stage: transfer volumes (explains mb intervals)
  int64_t profile_begin_ = -1, profile_end_ = -1;  // steps [begin, end) are timed
  bool profile_pending_ = false;
  std::map<std::pair<int64_t, int>, double> mb_layer_seconds_;  // (job, mb) -> timed compute
  std::optional<core::PlanChoice> prediction_;  // the plan in use, from the newest profile
  int64_t predicted_from_step_ = -1;             // steps from here on are compared with it
  std::vector<double> measured_step_s_, measured_bubble_;
  int drift_streak_ = 0;
  bool replan_ = false;
  std::string replan_to_;
  // The planner's search over every plan for the newest profile (partition = auto). It runs on
  // its own thread: about 0.1 s of a core for the Qwen3-1.7B job's 1,428 plans, which, run in
  // this loop, held back the workers' next inputs and commits that long (a 56-92 ms gap in the
  // step after the profile on the H200 host, in auto runs only).
  std::future<StatusOr<core::PlanChoice>> replan_search_;
};

Status Coordinator::Setup() {
  RP_ASSIGN_OR_RETURN(core::RunSpec run, core::ReadRunSpecFor(opts_.spec_path, opts_.num_workers));
  cfg_ = std::move(run.job);
  plan_ = std::move(run.plan);
  round_ = core::Round(cfg_);
  spec_ = core::BuildModelSpec(cfg_.model, cfg_.lora);
  trace_.emplace(cfg_.metrics.trace, plan_, round_.microbatches, opts_.num_workers);
  RP_ASSIGN_OR_RETURN(layout_, shm::ComputeLayout(cfg_, spec_, plan_));
  if (layout_.activations_in_worker && opts_.num_workers != 1)
    return Status::InvalidArgument("schedule.activations = \"worker\" keeps activations in the one worker's "
                                   "memory and needs --gpus 1 (this run has " +
                                   std::to_string(opts_.num_workers) + " workers); use \"host\"");
  h2d_bytes_per_step_ = StepH2dBytes();
  profile_builder_.emplace(plan_.num_layers);
  sim_stages_ = core::BuildSimInput(cfg_, spec_, plan_, core::DefaultCostModel(cfg_),
                                    opts_.num_workers, 1).stages;
  RP_ASSIGN_OR_RETURN(auto data, core::Dataset::Open(cfg_));
  data_.emplace(std::move(data));
  if (cfg_.train.eval_every > 0) {
    RP_ASSIGN_OR_RETURN(auto eval, core::Dataset::OpenEval(cfg_));
    eval_data_.emplace(std::move(eval));
  }
  state_hash_ = TrainingStateHash(cfg_, spec_, layout_);
  stop_step_ = cfg_.train.stop_after > 0 ? cfg_.train.stop_after : cfg_.train.steps;
  if (opts_.resume) {
    auto found = FindLatestTrainingState(CheckpointDir(cfg_));
    if (!found.ok()) return Status::InvalidArgument("--resume: " + found.status().message());
    resume_from_ = *found;
    first_step_ = checkpointed_ = found->steps_done;
    if (first_step_ >= cfg_.train.steps)
      return Status::InvalidArgument("--resume: " + found->path + " already holds all " +
                                     std::to_string(cfg_.train.steps) + " steps of this job");
    if (first_step_ >= stop_step_) stop_step_ = cfg_.train.steps;  // the stop that wrote it
    RP_RETURN_IF_ERROR(core::PrepareOutputDirForResume(cfg_, first_step_));
    RP_ASSIGN_OR_RETURN(auto mw, core::MetricsWriter::OpenForAppend(cfg_.job.output_dir + "/metrics.jsonl"));
    metrics_.emplace(std::move(mw));
  } else {
    RP_RETURN_IF_ERROR(core::PrepareOutputDir(cfg_));
    RP_ASSIGN_OR_RETURN(auto mw, core::MetricsWriter::Open(cfg_.job.output_dir + "/metrics.jsonl"));
    metrics_.emplace(std::move(mw));
  }
  RP_LOG(INFO) << "model: " << spec_.params.size() << " tensors, " << spec_.TrainableParams()
               << " trainable parameters; plan " << plan_.Describe() << "; " << opts_.num_workers
               << " workers; segments: state " << layout_.total_bytes / (1 << 20) << " MiB (gradient arena "
               << layout_.grad_arena_bytes / (1 << 20) << " MiB"
               << (layout_.grads_streamed ? ", streamed" : ", every gradient") << "), optimizer "
               << layout_.optim_total_bytes / (1 << 20) << " MiB; workers fetch "
               << (layout_.masters_in_state ? "the fp32 masters (no compute copy)" : "a compute copy")
               << "; activations "
               << (layout_.activations_in_worker ? "kept in the worker's memory"
                   : layout_.activations_in_pools
                       ? "in each worker's activation pool (" + std::to_string(layout_.pool_bytes >> 10) +
                             " KiB per worker, activations = cuda_ipc)"
                       : "in shared-memory slots (" + std::to_string((layout_.total_bytes - layout_.hidden) >> 10) +
                             " KiB)");
  if (layout_.activations_in_pools) {
    pools_.assign(opts_.num_workers, std::nullopt);
    const size_t per_parity = static_cast<size_t>(layout_.parities) * round_.microbatches;
    hidden_owner_.assign(per_parity * layout_.num_hidden, -1);
    grad_owner_.assign(per_parity * layout_.grad_slots_per_mb, -1);
  }
  return Status::Ok();
}

Status Coordinator::InitState() {
  RP_RETURN_IF_ERROR(shm::CheckSharedMemoryRoom(shm::SharedMemoryBytes(layout_, cfg_, opts_.num_workers),
                                                "this job (state and optimizer segments)"));
  const std::string name = shm::StateSegmentName(opts_.session);
  unlinker_.emplace(name);
  RP_ASSIGN_OR_RETURN(auto seg, shm::Segment::Create(name, layout_.total_bytes));
  segment_.emplace(std::move(seg));
  const std::string optim_name = shm::OptimSegmentName(opts_.session);
  optim_unlinker_.emplace(optim_name);
  RP_ASSIGN_OR_RETURN(auto optim_seg, shm::Segment::Create(optim_name, layout_.optim_total_bytes));
  optim_segment_.emplace(std::move(optim_seg));
  grad_arena_ = std::make_unique<GradArena>(
      layout_, segment_->At<std::atomic<uint64_t>>(layout_.grad_table));
  auto* h = segment_->header();
  std::memset(static_cast<void*>(h), 0, sizeof(*h));
  segment_->StampHeader(layout_.hash);
  h->trainable_params = static_cast<uint64_t>(spec_.TrainableParams());
  h->coordinator_pid = ::getpid();
  proto::CopyText(h->session, opts_.session);
  std::optional<core::HfWeights> hf;
  // Needed for the frozen base (always) and for the masters of a fresh start.
  if (!cfg_.model.path.empty() && (!spec_.frozen.empty() || !resume_from_)) {
    RP_ASSIGN_OR_RETURN(auto w, core::HfWeights::Open(cfg_.model.path));
    hf.emplace(std::move(w));
  }
  const bool bf16 = cfg_.train.dtype == core::TrainDtype::kBf16;
  // LoRA's frozen base, on resume too (checkpoints leave it out): the checkpoint (model.path)
  // or the seeded init, straight into its compute copy.
  std::vector<float> staging;
  for (size_t f = 0; f < spec_.frozen.size(); ++f) {
    const auto& ps = spec_.frozen[f];
    float* dst = bf16 ? (staging.resize(static_cast<size_t>(ps.numel)), staging.data())
                      : segment_->At<float>(layout_.frozen[f]);
    if (hf) RP_RETURN_IF_ERROR(hf->Load(ps, dst));
    else core::InitParam(ps, spec_.config, static_cast<uint64_t>(cfg_.train.seed), dst);
    if (bf16) {
      auto* c = segment_->At<uint16_t>(layout_.frozen[f]);
      for (int64_t i = 0; i < ps.numel; ++i) c[i] = FloatToBFloat16(dst[i]);
    }
  }
  std::vector<float>().swap(staging);
  if (resume_from_) {
    // Masters, moments and every compute-copy buffer as they were after first_step_ updates.
    RP_RETURN_IF_ERROR(ReadTrainingState(*resume_from_, state_hash_, layout_.masters_in_state, StateSections()));
    auto* versions = segment_->At<std::atomic<uint64_t>>(layout_.layer_versions);
    for (int l = 0; l < plan_.num_layers; ++l)
      versions[l].store(static_cast<uint64_t>(first_step_), std::memory_order_relaxed);
    segment_->At<std::atomic<uint64_t>>(layout_.lookup_version)->store(static_cast<uint64_t>(first_step_),
                                                                        std::memory_order_relaxed);
    RP_LOG(INFO) << "resumed from " << resume_from_->path << " after step " << first_step_;
  } else {
    // Masters from the Hugging Face checkpoint (model.path; under LoRA the adapter directory
    // lora.init_from) or the seeded init; compute copies from the masters. m and v are zero
    // because a fresh tmpfs object reads as zeros; gradient slots are written before they are read.
    std::optional<core::PeftAdapter> adapter;
    if (spec_.lora.enabled()) {
      hf.reset();  // the checkpoint holds the base, not the adapters
      if (!cfg_.lora.init_from.empty()) {
        RP_ASSIGN_OR_RETURN(auto a, core::PeftAdapter::Open(cfg_.lora.init_from, spec_));
        adapter.emplace(std::move(a));
      }
    }
    for (size_t p = 0; p < spec_.params.size(); ++p) {
      float* master = Master(static_cast<int>(p));
      if (adapter) RP_RETURN_IF_ERROR(adapter->Load(spec_.params[p], master));
      else if (hf) RP_RETURN_IF_ERROR(hf->Load(spec_.params[p], master));  // straight into the arena
      else core::InitParam(spec_, static_cast<int>(p), static_cast<uint64_t>(cfg_.train.seed), master);
      const int64_t n = spec_.params[p].numel;
      if (layout_.masters_in_state) {
        // Workers fetch the master itself: there is no compute copy to fill.
      } else if (bf16) {
        auto* c = segment_->At<uint16_t>(layout_.compute[p]);
        for (int64_t i = 0; i < n; ++i) c[i] = FloatToBFloat16(master[i]);
      } else {
        std::memcpy(segment_->At<float>(layout_.compute[p]), master, n * sizeof(float));
      }
    }
  }
  // The eval set: the same microbatches at every evaluation, written once.
  int64_t eval_targets = 0;
  for (int k = 0; k < layout_.eval_slots; ++k) {
    int64_t* labels = segment_->At<int64_t>(layout_.EvalLabelSlot(k));
    eval_data_->FillEval(k, segment_->At<int64_t>(layout_.EvalTokenSlot(k)), labels);
    for (uint64_t i = 0; i < layout_.tokens_per_mb; ++i) eval_targets += labels[i] != core::kIgnoreIndex;
  }
  if (layout_.eval_slots > 0 && eval_targets == 0)
    return Status::InvalidArgument(std::string(cfg_.data.eval_path.empty() ? "data.eval_fraction" : "data.eval_path") +
                                   ": the eval set (" + std::to_string(layout_.eval_slots) +
                                   " microbatches) has no target tokens");
  h->ready.store(1, std::memory_order_release);
  return Status::Ok();
}

void Coordinator::ReadFrozen(int f, float* out) const {
  const int64_t n = spec_.frozen[f].numel;
  if (cfg_.train.dtype == core::TrainDtype::kBf16) {
    const auto* c = segment_->At<const uint16_t>(layout_.frozen[f]);
    for (int64_t i = 0; i < n; ++i) out[i] = BFloat16ToFloat(c[i]);
  } else {
    std::memcpy(out, segment_->At<const float>(layout_.frozen[f]), n * sizeof(float));
  }
}

Status Coordinator::AcceptWorkers() {
  RP_ASSIGN_OR_RETURN(auto ch, proto::RouterChannel::Bind(ControlEndpoint(opts_.runtime_dir)));
  channel_.emplace(std::move(ch));
  worker_pids_.assign(opts_.num_workers, 0);
  int connected = 0;
  // With activation pools registration also waits for every worker's pool handle, sent after it
  // maps the segment, starts its device and creates the pool.
  auto pools_missing = [&] {
    return layout_.activations_in_pools &&
           std::any_of(pools_.begin(), pools_.end(), [](const auto& p) { return !p.has_value(); });
  };
  double deadline = MonoSeconds() + opts_.hello_timeout_s;
  while (connected < opts_.num_workers || pools_missing()) {
    if (g_stop || g_graceful_stop) return Status::Cancelled("stopped by signal while waiting for workers");
    if (MonoSeconds() > deadline)
      return Status::DeadlineExceeded(connected < opts_.num_workers
                                          ? "only " + std::to_string(connected) + " of " +
                                                std::to_string(opts_.num_workers) + " workers connected within " +
                                                std::to_string(opts_.hello_timeout_s) + " s"
                                          : "not every worker announced its activation pool within " +
                                                std::to_string(opts_.hello_timeout_s) + " s of the last connecting");
    RP_ASSIGN_OR_RETURN(auto env, channel_->Receive(100));
    if (!env) continue;
    // Workers already welcomed send heartbeats while the others connect.
    if (std::holds_alternative<proto::Heartbeat>(env->message)) continue;
    if (const auto* probe = std::get_if<proto::LinkProbe>(&env->message); probe && env->rank < opts_.num_workers) {
      OnLinkProbe(env->rank, *probe);
      continue;
    }
    // With activation pools a welcomed worker announces its pool, or reports that it could not
    // make one (a welcomed worker has no job yet to fail). Strangers fall to the checks below.
    const bool welcomed = layout_.activations_in_pools && env->rank < opts_.num_workers && worker_pids_[env->rank] != 0;
    if (const auto* pool = std::get_if<proto::ActivationPool>(&env->message); pool && welcomed) {
      RP_RETURN_IF_ERROR(OnActivationPool(env->rank, *pool));
      continue;
    }
    if (const auto* failed = std::get_if<proto::JobFailed>(&env->message); failed && welcomed)
      return Status::Unavailable("worker " + std::to_string(env->rank) + " could not set up its activation pool: " +
                                 failed->message);
    const auto* hello = std::get_if<proto::Hello>(&env->message);
    if (!hello || env->rank >= opts_.num_workers || hello->rank != env->rank) {
      RP_LOG(WARNING) << "ignored " << proto::MsgTypeName(proto::TypeOfMessage(env->message))
                      << " from peer w" << env->rank << " during registration";
      continue;
    }
    if (hello->layout_hash != layout_.hash) {
      return Status::ProtocolError("worker " + std::to_string(env->rank) +
                                   " computed a different shared-memory layout from the run spec (a different build?)");
    }
    // A replacement would announce a new pool the others have not opened; nothing to re-run yet.
    if (welcomed)
      return Status::Unavailable("worker " + std::to_string(env->rank) + " restarted while the activation pools "
                                 "were being set up (its log says why)");
    if (worker_pids_[env->rank] == 0 && ++connected == opts_.num_workers) {
      RP_LOG(INFO) << "all " << opts_.num_workers << " workers connected";
      deadline = MonoSeconds() + opts_.hello_timeout_s;  // the pools': CUDA start-up of the last one
    }
    worker_pids_[env->rank] = hello->pid;
    RP_RETURN_IF_ERROR(SendWelcome(env->rank));
    RP_VLOG(1) << "worker " << env->rank << " (pid " << hello->pid << ") connected";
  }
  if (!layout_.activations_in_pools) return Status::Ok();
  for (int to = 0; to < opts_.num_workers; ++to)
    for (int owner = 0; owner < opts_.num_workers; ++owner)
      if (owner != to) RP_RETURN_IF_ERROR(channel_->Send(to, *pools_[owner]));
  RP_LOG(INFO) << "activation pools: " << opts_.num_workers << " x " << (layout_.pool_bytes >> 20)
               << " MiB, handles relayed";
  return Status::Ok();
}

Status Coordinator::OnActivationPool(int rank, const proto::ActivationPool& p) {
  if (!layout_.activations_in_pools || p.rank != rank || p.bytes != layout_.pool_bytes)
    return Status::ProtocolError("worker " + std::to_string(rank) + " announced an activation pool (rank " +
                                 std::to_string(p.rank) + ", " + std::to_string(p.bytes) + " bytes) that this run " +
                                 (layout_.activations_in_pools ? "does not expect (" + std::to_string(layout_.pool_bytes) +
                                                                     " bytes per worker)"
                                                               : std::string("does not use")));
  if (pools_[rank])
    return Status::ProtocolError("worker " + std::to_string(rank) + " announced its activation pool twice");
  pools_[rank] = p;
  return Status::Ok();
}

void Coordinator::RecordPoolWrites(const JobState& j, int mb, int rank) {
  if (!layout_.activations_in_pools) return;
  const core::Stage& st = plan_.stages[j.stage];
  const size_t base = static_cast<size_t>(j.run.parity) * round_.microbatches + mb;
  if (st.kind == core::StageKind::kForward) {
    for (int l = st.begin; l < st.end; ++l)
      if (const int slot = plan_.HiddenSlot(l + 1); slot >= 0)
        hidden_owner_[base * layout_.num_hidden + slot] = rank;
  } else if (st.begin > 0) {  // the tail and backward stages above the embedding
    grad_owner_[base * layout_.grad_slots_per_mb + plan_.GradSlot(st.begin) % layout_.grad_slots_per_mb] = rank;
  }
}

proto::InputReady Coordinator::InputFor(const JobState& j, int mb) const {
  proto::InputReady r{j.index, mb, proto::kFromHostSlot, proto::kFromHostSlot, 0};
  if (!layout_.activations_in_pools) return r;
  const core::Stage& st = plan_.stages[j.stage];
  const size_t base = static_cast<size_t>(j.run.parity) * round_.microbatches + mb;
  if (st.begin > 0) r.hidden_rank = hidden_owner_[base * layout_.num_hidden + plan_.HiddenSlot(st.begin)];
  if (st.kind == core::StageKind::kBackward)
    r.grad_rank = grad_owner_[base * layout_.grad_slots_per_mb + plan_.GradSlot(st.end) % layout_.grad_slots_per_mb];
  return r;
}

StatusOr<JobState*> Coordinator::FindJob(int rank, int64_t index, const char* what) {
  auto it = jobs_.find(index);
  if (it == jobs_.end())
    return Status::ProtocolError(std::string(what) + " from worker " + std::to_string(rank) +
                                 " names job " + std::to_string(index) + ", which is not in flight");
  JobState* j = &it->second;
  if (j->worker != rank)
    return Status::ProtocolError(std::string(what) + " for job " + std::to_string(index) +
                                 " came from worker " + std::to_string(rank) + ", but worker " +
                                 std::to_string(j->worker) + " runs it");
  return j;
}

Status Coordinator::FeedCall(int64_t g) {
  const int64_t K = round_.calls;
  const int64_t step = g / K, call = g % K;
  const int parity = static_cast<int>(g % layout_.parities);
  std::vector<const int64_t*> call_tokens;
  for (int mb = 0; mb < round_.microbatches; ++mb) {
    int64_t* tokens = segment_->At<int64_t>(layout_.TokenSlot(parity, mb));
    data_->Fill(step, call, mb, tokens, segment_->At<int64_t>(layout_.LabelSlot(parity, mb)));
    call_tokens.push_back(tokens);
  }
  // Every row the embedding's lookup gradient can touch this step, given before any of its jobs
  // run. Collected call by call: with three calls or more a call's token slots are refilled (by
  // call + 2) before the step's last call is fed.
  if (call == 0) step_rows_.clear();
  const auto rows = core::SortedTokenRows(call_tokens, cfg_.TokensPerMicrobatch(), cfg_.model.vocab_size);
  if (K == 1) {
    optimizer_->SetTouchedRows(step, rows);
  } else {
    step_rows_.insert(rows.begin(), rows.end());
    if (call == K - 1) optimizer_->SetTouchedRows(step, std::vector<int64_t>(step_rows_.begin(), step_rows_.end()));
  }
  // Rows first (AsyncOptimizer): the next step's rows, known before this step's norm is.
  if (layout_.lookup_from_host && call == K - 1 && step + 1 < stop_step_)
    optimizer_->SetTouchedRows(step + 1, StepRows(step + 1));
  const JobState& first = jobs_.at(JobIndex(step, static_cast<int>(call), 0));
  for (int mb = 0; mb < round_.microbatches; ++mb)
    RP_RETURN_IF_ERROR(SendTo(first.worker, InputFor(first, mb)));
  fed_calls_.insert(g);
  return Status::Ok();
}

std::vector<int64_t> Coordinator::StepRows(int64_t step) {
  // Dataset::Fill is a pure function of (step, call, microbatch): drawing ahead changes nothing.
  const int64_t per_mb = cfg_.TokensPerMicrobatch();
  const int64_t count = round_.calls * round_.microbatches;
  std::vector<int64_t> tokens(static_cast<size_t>(count * per_mb)), labels(static_cast<size_t>(per_mb));
  std::vector<const int64_t*> slots;
  for (int64_t i = 0; i < count; ++i) {
    int64_t* t = tokens.data() + i * per_mb;
    data_->Fill(step, i / round_.microbatches, i % round_.microbatches, t, labels.data());
    slots.push_back(t);
  }
  return core::SortedTokenRows(slots, per_mb, cfg_.model.vocab_size);
}

Status Coordinator::TryFeed() {
  // Global call g uses slot parity g % P, so it may be fed once call g - P is completely done.
  const int64_t K = round_.calls;
  for (int64_t g = next_step_to_report_ * K; g < next_step_to_dispatch_ * K; ++g) {
    if (fed_calls_.count(g)) continue;
    auto prev = call_jobs_done_.find(g - layout_.parities);
    const bool free = g < first_step_ * K + layout_.parities || (prev != call_jobs_done_.end() && prev->second == static_cast<int>(plan_.stages.size()));
    if (!free) break;  // calls are fed in order
    RP_RETURN_IF_ERROR(FeedCall(g));
  }
  return Status::Ok();
}

std::vector<int> Coordinator::StageGradSlots(int stage) const {
  std::vector<int> slots;
  const auto& st = plan_.stages[stage];
  for (int l = st.begin; l < st.end; ++l)
    for (const auto& use : spec_.layer_uses[l]) slots.push_back(use.grad_slot);
  return slots;
}

bool Coordinator::FirstCommitMayGo(int64_t step, int stage) const {
  // The first commit of a step places the stage's slots: the previous step's update must have
  // given them back. In exact mode that is all it needs (the optimizer's second passes run while
  // this step computes, and each slot comes back when its parameter's update is complete). In
  // stale1 mode, and before a checkpoint (which must hold step - 1 whole and nothing of this
  // step), the whole previous update must be complete.
  if ((cfg_.optimizer.mode != core::OptimizerMode::kExact || PeriodicCheckpointAfter(step - 1)) && !optimizer_->Updated(step - 1))
    return false;
  // Also when Updated: the optimizer counts a parameter just before it gives its slots back.
  for (int slot : StageGradSlots(stage))
    if (grad_arena_->IsPlaced(slot)) return false;
  return true;
}

bool Coordinator::PeriodicCheckpointAfter(int64_t t) const {
  return cfg_.checkpoint.every > 0 && (t + 1) % cfg_.checkpoint.every == 0;
}

Status Coordinator::TryCommits(int64_t step) {
  // Gradients of one stage are written in call order (the first overwrites, later ones add), so
  // the float sums do not depend on which worker finishes first.
  const int S = static_cast<int>(plan_.stages.size());
  for (int pos = 0; pos < S * static_cast<int>(round_.calls); ++pos) {
    auto it = jobs_.find(steps_.at(step).job_at[pos]);
    if (it == jobs_.end()) continue;
    JobState& j = it->second;
    if (!j.grads_ready || j.commit_sent) continue;
    // (A job re-dispatched after a worker died may have placed its slots already.)
    if (j.call == 0 && !j.slots_placed && step > 0 && !FirstCommitMayGo(step, j.stage)) {
      commit_waits_for_optimizer_ = true;
      continue;
    }
    if (j.call > 0) {
      auto prev = jobs_.find(JobIndex(step, j.call - 1, j.stage));
      if (prev != jobs_.end() && !prev->second.done) continue;
    }
    // The first call's commit places the stage's slots in the gradient arena; with the arena
    // full it waits for an update to release space (the event loop retries).
    if (j.call == 0 && !j.slots_placed) {
      if (!grad_arena_->Place(StageGradSlots(j.stage))) continue;
      j.slots_placed = true;
    }
    j.commit_sent = true;
    RP_RETURN_IF_ERROR(SendTo(j.worker, proto::CommitGrads{j.index, j.call > 0 ? 1 : 0, 0}));
  }
  return Status::Ok();
}

Status Coordinator::OnMicrobatchDone(int rank, const proto::MicrobatchDone& d) {
  RP_ASSIGN_OR_RETURN(JobState * j, FindJob(rank, d.job_index, "MicrobatchDone"));
  if (d.microbatch != j->next_mb)
    return Status::ProtocolError("worker " + std::to_string(rank) + " finished microbatch " +
                                 std::to_string(d.microbatch) + " of job " +
                                 std::to_string(d.job_index) + ", expected " +
                                 std::to_string(j->next_mb));
  j->next_mb++;
  j->mb_times.emplace_back(d.start_us, d.end_us);
  if (d.microbatch < j->mb_hw) return Status::Ok();  // a replacement's replay: already counted
  j->mb_hw = j->next_mb;
  if (j->run.profile) {
    // What the layer timings and the modelled transfers do not explain is per-microbatch
    // overhead (synchronization, launch gaps, messages): the simulator adds it to every stage.
    // A layer-major job's microbatches have no intervals of their own to take it from; the term
    // then comes from the other stages' microbatches (with auto's plans on the H200 profiles:
    // tail and backward stages only) and is applied to every stage.
    auto key = std::make_pair(j->index, d.microbatch);
    if ((d.flags & proto::kMicrobatchLayerMajor) == 0) {
      profile_builder_->AddMicrobatch(
          static_cast<double>(d.end_us - d.start_us) * 1e-6,
          mb_layer_seconds_[key] + core::TransferSeconds(sim_stages_[j->stage], profile_builder_->H2dBytesPerS(),
                                                         profile_builder_->D2hBytesPerS()));
    }
    mb_layer_seconds_.erase(key);
  }
  StepState& st = steps_.at(j->step);
  st.busy_s += static_cast<double>(d.end_us - d.start_us) * 1e-6;
  if (plan_.stages[j->stage].kind == core::StageKind::kFusedTail) {
    st.loss_sum += d.loss_sum;
    st.targets += d.targets;
  }
  RecordPoolWrites(*j, d.microbatch, rank);
  if (static_cast<size_t>(j->stage) + 1 < plan_.stages.size()) {
    const JobState& next = jobs_.at(JobIndex(j->step, j->call, j->stage + 1));
    RP_RETURN_IF_ERROR(SendTo(next.worker, InputFor(next, d.microbatch)));
  }
  return Status::Ok();
}

Status Coordinator::OnLayerTime(int rank, const proto::LayerTime& t) {
  RP_ASSIGN_OR_RETURN(JobState * j, FindJob(rank, t.job_index, "LayerTime"));
  const core::Stage& stage = plan_.stages[j->stage];
  if (!j->run.profile || t.layer < stage.begin || t.layer >= stage.end || t.microbatch < 0 ||
      t.microbatch >= round_.microbatches || !(t.seconds >= 0))
    return Status::ProtocolError("LayerTime for job " + std::to_string(t.job_index) + " layer " +
                                 std::to_string(t.layer) + " microbatch " + std::to_string(t.microbatch) +
                                 " does not fit the job (not profiled, or out of range)");
  profile_builder_->AddLayer(t.layer, t.phase, t.seconds, static_cast<double>(t.saved_bytes));
  mb_layer_seconds_[{t.job_index, t.microbatch}] += t.seconds;
  return Status::Ok();
}

void Coordinator::OnLinkProbe(int rank, const proto::LinkProbe& p) {
  if (!(p.h2d_bytes_per_s >= 0) || !(p.d2h_bytes_per_s >= 0)) {
    RP_LOG(WARNING) << "dropped a LinkProbe with negative rates from worker " << rank;
    return;
  }
  profile_builder_->AddLink(p.h2d_bytes_per_s, p.d2h_bytes_per_s);
  RP_LOG(INFO) << "worker " << rank << " host link: " << p.h2d_bytes_per_s / 1e9 << " GB/s in, "
               << p.d2h_bytes_per_s / 1e9 << " GB/s out (" << (p.probe_bytes >> 20) << " MiB probe)";
}

void Coordinator::SetProfileWindow(int64_t begin) {
  profile_begin_ = begin;
  profile_end_ = std::min(begin + cfg_.schedule.profile_steps, stop_step_);
  profile_pending_ = profile_end_ > profile_begin_;
  if (profile_pending_)
    RP_LOG(INFO) << "profiling steps " << profile_begin_ + 1 << "-" << profile_end_
                 << " (per-layer times for " << cfg_.job.output_dir << "/profile.json)";
}

Status Coordinator::MaybeFinishProfile() {
  if (!profile_pending_ || next_step_to_report_ < profile_end_ || !optimizer_->Updated(profile_end_ - 1))
    return Status::Ok();
  profile_pending_ = false;
  // The optimizer's rate: parameters updated over the time the pool was busy with them (the
  // union of the per-layer spans; layers of one step may overlap).
  std::vector<double> owned(plan_.num_layers, 0.0);
  for (const auto& p : spec_.params) owned[p.owner_layer] += static_cast<double>(p.numel);
  for (int64_t t = profile_begin_; t < profile_end_; ++t) {
    auto spans = optimizer_->SpansOfStep(t);
    std::sort(spans.begin(), spans.end(), [](const auto& a, const auto& b) { return a.start_us < b.start_us; });
    double busy = 0.0, params = 0.0;
    int64_t covered = std::numeric_limits<int64_t>::min();
    for (const auto& sp : spans) {
      const int64_t from = std::max(sp.start_us, covered);
      if (sp.end_us > from) busy += static_cast<double>(sp.end_us - from) * 1e-6;
      covered = std::max(covered, sp.end_us);
      params += owned[sp.layer];
    }
    profile_builder_->AddOptimizer(params, busy);
    profile_builder_->AddStep();
  }
  auto profile = profile_builder_->Build(cfg_);
  if (!profile.ok()) {
    RP_LOG(WARNING) << "no profile written: " << profile.status().message();
    return Status::Ok();
  }
  const std::string path = cfg_.job.output_dir + "/profile.json";
  RP_RETURN_IF_ERROR(core::SaveProfile(path, *profile));
  prediction_ = core::PredictPlan(cfg_, plan_, *profile, opts_.num_workers);
  predicted_from_step_ = profile_end_;
  measured_step_s_.clear();
  measured_bubble_.clear();
  drift_streak_ = 0;
  RP_LOG(INFO) << "profile of steps " << profile_begin_ + 1 << "-" << profile_end_ << " written to "
               << path << "; prediction for " << plan_.Describe() << ": step "
               << prediction_->step_seconds << " s, bubble " << 100.0 * prediction_->bubble_ratio
               << "%, peak memory per worker " << prediction_->peak_memory_bytes / 1e9 << " GB";
  if (cfg_.schedule.partition != core::Partition::kAuto || cfg_.schedule.replan_gain <= 0) return Status::Ok();
  // A search for an older profile (drift) is waited for and dropped: the new one supersedes it.
  if (replan_search_.valid()) replan_search_.wait();
  replan_search_ = std::async(std::launch::async, [cfg = cfg_, workers = opts_.num_workers, p = *profile] {
    return core::ChoosePlan(cfg, workers, p);
  });
  return Status::Ok();
}

Status Coordinator::MaybeReplan() {
  if (!replan_search_.valid() ||
      replan_search_.wait_for(std::chrono::seconds(0)) != std::future_status::ready)
    return Status::Ok();
  StatusOr<core::PlanChoice> best = Status::Internal("no result");
  try {
    best = replan_search_.get();
  } catch (const std::exception& e) {
    best = Status::Internal(std::string("the planner's search threw: ") + e.what());
  }
  if (!best.ok()) {
    RP_LOG(WARNING) << "no re-plan check for the new profile: " << best.status().message();
    return Status::Ok();
  }
  const bool always = TestAlwaysReplan() || TestReplanOnce();
  if ((!always && (best->plan.Describe() == plan_.Describe() ||
                                 best->step_seconds >= prediction_->step_seconds * (1.0 - cfg_.schedule.replan_gain))))
    return Status::Ok();
  // Restarting costs a checkpoint and a start-up: only worth it with steps left to gain on.
  const int64_t stop_after = EarliestStop();
  if (stop_step_ - stop_after < 3) {
    RP_LOG(INFO) << "the profile favours " << best->plan.Describe() << " (predicted step "
                 << best->step_seconds << " s); too few steps remain to re-plan this run";
    return Status::Ok();
  }
  replan_ = true;
  replan_to_ = best->plan.Describe();
  stop_step_ = std::min(stop_step_, stop_after);
  RP_LOG(WARNING) << "re-planning: " << best->plan.Describe() << " predicts " << best->step_seconds
                  << " s per step against " << prediction_->step_seconds << " s for "
                  << plan_.Describe() << "; stopping after step " << stop_step_
                  << " with a checkpoint to resume on it";
  return Status::Ok();
}

void Coordinator::CheckDrift(int64_t step, double step_time_s) {
  if (!prediction_ || step < predicted_from_step_ || profile_pending_) return;
  measured_step_s_.push_back(step_time_s);
  if (cfg_.schedule.drift <= 0 || cfg_.schedule.profile_steps <= 0) return;
  const double off = std::abs(step_time_s / prediction_->step_seconds - 1.0);
  drift_streak_ = off > cfg_.schedule.drift ? drift_streak_ + 1 : 0;
  if (drift_streak_ < 3) return;
  RP_LOG(WARNING) << "step times drifted from the prediction (" << step_time_s << " s measured, "
                  << prediction_->step_seconds << " s predicted, 3 steps in a row): profiling again";
  profile_builder_->Clear();
  SetProfileWindow(next_step_to_dispatch_);
}

Status Coordinator::OnGradsReady(int rank, const proto::GradsReady& g) {
  RP_ASSIGN_OR_RETURN(JobState * j, FindJob(rank, g.job_index, "GradsReady"));
  if (plan_.stages[j->stage].kind == core::StageKind::kForward || j->next_mb != round_.microbatches)
    return Status::ProtocolError("unexpected GradsReady for job " + std::to_string(g.job_index));
  j->grads_ready = true;
  return TryCommits(j->step);
}

Status Coordinator::OnJobDone(int rank, const proto::JobDone& d) {
  RP_ASSIGN_OR_RETURN(JobState * j, FindJob(rank, d.job_index, "JobDone"));
  const bool needs_commit = plan_.stages[j->stage].kind != core::StageKind::kForward;
  if (j->done || j->next_mb != round_.microbatches || (needs_commit && !j->commit_sent))
    return Status::ProtocolError("premature JobDone for job " + std::to_string(d.job_index));
  j->done = true;
  j->start_us = d.start_us;
  j->fetch_end_us = d.fetch_end_us;
  j->end_us = d.end_us;
  trace_->AddJob({j->index, j->step, j->call, j->stage, j->worker, worker_pids_[j->worker], j->start_us,
                  j->fetch_end_us, j->end_us, j->mb_times});
  const int64_t step = j->step;
  const auto& stage = plan_.stages[j->stage];
  // The last call's commit of a stage makes its layers' gradients final for the step.
  if (stage.kind != core::StageKind::kForward && j->call == round_.calls - 1 &&
      step < stop_step_) {
    if (step > 0) RP_RETURN_IF_ERROR(MaybeCheckpoint(step - 1));
    for (int l = stage.begin; l < stage.end; ++l)
      for (const auto& use : spec_.layer_uses[l]) FinalizeSlot(step, use.grad_slot);
  }
  const int64_t g = step * round_.calls + j->call;
  RP_RETURN_IF_ERROR(TryCommits(step));
  jobs_.erase(d.job_index);
  call_jobs_done_[g]++;
  StepState& st = steps_.at(step);
  if (++st.jobs_done == static_cast<int>(plan_.stages.size() * round_.calls)) {
    st.done_at = MonoSeconds();
    if (EvalDue(step)) RP_RETURN_IF_ERROR(DispatchEval(step));
    // Two steps in flight: the one draining and the next one.
    if (next_step_to_dispatch_ < stop_step_) RP_RETURN_IF_ERROR(Dispatch(next_step_to_dispatch_));
  }
  return TryFeed();
}

Status Coordinator::SendTo(int rank, const Message& m) {
  Status s = channel_->Send(rank, m);
  if (s.ok() || !RestartsAllowed()) return s;
  RP_VLOG(1) << "worker " << rank << " unreachable (" << s.message() << "); its replacement gets the job again";
  return Status::Ok();
}

Status Coordinator::SendWelcome(int rank) {
  proto::Welcome w{};
  w.segment_bytes = layout_.total_bytes;
  w.num_workers = opts_.num_workers;
  proto::CopyText(w.segment_name, segment_->name());
  return channel_->Send(rank, w);
}

Status Coordinator::CheckHeartbeats() {
  const double now = MonoSeconds();
  liveness_->Listening(now);
  for (const auto& v : liveness_->Hung(now, opts_.hello_timeout_s)) {
    const int r = v.rank;
    const std::string who = "worker " + std::to_string(r) + " (pid " + std::to_string(worker_pids_[r]) + ")";
    if (!RestartsAllowed())
      return Status::Unavailable(who + " sent nothing for " + std::to_string(static_cast<int>(v.silent_s)) +
                                 " s (job.worker_timeout_s = " + std::to_string(liveness_->timeout_s()) + "): hung");
    RP_LOG(ERROR) << who << " sent nothing for " << v.silent_s << " s; killing it (hung), "
                  << "its replacement takes over";
    if (worker_pids_[r] > 0) ::kill(worker_pids_[r], SIGKILL);
  }
  return Status::Ok();
}

Status Coordinator::OnReplacement(int rank, const proto::Hello& hello) {
  if (!RestartsAllowed()) {
    RP_LOG(WARNING) << "worker " << rank << " said Hello again mid-run; ignored (job.max_worker_restarts = 0)";
    return Status::Ok();
  }
  if (hello.rank != rank || hello.layout_hash != layout_.hash)
    return Status::ProtocolError("replacement worker " + std::to_string(rank) +
                                 " computed a different shared-memory layout or rank");
  if (ActivationsInWorkers()) return ActivationsLost("worker " + std::to_string(rank) + " was replaced");
  worker_pids_[rank] = hello.pid;
  RP_RETURN_IF_ERROR(SendWelcome(rank));
  // The dead worker's unfinished jobs, in their original order (so the new worker's queue has
  // the same dependency order the round-robin schedule gave the old one), each with the inputs
  // that are already in their slots. What the old worker wrote is overwritten with the same
  // values; its gradients reached shared memory only through a commit, which is redone. An
  // accumulating commit (call > 0) cut short cannot be undone, so that case stops the run.
  const int64_t K = round_.calls;
  const int M = static_cast<int>(round_.microbatches);
  int resent = 0;
  // Eval jobs interleave with stage jobs by index; the replacement's queue must keep that order.
  std::map<int64_t, const proto::RunEval*> evals;
  for (const auto& [step, e] : evals_)
    for (const auto& [index, ej] : e.jobs)
      if (ej.worker == rank && !ej.done) evals.emplace(index, &ej.run);
  auto send_evals_before = [&](int64_t index) -> Status {
    while (!evals.empty() && evals.begin()->first < index) {
      RP_RETURN_IF_ERROR(SendTo(rank, *evals.begin()->second));
      evals.erase(evals.begin());
      resent++;
    }
    return Status::Ok();
  };
  for (auto& [index, j] : jobs_) {
    if (j.worker != rank || j.done) continue;
    RP_RETURN_IF_ERROR(send_evals_before(index));
    if (j.commit_sent && j.call > 0)
      return Status::Unavailable("worker " + std::to_string(rank) + " died while adding job " +
                                 std::to_string(index) + "'s gradients into the shared slots "
                                 "(accumulation call > 0); a partial sum cannot be undone");
    j.next_mb = 0;
    j.grads_ready = j.commit_sent = false;
    j.mb_times.clear();
    RP_RETURN_IF_ERROR(SendTo(rank, j.run));
    resent++;
    int ready = 0;
    if (j.stage == 0) {
      ready = fed_calls_.count(j.step * K + j.call) ? M : 0;
    } else {
      auto prev = jobs_.find(JobIndex(j.step, j.call, j.stage - 1));
      ready = prev == jobs_.end() ? M : prev->second.mb_hw;
    }
    for (int mb = 0; mb < ready; ++mb) RP_RETURN_IF_ERROR(SendTo(rank, InputFor(j, mb)));
  }
  RP_RETURN_IF_ERROR(send_evals_before(std::numeric_limits<int64_t>::max()));
  RP_LOG(WARNING) << "worker " << rank << " replaced by pid " << hello.pid << ": re-dispatched "
                  << resent << " unfinished jobs";
  return Status::Ok();
}

Status Coordinator::Handle(int rank, const Message& m) {
  switch (proto::TypeOfMessage(m)) {
    case proto::MsgType::kMicrobatchDone: return OnMicrobatchDone(rank, std::get<proto::MicrobatchDone>(m));
    case proto::MsgType::kGradsReady: return OnGradsReady(rank, std::get<proto::GradsReady>(m));
    case proto::MsgType::kJobDone: return OnJobDone(rank, std::get<proto::JobDone>(m));
    case proto::MsgType::kJobFailed: {
      const auto& f = std::get<proto::JobFailed>(m);
      // Job -1: the worker's setup failed (its activation pools); a replacement would fail alike.
      if (f.job_index < 0)
        return Status::Unavailable("worker " + std::to_string(rank) + " failed to set up: " + f.message);
      // The worker exits after JobFailed; with restarts allowed its replacement re-runs the job,
      // unless the step's activations lived in it (schedule.activations = "worker").
      if (ActivationsInWorkers())
        return ActivationsLost("worker " + std::to_string(rank) + " failed job " + std::to_string(f.job_index) +
                               ": " + f.message);
      if (RestartsAllowed()) {
        RP_LOG(WARNING) << "worker " << rank << " failed job " << f.job_index << ": " << f.message
                        << " (waiting for its replacement)";
        return Status::Ok();
      }
      return Status::Unavailable("worker " + std::to_string(rank) + " failed job " +
                                 std::to_string(f.job_index) + ": " + f.message);
    }
    case proto::MsgType::kHello: return OnReplacement(rank, std::get<proto::Hello>(m));
    case proto::MsgType::kHeartbeat: return Status::Ok();  // Loop noted the sign of life
    case proto::MsgType::kLayerTime: return OnLayerTime(rank, std::get<proto::LayerTime>(m));
    case proto::MsgType::kEvalDone: return OnEvalDone(rank, std::get<proto::EvalDone>(m));
    case proto::MsgType::kLinkProbe:
      OnLinkProbe(rank, std::get<proto::LinkProbe>(m));
      return Status::Ok();
    case proto::MsgType::kWelcome:
    case proto::MsgType::kRunJob:
    case proto::MsgType::kInputReady:
    case proto::MsgType::kCommitGrads:
    case proto::MsgType::kShutdown:
    case proto::MsgType::kRunEval:
    case proto::MsgType::kActivationPool:  // only during registration
      RP_LOG(WARNING) << "dropped coordinator-bound " << proto::MsgTypeName(proto::TypeOfMessage(m))
                      << " from worker " << rank;
      return Status::Ok();
  }
  return Status::Ok();
}


bool Coordinator::EvalDue(int64_t step) const {
  const int64_t every = cfg_.train.eval_every;
  return every > 0 && step < stop_step_ && ((step + 1) % every == 0 || step + 1 == cfg_.train.steps);
}

Status Coordinator::DispatchEval(int64_t step) {
  EvalState& e = evals_[step];
  for (int k = 0; k < layout_.eval_slots; ++k) {
    EvalJob j;
    j.run = proto::RunEval{job_counter_++, step, step + 1, k, 0};
    // Eval jobs take turns among themselves, so stage jobs keep the phase the planner assumed.
    j.worker = core::WorkerForJob(eval_jobs_dispatched_++, 0, opts_.num_workers);
    RP_RETURN_IF_ERROR(SendTo(j.worker, j.run));
    e.jobs.emplace(j.run.job_index, j);
  }
  e.left = layout_.eval_slots;
  return Status::Ok();
}

Status Coordinator::OnEvalDone(int rank, const proto::EvalDone& d) {
  for (auto& [step, e] : evals_) {
    auto it = e.jobs.find(d.job_index);
    if (it == e.jobs.end()) continue;
    EvalJob& j = it->second;
    if (j.worker != rank || j.done)
      return Status::ProtocolError("EvalDone for eval job " + std::to_string(d.job_index) + " from worker " +
                                   std::to_string(rank) + (j.done ? ", which is already done" : ", which does not run it"));
    j.done = true;
    j.loss_sum = d.loss_sum;
    j.targets = d.targets;
    if (--e.left > 0) return Status::Ok();
    // Summed in slot order, as rp-train-ref does, so the figure does not depend on timing. The
    // set has targets: InitState checked it, and it is the same at every evaluation.
    double sum = 0.0;
    for (const auto& [index, job] : e.jobs) {
      sum += job.loss_sum;
      e.targets += job.targets;
    }
    e.loss = sum / static_cast<double>(e.targets);
    ReleaseHeldUpdates();
    return Status::Ok();
  }
  return Status::ProtocolError("EvalDone for unknown eval job " + std::to_string(d.job_index));
}

bool Coordinator::UpdateHeld(int64_t step) const {
  // Step u's update writes compute buffer (u + 1) % B; an eval after step s reads (s + 1) % B.
  for (const auto& [s, e] : evals_)
    if (e.loss < 0 && step >= s + layout_.compute_buffers) return true;
  return false;
}

void Coordinator::FinalizeSlot(int64_t step, int slot) {
  // Once one is held, later ones queue behind it: the optimizer takes steps in order.
  if (!held_finals_.empty() || UpdateHeld(step)) {
    held_finals_.emplace_back(step, slot);
    return;
  }
  GiveToOptimizer(step, slot);
}

void Coordinator::GiveToOptimizer(int64_t step, int slot) {
  optimizer_->SlotFinal(step, slot);
  last_final_step_ = std::max(last_final_step_, step);
}

void Coordinator::ReleaseHeldUpdates() {
  while (!held_finals_.empty() && !UpdateHeld(held_finals_.front().first)) {
    const auto [step, slot] = held_finals_.front();
    held_finals_.pop_front();
    // A stop (signal, re-plan) moved stop_step_ below it: that step is abandoned, and its update
    // must not reach the checkpoint written at the stop.
    if (step >= stop_step_) continue;
    GiveToOptimizer(step, slot);
  }
}

int64_t Coordinator::EarliestStop() const {
  // Steps whose gradients already reached the optimizer must finish: their updates cannot be
  // taken back, and the checkpoint at the stop must hold whole steps.
  return std::max(next_step_to_report_, last_final_step_) + 1;
}

Status Coordinator::Dispatch(int64_t step) {
  const int64_t targets = data_->CountStepTargets(step);
  if (targets == 0)
    return Status::InvalidArgument("data: step " + std::to_string(step) + " has no target tokens");
  StepState& st = steps_[step];
  st.loss_scale = 1.0 / static_cast<double>(targets);
  const int K = static_cast<int>(round_.calls);
  const int S = static_cast<int>(plan_.stages.size());
  st.job_at.assign(static_cast<size_t>(K) * S, -1);
  for (const auto [c, s] : core::StepJobOrder(plan_, K, core::InterleaveCalls(cfg_))) {
    JobState j;
    j.index = job_counter_++;
    j.step = step;
    j.call = c;
    j.stage = s;
    j.worker = core::WorkerForJob(stage_jobs_dispatched_++, 0, opts_.num_workers);
    // exact: step t reads weights holding t updates; stale1: t - 1 updates, so step t - 1's
    // update overlaps all of step t.
    const int64_t version = cfg_.optimizer.mode == core::OptimizerMode::kStale1 ? std::max<int64_t>(0, step - 1) : step;
    proto::RunJob r{j.index, step, c, s, static_cast<int32_t>((step * K + c) % layout_.parities),
                    static_cast<int32_t>(round_.microbatches), st.loss_scale, version,
                    step >= profile_begin_ && step < profile_end_ ? 1 : 0, 0};
    j.run = r;
    st.job_at[static_cast<size_t>(c) * S + s] = j.index;
    RP_RETURN_IF_ERROR(SendTo(j.worker, r));
    jobs_.emplace(j.index, j);
  }
  // The eval after this step holds back a later update from now on (see UpdateHeld), even if
  // a later step's gradients were to become final before this step is done.
  if (EvalDue(step)) evals_[step];
  next_step_to_dispatch_ = step + 1;
  return TryFeed();
}

int64_t Coordinator::StepH2dBytes() const {
  // What the workers' executors read from host memory in one step: each job's stage weights
  // once, and per microbatch its inputs (tokens or a hidden state; labels for the tail; the
  // incoming gradient for backward stages).
  int64_t h2d = 0;
  const int64_t act = static_cast<int64_t>(layout_.act_elems) * layout_.compute_elem_bytes;
  const int64_t tok = static_cast<int64_t>(layout_.tokens_per_mb) * 8;
  for (const auto& st : plan_.stages) {
    for (int l = st.begin; l < st.end; ++l)
      h2d += spec_.LayerWeightBytes(l, layout_.weights_elem_bytes, layout_.compute_elem_bytes);
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

std::vector<StateSection> Coordinator::StateSections() {
  return {{"optim", optim_segment_->data(), layout_.optim_total_bytes},
          {"compute", segment_->data() + layout_.compute_begin,
           (layout_.compute_end - layout_.compute_begin) * static_cast<uint64_t>(layout_.compute_buffers)}};
}

Status Coordinator::MaybeCheckpoint(int64_t t) {
  const int64_t done = t + 1;
  if (t < first_step_ || done <= checkpointed_) return Status::Ok();
  const bool periodic = PeriodicCheckpointAfter(t);
  const bool last = done == stop_step_ && (cfg_.checkpoint.every > 0 || stop_step_ < cfg_.train.steps);
  if (!periodic && !last) return Status::Ok();
  if (!optimizer_->Updated(t))
    return Status::Internal("checkpoint after step " + std::to_string(done) + " requested before its update finished");
  // Weights updated with a non-finite gradient are no checkpoint to resume from.
  if (const auto norm = optimizer_->GradNorm(t); norm && !std::isfinite(*norm)) return Diverged(t);
  if (last_final_step_ > t)
    return Status::Internal("checkpoint after step " + std::to_string(done) + " requested after step " +
                            std::to_string(last_final_step_ + 1) + "'s gradients reached the optimizer");
  const double t0 = MonoSeconds();
  RP_RETURN_IF_ERROR(WriteTrainingState(CheckpointDir(cfg_), done, state_hash_, layout_.masters_in_state, StateSections(),
                                        static_cast<int>(cfg_.checkpoint.keep)));
  if (const double slow = TestCheckpointDelaySeconds(); slow > 0)  // a slow disk, for the liveness test
    std::this_thread::sleep_for(std::chrono::duration<double>(slow));
  checkpointed_ = done;
  RP_LOG(INFO) << "checkpoint after step " << done << " written to " << CheckpointDir(cfg_) << " in "
               << MonoSeconds() - t0 << " s";
  return Status::Ok();
}

Status Coordinator::Diverged(int64_t step) const {
  const auto norm = optimizer_->GradNorm(step);
  std::string newest = "none (rp-launch starts over)";
  if (checkpointed_ > 0) newest = "the one after step " + std::to_string(checkpointed_);
  return Status::NonFinite("step " + std::to_string(step + 1) + ": the gradient norm is " +
                           (norm ? std::to_string(*norm) : std::string("unknown")) +
                           " (not finite): training diverged, so the run stops and writes no checkpoint from this "
                           "step on. Newest checkpoint: " + newest +
                           "; rp-launch --resume continues from it (with a lower optimizer.lr, say)");
}

Status Coordinator::ReportSteps() {
  // A step is reported when its jobs are done and its gradient norm is known. Its time is the
  // interval since the previous step was reported (since the start for the first), so the sum
  // of step times is the run's wall time and overlap between steps is not counted twice.
  while (next_step_to_report_ < stop_step_) {
    auto it = steps_.find(next_step_to_report_);
    if (it == steps_.end() || it->second.done_at < 0) return Status::Ok();
    auto norm = optimizer_->GradNorm(next_step_to_report_);
    if (!norm) return Status::Ok();
    auto eval = evals_.find(next_step_to_report_);
    if (EvalDue(next_step_to_report_) && (eval == evals_.end() || eval->second.loss < 0)) return Status::Ok();
    StepState& st = it->second;
    const double now = MonoSeconds();
    core::StepMetrics m;
    m.step = next_step_to_report_ + 1;
    m.loss = st.loss_sum / static_cast<double>(st.targets);
    m.lr = optimizer_->LearningRate(next_step_to_report_);
    m.grad_norm = *norm;
    m.tokens = round_.calls * round_.microbatches * cfg_.TokensPerMicrobatch();
    m.step_time_s = now - last_report_at_;
    m.bubble_ratio = std::max(0.0, 1.0 - st.busy_s / (m.step_time_s * opts_.num_workers));
    m.h2d_bytes = h2d_bytes_per_step_;
    if (eval != evals_.end()) {
      m.eval_loss = eval->second.loss;
      m.eval_tokens = eval->second.targets;
      evals_.erase(eval);
    }
    busy_s_ += st.busy_s;
    last_report_at_ = now;
    // A diverged step's metrics are not written: metrics.jsonl keeps the steps a resume repeats.
    if (!std::isfinite(m.loss) || !std::isfinite(m.grad_norm)) return Diverged(next_step_to_report_);
    RP_RETURN_IF_ERROR(metrics_->Append(m));
    if (prediction_ && next_step_to_report_ >= predicted_from_step_) measured_bubble_.push_back(m.bubble_ratio);
    // An evaluation's time lands in its step and the next one: not a drift of the plan.
    if (!EvalDue(next_step_to_report_) && !(next_step_to_report_ > 0 && EvalDue(next_step_to_report_ - 1)))
      CheckDrift(next_step_to_report_, m.step_time_s);
    RP_LOG(INFO) << "step " << m.step << "/" << cfg_.train.steps << " loss " << m.loss << " lr "
                 << m.lr << " grad_norm " << m.grad_norm
                 << (m.eval_loss >= 0 ? " eval_loss " + std::to_string(m.eval_loss) : std::string()) << " "
                 << static_cast<int64_t>(static_cast<double>(m.tokens) / m.step_time_s)
                 << " tokens/s bubble " << static_cast<int>(m.bubble_ratio * 100) << "% ETA "
                 << static_cast<int64_t>((now - run_start_) / static_cast<double>(m.step - first_step_) *
                                         static_cast<double>(stop_step_ - m.step))
                 << " s";
    steps_.erase(it);
    next_step_to_report_++;
  }
  return Status::Ok();
}

Status Coordinator::Loop() {
  run_start_ = last_report_at_ = MonoSeconds();
  liveness_.emplace(opts_.num_workers, cfg_.job.worker_timeout_s, MonoSeconds());
  next_step_to_report_ = next_step_to_dispatch_ = first_step_;
  // The first step of a start is warm-up (allocator, kernel selection, page faults): timed only
  // when it is the only one.
  if (cfg_.schedule.profile_steps > 0)
    SetProfileWindow(stop_step_ - first_step_ >= 2 ? first_step_ + 1 : first_step_);
  RP_RETURN_IF_ERROR(Dispatch(first_step_));
  if (first_step_ + 1 < stop_step_) RP_RETURN_IF_ERROR(Dispatch(first_step_ + 1));
  // Done when every step is reported and the last update is in shared memory (the final drain).
  while (next_step_to_report_ < stop_step_ || !optimizer_->Updated(stop_step_ - 1)) {
    if (g_stop) return Status::Cancelled("stopped by signal at step " + std::to_string(next_step_to_report_ + 1));
    if (g_graceful_stop && !graceful_) {
      // Finish the step being drained; a step already dispatched behind it is abandoned (its
      // gradients never reach the optimizer), then the checkpoint below the loop is written.
      graceful_ = true;
      stop_step_ = std::min(stop_step_, EarliestStop());
      RP_LOG(WARNING) << "interrupted: stopping after step " << stop_step_ << " with a checkpoint";
    }
    // Short waits while a commit waits for the optimizer to give slots back: nothing wakes this
    // loop when it does, and the worker holds those gradients on its device meanwhile.
    RP_ASSIGN_OR_RETURN(auto env, channel_->Receive(jobs_.empty() || commit_waits_for_optimizer_ ? 2 : 20));
    if (env) {
      if (env->rank >= opts_.num_workers) {
        RP_LOG(WARNING) << "dropped a message from unknown worker " << env->rank;
        continue;
      }
      liveness_->Heard(env->rank, MonoSeconds());
      RP_RETURN_IF_ERROR(Handle(env->rank, env->message));
    }
    RP_RETURN_IF_ERROR(CheckHeartbeats());
    // A grant may have been waiting for the previous step's update (see TryCommits).
    commit_waits_for_optimizer_ = false;
    for (const auto& [step, state] : steps_) RP_RETURN_IF_ERROR(TryCommits(step));
    RP_RETURN_IF_ERROR(ReportSteps());
    RP_RETURN_IF_ERROR(MaybeFinishProfile());
    RP_RETURN_IF_ERROR(MaybeReplan());
  }
  makespan_s_ = MonoSeconds() - run_start_;
  // A search still running when the last step is done has no steps left to gain on; its verdict
  // is only logged (after the makespan, which it is no part of).
  if (replan_search_.valid()) {
    replan_search_.wait();
    RP_RETURN_IF_ERROR(MaybeReplan());
  }
  RP_RETURN_IF_ERROR(MaybeCheckpoint(stop_step_ - 1));
  if (replan_) return Status::Ok();  // resumed by rp-launch on the new plan
  if (graceful_ && stop_step_ < cfg_.train.steps)
    return Status::Cancelled("interrupted after step " + std::to_string(stop_step_) +
                             "; checkpoint written, rp-launch --resume continues");
  return Status::Ok();
}

void Coordinator::ShutdownWorkers(int exit_code) {
  if (!channel_) return;
  for (int w = 0; w < opts_.num_workers; ++w) {
    Status s = channel_->Send(w, proto::Shutdown{exit_code, 0});
    if (!s.ok()) RP_VLOG(1) << "shutdown of worker " << w << ": " << s.message();
  }
}

// The optimizer's pool size: --optimizer-threads, else bench.optimizer_threads, else every core this
// process may run on. Leaving a core to each GPU worker's launch thread was measured on the H200
// host and made no difference (21,886 and 22,172 tokens/s against 21,857 and 22,112 with all 16
// cores, alternated on one host), so the pool takes them all.
int OptimizerThreads(const CoordinatorOptions& o, const core::JobConfig& cfg) {
  if (o.optimizer_threads > 0) return o.optimizer_threads;
  if (cfg.bench.optimizer_threads > 0) return static_cast<int>(cfg.bench.optimizer_threads);
  cpu_set_t set;
  int cores = static_cast<int>(std::thread::hardware_concurrency());
  if (sched_getaffinity(0, sizeof(set), &set) == 0) cores = CPU_COUNT(&set);
  return std::max(1, cores);
}

Status Coordinator::Run() {
  RP_RETURN_IF_ERROR(Setup());
  RP_RETURN_IF_ERROR(InitState());
  Status st = AcceptWorkers();
  const int threads = OptimizerThreads(opts_, cfg_);
  RP_LOG(INFO) << "optimizer: " << threads << " threads";
  optimizer_ = std::make_unique<AsyncOptimizer>(cfg_, spec_, layout_, segment_->data(),
                                                optim_segment_->data(), grad_arena_.get(), threads);
  optimizer_->StartAfter(first_step_);
  if (st.ok()) st = Loop();
  const double wall = makespan_s_;
  // Workers exit with the run's code: 3 after a (graceful) interrupt, which the launcher expects.
  ShutdownWorkers(st.ok() ? 0 : st.code() == StatusCode::kCancelled ? kExitInterrupted : 1);
  if (optimizer_) trace_->AddOptimizerSpans(optimizer_->TakeLayerSpans());
  Status trace = trace_->Write(cfg_.job.output_dir + "/trace.json", ::getpid(), worker_pids_);
  if (!trace.ok()) RP_LOG(ERROR) << "trace.json: " << trace.message();
  if (st.ok() && (!cfg_.checkpoint.export_hf.empty() || (spec_.lora.enabled() && !cfg_.lora.export_dir.empty()))) {
    st = core::ExportTrainedModel(
        cfg_, spec_, [&](int p) { return static_cast<const float*>(Master(p)); },
        [&](int f, float* out) { ReadFrozen(f, out); });
    if (st.ok()) RP_LOG(INFO) << "exported the trained model to " << cfg_.job.output_dir;
  }
  if (st.ok()) {
    nlohmann::json summary = {
        {"steps", cfg_.train.steps}, {"first_step", first_step_ + 1}, {"last_step", stop_step_},
        {"num_workers", opts_.num_workers},
        {"plan", plan_.Describe()}, {"trainable_params", spec_.TrainableParams()},
        {"frozen_params", spec_.FrozenParams()},
        {"segment_bytes", layout_.total_bytes}, {"optim_segment_bytes", layout_.optim_total_bytes},
        {"grad_arena_bytes", layout_.grad_arena_bytes}, {"grads_streamed", layout_.grads_streamed},
        {"grad_arena_peak_bytes", grad_arena_->PeakBytes()}, {"wall_s", wall},
        {"tokens_per_s", static_cast<double>((stop_step_ - first_step_) * round_.calls *
                                             round_.microbatches * cfg_.TokensPerMicrobatch()) / wall},
        {"busy_s", busy_s_},
        // bench.merge_calls: the job file's calls that ran as this one round (1 = as written).
        {"merged_calls", round_.merged_calls}};
    if (prediction_) {
      const double measured = core::Median(measured_step_s_);
      summary["prediction"] = {
          {"plan", prediction_->plan.Describe()}, {"costs", prediction_->cost_source},
          {"profiled_steps", {profile_begin_ + 1, profile_end_}},
          {"predicted_step_s", prediction_->step_seconds},
          {"predicted_bubble_ratio", prediction_->bubble_ratio},
          {"predicted_peak_memory_bytes", prediction_->peak_memory_bytes},
          {"measured_steps", measured_step_s_.size()},
          {"measured_median_step_s", measured},
          {"measured_median_bubble_ratio", core::Median(measured_bubble_)},
          {"measured_over_predicted", measured > 0 ? measured / prediction_->step_seconds : -1.0}};
      if (measured > 0)
        RP_LOG(INFO) << "step time: measured " << measured << " s (median of " << measured_step_s_.size()
                     << " steps), predicted " << prediction_->step_seconds << " s ("
                     << 100.0 * (measured / prediction_->step_seconds - 1.0) << "%)";
    }
    if (replan_) summary["replan_to"] = replan_to_;
    RP_RETURN_IF_ERROR(core::WriteFileAtomically(cfg_.job.output_dir + "/summary.json",
                                                 summary.dump(2) + "\n"));
  }
  // Give the Shutdown frames a moment to leave before the socket closes with LINGER 0.
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  return st;
}

}  // namespace

void RequestStop() { g_stop = true; }
void RequestGracefulStop() { g_graceful_stop = true; }

Status RunCoordinator(const CoordinatorOptions& options, bool* replan) {
  Coordinator c(options);
  Status s = c.Run();
  if (replan) *replan = s.ok() && c.replan_requested();
  return s;
}

}  // namespace rp::coord
