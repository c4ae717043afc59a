// SPDX-License-Identifier: Apache-2.0
// schedule.activations = "worker": hidden states and input gradients stay in the worker's memory.
// Same arithmetic as the shared-memory slots (bit-identical losses and state), no host bytes for
// them, and the two limits stated where the key is documented: one worker only, and a worker
// that dies stops the run instead of being replaced.
#include <gtest/gtest.h>

#include <filesystem>

#include "tests/integration/launch_fixture.h"

namespace rp {
namespace {

using testing::Losses;

class ActivationsTest : public LaunchTest {};

TEST_F(ActivationsTest, KeptInTheWorkerGivesTheHostSlotsResultsBitForBit) {
  for (const std::string mode : {"exact", "stale1"}) {
    const std::vector<std::string> job = {"train.steps=6", "optimizer.mode=" + mode, "train.eval_every=3",
                                          "data.eval_fraction=0.1", "checkpoint.every=6"};
    auto host = Launch(1, tmp_ + "/host-" + mode, job);
    ASSERT_EQ(host.code, 0) << host.output;
    auto worker = Launch(1, tmp_ + "/worker-" + mode, With(job, {"schedule.activations=worker"}));
    ASSERT_EQ(worker.code, 0) << worker.output;
    EXPECT_EQ(Losses(tmp_ + "/worker-" + mode + "/metrics.jsonl"), Losses(tmp_ + "/host-" + mode + "/metrics.jsonl"));
    EXPECT_EQ(Losses(tmp_ + "/worker-" + mode + "/metrics.jsonl", "eval_loss"),
              Losses(tmp_ + "/host-" + mode + "/metrics.jsonl", "eval_loss"));
    const std::string state = "/checkpoints/step-00000006.rpstate";
    ASSERT_TRUE(std::filesystem::exists(tmp_ + "/host-" + mode + state));
    EXPECT_EQ(ReadBytes(tmp_ + "/worker-" + mode + state), ReadBytes(tmp_ + "/host-" + mode + state)) << mode;
  }
}

TEST_F(ActivationsTest, TheCoordinatorSaysWhereTheyAre) {
  // The byte count itself is checked by the layout's unit test.
  auto host = Launch(1, tmp_ + "/host", {"train.steps=1"});
  ASSERT_EQ(host.code, 0) << host.output;
  EXPECT_NE(host.output.find("activations in shared-memory slots ("), std::string::npos) << host.output;
  auto worker = Launch(1, tmp_ + "/worker", {"train.steps=1", "schedule.activations=worker"});
  ASSERT_EQ(worker.code, 0) << worker.output;
  EXPECT_NE(worker.output.find("activations kept in the worker's memory"), std::string::npos) << worker.output;
}

TEST_F(ActivationsTest, MoreThanOneWorkerIsRefusedNamingTheKey) {
  auto r = Launch(2, tmp_ + "/two", {"train.steps=1", "schedule.activations=worker"});
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.output.find("schedule.activations = \"worker\""), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("needs --gpus 1"), std::string::npos) << r.output;
}

TEST_F(ActivationsTest, AWorkerThatDiesStopsTheRunSayingHowToGoOn) {
  // The eval fault hook makes the worker fail a job and exit; its replacement cannot re-run jobs
  // whose inputs lived in the dead process.
  const std::vector<std::string> job = {"train.steps=6", "train.eval_every=2", "data.eval_fraction=0.1",
                                        "schedule.activations=worker"};
  auto r = testing::RunProcess(LaunchArgs(1, tmp_ + "/faulty", job), 240,
                               With(Env(), {"RP_TEST_FAIL_EVAL_ONCE=" + tmp_ + "/eval-fault-marker"}));
  EXPECT_NE(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("cannot be re-run"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("--resume"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace rp
