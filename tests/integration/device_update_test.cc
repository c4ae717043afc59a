// SPDX-License-Identifier: Apache-2.0
// optimizer.device_update_blocks: the worker computes blocks 1..N's next weights on its device
// and the next step's forward stages use them, while the host updates those blocks last. The run
// must be the run without the key bit for bit (losses, gradient norms, exported weights): with
// the masters as what workers fetch and with a compute copy, with gradients waiting on the host
// and in the worker, across a stop and resume, and when the worker is replaced. A nudge of the
// device's weights must change the losses, which shows that the forward stages did use them.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "tests/integration/launch_fixture.h"
#include "tests/testing/process_harness.h"

namespace rp {
namespace {

using testing::Losses;

class DeviceUpdateTest : public LaunchTest {};

TEST_F(DeviceUpdateTest, BlocksUpdatedOnTheWorkerGiveTheHostUpdatedRunBitForBit) {
  // Clipping that bites (the first steps' norms are above 1), one accumulation round.
  const std::vector<std::string> job = {"train.accum_calls=1", "train.microbatches=4",
                                        "train.steps=8", "train.grad_clip=1.0",
                                        "checkpoint.export_hf=hf"};
  const std::vector<std::string> on = {"optimizer.device_update_blocks=2"};
  auto expect_same = [&](const std::string& out, const std::string& base) {
    EXPECT_EQ(Losses(out + "/metrics.jsonl"), Losses(base + "/metrics.jsonl")) << out;
    EXPECT_EQ(Losses(out + "/metrics.jsonl", "grad_norm"),
              Losses(base + "/metrics.jsonl", "grad_norm"))
        << out;
    EXPECT_TRUE(ReadBytes(out + "/hf/model.safetensors") ==
                ReadBytes(base + "/hf/model.safetensors"))
        << out;
  };
  for (const std::string source : {"auto", "compute_copy"}) {
    SCOPED_TRACE("schedule.weights_source = " + source);
    const auto src = With(job, {"schedule.weights_source=\"" + source + "\""});
    const std::string host = tmp_ + "/host-" + source;
    auto h = Launch(1, host, src);
    ASSERT_EQ(h.code, 0) << h.output;
    ASSERT_GT(Losses(host + "/metrics.jsonl", "grad_norm").at(0), 1.0)
        << "clipping should bite on the first step";
    const std::string dev = tmp_ + "/device-" + source;
    auto d = Launch(1, dev, With(src, on));
    ASSERT_EQ(d.code, 0) << d.output;
    expect_same(dev, host);
    // The device's weights, nudged, reach the losses: the forward stages took them.
    const std::string nudged = tmp_ + "/nudged-" + source;
    auto n = Launch(1, nudged, With(src, With(on, {"RP_TEST_DEVICE_UPDATE_NUDGE=1"})));
    ASSERT_EQ(n.code, 0) << n.output;
    const auto a = Losses(nudged + "/metrics.jsonl"), b = Losses(host + "/metrics.jsonl");
    ASSERT_EQ(a.size(), b.size());
    EXPECT_EQ(a.at(0), b.at(0)) << "the first step runs on the initial weights";
    EXPECT_NE(a, b) << "no forward stage used the device's weights";
  }

  // Gradients waiting in the worker for the norm (an untied model, as that mode needs).
  const auto untied =
      With(job, {"model.tie_embeddings=false", "optimizer.gradients_wait_in=\"workers\""});
  const std::string held = tmp_ + "/held";
  auto h = Launch(1, held, untied);
  ASSERT_EQ(h.code, 0) << h.output;
  const std::string held_dev = tmp_ + "/held-device";
  auto hd = Launch(1, held_dev, With(untied, on));
  ASSERT_EQ(hd.code, 0) << hd.output;
  expect_same(held_dev, held);
  const std::string held_nudged = tmp_ + "/held-nudged";
  auto hn = Launch(1, held_nudged, With(untied, With(on, {"RP_TEST_DEVICE_UPDATE_NUDGE=1"})));
  ASSERT_EQ(hn.code, 0) << hn.output;
  EXPECT_NE(Losses(held_nudged + "/metrics.jsonl"), Losses(held + "/metrics.jsonl"))
      << "no forward stage used the device's weights";

  // A stop and resume: the replacement worker holds no device weights for its first step and
  // fetches the host's, which are the same.
  const auto resumable = With(job, With(on, {"checkpoint.every=3"}));
  const std::string pieces = tmp_ + "/pieces";
  ASSERT_TRUE(LaunchStoppedAndResumed(1, pieces, resumable, 5));
  expect_same(pieces, tmp_ + "/host-auto");
}

TEST_F(DeviceUpdateTest, AReplacedWorkerGivesTheSameResults) {
  // The worker hangs in its second step (its 20th microbatch) and is replaced: the replacement
  // holds no weights of its own for the step it re-runs and fetches the host's, then updates
  // blocks on its device again from the next step on.
  const std::vector<std::string> job = {"train.steps=6",
                                        "train.accum_calls=1",
                                        "train.microbatches=4",
                                        "train.grad_clip=1.0",
                                        "checkpoint.every=6",
                                        "job.worker_timeout_s=2",
                                        "optimizer.device_update_blocks=2"};
  const auto [clean, hang] =
      ExpectReplacementChangesNothing("device", 1, job, "RP_TEST_DEVICE_HANG_ONCE");
  const std::string state = "/checkpoints/step-00000006.rpstate";
  EXPECT_TRUE(ReadBytes(hang + state) == ReadBytes(clean + state));
}

TEST_F(DeviceUpdateTest, SeveralWorkersAreRefusedNamingTheKey) {
  const std::string out = tmp_ + "/two";
  auto r = Launch(
      2, out, {"train.accum_calls=1", "train.grad_clip=1.0", "optimizer.device_update_blocks=2"});
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.output.find("optimizer.device_update_blocks: needs one worker"), std::string::npos)
      << r.output;
}

}  // namespace
}  // namespace rp
