// SPDX-License-Identifier: Apache-2.0
// The coordinator's timeline part, in-process: what it records and the file it writes.
#include "coordinator/run_trace.h"

#include <gtest/gtest.h>

#include <filesystem>

#include <nlohmann/json.hpp>

#include "config/job_config.h"
#include "planning/plan.h"
#include "tests/testing/process_harness.h"

namespace rp::coord {
namespace {

namespace fs = std::filesystem;

TEST(RunTrace, RecordsJobsMicrobatchesAndUpdatesOnTheirRows) {
  core::JobConfig cfg;
  auto plan = core::BuildPlan(cfg);
  ASSERT_TRUE(plan.ok());
  const std::string dir = testing::MakeTempDir("rp-trace-");
  RunTrace trace(/*enabled=*/true, *plan, /*microbatches_per_round=*/2, /*workers=*/2);
  const int last = static_cast<int>(plan->stages.size()) - 1;
  trace.AddJob({7, 3, 1, 0, 1, 4242, 1000, 1100, 1900, {{1100, 1500}, {1500, 1900}}});
  trace.AddJob({8, 3, 1, last, 0, 4141, 2000, 2000, 2500, {{2000, 2500}}});
  trace.AddOptimizerSpans({{3, 5, 2600, 2700}});
  EXPECT_EQ(trace.events(), 6u);
  ASSERT_TRUE(trace.Write(dir + "/trace.json", 99, {4141, 4242}).ok());
  const auto doc = nlohmann::json::parse(testing::ReadFile(dir + "/trace.json"));
  const auto& ev = doc["traceEvents"];
  ASSERT_EQ(ev.size(), 3u + 6u);  // three process names first
  EXPECT_EQ(ev[0]["args"]["name"], "coordinator (pid 99)");
  EXPECT_EQ(ev[2]["args"]["name"], "worker 1 (pid 4242)");
  const auto& job = ev[3];
  EXPECT_EQ(job["name"], "F0");
  EXPECT_EQ(job["pid"], 2);  // worker 1's row
  EXPECT_EQ(job["dur"], 900);
  EXPECT_EQ(job["args"]["fetch_us"], 100);
  EXPECT_EQ(job["args"]["microbatches"], 2);
  EXPECT_EQ(job["args"]["worker_pid"], 4242);
  EXPECT_EQ(ev[4]["name"], "F0/mb0");
  EXPECT_EQ(ev[4]["tid"], 1);
  std::string backward = "B";  // (appended: GCC 12 warns falsely on "B" + std::string)
  backward += std::to_string(last);
  EXPECT_EQ(ev[6]["name"], backward);
  EXPECT_EQ(ev[8]["name"], "update layer 5");
  EXPECT_EQ(ev[8]["pid"], 0);
  EXPECT_EQ(doc["otherData"]["plan"], plan->Describe());
  EXPECT_EQ(doc["otherData"]["num_workers"], 2);
  fs::remove_all(dir);
}

TEST(RunTrace, OffRecordsAndWritesNothing) {
  core::JobConfig cfg;
  auto plan = core::BuildPlan(cfg);
  ASSERT_TRUE(plan.ok());
  const std::string dir = testing::MakeTempDir("rp-trace-off-");
  RunTrace trace(/*enabled=*/false, *plan, 2, 1);
  trace.AddJob({1, 0, 0, 0, 0, 1, 0, 0, 1, {}});
  EXPECT_EQ(trace.events(), 0u);
  ASSERT_TRUE(trace.Write(dir + "/trace.json", 1, {1}).ok());
  EXPECT_FALSE(fs::exists(dir + "/trace.json"));
  fs::remove_all(dir);
}

}  // namespace
}  // namespace rp::coord
