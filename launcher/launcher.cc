// SPDX-License-Identifier: Apache-2.0
#include "launcher/launcher.h"
#include "common/environment.h"

#include <signal.h>
#include <sys/stat.h>
#include <sys/mman.h>
#include <sys/file.h>
#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <cstdarg>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <optional>
#include <random>
#include <sstream>
#include <thread>
#include <utility>

#include <nlohmann/json.hpp>

#include "rp_config.h"
#include "common/cores.h"
#include "common/exit_codes.h"
#include "common/logging.h"
#include "common/process_state.h"
#include "common/session.h"
#include "common/time_util.h"
#include "common/stop_agreement.h"
#include "common/unique_fd.h"
#include "config/job_config.h"
#include "config/model_spec.h"
#include "optim/training_state.h"
#include "io/data.h"
#include "io/peft.h"
#include "planning/partitioner.h"
#include "launcher/node_link.h"
#include "launcher/run_secret.h"
#include "launcher/host_gpus.h"
#include "planning/run_spec.h"
#include "planning/plan.h"
#include "planning/profile.h"
#include "io/run_output.h"
#include "planning/simulator.h"
#include "launcher/child_process.h"
#include "launcher/log_pump.h"
#include "shm/layout.h"
#include "shm/segment.h"

namespace rp::launch {
namespace {

namespace fs = std::filesystem;

std::string NewSessionId() {
  std::random_device rd;  // unguessable names: another user cannot predict or pre-create them
  std::ostringstream o;
  for (int i = 0; i < 4; ++i) {
    char buf[9];
    std::snprintf(buf, sizeof(buf), "%08x", rd());
    o << buf;
  }
  return o.str().substr(0, 20);
}

std::string RuntimeBase() {
  const auto xdg = EnvironmentValue("XDG_RUNTIME_DIR");
  if (xdg && !xdg->empty() && ::access(xdg->c_str(), W_OK) == 0) return *xdg;
  return "/tmp";
}

// Holds this run's claim on its names for the launcher's life: an exclusive flock on
// <runtime dir>/owner. The file is locked under a temporary name and then renamed, so another
// launcher never finds it unlocked while this run lives; the lock dies with the process, however
// it dies.
class OwnerLock {
 public:
  static StatusOr<OwnerLock> Take(const std::string& dir) {
    const std::string path = dir + "/" + kOwnerFile, tmp = path + ".tmp";
    OwnerLock l;
    l.fd_ =
        UniqueFd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600));
    if (l.fd_.get() < 0) return Status::FromErrno("creating " + tmp, errno);
    if (::flock(l.fd_.get(), LOCK_EX | LOCK_NB) != 0)
      return Status::FromErrno("locking " + tmp, errno);
    if (::rename(tmp.c_str(), path.c_str()) != 0)
      return Status::FromErrno("renaming " + tmp, errno);
    return l;
  }

 private:
  OwnerLock() = default;
  UniqueFd fd_;
};

// Removes what launchers killed with SIGKILL left behind: runtime directories rp-<id> under
// `base` whose owner lock can be taken (so their launcher is dead), with their shared-memory
// names rp-<id>-*. A live run holds its lock and is never touched; a directory without an owner
// file (an older build's, or one being created) is left alone.
void ReclaimDeadRuns(const std::string& base) {
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(base, ec)) {
    const std::string name = e.path().filename().string();
    if (name.size() != 23 || name.rfind("rp-", 0) != 0 || e.is_symlink(ec) || !e.is_directory(ec))
      continue;
    const UniqueFd owner(
        ::open((e.path() / kOwnerFile).c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW));
    if (owner.get() < 0) continue;
    if (::flock(owner.get(), LOCK_EX | LOCK_NB) == 0) {
      int names = 0;
      for (const auto& m : fs::directory_iterator("/dev/shm", ec)) {
        const std::string segment = m.path().filename().string();
        std::string shm_name = "/";
        shm_name += segment;
        if (segment.rfind(name + "-", 0) == 0 && ::shm_unlink(shm_name.c_str()) == 0) ++names;
      }
      fs::remove_all(e.path(), ec);
      std::fprintf(
          stderr,
          "rp-launch: reclaimed %s and %d shared-memory names left by a launcher that was killed\n",
          e.path().c_str(), names);
    }
  }
}

