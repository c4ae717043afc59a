// SPDX-License-Identifier: Apache-2.0
// The integration tests' fixture: a private temp and runtime directory per test, and the check
// that nothing of ours (shared-memory segments, sockets) outlives a test.
#pragma once

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
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
inline std::vector<std::string> With(std::vector<std::string> a, const std::vector<std::string>& b) {
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

  std::vector<std::string> LaunchArgs(int n, const std::string& out, std::vector<std::string> sets = {}) {
    std::vector<std::string> a = {testing::BinDir() + "/rp-launch", "--gpus", std::to_string(n), Job(),
                                  "--set", "job.output_dir=" + out};
    for (auto& s : sets) {
      a.push_back("--set");
      a.push_back(s);
    }
    return a;
  }

  testing::ProcessResult Launch(int n, const std::string& out, std::vector<std::string> sets = {},
                                double timeout = 240) {
    return testing::RunProcess(LaunchArgs(n, out, sets), timeout, Env());
  }

  // rp-train-ref, the oracle, on the same job with the same overrides.
  testing::ProcessResult Ref(const std::string& out, const std::vector<std::string>& sets = {}) {
    std::vector<std::string> args = {testing::BinDir() + "/rp-train-ref", Job(), "--set", "job.output_dir=" + out};
    for (const auto& s : sets) args.insert(args.end(), {"--set", s});
    return testing::RunProcess(args, 240, Env());
  }

  std::string tmp_, runtime_;
  std::vector<std::string> before_;
};

}  // namespace rp
