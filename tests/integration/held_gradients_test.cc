// SPDX-License-Identifier: Apache-2.0
// optimizer.gradients_wait_in = "workers": with clipping, gradients wait for the step's norm on
// the workers, which report their chunks' squared sums (CPU workers sum them exactly as the
// coordinator does), and then stream through a small arena. The run must be the host-held run
// bit for bit (losses, gradient norms, exported weights) for every worker count and mode, and its
// arena must be streamed.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tests/integration/launch_fixture.h"
#include "tests/testing/process_harness.h"

namespace rp {
namespace {

using testing::Losses;

class HeldGradientsTest : public LaunchTest {};

TEST_F(HeldGradientsTest, WorkersHoldingGradientsForTheNormGiveTheHostHeldRunBitForBit) {
  // An untied model with one accumulation round per step (what the mode needs), clipping that
  // bites (the first steps' norms are above 1).
  const std::vector<std::string> base = {"model.tie_embeddings=false", "train.accum_calls=1",
                                         "train.microbatches=4",       "train.steps=8",
                                         "train.grad_clip=1.0",        "checkpoint.export_hf=hf"};
  for (const std::string mode : {"exact", "stale1"}) {
    const auto job = With(base, {"optimizer.mode=\"" + mode + "\""});
    const std::string host = tmp_ + "/host-" + mode;
    auto h = Launch(2, host, job);
    ASSERT_EQ(h.code, 0) << h.output;
    EXPECT_FALSE(Summary(host)["grads_streamed"].get<bool>());
    const auto norms = Losses(host + "/metrics.jsonl", "grad_norm");
    ASSERT_EQ(norms.size(), 8u);
    EXPECT_GT(norms[0], 1.0) << "clipping should bite on the first step";
    for (int n : {1, 2, 3}) {
      const std::string out = tmp_ + "/workers-" + mode + "-" + std::to_string(n);
      auto w = Launch(n, out, With(job, {"optimizer.gradients_wait_in=\"workers\""}));
      ASSERT_EQ(w.code, 0) << w.output;
      SCOPED_TRACE(mode + ", " + std::to_string(n) + " workers");
      EXPECT_EQ(Losses(out + "/metrics.jsonl"), Losses(host + "/metrics.jsonl"));
      EXPECT_EQ(Losses(out + "/metrics.jsonl", "grad_norm"), norms);
      EXPECT_TRUE(ReadBytes(out + "/hf/model.safetensors") ==
                  ReadBytes(host + "/hf/model.safetensors"));
      const auto s = Summary(out);
      EXPECT_TRUE(s["grads_streamed"].get<bool>()) << s.dump();
      EXPECT_LT(s["grad_arena_bytes"].get<int64_t>(),
                Summary(host)["grad_arena_bytes"].get<int64_t>());
    }
    // Squares and microbatches reported late, as a GPU's copies land after the host has moved on:
    // a job is announced only once its squares are written, so the norm is the same.
    const std::string late = tmp_ + "/late-" + mode;
    auto l = Launch(
        2, late,
        With(job, {"optimizer.gradients_wait_in=\"workers\"", "RP_TEST_LATE_COMPLETION_MS=15"}));
    ASSERT_EQ(l.code, 0) << l.output;
    EXPECT_EQ(Losses(late + "/metrics.jsonl", "grad_norm"), norms) << mode << ", reported late";
    EXPECT_TRUE(ReadBytes(late + "/hf/model.safetensors") ==
                ReadBytes(host + "/hf/model.safetensors"))
        << mode;
  }
}

TEST_F(HeldGradientsTest, AFullArenaKeepsTheCommitsInGrantOrder) {
  // Six blocks, backward stages [0,1) [1,2) [2,4) [4,6) and the tail [6,8) (block 6, the head),
  // granted first layers first; an arena of 7 MiB holds the embedding's and block 1's slots but
  // not blocks 2-3's (6.3 MB) beside them, while the tail's 3.4 MB would fit. The tail must still
  // wait its turn: its layers are updated after every block before it, in each step.
  const std::vector<std::string> job = {"model.tie_embeddings=false",
                                        "model.num_layers=6",
                                        "model.hidden_size=256",
                                        "model.intermediate_size=768",
                                        "model.head_dim=64",
                                        "train.accum_calls=1",
                                        "train.microbatches=4",
                                        "train.steps=4",
                                        "train.grad_clip=1.0",
                                        "schedule.tail_blocks=1",
                                        "schedule.backward_cuts=[1,2,4]",
                                        "optimizer.gradients_wait_in=\"workers\""};
  const std::string roomy = tmp_ + "/roomy";
  auto r = Launch(1, roomy, job);
  ASSERT_EQ(r.code, 0) << r.output;
  const std::string full = tmp_ + "/full";
  auto f = Launch(1, full, With(job, {"optimizer.grad_buffer_mb=7"}));
  ASSERT_EQ(f.code, 0) << f.output;
  EXPECT_EQ(Losses(full + "/metrics.jsonl"), Losses(roomy + "/metrics.jsonl"));
  EXPECT_EQ(Summary(full)["grad_arena_bytes"].get<int64_t>(), int64_t{7} << 20);
  std::map<int64_t, std::map<int, int64_t>> start;  // step -> layer -> its update's first start
  const auto trace = nlohmann::json::parse(testing::ReadFile(full + "/trace.json"));
  for (const auto& e : trace["traceEvents"]) {
    if (e.value("cat", "") != "optimizer") continue;
    const int64_t step = e["args"]["step"].get<int64_t>();
    const int layer = e["args"]["layer"].get<int>();
    const int64_t ts = e["ts"].get<int64_t>();
    auto [it, fresh] = start[step].emplace(layer, ts);
    if (!fresh) it->second = std::min(it->second, ts);
  }
  ASSERT_EQ(start.size(), 4u);
  for (const auto& [step, layers] : start) {
    ASSERT_EQ(layers.size(), 8u) << "step " << step;
    int64_t blocks_last = 0, tail_first = INT64_MAX;
    for (const auto& [layer, ts] : layers)
      (layer < 6 ? blocks_last = std::max(blocks_last, ts) : tail_first = std::min(tail_first, ts));
    EXPECT_GT(tail_first, blocks_last)
        << "step " << step << ": the tail's update started before a block's";
  }
}

TEST_F(HeldGradientsTest, AHungWorkerHoldingGradientsIsReplacedWithTheSameResult) {
  // The next step's tokens and checkpoints go into the other slot set while this step's commits
  // wait for the norm (ExecutionPlan::activation_parities), so a replacement can still re-run any
  // job whose commit had not landed: losses, norms and weights equal the fault-free run's.
  const std::vector<std::string> job = {
      "model.tie_embeddings=false", "train.accum_calls=1",
      "train.microbatches=4",       "train.steps=8",
      "train.grad_clip=1.0",        "checkpoint.export_hf=hf",
      "job.worker_timeout_s=2",     "optimizer.gradients_wait_in=\"workers\""};
  const auto [clean, hang] = ExpectReplacementChangesNothing("held", 2, job, "RP_TEST_HANG_ONCE");
  EXPECT_TRUE(ReadBytes(hang + "/hf/model.safetensors") ==
              ReadBytes(clean + "/hf/model.safetensors"));
}

TEST_F(HeldGradientsTest, LoraOnATiedModelHoldsItsAdaptersInTheWorkers) {
  // LoRA freezes the tied embedding: every trainable parameter (an adapter) is in one layer.
  const std::vector<std::string> job = {"lora.rank=4", "train.accum_calls=1", "train.steps=6",
                                        "train.grad_clip=0.05"};
  auto h = Launch(2, tmp_ + "/host", job);
  ASSERT_EQ(h.code, 0) << h.output;
  auto w = Launch(2, tmp_ + "/workers", With(job, {"optimizer.gradients_wait_in=\"workers\""}));
  ASSERT_EQ(w.code, 0) << w.output;
  EXPECT_EQ(Losses(tmp_ + "/workers/metrics.jsonl"), Losses(tmp_ + "/host/metrics.jsonl"));
  EXPECT_EQ(Losses(tmp_ + "/workers/metrics.jsonl", "grad_norm"),
            Losses(tmp_ + "/host/metrics.jsonl", "grad_norm"));
}

TEST_F(HeldGradientsTest, Fp16SkipsTheSameStepsWhenTheNormComesFromTheWorkers) {
  // Overflows injected at steps 2 and 5 (0-based): the workers' sums of squares are not finite
  // there, and the run skips and rescales as the host-held one does, bit for bit; without
  // clipping too (the scaler alone needs the norm first).
  for (const std::string clip : {"1.0", "0"}) {
    const std::vector<std::string> job = {"model.tie_embeddings=false",
                                          "train.accum_calls=1",
                                          "train.steps=8",
                                          "train.dtype=\"fp16\"",
                                          "train.loss_scale_growth_interval=2",
                                          "train.grad_clip=" + clip,
                                          "RP_TEST_OVERFLOW_AT_STEPS=2,5"};
    auto h = Launch(2, tmp_ + "/host" + clip, job);
    ASSERT_EQ(h.code, 0) << h.output;
    auto w =
        Launch(2, tmp_ + "/workers" + clip, With(job, {"optimizer.gradients_wait_in=\"workers\""}));
    ASSERT_EQ(w.code, 0) << w.output;
    const std::string hm = tmp_ + "/host" + clip + "/metrics.jsonl",
                      wm = tmp_ + "/workers" + clip + "/metrics.jsonl";
    EXPECT_EQ(Losses(wm), Losses(hm)) << clip;
    EXPECT_EQ(Losses(wm, "loss_scale"), Losses(hm, "loss_scale")) << clip;
    EXPECT_EQ(Summary(tmp_ + "/workers" + clip)["skipped_steps"], 2) << clip;
  }
}

TEST_F(HeldGradientsTest, WhatTheModeCannotHoldIsRefusedBeforeAnythingStarts) {
  const std::string key = "optimizer.gradients_wait_in=\"workers\"";
  for (const auto& [sets, why] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{key, "model.tie_embeddings=false", "train.accum_calls=1", "train.grad_clip=0"},
            "train.grad_clip = 0"},
           {{key, "train.accum_calls=1"}, "tied embedding"},
           {{key, "model.tie_embeddings=false", "optimizer.mode=\"stale1\""},
            "one accumulation round"}}) {
    auto r = Launch(2, tmp_ + "/refused", sets);
    EXPECT_EQ(r.code, 2) << r.output;
    EXPECT_NE(r.output.find("optimizer.gradients_wait_in"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find(why), std::string::npos) << r.output;
  }
}

}  // namespace
}  // namespace rp