// Owns the runtime directory: removed (with the control socket in it) on every exit path.
class RuntimeDir {
 public:
  explicit RuntimeDir(std::string path) : path_(std::move(path)) {}
  ~RuntimeDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
    if (ec) RP_LOG(ERROR) << "could not remove " << path_ << ": " << ec.message();
  }
  RuntimeDir(const RuntimeDir&) = delete;
  RuntimeDir& operator=(const RuntimeDir&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

void PrintDryRun(const core::RunSpec& run, int gpus, bool cpu_workers) {
  const core::JobConfig& cfg = run.job;
  auto spec = core::BuildModelSpec(cfg.model, cfg.lora);
  const core::PipelinePlan* plan = &run.plan;
  auto layout = shm::ComputeLayout(cfg, run.execution, spec, *plan);
  if (!layout.ok()) {
    std::fprintf(stderr, "layout: %s\n", layout.status().message().c_str());
    return;
  }
  const double params = static_cast<double>(spec.TrainableParams());
  std::printf("job %s: %lld trainable parameters, %d workers\n", cfg.job.name.c_str(),
              static_cast<long long>(spec.TrainableParams()), gpus);
  if (spec.lora.enabled())
    std::printf(
        "LoRA rank %lld on %zu projection kinds and %zu expert tensors: %lld frozen base "
        "parameters "
        "kept once as the compute copy (%.1f MiB, no master, moments or gradients)\n",
        static_cast<long long>(spec.lora.rank), spec.lora.target_modules.size(),
        spec.lora.target_parameters.size(), static_cast<long long>(spec.FrozenParams()),
        static_cast<double>(layout->frozen_end - layout->frozen_begin) / (1 << 20));
  std::printf("plan: %s (%zu stage jobs per call)\n", plan->Describe().c_str(),
              plan->stages.size());
  if (cfg.train.mlp_tile_tokens > 0)
    std::printf(
        "dense MLPs in tiles of %lld tokens (train.mlp_tile_tokens, as the run spec below holds "
        "it)\n",
        static_cast<long long>(cfg.train.mlp_tile_tokens));
  if (cfg.schedule.keep_attention > 0)
    std::printf(
        "attention kept from the forward for blocks %d..%d (schedule.keep_attention = %lld, as the "
        "run spec below holds it)\n",
        core::KeptAttentionStart(cfg, *plan) - 1, std::min(plan->kept_start, plan->tail_start) - 2,
        static_cast<long long>(cfg.schedule.keep_attention));
  if (core::Round(cfg).merged_calls > 1)
    std::printf(
        "the job's %lld accumulation calls of %lld microbatches run as one round of %lld "
        "(RP_MERGE_CALLS=never runs them one after another)\n",
        static_cast<long long>(cfg.train.accum_calls),
        static_cast<long long>(cfg.train.microbatches),
        static_cast<long long>(core::GlobalRound(cfg).microbatches));
  if (cfg.nodes.count > 1) {
    const int64_t share = core::Round(cfg).microbatches;
    std::printf(
        "node %lld of %lld: microbatches %lld..%lld of each round of %lld run here; the plan and "
        "the "
        "prediction below are this node's share\n",
        static_cast<long long>(cfg.nodes.rank), static_cast<long long>(cfg.nodes.count),
        static_cast<long long>(core::StepMicrobatch(cfg, 0, 0)),
        static_cast<long long>(core::StepMicrobatch(cfg, 0, share - 1)),
        static_cast<long long>(core::GlobalRound(cfg).microbatches));
  }
  if (plan->kept_start < plan->tail_start)
    std::printf(
        "kept blocks: %d (layers %d-%d keep their forward graphs on the device for their backward "
        "instead of being recomputed)\n",
        plan->tail_start - plan->kept_start, plan->kept_start, plan->tail_start - 1);
  if (auto costs = core::PlanningProfile(cfg); costs.ok()) {
    auto p = core::PredictPlan(cfg, *plan, *costs, gpus);
    std::printf(
        "predicted step %.4f s, predicted bubble ratio %.1f%% (%s costs; rp-plan shows more)\n",
        p.step_seconds, 100.0 * p.bubble_ratio, p.cost_source.c_str());
    if (!cpu_workers)
      std::printf(
          "estimated device memory per worker: %.1f GiB (the planner's estimate; "
          "schedule.gpu_memory_gb bounds it for partition = \"auto\")\n",
          p.peak_memory_bytes / (1ull << 30));
    if (auto alt = cpu_workers ? std::nullopt
                               : core::FrozenOnDeviceAlternative(cfg, gpus, *costs, p.step_seconds))
      std::printf(
          "schedule.frozen_on_device = true would keep the %.1f GiB frozen base on each GPU and "
          "fetch only "
          "the adapters: predicted step %.4f s (plan %s), estimated device memory %.1f GiB per "
          "worker\n",
          alt->memory.frozen / (1ull << 30), alt->step_seconds, alt->plan.Describe().c_str(),
          alt->peak_memory_bytes / (1ull << 30));
  }
  std::printf("workers fetch %s\n",
              !layout->masters_in_state ? "a compute copy the optimizer writes"
              : layout->compute_elem_bytes == 2
                  ? "the fp32 masters and round them to bf16 (no compute copy)"
                  : "the fp32 masters (no compute copy)");
  if (run.execution.NextStepWaitsForUpdate())
    std::printf("optimizer updates: %s\n",
                run.execution.two_pass_updates
                    ? "two passes (what workers fetch, then the moments while the next step "
                      "computes; optimizer.update_passes)"
                    : "one pass (optimizer.update_passes)");
  if (layout->activations == core::Activations::kCudaIpc)
    std::printf(
        "activations: in each worker's activation pool, %.1f MiB per worker (%s), copied device to "
        "device by the consumer (activations = \"cuda_ipc\")\n",
        static_cast<double>(layout->pool_bytes) / (1 << 20),
        cfg.job.device == core::DeviceKind::kCpu ? "a shared-memory object per CPU worker"
                                                 : "device memory");
  const uint64_t acts = layout->total_bytes - layout->tokens;
  std::printf(
      "shared memory: %.1f MiB = %.2f bytes per trainable parameter (state segment %.1f MiB: "
      "gradient arena %.1f MiB%s, activation slots %.1f MiB; optimizer segment %.1f MiB)\n",
      static_cast<double>(layout->total_bytes + layout->optim_total_bytes) / (1 << 20),
      static_cast<double>(layout->total_bytes + layout->optim_total_bytes) / params,
      static_cast<double>(layout->total_bytes) / (1 << 20),
      static_cast<double>(layout->grad_arena_bytes) / (1 << 20),
      layout->grads_streamed ? " streamed" : " holding every gradient",
      static_cast<double>(acts) / (1 << 20),
      static_cast<double>(layout->optim_total_bytes) / (1 << 20));
}

// The GPUs a CUDA worker may use: CUDA_VISIBLE_DEVICES's entries when it is set, else the
// /dev/nvidia<N> device nodes; -1 when neither says (the workers' own start-up then decides).
int VisibleGpus() {
  if (const auto v = EnvironmentValue("CUDA_VISIBLE_DEVICES")) {
    int n = 0;
    const std::string& list = *v;
    for (size_t at = 0; at <= list.size();) {
      const size_t comma = std::min(list.find(',', at), list.size());
      const std::string entry = list.substr(at, comma - at);
      // CUDA stops at the first invalid entry ("-1" hides every device).
      if (entry.empty() || entry[0] == '-') break;
      ++n;
      at = comma + 1;
    }
    return n;
  }
  int n = 0;
  std::error_code ec;
  bool any = false;
  for (const auto& e : fs::directory_iterator("/dev", ec)) {
    const std::string name = e.path().filename().string();
    if (name.size() > 6 && name.rfind("nvidia", 0) == 0 &&
        name.find_first_not_of("0123456789", 6) == std::string::npos) {
      ++n;
      any = true;
    }
  }
  return any ? n : -1;
}

// The newest training checkpoint of the output directory fits this job (header checks; the
// coordinator verifies every byte's checksum when it loads it) and was written by this run: its
// run-defining values equal the job's, or `force` and the differences are logged.
Status CheckResumable(const core::JobConfig& cfg, const core::ModelSpec& spec,
                      const shm::ArenaLayout& layout, bool force) {
  auto latest = coord::FindLatestTrainingState(coord::CheckpointDir(cfg));
  // No checkpoint to resume is the user's situation, not a fault: said as one.
  if (!latest.ok()) return Status::InvalidArgument(latest.status().message());
  const coord::StateFile& found = *latest;
  if (found.steps_done >= cfg.train.steps)
    return Status::InvalidArgument(found.path + " already holds all " +
                                   std::to_string(cfg.train.steps) + " steps of this job");
  RP_RETURN_IF_ERROR(coord::ReadTrainingStateShares(found, cfg, spec, layout,
                                                    coord::TrainingStateHash(cfg, spec, layout),
                                                    /*optim=*/nullptr, /*state=*/nullptr));
  RP_ASSIGN_OR_RETURN(const core::RunRecord recorded, coord::ReadRunRecord(found));
  if (recorded.empty()) return Status::Ok();  // written before checkpoints recorded their run
  const std::vector<std::string> differences =
      core::RunDifferences(recorded, core::RunDefiningValues(cfg));
  if (differences.empty()) return Status::Ok();
  std::string listed;
  for (const auto& d : differences) listed += "\n  " + d;
  if (!force)
    return Status::InvalidArgument(
        found.path + " is another run's checkpoint: " + std::to_string(differences.size()) +
        " key(s) that decide the training differ" + listed +
        "\n(--force-resume continues from it anyway)");
  RP_LOG(WARNING) << "--force-resume: " << found.path
                  << " was written by a run whose keys differ:" << listed;
  return Status::Ok();
}

// Seconds since the coordinator's last beat; 0 before its first (the file does not exist yet).
double SecondsSinceBeat(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return 0.0;
  timespec now{};
  ::clock_gettime(CLOCK_REALTIME, &now);
  return static_cast<double>(now.tv_sec - st.st_mtim.tv_sec) +
         static_cast<double>(now.tv_nsec - st.st_mtim.tv_nsec) * 1e-9;
}

// OUTPUT_DIR/logs/<run id>, made without following links: the output directory may be a link
// (the user's choice), but logs must be a directory we made or found, not a link planted there,
// and the run's own directory is new (EEXIST would mean someone else made it).
Status MakeLogDir(const std::string& output_dir, const std::string& log_dir) {
  std::error_code ec;
  fs::create_directories(output_dir, ec);
  if (ec)
    return Status::InvalidArgument("cannot create job.output_dir " + output_dir + ": " +
                                   ec.message());
  const std::string logs = output_dir + "/logs";
  if (::mkdir(logs.c_str(), 0755) != 0 && errno != EEXIST)
    return Status::InvalidArgument("cannot create " + logs + ": " + std::strerror(errno));
  struct stat st {};
  if (::lstat(logs.c_str(), &st) != 0 || !S_ISDIR(st.st_mode))
    return Status::InvalidArgument(
        logs +
        " is not a directory (a symbolic link or a file); the launcher does not "
        "follow links it did not create");
  if (::mkdir(log_dir.c_str(), 0755) != 0)
    return Status::InvalidArgument("cannot create " + log_dir + ": " + std::strerror(errno));
  return Status::Ok();
}

// CPU workers compute in host memory: `cpu_worker` is one worker's estimate (EstimateMemory as
// the workers run). When they and the segments (`bytes`) exceed what is available, the reason,
// naming the estimate's largest part; empty when they fit or the host does not say.
std::string CpuWorkersOverHostMemory(const core::JobConfig& cfg, uint64_t bytes, int workers,
                                     const core::MemoryEstimate& cpu_worker) {
  const uint64_t avail = shm::AvailableHostMemory();
  const double need = static_cast<double>(bytes) + workers * cpu_worker.total;
  if (avail == 0 || need <= static_cast<double>(avail)) return "";
  auto gib = [](double b) {
    char t[32];
    std::snprintf(t, sizeof(t), "%.1f GiB", b / static_cast<double>(1ull << 30));
    return std::string(t);
  };
  std::string why = "job " + cfg.job.name + ": each of the " + std::to_string(workers) +
                    " CPU workers needs about " + gib(cpu_worker.total) +
                    " by the planner's estimate";
  if (cpu_worker.attention_scores > 0.5 * cpu_worker.total)
    why += " (" + gib(cpu_worker.attention_scores) +
           " of it attention scores, which CPU workers keep for every pair of positions: they grow "
           "with the "
           "square of data.seq_len = " +
           std::to_string(cfg.data.seq_len) + ")";
  else why += " (rp-plan prints its parts)";
  return why + ", " + gib(need) +
         " with the shared memory, and the host (or its memory cgroup) has " +
         gib(static_cast<double>(avail)) +
         " available; shorter sequences, fewer workers, train.layer_recompute " + "or CUDA workers";
}

// Before any process starts: the segments (`bytes`) must fit /dev/shm (a hard limit: tmpfs would
// SIGBUS mid-run), and should fit the available host memory (a warning: swap may still hold them,
// but CUDA workers pin the state segment and pinned pages cannot be swapped). CPU workers and the
// segments beyond the available memory are refused: a worker swapping its attention scores would
// not finish a layer before it is taken for a hung one.
Status CheckHostMemory(const core::JobConfig& cfg, uint64_t bytes, int workers,
                       const std::optional<core::MemoryEstimate>& cpu_worker) {
  if (Status room = shm::CheckSharedMemoryRoom(bytes, "job " + cfg.job.name); !room.ok())
    return Status::InvalidArgument(room.message() +
                                   " (rp-launch --dry-run shows where the bytes go)");
  if (cpu_worker)
    if (std::string why = CpuWorkersOverHostMemory(cfg, bytes, workers, *cpu_worker); !why.empty())
      return Status::InvalidArgument(why);
  const uint64_t avail = shm::AvailableHostMemory();
  if (avail > 0 && bytes > avail)
    std::fprintf(stderr,
                 "rp-launch: warning: job %s needs %.1f GiB of shared memory and the host (or its "
                 "memory cgroup) has "
                 "%.1f GiB available; expect swapping, or the kernel's OOM killer\n",
                 cfg.job.name.c_str(), static_cast<double>(bytes) / (1ull << 30),
                 static_cast<double>(avail) / (1ull << 30));
  return Status::Ok();
}

// One launch: a coordinator and its workers until the coordinator ends the run (or asks to be
// resumed on a new plan: kExitReplan).
// What every node of a multi-node run must have resolved alike: a readable summary (plan, workers,
// first step) and a fingerprint of the whole run spec, leaving out the node's own rank and the
// paths, which may differ between hosts (mount points) for the same files.
std::string NodeRunFingerprint(const core::RunSpec& run, bool resume) {
  auto spec = nlohmann::json::parse(core::RunSpecJson(run));
  auto& job = spec["job"];
  job["nodes"].erase("rank");
  job.erase("source_path");
  job["job"].erase("output_dir");
  job["model"].erase("path");
  job["data"].erase("path");
  job["data"].erase("eval_path");
  job["lora"].erase("init_from");
  job["lora"].erase("export_dir");
  job["checkpoint"].erase("dir");
  job["checkpoint"].erase("export_hf");
  job["schedule"].erase("profile");
  int64_t first_step = 0;
  if (resume)
    if (auto found = coord::FindLatestTrainingState(coord::CheckpointDir(run.job)); found.ok())
      first_step = found->steps_done;
  char hash[17];
  std::snprintf(hash, sizeof(hash), "%016zx", std::hash<std::string>{}(spec.dump()));
  return run.plan.Describe() + ", " + std::to_string(run.workers) + " workers, from step " +
         std::to_string(first_step) + " (job " + hash + ")";
}

// Blocks `signals` in this thread (and the threads it starts afterwards) for its lifetime, so
// they are taken synchronously (sigtimedwait); the previous mask comes back on destruction.
class SignalMask {
 public:
  explicit SignalMask(std::initializer_list<int> signals) {
    sigemptyset(&blocked_);
    for (int s : signals) sigaddset(&blocked_, s);
    pthread_sigmask(SIG_BLOCK, &blocked_, &previous_);
  }
  ~SignalMask() { pthread_sigmask(SIG_SETMASK, &previous_, nullptr); }
  SignalMask(const SignalMask&) = delete;
  SignalMask& operator=(const SignalMask&) = delete;
  const sigset_t& blocked() const { return blocked_; }

 private:
  sigset_t blocked_, previous_;
};

// Several nodes: this node's secret, then every node arrives at node 0's store with the same run
// before anything starts. kExitOk with `link` set, else the exit code after saying why.
int MeetTheOtherNodes(const LaunchOptions& o, const core::RunSpec& run,
                      std::unique_ptr<NodeLink>* link, std::optional<RunSecret>* node_secret) {
  const core::JobConfig& cfg = run.job;
  auto secret = ResolveRunSecret(core::SharedOutputDir(cfg), ProcessEnv);
  if (!secret.ok()) {
    std::fprintf(stderr, "rp-launch: the run's node secret: %s\n",
                 secret.status().message().c_str());
    return secret.status().code() == StatusCode::kInvalidArgument ? kExitBadConfig : kExitError;
  }
  *node_secret = std::move(secret).value();
  std::fprintf(stderr,
               "rp-launch: node %lld of %lld (%s), node store %s:%lld sealed with the secret from "
               "%s; waiting for "
               "the other nodes\n",
               static_cast<long long>(cfg.nodes.rank), static_cast<long long>(cfg.nodes.count),
               o.world.source.c_str(), cfg.nodes.store_host.c_str(),
               static_cast<long long>(cfg.nodes.store_port), (*node_secret)->source.c_str());
  auto opened = NodeLink::Open(cfg, nodes::StoreSeal((*node_secret)->value));
  Status met = opened.ok() ? (*opened)->Meet(NodeRunFingerprint(run, o.resume)) : opened.status();
  if (!met.ok()) {
    std::fprintf(stderr, "rp-launch: %s\n", met.message().c_str());
    return met.code() == StatusCode::kInvalidArgument ? kExitBadConfig : kExitPeerLost;
  }
  *link = std::move(opened).value();
  return kExitOk;
}

// A log pipe per process of the run (the coordinator's, then worker r's at r + 1), each drained
// by `pump` into its file under `log_dir`; the write ends, for the children.
StatusOr<std::vector<int>> OpenLogPipes(LogPump* pump, const std::string& log_dir, int workers) {
  std::vector<std::string> roles = {"coordinator"};
  for (int r = 0; r < workers; ++r) roles.push_back("worker " + std::to_string(r));
  std::vector<int> out_fds;
  for (const auto& role : roles) {
    std::string file = role;
    for (auto& ch : file)
      if (ch == ' ') ch = '-';
    auto fd = pump->Pipe(role, log_dir + "/" + file + ".log");
    if (!fd.ok()) {
      for (int f : out_fds) ::close(f);
      return fd.status();
    }
    out_fds.push_back(*fd);
  }
  return out_fds;
}

// The launcher's exit code once the children are gone, with what the user does next: an
// interrupt (stopped at once, or `checkpointed` after a graceful stop), a re-plan, or the run's
// own code.
int EndOfRunCode(const core::RunSpec& run, bool interrupted, bool checkpointed, bool replan,
                 int exit_code) {
  const core::JobConfig& cfg = run.job;
  if (interrupted) {
    std::fprintf(stderr, "rp-launch: interrupted; run stopped\n");
    return kExitInterrupted;
  }
  if (checkpointed) {
    // checkpoint.dir is relative to the output directory, or absolute (node 0's, on the others).
    const std::string checkpoints = (fs::path(cfg.job.output_dir) / cfg.checkpoint.dir).string();
    if (run.execution.sharded_state)
      // Every node wrote its own part after the step the nodes agreed on.
      std::fprintf(
          stderr,
          "rp-launch: interrupted; every node stopped after the same step and wrote its part of a "
          "checkpoint into %s; `rp-launch --resume` on every node continues the run\n",
          checkpoints.c_str());
    else if (cfg.nodes.count > 1)
      std::fprintf(stderr,
                   "rp-launch: interrupted; every node stopped after the same step, node 0 wrote a "
                   "checkpoint into %s; `rp-launch --resume` on every node continues the run\n",
                   checkpoints.c_str());
    else
      std::fprintf(
          stderr,
          "rp-launch: interrupted; a checkpoint is in %s, `rp-launch --resume` continues the run\n",
          checkpoints.c_str());
    return kExitInterrupted;
  }
  if (replan && exit_code == kExitOk) return kExitReplan;
  return exit_code;
}

// How the run's processes start: their programs, arguments and environment, decided once.
class ChildCommands {
 public:
  ChildCommands(const LaunchOptions& o, const std::string& session, const std::string& dir,
                const std::string& spec_path, const std::optional<RunSecret>& node_secret)
      : coordinator_bin_(o.bin_dir + "/rp-coordinator"),
        worker_bin_(o.bin_dir + "/rp-worker"),
        resume_(o.resume) {
    common_ = {
        "--spec",        spec_path, "--gpus", std::to_string(o.gpus),     "--session", session,
        "--runtime-dir", dir,       "-v",     std::to_string(o.verbosity)};
    env_ = {"RP_LAUNCHER_PID=" + std::to_string(::getpid()), "RP_SESSION=" + session,
            "NCCL_NVLS_ENABLE=0"};
    // One BLAS thread per process: workers share the cores and CPU results stay reproducible.
    if (!EnvironmentValue("OPENBLAS_NUM_THREADS")) env_.push_back("OPENBLAS_NUM_THREADS=1");
    // The workers' cross-node groups seal their store traffic with the run's secret.
    if (node_secret && !node_secret->from_env)
      env_.push_back(std::string(nodes::kRunSecretVariable) + "=" + node_secret->value);
    if (o.debug_worker >= 0) {
      // A paused worker must not make the coordinator give up waiting for it.
      common_.push_back("--hello-timeout-s");
      common_.push_back("86400");
    }
    std::istringstream words(o.worker_wrapper);
    for (std::string w; words >> w;) wrapper_.push_back(w);
  }

  StatusOr<ChildProcess> Coordinator(int out_fd) const {
    std::vector<std::string> argv = {coordinator_bin_};
    argv.insert(argv.end(), common_.begin(), common_.end());
    if (resume_) argv.push_back("--resume");
    return ChildProcess::Spawn("coordinator", argv, env_, out_fd);
  }
  // Worker `rank` (a replacement too); `debug_pause`: it waits for a debugger or SIGUSR1.
  StatusOr<ChildProcess> Worker(int rank, int out_fd, bool debug_pause) const {
    std::vector<std::string> argv = wrapper_;
    argv.push_back(worker_bin_);
    argv.insert(argv.end(), {"--rank", std::to_string(rank)});
    argv.insert(argv.end(), common_.begin(), common_.end());
    auto env = env_;
    env.push_back("RP_RANK=" + std::to_string(rank));
    if (debug_pause) env.push_back("RP_DEBUG_PAUSE=1");
    return ChildProcess::Spawn("worker " + std::to_string(rank), argv, env, out_fd);
  }

 private:
  std::string coordinator_bin_, worker_bin_;
  bool resume_;
  std::vector<std::string> common_, env_,
      wrapper_;  // every child's arguments and environment; the worker's wrapper
};

// The supervision loop of a launch: signals, the children's exits (with replacement workers), the
// other nodes and the coordinator's progress, each a part that says whether the loop ends now.
// What it leaves in its public fields is how the run ended, for RunSession's report.
class Supervision {
 public:
  using SpawnWorker = std::function<StatusOr<ChildProcess>(int rank, int out_fd, bool debug_pause)>;
  Supervision(const core::JobConfig& cfg, std::vector<ChildProcess>& children, NodeLink* link,
              std::string dir, SpawnWorker spawn_worker, const std::vector<int>& respawn_fds,
              int exit_code_so_far)
      : exit_code(exit_code_so_far),
        cfg_(cfg),
        children_(children),
        link_(link),
        dir_(std::move(dir)),
        spawn_worker_(std::move(spawn_worker)),
        respawn_fds_(respawn_fds) {}

  // Until every child is done, a failure, or a second interrupt.
  void Run(const sigset_t& signals) {
    while (exit_code == kExitOk && !interrupted) {
      timespec ts{0, 100 * 1000 * 1000};
      if (OnSignal(sigtimedwait(&signals, nullptr, &ts))) break;
      if (ReapChildren()) break;
      if (link_ && failure.empty() && NodeLost()) break;
      if (link_ && failure.empty() && !children_[0].exit_info() && StopAgreementFailed()) break;
      if (failure.empty() && !children_[0].exit_info() && cfg_.job.worker_timeout_s > 0 &&
          CoordinatorGone())
        break;
      // Workers get a grace period to leave after the coordinator finished the job.
      if (std::chrono::steady_clock::now() - coordinator_done_at_ > std::chrono::seconds(10)) {
        RP_LOG(WARNING)
            << "workers still running 10 s after the coordinator finished; stopping them";
        break;
      }
    }
  }

  int exit_code;
  bool interrupted = false;    // stopped at once (second signal)
  bool graceful = false;       // first SIGINT/SIGTERM: the coordinator stops with a checkpoint
  bool graceful_done = false;  // ... and it did (exit code 3)
  bool replan = false;         // the coordinator checkpointed to be resumed on a new plan
  std::string failure, failed_role;

 private:
  // The first SIGINT or SIGTERM asks the coordinator for a graceful stop; another one ends
  // everything at once (true).
  bool OnSignal(int sig) {
    if ((sig == SIGINT || sig == SIGTERM) && !graceful && !children_[0].exit_info()) {
      graceful = true;
      std::fprintf(stderr,
                   "rp-launch: stopping after the step in flight and writing a checkpoint "
                   "(interrupt again to stop at once)\n");
      if (link_) {
        if (Status told = link_->Interrupt(); !told.ok())
          std::fprintf(stderr, "rp-launch: %s\n", told.message().c_str());
      }
      children_[0].Signal(SIGINT);
    } else if (sig == SIGINT || sig == SIGTERM) {
      interrupted = true;
      for (auto& c : children_) c.Signal(SIGTERM);
      return true;
    }
    return false;
  }

  // Reaps the children that ended: a worker that died mid-run is replaced while restarts remain,
  // anything else that ended badly is the run's failure. True when every child is done.
  bool ReapChildren() {
    bool all_done = true;
    for (auto& c : children_) {
      if (!c.TryReap()) {
        all_done = false;
        continue;
      }
      const ExitInfo& e = *c.exit_info();
      const bool is_coord = &c == &children_[0];
      const bool graceful_exit = graceful && !e.signaled && e.code == kExitInterrupted;
      if (is_coord && !e.signaled &&
          (e.code == 0 || graceful_exit || (e.code == kExitReplan && !graceful))) {
        graceful_done = graceful_exit;
        replan = e.code == kExitReplan;
        if (coordinator_done_at_ == std::chrono::steady_clock::time_point::max())
          coordinator_done_at_ = std::chrono::steady_clock::now();
        continue;
      }
      // A worker exits 0 only after the coordinator's Shutdown{0}, i.e. at the end of a good run,
      // possibly before the launcher has seen the coordinator's own exit (3 after a graceful stop).
      if (!is_coord && !e.signaled && (e.code == 0 || graceful_exit)) continue;
      // A worker died mid-run: start a replacement with the same rank while restarts remain. The
      // coordinator re-dispatches the dead worker's unfinished jobs when the replacement says
      // Hello.
      const int rank = static_cast<int>(&c - &children_[0]) - 1;
      // A worker that refused the run's spec (exit 2) would be refused again by any replacement.
      const bool refused = !e.signaled && e.code == kExitBadConfig;
      if (!is_coord && !refused && !children_[0].exit_info() && !graceful &&
          restarts_ < cfg_.job.max_worker_restarts) {
        restarts_++;
        std::fprintf(
            stderr, "rp-launch: %s (pid %d) %s; starting a replacement (restart %lld of %lld)\n",
            c.role().c_str(), c.pid(), e.Describe().c_str(), static_cast<long long>(restarts_),
            static_cast<long long>(cfg_.job.max_worker_restarts));
        auto fresh = spawn_worker_(rank, respawn_fds_[rank], false);
        if (fresh.ok()) {
          c = std::move(fresh).value();
          all_done = false;
          continue;
        }
        std::fprintf(stderr, "rp-launch: %s\n", fresh.status().message().c_str());
      }
      if (failure.empty()) {
        failed_role = c.role();
        failure = c.role() + " (pid " + std::to_string(c.pid()) + ") " + e.Describe();
        exit_code = is_coord  ? (e.signaled ? kExitPeerLost : e.code)
                    : refused ? kExitBadConfig
                              : kExitPeerLost;
      }
    }
    return all_done;
  }

  // Beats go on through a graceful stop (its checkpoint may take a while). Once this node's
  // coordinator is done, the others ending is their reaction to this node's stop, not a failure.
  bool NodeLost() {
    auto lost = link_->Tick();
    if (!lost || children_[0].exit_info()) return false;
    failure =
        graceful
            ? *lost +
                  "; this node was stopping after an interrupt, and its stop step needs the other "
                  "nodes: no checkpoint at the interrupt (resume from the newest periodic one)"
            : *lost;
    exit_code = kExitPeerLost;
    return true;
  }

  // An interrupt agreed across the nodes (common/stop_agreement.h): one node's interrupt
  // interrupts every node's coordinator; each proposes a stop step, and all stop after the
  // largest. True when the agreement failed.
  bool StopAgreementFailed() {
    if (!graceful) {
      if (auto by = link_->InterruptedElsewhere()) {
        graceful = true;
        std::fprintf(
            stderr,
            "rp-launch: node %d was interrupted: every node stops after an agreed step with a "
            "checkpoint\n",
            *by);
        children_[0].Signal(SIGINT);
      }
    }
    if (!stop_proposed_) {
      // Also a coordinator interrupted without this launcher (a signal sent to it alone): its
      // proposal interrupts the other nodes too.
      auto proposal = ReadStepFile(dir_ + "/" + kStopProposalFile);
      if (!proposal.ok()) {
        failure = proposal.status().message();
        exit_code = kExitProtocolError;
        return true;
      }
      if (*proposal) {
        Status posted = graceful ? Status::Ok() : link_->Interrupt();
        if (posted.ok()) posted = link_->Propose(**proposal);
        graceful = true;
        if (!posted.ok()) {
          failure = posted.message();
          exit_code = kExitPeerLost;
          return true;
        }
        stop_proposed_ = true;
      }
    }
    if (stop_proposed_ && !stop_agreed_) {
      auto agreed = link_->Agreed();
      Status written = agreed.ok() && *agreed
                           ? WriteStepFile(dir_ + "/" + kStopAgreedFile, **agreed)
                           : agreed.status();
      if (!written.ok()) {
        failure = "agreeing on a stop step with the other nodes: " + written.message();
        exit_code = agreed.ok() ? kExitProtocolError : kExitPeerLost;
        return true;
      }
      stop_agreed_ = agreed.ok() && agreed->has_value();
    }
    return false;
  }

  // A coordinator that stopped making progress (a hang) beats no more
  // (coordinator/progress_beacon.h): the run ends with it rather than waiting forever. One that
  // is stopped (SIGSTOP, Ctrl-Z, a debugger) is waited for, up to job.stopped_timeout_s. True
  // when the run ends for either.
  bool CoordinatorGone() {
    const double now = MonoSeconds();
    const std::string who = "coordinator (pid " + std::to_string(children_[0].pid()) + ")";
    if (stopped_since_ >= 0 && !ProcessStopped(children_[0].pid())) {
      RP_LOG(WARNING) << who << " continues after " << FormatSeconds(now - stopped_since_)
                      << " s stopped";
      stopped_since_ = stopped_said_ = -1.0;
    }
    double quiet = SecondsSinceBeat(dir_ + "/" + kBeaconFile);
    if (last_stopped_ >= 0) quiet = std::min(quiet, now - last_stopped_);
    if (stopped_since_ >= 0 ||
        (quiet > cfg_.job.worker_timeout_s && ProcessStopped(children_[0].pid()))) {
      if (stopped_since_ < 0) stopped_since_ = now - quiet;
      last_stopped_ = now;
      const double stopped_for = now - stopped_since_;
      if (stopped_for > cfg_.job.stopped_timeout_s) {
        failed_role = children_[0].role();
        failure = who + " has been stopped (SIGSTOP, Ctrl-Z or a debugger) for " +
                  std::to_string(static_cast<int>(stopped_for)) +
                  " s, past job.stopped_timeout_s = " + FormatSeconds(cfg_.job.stopped_timeout_s) +
                  " s; ending the run";
        exit_code = kExitPeerLost;
        for (auto& c : children_) c.Signal(SIGKILL);
        return true;
      }
      if (stopped_said_ < 0 || now - stopped_said_ >= cfg_.job.worker_timeout_s) {
        RP_LOG(WARNING) << who << " is stopped (SIGSTOP, Ctrl-Z or a debugger) for "
                        << FormatSeconds(stopped_for)
                        << " s; waiting for it to continue, up to job.stopped_timeout_s = "
                        << FormatSeconds(cfg_.job.stopped_timeout_s) << " s";
        stopped_said_ = now;
      }
    } else if (quiet > cfg_.job.worker_timeout_s) {
      failed_role = children_[0].role();
      failure = who + " made no progress for " + std::to_string(static_cast<int>(quiet)) +
                " s (job.worker_timeout_s = " + FormatSeconds(cfg_.job.worker_timeout_s) +
                "): stuck; ending the run";
      exit_code = kExitPeerLost;
      for (auto& c : children_) c.Signal(SIGKILL);
      return true;
    }
    return false;
  }

  const core::JobConfig& cfg_;
  std::vector<ChildProcess>& children_;  // the coordinator first, then worker r at r + 1
  NodeLink* link_;                       // several nodes; null on one
  const std::string dir_;                // the runtime directory
  SpawnWorker spawn_worker_;
  const std::vector<int>& respawn_fds_;  // each worker rank's log pipe, for its replacements
  int64_t restarts_ = 0;                 // replacement workers started
  bool stop_proposed_ = false;  // several nodes: this node's stop step is in the node store
  bool stop_agreed_ = false;    // ... and the agreed one is in the coordinator's runtime dir
  std::chrono::steady_clock::time_point coordinator_done_at_ =
      std::chrono::steady_clock::time_point::max();
  // The coordinator found stopped (SIGSTOP, a debugger) while quiet: since when, when it was last
  // said, and when it was last seen stopped (its quiet counts from then).
  double stopped_since_ = -1.0, stopped_said_ = -1.0, last_stopped_ = -1.0;
};

// A refusal before anything exists (exit 2): an InvalidArgument with a printf-style message.
Status Refusal(const char* format, ...) __attribute__((format(printf, 1, 2)));
Status Refusal(const char* format, ...) {
  va_list args;
  va_start(args, format);
  char text[1024];
  std::vsnprintf(text, sizeof(text), format, args);
  va_end(args);
  return Status::InvalidArgument(text);
}

// The backend the job asks for against this build and host, and what the worker count allows:
// GPUs per worker, cores per CPU worker, options that keep state in one worker.
Status CheckWorkersFitTheHost(const LaunchOptions& o, const core::RunSpec& run, int visible,
                              bool cpu_workers) {
  const core::JobConfig& cfg = run.job;
  if (cfg.job.device == core::DeviceKind::kCuda && !RP_WITH_CUDA) {
    return Refusal(
        "job.device = \"cuda\", but this build has no CUDA backend "
        "(configured without a CUDA LibTorch and nvcc); use \"cpu\", or a CUDA build");
  }
  if (cfg.nodes.count > 1) {
    // The workers sum across the nodes with Gloo (CPU workers) or NCCL (CUDA workers).
    const bool cuda = RP_WITH_CUDA && (cfg.job.device == core::DeviceKind::kCuda ||
                                       (cfg.job.device == core::DeviceKind::kAuto && visible != 0));
    if (cuda && !RP_WITH_NCCL) {
      return Refusal(
          "several nodes with CUDA workers need LibTorch's c10d with NCCL, which this "
          "build lacks (no nccl.h found at configure time); set job.device = \"cpu\"");
    }
    if (!cuda && !RP_WITH_GLOO) {
      return Refusal(
          "several nodes with CPU workers need LibTorch's c10d with Gloo, which this "
          "build lacks (Debian: install libgloo-dev and rebuild)");
    }
  }
  // CUDA workers take the visible GPUs round-robin (rank mod GPUs). A few may share one GPU
  // (docs/features.md); beyond that they only contend for its memory and its queue.
  if (cfg.job.device == core::DeviceKind::kCuda && RP_WITH_CUDA) {
    constexpr int kWorkersPerGpu = 4;
    if (visible >= 0 && o.gpus > kWorkersPerGpu * visible) {
      return Refusal(
          "--gpus %d CUDA workers on %d visible GPU%s (CUDA_VISIBLE_DEVICES, /dev/nvidia*); "
          "at most %d per GPU",
          o.gpus, visible, visible == 1 ? "" : "s", kWorkersPerGpu);
    }
    if (run.execution.frozen_on_device && visible > 0 && o.gpus > visible) {
      return Refusal(
          "schedule.frozen_on_device with --gpus %d CUDA workers on %d visible GPU%s: "
          "workers sharing a GPU would each keep a copy of the frozen base there; run at most one "
          "worker per GPU or leave the option off",
          o.gpus, visible, visible == 1 ? "" : "s");
    }
  }
  // CPU workers share the host's cores: beyond a few per core they only contend.
  if (cpu_workers && core::Fp8Matmuls(cfg)) {
    return Refusal(
        "train.dtype = \"fp8\" needs CUDA workers, and job.device = \"%s\" gives CPU "
        "workers here (%s)",
        core::EnumName(cfg.job.device),
        RP_WITH_CUDA ? "no GPU is visible" : "this build has no CUDA backend");
  }
  const int max_cpu_workers = 4 * UsableCores();
  if (cpu_workers && o.gpus > max_cpu_workers) {
    return Refusal("--gpus %d CPU workers on %d usable cores; at most %d (4 per core)", o.gpus,
                   UsableCores(), max_cpu_workers);
  }
  if (run.execution.activations == core::Activations::kWorker && o.gpus != 1) {
    return Refusal(
        "schedule.activations = \"worker\" keeps activations in the one worker's "
        "memory and needs --gpus 1 (this launch asks for %d); use \"host\" or \"cuda_ipc\"",
        o.gpus);
  }
  if (cfg.schedule.kept_blocks > 0 && (o.gpus != 1 || cfg.nodes.count > 1)) {
    return Refusal(
        "schedule.kept_blocks = %lld keeps forward graphs in the worker that ran "
        "the forward, for its backward, and needs one worker in the run (this launch asks for "
        "%d on %lld node(s)); set it to 0",
        static_cast<long long>(cfg.schedule.kept_blocks), o.gpus,
        static_cast<long long>(cfg.nodes.count));
  }
  if (cfg.schedule.keep_attention != 0 && (o.gpus != 1 || cfg.nodes.count > 1)) {
    return Refusal(
        "schedule.keep_attention = %lld keeps attention outputs in the worker that ran their "
        "forward, for its backward, and needs one worker in the run (this launch asks for %d on "
        "%lld node(s)); set it to 0",
        static_cast<long long>(cfg.schedule.keep_attention), o.gpus,
        static_cast<long long>(cfg.nodes.count));
  }
  return Status::Ok();
}

// The run resolved and every check a launch makes before anything exists: the build, the
// workers' count for the device, the files it reads first, the data, the output directory and
// the host's memory. The dry run makes the same checks with the same messages and then prints
// the plan here. A refusal is a Status whose message the caller prints after "rp-launch: ".
StatusOr<core::RunSpec> ResolveAndCheck(const LaunchOptions& o) {
  // The run's decisions, made once here; the coordinator and the workers read them from the
  // runtime directory (planning/run_spec.h).
  core::NodesConfig nodes;
  nodes.count = o.world.nodes;
  nodes.rank = o.world.rank;
  nodes.store_host = o.world.store_host;
  nodes.store_port = o.world.store_port;
  // A job without a device memory budget plans for the host's smallest GPU (config/job_config.h).
  core::HostFacts host;
  const int visible = VisibleGpus();  // read once: -1 when nothing says
  if (visible > 0) host.gpu_memory_gib = QueryGpuMemoryGib(ProcessEnv);
  auto resolved = core::ResolveRun(
      o.job_path, o.overrides, o.gpus, nodes, host,
      core::SessionInputs{o.frozen_profile, o.replanning_off, shm::SharedBytesFor(o.gpus)});
  if (!resolved.ok()) return resolved.status();
  core::RunSpec run = std::move(resolved).value();
  const core::JobConfig* cfg = &run.job;
  // Refused here, before any process exists, not by the workers once everything started.
  const bool cpu_workers = cfg->job.device == core::DeviceKind::kCpu || !RP_WITH_CUDA ||
                           (cfg->job.device == core::DeviceKind::kAuto && visible == 0);
  if (Status s = CheckWorkersFitTheHost(o, run, visible, cpu_workers); !s.ok()) return s;
  uint64_t shared_bytes = 0;
  const core::ModelSpec spec = core::BuildModelSpec(cfg->model, cfg->lora);
  auto layout = shm::ComputeLayout(*cfg, run.execution, spec, run.plan);
  if (!layout.ok()) {
    return layout.status();
  }
  shared_bytes = shm::SharedMemoryBytes(*layout, *cfg, o.gpus);
  // An auto plan fits schedule.host_memory_gb by its choice; the job's own plan is checked here.
  if (cfg->schedule.host_memory_gb > 0 &&
      static_cast<double>(shared_bytes) > cfg->schedule.host_memory_gb * 1e9) {
    char sizes[96];
    std::snprintf(sizes, sizeof(sizes), "takes %.2f GB of shared memory, over the limit of %.2f GB",
                  static_cast<double>(shared_bytes) / 1e9, cfg->schedule.host_memory_gb);
    return Status::InvalidArgument("schedule.host_memory_gb: the job's plan " +
                                   run.plan.Describe() + " " + sizes +
                                   "; set schedule.partition = \"auto\" to plan under it, or "
                                   "use fewer backward stages");
  }
  // The files the run reads at its start, checked here (headers only) so a bad path is refused
  // before anything exists: the weights of model.path and lora.init_from, and with --resume the
  // newest checkpoint's header against this job.
  if (Status s = core::CheckInitialWeights(*cfg, spec, o.resume); !s.ok()) {
    return s;
  }
  if (o.resume) {
    if (Status s = CheckResumable(*cfg, spec, *layout, o.force_resume); !s.ok()) {
      return Status::InvalidArgument("--resume: " + s.message());
    }
  }
  std::optional<core::MemoryEstimate> cpu_worker;
  if (cpu_workers) {
    core::JobConfig as_run =
        *cfg;  // job.device = "auto" without a GPU: the workers compute on the CPU
    as_run.job.device = core::DeviceKind::kCpu;
    cpu_worker = core::EstimateMemory(as_run, run.plan, o.gpus);
  }
  // Every check a launch makes before starting anything, the dry run makes too, with the same
  // exit code and message: the data as the coordinator will read it, the output directory, the
  // host's memory.
  std::string packing_summary, length_summary;
  {
    auto data = core::Dataset::Open(*cfg);
    if (!data.ok()) {
      return data.status();
    }
    packing_summary = data->PackingSummary();
    length_summary = data->LengthSummary();
    if (cfg->train.eval_every > 0) {
      if (auto eval = core::Dataset::OpenEval(*cfg); !eval.ok()) {
        return eval.status();
      }
    }
  }
  // Not a refusal: training past the pretraining context is what long-sequence runs do.
  if (!cfg->model.path.empty() && cfg->data.seq_len > cfg->model.max_position_embeddings)
    std::fprintf(
        stderr,
        "rp-launch: warning: data.seq_len = %lld is above %s/config.json's "
        "max_position_embeddings (%lld): the model was not pretrained at these positions\n",
        static_cast<long long>(cfg->data.seq_len), cfg->model.path.c_str(),
        static_cast<long long>(cfg->model.max_position_embeddings));
  // A node that joins a resumed run (more nodes than before) starts its own directory, as the
  // coordinator does.
  std::error_code joins_ec;
  const bool node_joins =
      cfg->nodes.rank > 0 && !fs::exists(cfg->job.output_dir + "/metrics.jsonl", joins_ec);
  if (Status s = !o.resume    ? core::CheckOutputDir(*cfg)
                 : node_joins ? core::CheckNoPlantedLinks(*cfg)
                              : core::CheckOutputDirForResume(*cfg);
      !s.ok()) {
    return s;
  }
  if (Status s = CheckHostMemory(*cfg, shared_bytes, o.gpus, cpu_worker); !s.ok()) {
    return s;
  }
  if (o.dry_run) {
    PrintDryRun(run, o.gpus, cpu_workers);
    if (!packing_summary.empty()) std::printf("%s\n", packing_summary.c_str());
    if (!length_summary.empty()) std::printf("%s\n", length_summary.c_str());
    if (cpu_worker)
      std::printf(
          "estimated memory per CPU worker: %.2f GiB (the planner's estimate; %.2f GiB of it "
          "attention "
          "scores, which grow with the square of data.seq_len)\n",
          cpu_worker->total / (1ull << 30), cpu_worker->attention_scores / (1ull << 30));
    std::printf("the job as resolved (a job file; the run keeps it as %s/job.toml):\n%s",
                cfg->job.output_dir.c_str(), core::JobToml(*cfg).c_str());
  }
  return run;
}

int RunSession(const LaunchOptions& o) {
  auto checked = ResolveAndCheck(o);
  if (!checked.ok()) {
    std::fprintf(stderr, "rp-launch: %s\n", checked.status().message().c_str());
    return kExitBadConfig;
  }
  if (o.dry_run) return kExitOk;
  core::RunSpec& run = *checked;
  const core::JobConfig* cfg = &run.job;
  for (const auto& b : {o.bin_dir + "/rp-coordinator", o.bin_dir + "/rp-worker"})
    if (::access(b.c_str(), X_OK) != 0) {
      std::fprintf(stderr, "rp-launch: cannot execute %s\n", b.c_str());
      return kExitError;
    }

  ReclaimDeadRuns(RuntimeBase());
  const std::string session = NewSessionId();
  const std::string dir = RuntimeBase() + "/rp-" + session;
  if (::mkdir(dir.c_str(), 0700) != 0) {
    std::fprintf(stderr, "rp-launch: cannot create runtime directory %s: %s\n", dir.c_str(),
                 std::strerror(errno));
    return kExitError;
  }
  RuntimeDir runtime(dir);
  // Destroyed after the unlinkers below and before the directory: the claim outlives the names.
  auto owner = OwnerLock::Take(dir);
  if (!owner.ok()) {
    std::fprintf(stderr, "rp-launch: %s\n", owner.status().message().c_str());
    return kExitError;
  }
  // Backstop: the coordinator unlinks the segment itself, but not if it is SIGKILLed.
  shm::Unlinker segment_name(shm::StateSegmentName(session));
  shm::Unlinker optim_segment_name(shm::OptimSegmentName(session));
  // CPU workers' activation pools (schedule.activations = "cuda_ipc"): each worker
  // unlinks its own, but not if it is SIGKILLed. Removing a name that was never made is harmless.
  std::vector<shm::Unlinker> pool_names;
  for (int r = 0; r < o.gpus; ++r) pool_names.emplace_back(shm::PoolSegmentName(session, r));

  // Signals are taken synchronously (sigtimedwait) so the supervision loop is the only place
  // that reacts to them; children get the default dispositions back via posix_spawn's exec.
  const SignalMask mask({SIGINT, SIGTERM, SIGCHLD});
  // Several nodes: every node arrives with the same plan before anything starts. After the mask:
  // node 0's store serves from a thread of its own, which must not take the signals the
  // supervision loop waits for.
  std::unique_ptr<NodeLink> link;
  std::optional<RunSecret> node_secret;
  if (cfg->nodes.count > 1) {
    if (const int code = MeetTheOtherNodes(o, run, &link, &node_secret); code != kExitOk)
      return code;
  }

  if (o.debug_worker >= 0)
    run.job.job.worker_timeout_s = 0;  // a worker in a debugger sends no heartbeats
  const std::string spec_path = dir + "/" + kRunSpecFile;
  if (Status s = core::WriteRunSpec(spec_path, run); !s.ok()) {
    std::fprintf(stderr, "rp-launch: writing %s: %s\n", spec_path.c_str(), s.message().c_str());
    return kExitError;
  }
  const ChildCommands commands(o, session, dir, spec_path, node_secret);
  // Logs of this run: one file per process, never overwriting an earlier run's.
  const std::string log_dir = cfg->job.output_dir + "/logs/" + session;
  if (Status s = MakeLogDir(cfg->job.output_dir, log_dir); !s.ok()) {
    std::fprintf(stderr, "rp-launch: %s\n", s.message().c_str());
    return kExitBadConfig;
  }
  LogPump pump;  // declared before the children: it outlives them and drains their pipes
  auto pipes = OpenLogPipes(&pump, log_dir, o.gpus);
  if (!pipes.ok()) {
    std::fprintf(stderr, "rp-launch: %s\n", pipes.status().message().c_str());
    return kExitError;
  }
  std::vector<int>& out_fds = *pipes;
  pump.Start();
  std::vector<ChildProcess> children;
  int exit_code = kExitOk;
  {
    auto c = commands.Coordinator(out_fds[0]);
    if (!c.ok()) {
      std::fprintf(stderr, "rp-launch: %s\n", c.status().message().c_str());
      for (int f : out_fds) ::close(f);
      return kExitError;
    }
    children.push_back(std::move(c).value());
  }
  auto spawn_worker = [&commands](int r, int out_fd, bool debug_pause) {
    return commands.Worker(r, out_fd, debug_pause);
  };
  for (int r = 0; r < o.gpus && exit_code == kExitOk; ++r) {
    auto c = spawn_worker(r, out_fds[r + 1], r == o.debug_worker);
    if (!c.ok()) {
      std::fprintf(stderr, "rp-launch: %s\n", c.status().message().c_str());
      exit_code = kExitError;
      break;
    }
    if (r == o.debug_worker)
      std::fprintf(stderr,
                   "rp-launch: worker %d (pid %d) waits before touching the GPU. Attach with\n"
                   "    cuda-gdb -p %d      (or: gdb -p %d)\n"
                   "set breakpoints, then `continue`: it runs once a debugger lets it. Or resume "
                   "without one:\n"
                   "    kill -USR1 %d\n",
                   r, c->pid(), c->pid(), c->pid(), c->pid());
    children.push_back(std::move(c).value());
  }
  // Replacement workers write to their rank's log pipe too: keep a copy of each worker's write
  // end (closed before the pump drains, or it would never see end-of-file).
  std::vector<int> respawn_fds;
  for (size_t i = 1; i < out_fds.size(); ++i)
    respawn_fds.push_back(::fcntl(out_fds[i], F_DUPFD_CLOEXEC, 0));
  for (int f : out_fds) ::close(f);  // the children hold the write ends now
  RP_LOG(INFO) << "session " << session << ": coordinator pid " << children[0].pid() << ", "
               << o.gpus << " workers";

  Supervision supervision(*cfg, children, link.get(), dir, spawn_worker, respawn_fds, exit_code);
  supervision.Run(mask.blocked());
  exit_code = supervision.exit_code;
  const bool interrupted = supervision.interrupted, graceful_done = supervision.graceful_done,
             replan = supervision.replan;
  std::string failure = supervision.failure;
  const std::string failed_role = supervision.failed_role;
  if (link && !failure.empty() && !failed_role.empty()) {
    // A failure here may be the echo of another node's (a reduction whose peer vanished).
    link->Failing(failure);
    if (auto cause = link->Diagnose()) failure = *cause + "; on this node: " + failure;
  }
  if (!failure.empty()) std::fprintf(stderr, "rp-launch: %s; stopping the run\n", failure.c_str());
  // Stops whatever still runs (SIGTERM, then SIGKILL) and reaps it.
  for (auto it = children.rbegin(); it != children.rend(); ++it)
    it->Terminate(std::chrono::milliseconds(3000));
  children.clear();
  for (int f : respawn_fds)
    if (f >= 0) ::close(f);
  pump.Finish();
  if (link)
    link->End(interrupted || (graceful_done && failure.empty()) ? kExitInterrupted : exit_code,
              interrupted && failure.empty() ? "stopped at once by a second interrupt" : failure);
  if (!failure.empty() && !failed_role.empty()) {
    // Where it ran and how far the run got, then its own last words.
    const std::string device = pump.LastLineWith(failed_role, "joined: device");
    const std::string step = pump.LastLineWith("coordinator", "] step ");
    if (!device.empty())
      std::fprintf(stderr, "rp-launch: %s had %s", failed_role.c_str(), device.c_str());
    std::fprintf(stderr, "rp-launch: last step reported: %s",
                 step.empty() ? "none\n" : step.c_str());
    std::fprintf(stderr, "rp-launch: last lines of %s (all logs in %s):\n%s", failed_role.c_str(),
                 log_dir.c_str(), pump.LastLines(failed_role).c_str());
  }
  return EndOfRunCode(run, interrupted, graceful_done && failure.empty(), replan, exit_code);
}

// With schedule.partition = "auto" and no schedule.profile, the plan comes from the run's
// stored profile when it exists and fits the workload. Every process must plan from the same
// numbers while the coordinator may rewrite profile.json mid-run, so the launcher freezes a copy
// (<output_dir>/plan-profile.json) for the session to plan from (`frozen_profile`). After a
// re-plan the fresh profile wins over a schedule.profile the user gave: it is what the
// coordinator planned with.
Status FreezeProfile(const LaunchOptions& o, bool after_replan, std::string* frozen_profile) {
  auto loaded = core::LoadJobConfig(o.job_path, o.overrides);
  if (!loaded.ok()) return Status::Ok();  // RunSession reports it, with its exit code
  const core::JobConfig& cfg = *loaded;
  if (!core::ResolveExecution(cfg).planner_chooses_partition ||
      (!cfg.schedule.profile.empty() && !after_replan))
    return Status::Ok();
  const std::string stored = cfg.job.output_dir + "/profile.json";
  std::error_code ec;
  if (!fs::exists(stored, ec)) return Status::Ok();
  auto profile = core::LoadProfile(stored, cfg);
  if (!profile.ok()) {
    std::fprintf(stderr, "rp-launch: not planning from %s: %s\n", stored.c_str(),
                 profile.status().message().c_str());
    return Status::Ok();
  }
  // A dry run writes nothing: it reads the stored profile itself.
  const std::string frozen = o.dry_run ? stored : cfg.job.output_dir + "/plan-profile.json";
  if (!o.dry_run) RP_RETURN_IF_ERROR(core::SaveProfile(frozen, *profile));
  *frozen_profile = frozen;
  std::fprintf(stderr, "rp-launch: planning from the measured profile %s\n", stored.c_str());
  return Status::Ok();
}

}  // namespace

