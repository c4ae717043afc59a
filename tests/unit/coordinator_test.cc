// SPDX-License-Identifier: Apache-2.0
// The whole coordinator in-process: its parts (StepDispatch, WorkerTable, Evaluations, HostState,
// the optimizer) driven through a test channel by simulated workers on threads. The simulated
// workers follow the worker's protocol (Hello, wait for their layers' weight versions, report
// every microbatch, ask for and wait for a commit) but compute nothing: every tail microbatch
// reports a loss of exactly kLoss per target, and the gradient slots stay zero.
#include "coordinator/coordinator.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <filesystem>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <thread>

#include <nlohmann/json.hpp>

#include "common/time_util.h"
#include "config/model_spec.h"
#include "planning/run_spec.h"
#include "protocol/channel.h"
#include "protocol/codec.h"
#include "shm/layout.h"
#include "shm/segment.h"
#include "tests/testing/process_harness.h"

namespace rp::coord {
namespace {

namespace fs = std::filesystem;
using proto::Message;

constexpr double kLoss = 2.0;

// Both ends of the control channel in one process.
class InProcessChannel final : public proto::CoordinatorChannel {
 public:
  explicit InProcessChannel(int workers) : to_worker_(workers), connected_(workers, true) {}

  Status Send(int rank, const Message& m) override {
    std::lock_guard<std::mutex> l(mu_);
    if (rank < 0 || rank >= static_cast<int>(to_worker_.size()) || !connected_[rank])
      return Status::Unavailable("worker " + std::to_string(rank) + " is not connected");
    to_worker_[rank].push_back(m);
    sent_.emplace_back(rank, m);
    cv_.notify_all();
    return Status::Ok();
  }
  StatusOr<std::optional<proto::Envelope>> Receive(int timeout_ms) override {
    std::unique_lock<std::mutex> l(mu_);
    cv_.wait_for(l, std::chrono::milliseconds(timeout_ms),
                 [&] { return !to_coordinator_.empty() || woken_; });
    woken_ = false;
    if (to_coordinator_.empty()) return std::optional<proto::Envelope>();
    proto::Envelope e = std::move(to_coordinator_.front());
    to_coordinator_.pop_front();
    return std::optional<proto::Envelope>(std::move(e));
  }
  void Wake() override {
    std::lock_guard<std::mutex> l(mu_);
    woken_ = true;
    cv_.notify_all();
  }

  // The workers' side.
  void FromWorker(int rank, const Message& m) {
    std::lock_guard<std::mutex> l(mu_);
    to_coordinator_.push_back({rank, m});
    cv_.notify_all();
  }
  std::optional<Message> ToWorker(int rank, int timeout_ms) {
    std::unique_lock<std::mutex> l(mu_);
    if (!cv_.wait_for(l, std::chrono::milliseconds(timeout_ms),
                      [&] { return !to_worker_[rank].empty(); }))
      return std::nullopt;
    Message m = std::move(to_worker_[rank].front());
    to_worker_[rank].pop_front();
    return m;
  }
  // A worker process dies (its queue is gone and sends to it fail) or its replacement connects.
  void SetConnected(int rank, bool connected) {
    std::lock_guard<std::mutex> l(mu_);
    connected_[rank] = connected;
    to_worker_[rank].clear();
  }
  std::vector<std::pair<int, Message>> Sent() const {
    std::lock_guard<std::mutex> l(mu_);
    return sent_;
  }

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<proto::Envelope> to_coordinator_;
  std::vector<std::deque<Message>> to_worker_;
  std::vector<bool> connected_;
  std::vector<std::pair<int, Message>> sent_;
  bool woken_ = false;
};

// How a simulated worker misbehaves.
struct Fault {
  int die_at_run_job = 0;       // > 0: disconnects on receiving its n-th RunJob (a crash)
  bool silent = false;          // says Hello, then never answers (a hang)
  bool bogus_job_done = false;  // answers its first RunJob with a JobDone for a job never sent
  bool fail_in_latin1 = false;  // fails its first RunJob with a message that is not UTF-8
};

class SimulatedWorker {
 public:
  SimulatedWorker(InProcessChannel& ch, int rank, const core::RunSpec& run,
                  const shm::ArenaLayout& layout, Fault fault = {})
      : ch_(ch), rank_(rank), run_(run), layout_(layout), fault_(fault) {
    thread_ = std::thread([this] { Main(); });
  }
  ~SimulatedWorker() { thread_.join(); }
  bool died() const { return died_; }

