// SPDX-License-Identifier: Apache-2.0
// schedule.activations = "worker": hidden states and input gradients stay in the worker's memory;
// activations = "cuda_ipc": they stay in the producing worker's pool.
// Same arithmetic as the shared-memory slots (bit-identical losses and state), no host bytes for
// them, and the two limits stated where the key is documented: one worker only, and a worker
// that dies stops the run instead of being replaced.
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>

#include "tests/integration/launch_fixture.h"

namespace rp {
namespace {

using testing::Losses;

class ActivationsTest : public LaunchTest {};

TEST_F(ActivationsTest, KeptInTheWorkerGivesTheHostSlotsResultsBitForBit) {
  for (const std::string mode : {"exact", "stale1"}) {
    const std::vector<std::string> job = {"train.steps=6", "optimizer.mode=" + mode,
                                          "train.eval_every=3", "data.eval_fraction=0.1",
                                          "checkpoint.every=6"};
    auto host = Launch(1, tmp_ + "/host-" + mode, job);
    ASSERT_EQ(host.code, 0) << host.output;
    auto worker = Launch(1, tmp_ + "/worker-" + mode, With(job, {"schedule.activations=worker"}));
    ASSERT_EQ(worker.code, 0) << worker.output;
    EXPECT_EQ(Losses(tmp_ + "/worker-" + mode + "/metrics.jsonl"),
              Losses(tmp_ + "/host-" + mode + "/metrics.jsonl"));
    EXPECT_EQ(Losses(tmp_ + "/worker-" + mode + "/metrics.jsonl", "eval_loss"),
              Losses(tmp_ + "/host-" + mode + "/metrics.jsonl", "eval_loss"));
    const std::string state = "/checkpoints/step-00000006.rpstate";
    ASSERT_TRUE(std::filesystem::exists(tmp_ + "/host-" + mode + state));
    EXPECT_EQ(ReadBytes(tmp_ + "/worker-" + mode + state),
              ReadBytes(tmp_ + "/host-" + mode + state))
        << mode;
  }
}

TEST_F(ActivationsTest, TheCoordinatorSaysWhereTheyAre) {
  // The byte count itself is checked by the layout's unit test.
  auto host = Launch(1, tmp_ + "/host", {"train.steps=1"});
  ASSERT_EQ(host.code, 0) << host.output;
  EXPECT_EQ(Summary(tmp_ + "/host")["activations"], "host");
  auto worker = Launch(1, tmp_ + "/worker", {"train.steps=1", "schedule.activations=worker"});
  ASSERT_EQ(worker.code, 0) << worker.output;
  EXPECT_EQ(Summary(tmp_ + "/worker")["activations"], "worker");
}

TEST_F(ActivationsTest, MoreThanOneWorkerIsRefusedNamingTheKey) {
  auto r = Launch(2, tmp_ + "/two", {"train.steps=1", "schedule.activations=worker"});
  EXPECT_EQ(r.code, 2) << "a bad job, refused before anything starts";
  EXPECT_FALSE(std::filesystem::exists(tmp_ + "/two")) << "a refused job creates nothing";
  EXPECT_NE(r.output.find("schedule.activations = \"worker\""), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("needs --gpus 1"), std::string::npos) << r.output;
}

TEST_F(ActivationsTest, AWorkerThatDiesStopsTheRunSayingHowToGoOn) {
  // The eval fault hook makes the worker fail a job and exit; its replacement cannot re-run jobs
  // whose inputs lived in the dead process.
  const std::vector<std::string> job = {"train.steps=6", "train.eval_every=2",
                                        "data.eval_fraction=0.1", "schedule.activations=worker"};
  auto r =
      testing::RunProcess(LaunchArgs(1, tmp_ + "/faulty", job), 240,
                          With(Env(), {"RP_TEST_FAIL_EVAL_ONCE=" + tmp_ + "/eval-fault-marker"}));
  EXPECT_NE(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("cannot be re-run"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("--resume"), std::string::npos) << r.output;
}

// activations = "cuda_ipc" with CPU workers: each worker's pool is a named shared-memory
// object (the CUDA backend's stand-in), so this runs the protocol the GPU runs: pools announced
// and relayed at registration, InputReady naming the producer's pool (for checkpoints written
// several stages earlier by another worker too), consumers copying from it. Bit-identical to the
// host slots, for several worker counts (so producer and consumer differ) and both modes.
TEST_F(ActivationsTest, PoolsGiveTheHostSlotsResultsBitForBit) {
  // Both modes with two slot parities (K = 2), and exact mode with one parity (K = 1) and three
  // backward stages, so the two alternating input-gradient slots are rewritten within a chain.
  const std::vector<std::pair<std::string, std::vector<std::string>>> cases = {
      {"exact", {"optimizer.mode=exact"}},
      {"stale1", {"optimizer.mode=stale1"}},
      {"exact-k1", {"optimizer.mode=exact", "train.accum_calls=1", "schedule.backward_stages=3"}}};
  for (const auto& [name, mode] : cases) {
    const std::vector<std::string> job = With(
        mode,
        {"train.steps=4", "train.eval_every=2", "data.eval_fraction=0.1", "checkpoint.every=4"});
    auto host = Launch(2, tmp_ + "/host-" + name, job);
    ASSERT_EQ(host.code, 0) << host.output;
    const auto expected = Losses(tmp_ + "/host-" + name + "/metrics.jsonl");
    ASSERT_EQ(expected.size(), 4u);
    for (int n : {2, 3}) {
      const std::string out = tmp_ + "/pools-" + name + "-" + std::to_string(n);
      auto pools = Launch(n, out, With(job, {"schedule.activations=cuda_ipc"}));
      ASSERT_EQ(pools.code, 0) << pools.output;
      EXPECT_EQ(Summary(out)["activations"], "cuda_ipc");
      EXPECT_EQ(Losses(out + "/metrics.jsonl"), expected) << name << ", " << n << " workers";
      EXPECT_EQ(Losses(out + "/metrics.jsonl", "eval_loss"),
                Losses(tmp_ + "/host-" + name + "/metrics.jsonl", "eval_loss"));
      const std::string state = "/checkpoints/step-00000004.rpstate";
      EXPECT_EQ(ReadBytes(out + state), ReadBytes(tmp_ + "/host-" + name + state))
          << name << ", " << n << " workers";
    }
  }
}

// A worker that cannot set up its pool (here a test hook; on a GPU, device memory or peer
// access) ends the run at once with its reason, instead of being replaced over and over or
// leaving the coordinator waiting.
TEST_F(ActivationsTest, APoolThatCannotBeSetUpStopsTheRunWithItsReason) {
  const auto t0 = std::chrono::steady_clock::now();
  auto r = testing::RunProcess(
      LaunchArgs(2, tmp_ + "/nopool", {"train.steps=2", "schedule.activations=cuda_ipc"}), 120,
      With(Env(), {"RP_TEST_FAIL_POOL_ONCE=" + tmp_ + "/pool-fault-marker"}));
  EXPECT_NE(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("could not set up its activation pool"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("failing the activation pool's setup on purpose"), std::string::npos)
      << r.output;
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(60));
}

TEST_F(ActivationsTest, AWorkerThatDiesWithPoolsStopsTheRunNamingTheSetting) {
  const std::vector<std::string> job = {"train.steps=6", "train.eval_every=2",
                                        "data.eval_fraction=0.1", "schedule.activations=cuda_ipc",
                                        "job.max_worker_restarts=2"};
  auto r =
      testing::RunProcess(LaunchArgs(2, tmp_ + "/faulty", job), 240,
                          With(Env(), {"RP_TEST_FAIL_EVAL_ONCE=" + tmp_ + "/eval-fault-marker"}));
  EXPECT_NE(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("schedule.activations = \"cuda_ipc\""), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("cannot be re-run"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace rp
