// SPDX-License-Identifier: Apache-2.0
#include "planning/run_spec.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "planning/partitioner.h"
#include "tests/testing/process_harness.h"

namespace rp::core {
namespace {

namespace fs = std::filesystem;

// A job that exercises what only resolution knows: config.json's architecture (a Llama with
// llama3 RoPE), merged calls, a bench switch from the environment and the planner's choice.
RunSpec Resolve(const std::string& dir) {
  std::ofstream(dir + "/job.toml")
      << "[model]\npath = \"" << testing::SourceDir()
      << "/tests/testdata/hf_fixtures/llama3\"\n[data]\nformat = \"random\"\nseq_len = 64\n"
         "[train]\naccum_calls = 2\nmicrobatches = 3\n[schedule]\npartition = \"auto\"\n";
  ::setenv("RP_LAYER_MAJOR_FORWARD", "never", 1);
  auto r = ResolveRun(dir + "/job.toml", {"optimizer.lr=1e-3"}, 2);
  ::unsetenv("RP_LAYER_MAJOR_FORWARD");
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  return *r;
}

TEST(RunSpec, WrittenAndReadBackIsTheSameRun) {
  const std::string dir = testing::MakeTempDir("rp-spec-");
  const RunSpec run = Resolve(dir);
  EXPECT_EQ(run.job.model.rope.type, RopeConfig::Type::kLlama3);
  EXPECT_EQ(Round(run.job).merged_calls, 2);
  EXPECT_EQ(run.job.bench.layer_major_forward, Tristate::kNever);
  ASSERT_TRUE(WriteRunSpec(dir + "/run-spec.json", run).ok());
  auto back = ReadRunSpec(dir + "/run-spec.json");
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(RunSpecJson(*back), RunSpecJson(run));
  EXPECT_EQ(back->plan.Describe(), run.plan.Describe());
  EXPECT_EQ(back->plan.hidden_boundaries, run.plan.hidden_boundaries);
  EXPECT_EQ(back->job.model.rope.original_max_position, 32);
  EXPECT_EQ(back->job.optimizer.lr, 1e-3);
  EXPECT_EQ(back->workers, 2);
  EXPECT_TRUE(back->execution == ResolveExecution(run.job));
  EXPECT_TRUE(back->execution.planner_chooses_partition);
  // The plan is the planner's for the job, not re-derived by the reader.
  auto planned = MakePlan(run.job, 2);
  ASSERT_TRUE(planned.ok());
  EXPECT_EQ(back->plan.Describe(), planned->Describe());
  fs::remove_all(dir);
}

TEST(RunSpec, TheJobTomlOfEveryShippedJobResolvesToTheSameRun) {
  // JobToml (what every run keeps as OUTPUT/job.toml) loaded as a job file gives the run it was
  // written from: the same resolved spec, and the same text again.
  const std::string dir = testing::MakeTempDir("rp-jobtoml-");
  int jobs = 0;
  std::vector<std::pair<std::string, std::vector<std::string>>> cases;
  for (const auto& e : fs::directory_iterator(testing::SourceDir() + "/configs"))
    if (e.path().extension() == ".toml") cases.push_back({e.path().string(), {}});
  // Keys that another key decides (the tiny job by epochs and a warmup ratio), and a model from a
  // checkpoint.
  {
    std::ifstream in(testing::SourceDir() + "/configs/tiny.toml");
    std::ofstream out(dir + "/epochs.toml");
    for (std::string line; std::getline(in, line);) {
      if (line.rfind("steps", 0) == 0 || line.rfind("warmup_steps", 0) == 0) continue;
      if (line.rfind("path", 0) == 0)
        line = "path = \"" + testing::SourceDir() + "/data/tiny_corpus.txt\"";
      out << line << "\n";
    }
  }
  cases.push_back({dir + "/epochs.toml", {"train.epochs=0.5", "optimizer.warmup_ratio=0.2"}});
  cases.push_back({dir + "/llama.toml", {}});
  std::ofstream(dir + "/llama.toml")
      << "[model]\npath = \"" << testing::SourceDir()
      << "/tests/testdata/hf_fixtures/llama3\"\n[data]\nformat = \"random\"\n"
         "seq_len = 64\n[job]\noutput_dir = \"out\"\n";
  for (const auto& [path, overrides] : cases) {
    SCOPED_TRACE(path);
    auto run = ResolveRun(path, overrides, 2);
    if (!run.ok()) {
      // Jobs too large for this machine's planner budget are not what this test is about.
      EXPECT_NE(path.find("30b"), std::string::npos) << run.status().message();
      continue;
    }
    const std::string text = JobToml(run->job);
    // Floats as a person writes them (lr = 0.003), not toml++'s 17 digits.
    EXPECT_FALSE(std::regex_search(text, std::regex(R"(= -?[0-9]*\.[0-9]{12,})"))) << text;
    std::ofstream(dir + "/job.toml") << text;
    auto again = ResolveRun(dir + "/job.toml", {}, 2);
    ASSERT_TRUE(again.ok()) << again.status().message() << "\n" << text;
    again->job.source_path = run->job.source_path;  // where each was read from
    EXPECT_EQ(RunSpecJson(*again), RunSpecJson(*run));
    EXPECT_EQ(JobToml(again->job), text);
    ++jobs;
  }
  EXPECT_GE(jobs, 10);
  fs::remove_all(dir);
}

TEST(RunSpec, TheRunRecordHoldsWhatDecidesTheTrainingAndNothingElse) {
  // What a checkpoint records for --resume to compare: a changed learning rate, seed, data
  // length, adapter or mode is another run; a longer run, another cadence, other output or
  // speed keys are the same run. Each key is changed alone from the same job.
  const std::string dir = testing::MakeTempDir("rp-record-");
  const std::string job = "[data]\nformat = \"random\"\nseq_len = 64\n[train]\nsteps = 10\n";
  std::ofstream(dir + "/job.toml") << job;
  auto record = [&](const std::string& change) {
    auto c = LoadJobConfig(dir + "/job.toml", change.empty() ? std::vector<std::string>{}
                                                             : std::vector<std::string>{change});
    EXPECT_TRUE(c.ok()) << change << ": " << c.status().message();
    return c.ok() ? RunDefiningValues(*c) : RunRecord{};
  };
  const RunRecord base = record("");
  EXPECT_EQ(base.at("optimizer.lr"), "0.003");  // the shortest decimal, not 17 digits
  for (const char* other :
       {"optimizer.lr=0.001", "train.seed=7", "data.seq_len=32", "optimizer.mode=\"stale1\"",
        "lora.rank=4", "train.grad_clip=0.5", "model.intermediate_size=256", "data.shuffle=false",
        "optimizer.warmup_steps=3", "train.microbatches=2", "train.dtype=\"bf16\""}) {
    const auto d = RunDifferences(base, record(other));
    ASSERT_EQ(d.size(), 1u) << other;
    const std::string key = std::string(other).substr(0, std::string(other).find('='));
    EXPECT_EQ(d[0].rfind(key + " ", 0), 0u) << d[0];
  }
  for (const char* same :
       {"train.steps=20", "train.stop_after=3", "train.eval_every=5", "checkpoint.every=2",
        "job.output_dir=\"elsewhere\"", "schedule.forward_stages=2",
        "optimizer.speculative_update=false", "train.loss_chunk_tokens=16",
        "metrics.tensorboard=false", "job.worker_timeout_s=9", "optimizer.state=\"sharded\""})
    EXPECT_EQ(RunDifferences(base, record(same)), std::vector<std::string>{}) << same;
  EXPECT_EQ(
      RunDifferences({{"a.b", "1"}}, {{"a.c", "2"}}),
      (std::vector<std::string>{"a.b 1 there, (not set) here", "a.c (not set) there, 2 here"}));
  fs::remove_all(dir);
}

TEST(RunSpec, DamagedOrForeignSpecsAreRefusedNamingWhat) {
  const std::string dir = testing::MakeTempDir("rp-spec-bad-");
  const RunSpec run = Resolve(dir);
  const auto good = nlohmann::json::parse(RunSpecJson(run));
  auto refused = [&](nlohmann::json j, const std::string& want) {
    auto r = ParseRunSpec(j.dump(), "spec");
    ASSERT_FALSE(r.ok());
    EXPECT_NE(r.status().message().find(want), std::string::npos) << r.status().message();
  };
  EXPECT_FALSE(ParseRunSpec("not json", "spec").ok());
  auto j = good;
  j["version"] = 99;
  refused(j, "version 99");
  j = good;
  j["job"]["train"].erase("steps");
  refused(j, "steps");
  j = good;
  j["job"]["optimizer"]["mode"] = "stale2";
  refused(j, "stale2");
  j = good;
  j["job"]["model"]["rope"]["type"] = "longrope";
  refused(j, "longrope");
  j = good;
  j["plan"]["stages"][0]["begin"] = "zero";
  refused(j, "not a complete run spec");
  j = good;
  j["workers"] = 0;
  refused(j, "workers");
  // The processes act on the stored decisions: a spec without them, or with decisions its job
  // does not resolve to, is refused, naming the stored and the resolved plan.
  j = good;
  j.erase("execution");
  refused(j, "execution");
  j = good;
  ASSERT_EQ(j["execution"]["weight_version_lag"], 0);
  j["execution"]["weight_version_lag"] = 1;
  refused(j, "execution {\"activation_parities\"");
  refused(j, "is not what its job resolves to");
  j = good;
  j["job"]["optimizer"]["mode"] = "stale1";  // the key changed, the stored decisions did not
  refused(j, "is not what its job resolves to");
  // The resolution chose the update passes: the stored job holds 1 or 2, never auto.
  ASSERT_TRUE(good["job"]["optimizer"]["update_passes"] == 1 ||
              good["job"]["optimizer"]["update_passes"] == 2);
  EXPECT_FALSE(run.execution.planner_chooses_update_passes);
  // Specs of the versions before the stored plan (9) and before the update passes (10), in an
  // older run's directory, are read with two passes (what those builds did) and the rest of the
  // plan their job resolves to.
  for (int version : {9, 10}) {
    j = good;
    j["version"] = version;
    j["job"]["schedule"].erase("host_memory_gb");
    j["job"]["schedule"].erase("keep_attention");
    j["job"]["optimizer"].erase("update_passes");
    if (version == 9) {
      j.erase("execution");
    } else {
      j["execution"].erase("two_pass_updates");
      j["execution"].erase("planner_chooses_update_passes");
    }
    auto older = ParseRunSpec(j.dump(), "spec");
    ASSERT_TRUE(older.ok()) << version << ": " << older.status().message();
    ExecutionPlan want = run.execution;
    want.two_pass_updates = run.execution.NextStepWaitsForUpdate();
    EXPECT_TRUE(older->execution == want) << version;
  }
  // Version 11 had no schedule.host_memory_gb (its plans ignored host memory) and version 12 no
  // schedule.keep_attention (its attention was recomputed).
  for (int version : {11, 12}) {
    j = good;
    j["version"] = version;
    if (version == 11) j["job"]["schedule"].erase("host_memory_gb");
    j["job"]["schedule"].erase("keep_attention");
    auto older = ParseRunSpec(j.dump(), "spec");
    ASSERT_TRUE(older.ok()) << version << ": " << older.status().message();
    EXPECT_EQ(older->job.schedule.host_memory_gb, 0.0) << version;
    EXPECT_EQ(older->job.schedule.keep_attention, 0) << version;
  }
  j = good;
  j["job"]["schedule"].erase("keep_attention");
  refused(j, "keep_attention");
  j = good;
  j["job"]["schedule"].erase("host_memory_gb");
  refused(j, "host_memory_gb");
  j = good;
  j["execution"].erase("two_pass_updates");
  refused(j, "two_pass_updates");
  EXPECT_FALSE(ReadRunSpec(dir + "/missing.json").ok());
  ASSERT_TRUE(WriteRunSpec(dir + "/two.json", run).ok());
  EXPECT_TRUE(ReadRunSpecFor(dir + "/two.json", 2).ok());
  auto other = ReadRunSpecFor(dir + "/two.json", 3);
  EXPECT_NE(other.status().message().find("resolved for 2 workers, this run has 3"),
            std::string::npos);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace rp::core

namespace rp::core {
namespace {

// The launcher's decisions about a session reach the resolution as values: the frozen profile is
// what the planner reads (a missing one is named), and re-planning off is replan_gain 0.
TEST(RunSpec, ASessionsFrozenProfileAndReplanningOffAreWhatTheRunResolvesWith) {
  const std::string dir = testing::MakeTempDir("rp-spec-session-");
  std::ofstream(dir + "/job.toml")
      << "[data]\nformat = \"random\"\nseq_len = 64\n[schedule]\npartition = \"auto\"\n";
  auto plain = ResolveRun(dir + "/job.toml", {}, 2);
  ASSERT_TRUE(plain.ok()) << plain.status().message();
  EXPECT_GT(plain->job.schedule.replan_gain, 0.0);
  EXPECT_TRUE(plain->job.schedule.profile.empty());

  SessionInputs off;
  off.replanning_off = true;
  auto capped = ResolveRun(dir + "/job.toml", {}, 2, {}, {}, off);
  ASSERT_TRUE(capped.ok()) << capped.status().message();
  EXPECT_EQ(capped->job.schedule.replan_gain, 0.0);
  EXPECT_EQ(capped->plan.Describe(), plain->plan.Describe());

  SessionInputs frozen;
  frozen.frozen_profile = dir + "/plan-profile.json";  // not written: the planner must say so
  auto missing = ResolveRun(dir + "/job.toml", {}, 2, {}, {}, frozen);
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find(frozen.frozen_profile), std::string::npos)
      << missing.status().message();
}

}  // namespace
}  // namespace rp::core