 private:
  // Waits until every layer in [begin, end) holds `version` updates, as a worker's fetch does.
  bool WaitForVersions(int begin, int end, int64_t version) {
    auto* versions = segment_->At<std::atomic<uint64_t>>(layout_.layer_versions);
    const double deadline = MonoSeconds() + 20.0;
    for (int l = begin; l < end; ++l)
      while (versions[l].load(std::memory_order_acquire) < static_cast<uint64_t>(version)) {
        if (MonoSeconds() > deadline) return false;
        std::this_thread::sleep_for(std::chrono::microseconds(200));
      }
    return true;
  }

  // Runs the queue's head jobs as far as their inputs and commits allow.
  bool Progress() {
    while (!queue_.empty()) {
      if (const auto* eval = std::get_if<proto::RunEval>(&queue_.front())) {
        if (!WaitForVersions(0, run_.plan.num_layers, eval->weights_version)) return false;
        const int64_t targets = static_cast<int64_t>(layout_.tokens_per_mb);
        ch_.FromWorker(rank_, proto::EvalDone{eval->job_index, 1.5 * targets, targets, WallMicros(),
                                              WallMicros()});
        queue_.pop_front();
        continue;
      }
      const auto& job = std::get<proto::RunJob>(queue_.front());
      const core::Stage& stage = run_.plan.stages[job.stage];
      if (next_mb_ == 0 && !WaitForVersions(stage.begin, stage.end, job.weights_version))
        return false;
      while (next_mb_ < job.num_microbatches && ready_[job.job_index].count(next_mb_)) {
        const bool tail = stage.kind == core::StageKind::kFusedTail;
        const int64_t targets = tail ? static_cast<int64_t>(layout_.tokens_per_mb) : 0;
        ch_.FromWorker(rank_, proto::MicrobatchDone{job.job_index, next_mb_, 0, kLoss * targets,
                                                    targets, WallMicros(), WallMicros()});
        next_mb_++;
      }
      if (next_mb_ < job.num_microbatches) return true;
      if (stage.kind != core::StageKind::kForward) {
        if (!grads_ready_sent_) {
          ch_.FromWorker(rank_, proto::GradsReady{job.job_index});
          grads_ready_sent_ = true;
        }
        if (!committed_.count(job.job_index)) return true;
      }
      ch_.FromWorker(rank_, proto::JobDone{job.job_index, WallMicros(), WallMicros(), WallMicros(),
                                           0.0, 0, -1});
      queue_.pop_front();
      next_mb_ = 0;
      grads_ready_sent_ = false;
    }
    return true;
  }

  void Main() {
    ch_.FromWorker(rank_, proto::Hello{rank_, 0, layout_.hash, -1, 0});
    int run_jobs = 0;
    while (true) {
      auto m = ch_.ToWorker(rank_, 30000);
      if (!m) {
        ADD_FAILURE() << "simulated worker " << rank_ << " heard nothing for 30 s";
        return;
      }
      if (const auto* w = std::get_if<proto::Welcome>(&*m)) {
        auto seg = shm::Segment::Open(w->segment_name, layout_.hash);
        ASSERT_TRUE(seg.ok()) << seg.status().ToString();
        segment_.emplace(std::move(seg).value());
      } else if (const auto* r = std::get_if<proto::RunJob>(&*m)) {
        if (fault_.silent) continue;
        if (fault_.bogus_job_done) {
          ch_.FromWorker(rank_, proto::JobDone{999, 0, 0, 0, 0.0, 0, -1});
          continue;
        }
        if (fault_.fail_in_latin1) {
          proto::JobFailed f{};
          f.job_index = r->job_index;
          proto::CopyText(f.message, "cannot open /data/caf\xe9");  // Latin-1, cut or foreign text
          ch_.FromWorker(rank_, f);
          continue;
        }
        if (++run_jobs == fault_.die_at_run_job) {
          ch_.SetConnected(rank_, false);
          died_ = true;
          return;
        }
        queue_.push_back(*r);
      } else if (const auto* e = std::get_if<proto::RunEval>(&*m)) {
        queue_.push_back(*e);
      } else if (const auto* in = std::get_if<proto::InputReady>(&*m)) {
        ready_[in->job_index].insert(in->microbatch);
      } else if (const auto* c = std::get_if<proto::CommitGrads>(&*m)) {
        committed_.insert(c->job_index);
      } else if (std::holds_alternative<proto::Shutdown>(*m)) {
        return;
      }
      if (!Progress()) {
        ADD_FAILURE() << "simulated worker " << rank_ << " waited 20 s for its weights";
        return;
      }
    }
  }

