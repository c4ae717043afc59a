// SPDX-License-Identifier: Apache-2.0
// Every model family and RoPE variant through real processes: the transformers-saved fixtures of
// tests/testdata/hf_fixtures (byte vocabulary, so the demo corpus feeds them) trained by the
// pipeline and by rp-train-ref, and a transformers 5 config against its transformers 4 spelling.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tests/integration/launch_fixture.h"
#include "tests/testing/process_harness.h"

namespace rp {
namespace {

namespace fs = std::filesystem;
using testing::Losses;

std::string Fixture(const std::string& name) { return testing::SourceDir() + "/tests/testdata/hf_fixtures/" + name; }

// 64-token sequences: longer than the scaled fixtures' original_max_position_embeddings (32),
// so the rescaled low frequencies are exercised.
std::vector<std::string> FixtureJob(const std::string& model, int steps) {
  return {"model.path=" + model, "data.seq_len=64", "train.steps=" + std::to_string(steps),
          "train.microbatch_size=2", "train.microbatches=3", "train.accum_calls=2"};
}

// transformers 5 writes the RoPE base only inside rope_parameters; transformers 4 wrote it at
// the top level. The two spellings are one model: the pipeline trains them bit for bit alike.
TEST_F(LaunchTest, RopeParametersTrainExactlyLikeTopLevelRopeTheta) {
  const std::string v5 = tmp_ + "/v5", v4 = tmp_ + "/v4";
  for (const auto& d : {v5, v4}) {
    fs::create_directories(d);
    fs::copy_file(Fixture("qwen3") + "/model.safetensors", d + "/model.safetensors");
  }
  auto cfg = nlohmann::json::parse(testing::ReadFile(Fixture("qwen3") + "/config.json"));
  ASSERT_FALSE(cfg.contains("rope_theta")) << "the fixture should be as transformers 5 writes it";
  ASSERT_NE(cfg["rope_parameters"]["rope_theta"].get<double>(), 10000.0);
  std::ofstream(v5 + "/config.json") << cfg.dump(2);
  cfg["rope_theta"] = cfg["rope_parameters"]["rope_theta"];
  cfg.erase("rope_parameters");
  std::ofstream(v4 + "/config.json") << cfg.dump(2);
  auto a = Launch(2, tmp_ + "/run-v5", FixtureJob(v5, 5));
  ASSERT_EQ(a.code, 0) << a.output;
  auto b = Launch(2, tmp_ + "/run-v4", FixtureJob(v4, 5));
  ASSERT_EQ(b.code, 0) << b.output;
  const auto la = Losses(tmp_ + "/run-v5/metrics.jsonl"), lb = Losses(tmp_ + "/run-v4/metrics.jsonl");
  ASSERT_EQ(la.size(), 5u);
  EXPECT_EQ(la, lb);
  // And the base matters: the default base (what a reader of the top-level key alone falls back
  // to) trains differently.
  cfg.erase("rope_theta");
  std::ofstream(v4 + "/config.json") << cfg.dump(2);
  auto c = Launch(2, tmp_ + "/run-default", FixtureJob(v4, 1));
  ASSERT_EQ(c.code, 0) << c.output;
  EXPECT_GT(std::abs(Losses(tmp_ + "/run-default/metrics.jsonl")[0] - la[0]), 1e-4 * la[0]);
}

class FamilyParity : public LaunchTest, public ::testing::WithParamInterface<std::string> {};

// Ten steps of each fixture on two CPU workers against rp-train-ref (AdamW, warmup + cosine,
// clipping), full fine-tune; LoRA on every projection for the families with biases (frozen, as
// PEFT's default).
TEST_P(FamilyParity, PipelineMatchesTheReferenceForTenSteps) {
  const std::string name = GetParam();
  std::vector<std::string> sets = FixtureJob(Fixture(name), 10);
  if (name == "qwen2" || name == "llama_bias") {
    sets = With(sets, {"lora.rank=4", "lora.target_modules=[\"q_proj\",\"k_proj\",\"v_proj\",\"o_proj\","
                                      "\"gate_proj\",\"up_proj\",\"down_proj\"]",
                       "optimizer.lr=2e-2"});
  }
  auto ref = Ref(tmp_ + "/ref", sets);
  ASSERT_EQ(ref.code, 0) << ref.output;
  auto run = Launch(2, tmp_ + "/run", sets);
  ASSERT_EQ(run.code, 0) << run.output;
  const auto expected = Losses(tmp_ + "/ref/metrics.jsonl"), got = Losses(tmp_ + "/run/metrics.jsonl");
  ASSERT_EQ(expected.size(), 10u);
  ASSERT_EQ(got.size(), 10u);
  for (size_t s = 0; s < got.size(); ++s)
    EXPECT_LE(std::abs(got[s] - expected[s]) / expected[s], 1e-5) << "step " << s + 1;
  EXPECT_LT(got.back(), got.front()) << "ten steps should lower the loss";
}

INSTANTIATE_TEST_SUITE_P(Fixtures, FamilyParity,
                         ::testing::Values("qwen3", "qwen3_yarn", "llama3", "llama_tied_linear", "llama_bias",
                                           "qwen2", "mistral"));

}  // namespace
}  // namespace rp
