// SPDX-License-Identifier: Apache-2.0
// LoRA through real processes: the pipeline against rp-train-ref, resume, and the PEFT and
// merged exports loading back.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "tests/integration/launch_fixture.h"
#include "tests/testing/process_harness.h"

namespace rp {
namespace {

namespace fs = std::filesystem;
using testing::BinDir;
using testing::Losses;

// Five of the seven projections, dropout on: every code path of the adapter math.
const std::vector<std::string> kLora = {
    "lora.rank=4", "lora.alpha=8", "lora.dropout=0.1",
    "lora.target_modules=[\"q_proj\",\"k_proj\",\"o_proj\",\"up_proj\",\"down_proj\"]"};

using LoraTest = LaunchTest;

void ExpectClose(const std::vector<double>& got, const std::vector<double>& expected,
                 const std::string& what) {
  ASSERT_EQ(got.size(), expected.size()) << what;
  for (size_t s = 0; s < got.size(); ++s)
    EXPECT_LE(std::abs(got[s] - expected[s]) / std::abs(expected[s]), 1e-5)
        << what << ", step " << s + 1 << ": " << got[s] << " vs reference " << expected[s];
}

TEST_F(LoraTest, PipelineMatchesTheReferenceInBothModes) {
  auto ref = Ref(tmp_ + "/ref", kLora);
  ASSERT_EQ(ref.code, 0) << ref.output;
  const auto expected = Losses(tmp_ + "/ref/metrics.jsonl");
  ASSERT_EQ(expected.size(), 20u);
  EXPECT_LT(expected.back(), expected.front());
  // B starts at zero, so the first step computes exactly the full model's loss.
  auto full = Ref(tmp_ + "/full", {"train.steps=1"});
  ASSERT_EQ(full.code, 0) << full.output;
  EXPECT_EQ(Losses(tmp_ + "/full/metrics.jsonl")[0], expected[0]);
  for (int n = 1; n <= 3; ++n) {
    const std::string out = tmp_ + "/n" + std::to_string(n);
    auto r = Launch(n, out, kLora);
    ASSERT_EQ(r.code, 0) << r.output;
    ExpectClose(Losses(out + "/metrics.jsonl"), expected, "exact, N=" + std::to_string(n));
  }
  // The job's two calls merged (the default here) or not draw the same dropout masks.
  auto never = Launch(2, tmp_ + "/never", With(kLora, {"RP_MERGE_CALLS=never"}));
  ASSERT_EQ(never.code, 0) << never.output;
  ExpectClose(Losses(tmp_ + "/never/metrics.jsonl"), expected, "exact, calls not merged, N=2");
  auto ref1 = Ref(tmp_ + "/ref-stale1", With(kLora, {"optimizer.mode=stale1"}));
  ASSERT_EQ(ref1.code, 0) << ref1.output;
  auto r = Launch(2, tmp_ + "/stale1", With(kLora, {"optimizer.mode=stale1"}));
  ASSERT_EQ(r.code, 0) << r.output;
  ExpectClose(Losses(tmp_ + "/stale1/metrics.jsonl"), Losses(tmp_ + "/ref-stale1/metrics.jsonl"),
              "stale1, N=2");
}

// schedule.frozen_on_device: the workers keep the base from their first fetch on and copy only
// the adapters afterwards; the same bits as fetching it for every job, in both modes, with fp16
// (emulated on CPU workers), evaluations, layer-major forward stages, and a worker replaced
// after a hang (its replacement keeps the base anew).
TEST_F(LoraTest, TheFrozenBaseKeptOnTheWorkersChangesNoBit) {
  const std::string said = "keeps the frozen base weights on its device";
  const std::string adapter = "/adapter/adapter_model.safetensors";
  const std::vector<std::pair<std::string, std::vector<std::string>>> variants = {
      {"exact", {}},
      {"stale1", {"optimizer.mode=stale1"}},
      {"fp16", {"train.dtype=fp16"}},
      {"eval", {"train.eval_every=5", "data.eval_fraction=0.1"}},
      {"layer-major", {"RP_LAYER_MAJOR_FORWARD=always"}},
  };
  for (const auto& [tag, sets] : variants) {
    const auto job = With(kLora, With(sets, {"train.steps=8"}));
    auto fetched = Launch(2, tmp_ + "/fetched-" + tag, job);
    ASSERT_EQ(fetched.code, 0) << tag << "\n" << fetched.output;
    auto kept = Launch(2, tmp_ + "/kept-" + tag, With(job, {"schedule.frozen_on_device=true"}));
    ASSERT_EQ(kept.code, 0) << tag << "\n" << kept.output;
    EXPECT_NE(kept.output.find(said), std::string::npos) << tag << "\n" << kept.output;
    EXPECT_EQ(fetched.output.find(said), std::string::npos) << tag;
    const auto want = Losses(tmp_ + "/fetched-" + tag + "/metrics.jsonl");
    ASSERT_EQ(want.size(), 8u) << tag;
    EXPECT_EQ(Losses(tmp_ + "/kept-" + tag + "/metrics.jsonl"), want) << tag;
    ASSERT_TRUE(fs::exists(tmp_ + "/fetched-" + tag + adapter)) << tag;
    EXPECT_EQ(ReadBytes(tmp_ + "/kept-" + tag + adapter),
              ReadBytes(tmp_ + "/fetched-" + tag + adapter))
        << tag;
  }
  const auto eval_losses = [](const std::string& metrics) {
    std::vector<double> out;
    std::ifstream f(metrics);
    for (std::string line; std::getline(f, line);)
      if (auto j = nlohmann::json::parse(line); j.contains("eval_loss"))
        out.push_back(j["eval_loss"].get<double>());
    return out;
  };
  const auto evals = eval_losses(tmp_ + "/fetched-eval/metrics.jsonl");
  EXPECT_FALSE(evals.empty());
  EXPECT_EQ(eval_losses(tmp_ + "/kept-eval/metrics.jsonl"), evals);
  const auto hang_job =
      With(kLora, {"train.steps=6", "job.worker_timeout_s=2", "schedule.frozen_on_device=true"});
  auto clean = Launch(2, tmp_ + "/kept-clean", hang_job);
  ASSERT_EQ(clean.code, 0) << clean.output;
  auto hung = LaunchWithHookOnce(2, tmp_ + "/kept-hung", hang_job, "RP_TEST_HANG_ONCE");
  ASSERT_EQ(hung.code, 0) << hung.output;
  EXPECT_NE(hung.output.find("hanging on purpose"), std::string::npos) << hung.output;
  EXPECT_EQ(Summary(tmp_ + "/kept-hung")["worker_replacements"], 1);
  EXPECT_EQ(Losses(tmp_ + "/kept-hung/metrics.jsonl"), Losses(tmp_ + "/kept-clean/metrics.jsonl"));
}

TEST_F(LoraTest, StopAndResumeIsBitIdenticalToAnUninterruptedRun) {
  // With evaluations every 3 steps: the resumed run evaluates at the same steps, bit for bit.
  const auto job =
      With(kLora, {"checkpoint.every=20", "train.eval_every=3", "data.eval_fraction=0.1"});
  const std::string a = tmp_ + "/whole", b = tmp_ + "/pieces";
  auto whole = Launch(2, a, job);
  ASSERT_EQ(whole.code, 0) << whole.output;
  auto first = Launch(2, b, With(job, {"train.stop_after=10"}));
  ASSERT_EQ(first.code, 0) << first.output;
  ASSERT_EQ(Losses(b + "/metrics.jsonl").size(), 10u);
  auto args = LaunchArgs(2, b, job);
  args.push_back("--resume");
  auto second = testing::RunProcess(args, 240, Env());
  ASSERT_EQ(second.code, 0) << second.output;
  const auto expected = Losses(a + "/metrics.jsonl"), got = Losses(b + "/metrics.jsonl");
  ASSERT_EQ(got.size(), 20u);
  for (size_t s = 0; s < got.size(); ++s) EXPECT_EQ(got[s], expected[s]) << "step " << s + 1;
  EXPECT_EQ(Losses(b + "/metrics.jsonl", "eval_loss"), Losses(a + "/metrics.jsonl", "eval_loss"));
  EXPECT_GT(Losses(a + "/metrics.jsonl", "eval_loss")[2], 0);  // step 3 was evaluated
  EXPECT_TRUE(ReadBytes(a + "/checkpoints/step-00000020.rpstate") ==
              ReadBytes(b + "/checkpoints/step-00000020.rpstate"));
  EXPECT_TRUE(ReadBytes(a + "/adapter/adapter_model.safetensors") ==
              ReadBytes(b + "/adapter/adapter_model.safetensors"));
  // The checkpoint holds the adapters' state only: far smaller than a full fine-tune's.
  auto full =
      Launch(2, tmp_ + "/full", {"checkpoint.every=20", "train.steps=2", "train.stop_after=2"});
  ASSERT_EQ(full.code, 0) << full.output;
  EXPECT_LT(fs::file_size(a + "/checkpoints/step-00000020.rpstate") * 4,
            fs::file_size(tmp_ + "/full/checkpoints/step-00000002.rpstate"));
  // A different base (another seed) must not resume these adapters.
  auto other = LaunchArgs(2, b, With(job, {"train.seed=5", "train.steps=30"}));
  other.push_back("--resume");
  auto refused = testing::RunProcess(other, 240, Env());
  EXPECT_NE(refused.code, 0);
  EXPECT_NE(refused.output.find("step-00000020.rpstate"), std::string::npos) << refused.output;
}

TEST_F(LoraTest, AdapterAndMergedExportsLoadBack) {
  // Train 5 steps, export the adapter (PEFT layout) and the merged model. Start again from the
  // adapter with lr = 0: the adapter comes back out bit for bit, the pipeline's and the
  // reference's losses agree, and the merged model (a full fine-tune from model.path) computes
  // the same loss as base + adapter. Qwen3-style with tied embeddings (the job's model), then
  // Llama-style (no q/k norm) with an untied LM head.
  for (const bool llama : {false, true}) {
    SCOPED_TRACE(llama ? "llama, untied" : "qwen3, tied");
    const std::string tag = llama ? "/llama" : "/qwen3";
    std::vector<std::string> lora = {
        "lora.rank=4", "lora.alpha=16",
        "lora.target_modules=[\"q_proj\",\"v_proj\",\"gate_proj\",\"down_proj\"]"};
    if (llama) lora = With(lora, {"model.qk_norm=false", "model.tie_embeddings=false"});
    const std::string a = tmp_ + tag + "-train";
    auto train = Launch(2, a, With(lora, {"train.steps=5", "checkpoint.export_hf=merged"}));
    ASSERT_EQ(train.code, 0) << train.output;
    ASSERT_TRUE(fs::exists(a + "/adapter/adapter_config.json"));
    ASSERT_TRUE(fs::exists(a + "/merged/model.safetensors"));
    const std::vector<std::string> frozen = {"train.steps=1", "optimizer.lr=0",
                                             "optimizer.min_lr=0"};
    const auto again = With(With(lora, frozen), {"lora.init_from=" + a + "/adapter"});
    auto load = Launch(2, tmp_ + tag + "-load", again);
    ASSERT_EQ(load.code, 0) << load.output;
    EXPECT_TRUE(ReadBytes(a + "/adapter/adapter_model.safetensors") ==
                ReadBytes(tmp_ + tag + "-load/adapter/adapter_model.safetensors"))
        << "the adapter changed on the way through load and export";
    auto ref = Ref(tmp_ + tag + "-ref", again);
    ASSERT_EQ(ref.code, 0) << ref.output;
    const double loaded = Losses(tmp_ + tag + "-load/metrics.jsonl").at(0);
    EXPECT_LE(std::abs(loaded - Losses(tmp_ + tag + "-ref/metrics.jsonl").at(0)) / loaded, 1e-5);
    EXPECT_LT(loaded, Losses(a + "/metrics.jsonl").at(0));  // trained adapters, not fresh ones
    // The merged directory's config.json carries the architecture (llama / qwen3, tied or not).
    auto merged = Launch(2, tmp_ + tag + "-merged", With(frozen, {"model.path=" + a + "/merged"}));
    ASSERT_EQ(merged.code, 0) << merged.output;
    EXPECT_LE(std::abs(Losses(tmp_ + tag + "-merged/metrics.jsonl").at(0) - loaded) / loaded, 1e-5);
    EXPECT_NE(testing::ReadFile(a + "/merged/config.json").find(llama ? "\"llama\"" : "\"qwen3\""),
              std::string::npos);
  }
}

TEST_F(LoraTest, MismatchedOrDamagedAdaptersAreRefusedNamingTheProblem) {
  const std::string a = tmp_ + "/train";
  auto train = Launch(1, a, With(kLora, {"train.steps=2"}));
  ASSERT_EQ(train.code, 0) << train.output;
  const std::string dir = a + "/adapter";
  auto wrong_rank = Launch(1, tmp_ + "/r8", With(kLora, {"lora.rank=8", "lora.init_from=" + dir}));
  EXPECT_NE(wrong_rank.code, 0);
  EXPECT_NE(wrong_rank.output.find("adapter_config.json: \"r\" is 4; lora.rank is 8"),
            std::string::npos)
      << wrong_rank.output;
  auto wrong_targets =
      Launch(1, tmp_ + "/targets",
             With(kLora, {"lora.target_modules=[\"q_proj\"]", "lora.init_from=" + dir}));
  EXPECT_NE(wrong_targets.code, 0);
  EXPECT_NE(wrong_targets.output.find("\"target_modules\" is ["), std::string::npos)
      << wrong_targets.output;
  const std::string weights = dir + "/adapter_model.safetensors";
  fs::resize_file(weights, fs::file_size(weights) - 100);
  auto truncated = Launch(1, tmp_ + "/trunc", With(kLora, {"lora.init_from=" + dir}));
  EXPECT_NE(truncated.code, 0);
  EXPECT_NE(truncated.output.find(weights), std::string::npos) << truncated.output;
  auto bad_target = Launch(1, tmp_ + "/bad", With(kLora, {"lora.target_modules=[\"qproj\"]"}));
  EXPECT_NE(bad_target.code, 0);
  EXPECT_NE(bad_target.output.find("lora.target_modules: \"qproj\""), std::string::npos)
      << bad_target.output;
}

TEST_F(LoraTest, AnAdapterSavedByPeftComputesPeftsLoss) {
  // tests/testdata/peft_fixture: peft's save_pretrained output for the fixture job's seeded base
  // and the loss transformers + peft computed on step 1's batch (tools/peft_check.py --fixture).
  const std::string dir = testing::SourceDir() + "/tests/testdata/peft_fixture";
  std::ifstream f(dir + "/expected.json");
  std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  const auto at = text.find("\"loss\":");
  ASSERT_NE(at, std::string::npos) << text;
  const double expected = std::stod(text.substr(at + 7));
  auto ref = testing::RunProcess(
      {BinDir() + "/rp-train-ref", dir + "/job.toml", "--set", "job.output_dir=" + tmp_ + "/ref"},
      240, Env());
  ASSERT_EQ(ref.code, 0) << ref.output;
  auto pipe = testing::RunProcess({BinDir() + "/rp-launch", "--gpus", "2", dir + "/job.toml",
                                   "--set", "job.output_dir=" + tmp_ + "/pipe"},
                                  240, Env());
  ASSERT_EQ(pipe.code, 0) << pipe.output;
  for (const std::string out : {"/ref", "/pipe"}) {
    const double got = Losses(tmp_ + out + "/metrics.jsonl").at(0);
    EXPECT_LE(std::abs(got - expected) / expected, 1e-5)
        << out << ": " << got << " vs peft's " << expected;
  }
  // Without the adapter the same batch scores differently: the adapter was applied.
  auto bare =
      testing::RunProcess({BinDir() + "/rp-train-ref", dir + "/job.toml", "--set",
                           "job.output_dir=" + tmp_ + "/bare", "--set", "lora.init_from=\"\""},
                          240, Env());
  ASSERT_EQ(bare.code, 0) << bare.output;
  EXPECT_GT(std::abs(Losses(tmp_ + "/bare/metrics.jsonl").at(0) - expected) / expected, 1e-3);
}

}  // namespace
}  // namespace rp