  InProcessChannel& ch_;
  int rank_;
  const core::RunSpec& run_;
  const shm::ArenaLayout& layout_;
  Fault fault_;
  std::optional<shm::Segment> segment_;
  std::deque<Message> queue_;  // RunJob and RunEval, in the order sent
  std::map<int64_t, std::set<int>> ready_;
  std::set<int64_t> committed_;
  int next_mb_ = 0;
  bool grads_ready_sent_ = false;
  std::atomic<bool> died_{false};
  std::thread thread_;
};

class CoordinatorTest : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = testing::MakeTempDir("rp-coord-"); }
  void TearDown() override { fs::remove_all(dir_); }

  // Resolves the integration tests' job with `sets` for `workers` workers and writes its spec.
  void Resolve(int workers, std::vector<std::string> sets) {
    sets.push_back("job.output_dir=" + dir_ + "/out");
    auto r = core::ResolveRun(testing::SourceDir() + "/tests/testdata/parity.toml", sets, workers);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    run_ = std::move(r).value();
    spec_ = core::BuildModelSpec(run_.job.model, run_.job.lora);
    auto layout = shm::ComputeLayout(run_.job, core::ResolveExecution(run_.job), spec_, run_.plan);
    ASSERT_TRUE(layout.ok()) << layout.status().ToString();
    layout_ = *layout;
    ASSERT_TRUE(core::WriteRunSpec(dir_ + "/run-spec.json", run_).ok());
  }

  CoordinatorOptions Options(int workers) const {
    CoordinatorOptions o;
    o.spec_path = dir_ + "/run-spec.json";
    o.num_workers = workers;
    o.session = "ut" + std::to_string(::getpid()) + "-" + std::to_string(counter_++);
    last_run_id_ = o.session;
    o.runtime_dir = dir_;
    o.optimizer_threads = 2;
    o.hello_timeout_s = 20;
    return o;
  }

  // This run's shared-memory names are gone (other tests may be running beside it).
  bool SegmentsRemoved() const {
    return !fs::exists("/dev/shm/" + shm::StateSegmentName(last_run_id_)) &&
           !fs::exists("/dev/shm/" + shm::OptimSegmentName(last_run_id_));
  }

  std::string dir_;
  mutable std::string last_run_id_;
  core::RunSpec run_;
  core::ModelSpec spec_;
  shm::ArenaLayout layout_;
  static inline int counter_ = 0;
};

TEST_F(CoordinatorTest, AWholeRunReportsEveryStepAndDispatchesRoundRobinWithCommitsInCallOrder) {
  // Two calls that stay two rounds (not merged into one), so commits have an order to keep.
  ::setenv("RP_MERGE_CALLS", "never", 1);
  Resolve(2, {"train.steps=4", "train.accum_calls=2", "train.microbatches=3",
              "job.worker_timeout_s=0"});
  ::unsetenv("RP_MERGE_CALLS");
  ASSERT_EQ(core::Round(run_.job).calls, 2);
  InProcessChannel ch(2);
  Status s;
  {
    SimulatedWorker w0(ch, 0, run_, layout_), w1(ch, 1, run_, layout_);
    s = RunCoordinator(Options(2), nullptr, &ch);
  }
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_EQ(testing::Losses(dir_ + "/out/metrics.jsonl"), std::vector<double>(4, kLoss));
  EXPECT_EQ(testing::Losses(dir_ + "/out/metrics.jsonl", "grad_norm"), std::vector<double>(4, 0.0));
  // Stage job k (in index order) ran on worker k mod 2.
  std::map<int64_t, std::pair<int, proto::RunJob>> jobs;
  std::vector<std::pair<int, proto::CommitGrads>> commits;
  for (const auto& [rank, m] : ch.Sent()) {
    if (const auto* r = std::get_if<proto::RunJob>(&m))
      jobs.emplace(r->job_index, std::make_pair(rank, *r));
    if (const auto* c = std::get_if<proto::CommitGrads>(&m)) commits.emplace_back(rank, *c);
  }
  const size_t per_step = 2 * run_.plan.stages.size();
  ASSERT_EQ(jobs.size(), 4 * per_step);
  int k = 0;
  for (const auto& [index, job] : jobs) EXPECT_EQ(job.first, k++ % 2) << "job " << index;
  // Each non-forward stage of each step: call 0's commit (overwrite), then call 1's (accumulate).
  std::map<std::pair<int64_t, int>, std::vector<int>> calls;
  for (const auto& [rank, c] : commits) {
    const proto::RunJob& r = jobs.at(c.job_index).second;
    EXPECT_EQ(c.accumulate, r.call > 0 ? 1 : 0);
    calls[{r.step, r.stage}].push_back(r.call);
  }
  for (const auto& [key, order] : calls)
    EXPECT_EQ(order, (std::vector<int>{0, 1})) << "step " << key.first;
  EXPECT_TRUE(SegmentsRemoved());
}