int RunLauncher(const LaunchOptions& options) {
  // A run re-plans at most twice: each restart costs a checkpoint and a start-up. A third request
  // means each fresh profile favours yet another plan (noisy timings, e.g. CPU workers sharing
  // cores with the optimizer): the run then finishes on the latest plan without re-planning,
  // instead of failing a healthy run.
  constexpr int kMaxReplans = 2;
  LaunchOptions o = options;
  for (int replans = 0;; ++replans) {
    LaunchOptions run = o;
    if (Status s = FreezeProfile(o, replans > 0, &run.frozen_profile); !s.ok()) {
      std::fprintf(stderr, "rp-launch: %s\n", s.message().c_str());
      return kExitError;
    }
    const int rc = RunSession(run);
    if (rc != kExitReplan) return rc;
    if (replans > kMaxReplans) {  // re-planning was off: the coordinator broke its contract
      std::fprintf(stderr,
                   "rp-launch: the coordinator asked to re-plan with re-planning off; stopping "
                   "(the checkpoint is kept: --resume continues)\n");
      return kExitError;
    }
    if (replans == kMaxReplans) {
      std::fprintf(stderr,
                   "rp-launch: a third re-plan was asked for (each new profile favours another "
                   "plan); finishing the run on the latest plan without re-planning\n");
      o.replanning_off = true;
    } else {
      std::fprintf(stderr, "rp-launch: resuming the run on the plan made from its new profile\n");
    }
    o.resume = true;
  }
}

}  // namespace rp::launch
