// SPDX-License-Identifier: Apache-2.0
// The integration tests' fixture: a private temp and runtime directory per test, and the check
// that nothing of ours (shared-memory segments, sockets) outlives a test.
#pragma once

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "tests/testing/process_harness.h"

namespace rp {

inline std::string ReadBytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// `a` followed by `b` (job overrides, environment entries).
inline std::vector<std::string> With(std::vector<std::string> a,
                                     const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

class LaunchTest : public ::testing::Test {
 protected:
  void SetUp() override {
    tmp_ = testing::MakeTempDir("rp-it-");
    runtime_ = tmp_ + "/xdg";
    std::filesystem::create_directories(runtime_);
    std::filesystem::permissions(runtime_, std::filesystem::perms::owner_all);
    before_ = testing::LeftoverSegments();
  }
  void TearDown() override {
    // Nothing of ours may outlive a test, whether it passed or not.
    EXPECT_EQ(testing::LeftoverSegments(), before_) << "shared-memory segments left behind";
    std::vector<std::string> left;
    for (auto& e : std::filesystem::directory_iterator(runtime_)) left.push_back(e.path().string());
    EXPECT_TRUE(left.empty()) << "runtime directory left behind: " << (left.empty() ? "" : left[0]);
    std::error_code ec;
    std::filesystem::remove_all(tmp_, ec);
  }
  std::vector<std::string> Env() const { return {"XDG_RUNTIME_DIR=" + runtime_}; }
  std::string Job() const { return testing::SourceDir() + "/tests/testdata/parity.toml"; }
  // The job for `sets`: with model.path among them, parity.toml without its [model] keys (a
  // checkpoint's config.json decides the architecture, and a job key that disagrees is refused).
  std::string JobFor(const std::vector<std::string>& sets) const {
    const bool from_checkpoint = std::any_of(sets.begin(), sets.end(), [](const std::string& s) {
      return s.rfind("model.path=", 0) == 0;
    });
    if (!from_checkpoint) return Job();
    const std::string path = tmp_ + "/parity-from-checkpoint.toml";
    std::ifstream in(Job());
    std::ofstream out(path);
    bool in_model = false;
    for (std::string line; std::getline(in, line);) {
      if (!line.empty() && line[0] == '[') in_model = line == "[model]";
      if (in_model) continue;
      if (line.rfind("path = \"../../", 0) == 0)
        line = "path = \"" + testing::SourceDir() + "/" + line.substr(14);
      out << line << "\n";
    }
    return path;
  }

  // Overrides: "section.key=value" become --set arguments; "RP_NAME=value" entries are
  // environment variables instead (the bench and test switches, core::BenchKnobs).
  static bool IsEnv(const std::string& s) { return s.rfind("RP_", 0) == 0; }
  // A later entry for the same variable replaces an earlier one, as a later --set does.
  std::vector<std::string> EnvWith(const std::vector<std::string>& sets) const {
    std::vector<std::string> env = Env();
    for (const auto& s : sets) {
      if (!IsEnv(s)) continue;
      const std::string name = s.substr(0, s.find('=') + 1);
      std::erase_if(env, [&](const std::string& e) { return e.rfind(name, 0) == 0; });
      env.push_back(s);
    }
    return env;
  }

  std::vector<std::string> LaunchArgs(int n, const std::string& out,
                                      std::vector<std::string> sets = {}) {
    std::vector<std::string> a = {
        testing::BinDir() + "/rp-launch", "--gpus", std::to_string(n), JobFor(sets), "--set",
        "job.output_dir=" + out};
    for (auto& s : sets) {
      if (IsEnv(s)) continue;
      a.push_back("--set");
      a.push_back(s);
    }
    return a;
  }

  testing::ProcessResult Launch(int n, const std::string& out, std::vector<std::string> sets = {},
                                double timeout = 240) {
    return testing::RunProcess(LaunchArgs(n, out, sets), timeout, EnvWith(sets));
  }

  // A run of `job` stopped with a checkpoint after `stop_after` steps, then resumed to its end in
  // the same output directory; false (with the output in a test failure) if either part fails.
  bool LaunchStoppedAndResumed(int n, const std::string& out, const std::vector<std::string>& job,
                               int stop_after) {
    auto first = Launch(n, out, With(job, {"train.stop_after=" + std::to_string(stop_after)}));
    EXPECT_EQ(first.code, 0) << first.output;
    if (first.code != 0) return false;
    auto args = LaunchArgs(n, out, job);
    args.push_back("--resume");
    auto second = testing::RunProcess(args, 240, EnvWith(job));
    EXPECT_EQ(second.code, 0) << second.output;
    return second.code == 0;
  }

  // rp-train-ref, the oracle, on the same job with the same overrides.
  testing::ProcessResult Ref(const std::string& out, const std::vector<std::string>& sets = {}) {
    std::vector<std::string> args = {testing::BinDir() + "/rp-train-ref", JobFor(sets), "--set",
                                     "job.output_dir=" + out};
    for (const auto& s : sets)
      if (!IsEnv(s)) args.insert(args.end(), {"--set", s});
    return testing::RunProcess(args, 240, EnvWith(sets));
  }

  // A launch with the test hook `hook` armed for one firing (its marker file beside `out`).
  testing::ProcessResult LaunchWithHookOnce(int workers, const std::string& out,
                                            const std::vector<std::string>& job,
                                            const std::string& hook) {
    auto env = Env();
    env.push_back(hook + "=" + out + "-marker");
    return testing::RunProcess(LaunchArgs(workers, out, job), 120, env);
  }

  // A two-worker run of `steps` steps (a checkpoint at the end, hang timeout 2 s), fault-free and
  // with the test hook `hook` (an environment variable naming a marker file) armed in one worker:
  // the armed run must say `fired`, lose that worker to hang detection, replace it, and end with
  // the fault-free run's losses and checkpoint. Returns the job's overrides.
  std::vector<std::string> ExpectHungWorkerReplaced(const std::string& tag, int steps,
                                                    const std::string& hook,
                                                    const std::string& fired) {
    const std::string n = std::to_string(steps);
    const std::vector<std::string> job = {"train.steps=" + n, "train.accum_calls=1",
                                          "train.microbatches=4", "checkpoint.every=" + n,
                                          "job.worker_timeout_s=2"};
    auto clean = Launch(2, tmp_ + "/" + tag + "-clean", job);
    EXPECT_EQ(clean.code, 0) << clean.output;
    auto r = LaunchWithHookOnce(2, tmp_ + "/" + tag, job, hook);
    EXPECT_EQ(r.code, 0) << r.output;
    EXPECT_NE(r.output.find(fired), std::string::npos) << r.output;
    const auto summary =
        nlohmann::json::parse(testing::ReadFile(tmp_ + "/" + tag + "/summary.json"));
    EXPECT_EQ(summary["workers_hung"], 1) << summary.dump();
    EXPECT_EQ(summary["worker_replacements"], 1) << summary.dump();
    EXPECT_EQ(testing::Losses(tmp_ + "/" + tag + "/metrics.jsonl"),
              testing::Losses(tmp_ + "/" + tag + "-clean/metrics.jsonl"));
    const std::string state =
        "/checkpoints/step-" + std::string(8 - n.size(), '0') + n + ".rpstate";
    EXPECT_TRUE(ReadBytes(tmp_ + "/" + tag + state) ==
                ReadBytes(tmp_ + "/" + tag + "-clean" + state))
        << tag;
    return job;
  }

  // `job` on `workers` workers, fault-free (TAG-clean) and with `hook` armed once (TAG-hang):
  // the armed run replaces one worker and ends with the fault-free run's losses and gradient
  // norms. Returns the two output directories, for the caller to compare what else its job
  // writes.
  std::pair<std::string, std::string> ExpectReplacementChangesNothing(
      const std::string& tag, int workers, const std::vector<std::string>& job,
      const std::string& hook) {
    const std::string clean = tmp_ + "/" + tag + "-clean", hang = tmp_ + "/" + tag + "-hang";
    auto c = Launch(workers, clean, job);
    EXPECT_EQ(c.code, 0) << c.output;
    auto r = LaunchWithHookOnce(workers, hang, job, hook);
    EXPECT_EQ(r.code, 0) << r.output;
    if (c.code != 0 || r.code != 0) return {clean, hang};
    EXPECT_EQ(Summary(hang)["worker_replacements"], 1) << Summary(hang).dump();
    EXPECT_EQ(testing::Losses(hang + "/metrics.jsonl"), testing::Losses(clean + "/metrics.jsonl"));
    EXPECT_EQ(testing::Losses(hang + "/metrics.jsonl", "grad_norm"),
              testing::Losses(clean + "/metrics.jsonl", "grad_norm"));
    return {clean, hang};
  }

  // What the run's summary.json says about how it went (docs/features.md lists the fields).
  static nlohmann::json Summary(const std::string& out) {
    return nlohmann::json::parse(testing::ReadFile(out + "/summary.json"));
  }

  std::string tmp_, runtime_;
  std::vector<std::string> before_;
};

}  // namespace rp