TEST_F(CoordinatorTest, ACrashedWorkersReplacementGetsItsUnfinishedJobsAgainInOrder) {
  Resolve(2, {"train.steps=4", "train.accum_calls=1", "train.microbatches=3",
              "job.worker_timeout_s=0", "job.max_worker_restarts=1"});
  InProcessChannel ch(2);
  Status s;
  {
    SimulatedWorker w0(ch, 0, run_, layout_);
    auto w1 = std::make_unique<SimulatedWorker>(ch, 1, run_, layout_, Fault{.die_at_run_job = 3});
    std::atomic<bool> over{false};
    std::thread replacer([&] {
      while (!w1->died())
        if (over) return;
        else std::this_thread::sleep_for(std::chrono::milliseconds(5));
      w1.reset();
      ch.SetConnected(1, true);
      w1 = std::make_unique<SimulatedWorker>(ch, 1, run_, layout_);
    });
    s = RunCoordinator(Options(2), nullptr, &ch);
    over = true;
    replacer.join();
  }
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_EQ(testing::Losses(dir_ + "/out/metrics.jsonl"), std::vector<double>(4, kLoss));
  // Worker 1 was welcomed twice, and its replacement got some job a second time, each job's
  // second sending in index order.
  int welcomes = 0;
  std::map<int64_t, int> sends;
  std::vector<int64_t> resent;
  for (const auto& [rank, m] : ch.Sent()) {
    if (rank == 1 && std::holds_alternative<proto::Welcome>(m)) welcomes++;
    if (const auto* r = std::get_if<proto::RunJob>(&m); r && ++sends[r->job_index] == 2) {
      EXPECT_EQ(rank, 1);
      resent.push_back(r->job_index);
    }
  }
  EXPECT_EQ(welcomes, 2);
  ASSERT_FALSE(resent.empty());
  EXPECT_TRUE(std::is_sorted(resent.begin(), resent.end()));
}

TEST_F(CoordinatorTest, AMessageAboutAJobNotInFlightEndsTheRunNamingIt) {
  Resolve(2, {"train.steps=2", "job.worker_timeout_s=0", "job.max_worker_restarts=0"});
  InProcessChannel ch(2);
  Status s;
  {
    SimulatedWorker w0(ch, 0, run_, layout_, Fault{.bogus_job_done = true}),
        w1(ch, 1, run_, layout_);
    s = RunCoordinator(Options(2), nullptr, &ch);
  }
  EXPECT_EQ(s.code(), StatusCode::kProtocolError) << s.ToString();
  EXPECT_NE(s.message().find("job 999"), std::string::npos) << s.message();
  // summary.json (reserved at the start) says how the run ended.
  const auto summary = nlohmann::json::parse(testing::ReadFile(dir_ + "/out/summary.json"));
  EXPECT_EQ(summary["status"], "failed");
  EXPECT_NE(summary["error"].get<std::string>().find("job 999"), std::string::npos);
  EXPECT_TRUE(SegmentsRemoved());
}

TEST_F(CoordinatorTest, AFailureMessageThatIsNotUtf8StillEndsInSummaryJson) {
  Resolve(2, {"train.steps=2", "job.worker_timeout_s=0", "job.max_worker_restarts=0"});
  InProcessChannel ch(2);
  Status s;
  {
    SimulatedWorker w0(ch, 0, run_, layout_, Fault{.fail_in_latin1 = true}),
        w1(ch, 1, run_, layout_);
    s = RunCoordinator(Options(2), nullptr, &ch);
  }
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.ToString();
  const auto summary = nlohmann::json::parse(testing::ReadFile(dir_ + "/out/summary.json"));
  EXPECT_EQ(summary["status"], "failed");
  EXPECT_NE(summary["error"].get<std::string>().find("cannot open /data/caf"), std::string::npos);
  EXPECT_TRUE(SegmentsRemoved());
}

TEST_F(CoordinatorTest, ASilentWorkerWithoutRestartsEndsTheRunAsHung) {
  Resolve(2, {"train.steps=2", "job.worker_timeout_s=1", "job.max_worker_restarts=0"});
  InProcessChannel ch(2);
  Status s;
  const double t0 = MonoSeconds();
  {
    SimulatedWorker w0(ch, 0, run_, layout_), w1(ch, 1, run_, layout_, Fault{.silent = true});
    s = RunCoordinator(Options(2), nullptr, &ch);
  }
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.ToString();
  EXPECT_NE(s.message().find("hung"), std::string::npos) << s.message();
  // Noticed within the timeout plus the loop's longest wait, not at some later tick.
  EXPECT_LT(MonoSeconds() - t0, 5.0);
}

}  // namespace
}  // namespace rp::coord
