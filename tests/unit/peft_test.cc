// SPDX-License-Identifier: Apache-2.0
// LoRA's model spec and PEFT adapter directories.
#include "io/peft.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <random>

#include <nlohmann/json.hpp>

#include "config/model_spec.h"
#include "io/safetensors.h"
#include "tests/testing/process_harness.h"

namespace rp::core {
namespace {

namespace fs = std::filesystem;

ModelConfig Small() {
  ModelConfig m;
  m.vocab_size = 300;
  m.hidden_size = 64;
  m.intermediate_size = 96;
  m.num_layers = 2;
  m.num_heads = 4;
  m.num_kv_heads = 2;
  m.head_dim = 16;
  return m;
}

LoraConfig Lora(int64_t rank, std::vector<std::string> targets) {
  LoraConfig l;
  l.rank = rank;
  l.alpha = 2.0 * static_cast<double>(rank);
  l.target_modules = std::move(targets);
  return l;
}

TEST(LoraSpec, AdaptersAreTrainableAndTheBaseIsFrozenWithTheFullModelsInit) {
  const ModelConfig m = Small();
  const ModelSpec full = BuildModelSpec(m);
  const ModelSpec spec = BuildModelSpec(m, Lora(4, {"q_proj", "down_proj"}));
  ASSERT_EQ(spec.frozen.size(), full.params.size());
  EXPECT_EQ(spec.FrozenParams(), full.TrainableParams());
  // Per block: q_proj A [4, 64] + B [64, 4], down_proj A [4, 96] + B [64, 4].
  EXPECT_EQ(spec.TrainableParams(), 2 * (4 * 64 + 64 * 4 + 4 * 96 + 64 * 4));
  ASSERT_EQ(spec.params.size(), 8u);
  EXPECT_EQ(spec.params[0].name, "model.layers.0.self_attn.q_proj.lora_A.weight");
  EXPECT_EQ(spec.params[1].name, "model.layers.0.self_attn.q_proj.lora_B.weight");
  EXPECT_EQ(spec.params[3].shape, (std::vector<int64_t>{64, 4}));
  EXPECT_EQ(spec.grad_slots.size(), spec.params.size());  // no tied use of a trainable weight
  for (int l : {0, 3}) EXPECT_TRUE(spec.layer_uses[l].empty()) << "layer " << l;
  // The base starts as the full model would; A is uniform in +-1/sqrt(in), B zero.
  for (size_t f = 0; f < spec.frozen.size(); ++f) {
    std::vector<float> a(spec.frozen[f].numel), b(full.params[f].numel);
    InitParam(spec.frozen[f], m, 5, a.data());
    InitParam(full, static_cast<int>(f), 5, b.data());
    ASSERT_EQ(a, b) << spec.frozen[f].name;
  }
  std::vector<float> A(spec.params[2].numel), B(spec.params[3].numel);
  InitParam(spec, 2, 5, A.data());
  InitParam(spec, 3, 5, B.data());
  float lo = 1, hi = -1;
  for (float x : A) lo = std::min(lo, x), hi = std::max(hi, x);
  EXPECT_LT(hi, 1.0f / std::sqrt(96.0f));
  EXPECT_GT(lo, -1.0f / std::sqrt(96.0f));
  EXPECT_GT(hi - lo, 1.5f / std::sqrt(96.0f));  // spread over the range, not constant
  for (float x : B) ASSERT_EQ(x, 0.0f);
}

class PeftTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing::MakeTempDir("rp-peft-");
    spec_ = BuildModelSpec(Small(), Lora(2, {"q_proj", "v_proj"}));
    std::mt19937 rng(1);
    for (const auto& p : spec_.params) {
      values_.emplace_back(p.numel);
      for (auto& x : values_.back()) x = std::normal_distribution<float>()(rng);
    }
    ASSERT_TRUE(
        ExportPeft(dir_, spec_, "/models/base", [&](int p) { return values_[p].data(); }).ok());
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  nlohmann::json Config() {
    std::ifstream f(dir_ + "/adapter_config.json");
    return nlohmann::json::parse(f);
  }
  void WriteConfig(const nlohmann::json& c) {
    std::ofstream f(dir_ + "/adapter_config.json", std::ios::trunc);
    f << c.dump();
  }
  void ExpectRefused(const std::string& needle) {
    auto a = PeftAdapter::Open(dir_, spec_);
    ASSERT_FALSE(a.ok()) << "accepted; expected: " << needle;
    EXPECT_NE(a.status().message().find(needle), std::string::npos) << a.status().message();
  }
  std::string dir_;
  ModelSpec spec_;
  std::vector<std::vector<float>> values_;
};

TEST_F(PeftTest, ExportLoadsBackBitForBitUnderPeftNames) {
  const nlohmann::json c = Config();
  EXPECT_EQ(c["peft_type"], "LORA");
  EXPECT_EQ(c["r"], 2);
  EXPECT_EQ(c["lora_alpha"], 4.0);
  EXPECT_EQ(c["base_model_name_or_path"], "/models/base");
  auto f = SafetensorsFile::Open(dir_ + "/adapter_model.safetensors");
  ASSERT_TRUE(f.ok());
  EXPECT_NE(f->Find("base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"), nullptr);
  EXPECT_EQ(f->tensors().size(), spec_.params.size());
  auto a = PeftAdapter::Open(dir_, spec_);
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  for (size_t p = 0; p < spec_.params.size(); ++p) {
    std::vector<float> back(spec_.params[p].numel);
    ASSERT_TRUE(a->Load(spec_.params[p], back.data()).ok());
    EXPECT_EQ(back, values_[p]) << spec_.params[p].name;
  }
}

TEST_F(PeftTest, ConfigMismatchesAreRefused) {
  const nlohmann::json good = Config();
  auto with = [&](const std::string& key, const nlohmann::json& v) {
    nlohmann::json c = good;
    if (v.is_discarded()) c.erase(key);
    else c[key] = v;
    WriteConfig(c);
  };
  with("r", 8);
  ExpectRefused("adapter_config.json: \"r\" is 8; lora.rank is 2");
  with("r", nlohmann::json::value_t::discarded);
  ExpectRefused("\"r\" is missing");
  with("lora_alpha", 32);
  ExpectRefused("\"lora_alpha\" is 32; lora.alpha is 4");
  with("target_modules", {"q_proj", "k_proj"});
  ExpectRefused("\"target_modules\" is [k_proj, q_proj]; lora.target_modules is [q_proj, v_proj]");
  with("target_modules", "q_proj|v_proj");
  ExpectRefused("a regular expression is not supported");
  with("peft_type", "IA3");
  ExpectRefused("\"peft_type\" must be \"LORA\"");
  with("peft_type", 3);  // not even a string: still a message, not an exception
  ExpectRefused("\"peft_type\" must be \"LORA\"");
  with("use_dora", true);
  ExpectRefused("\"use_dora\" is true");
  with("bias", "all");
  ExpectRefused("\"bias\" is \"all\"");
  with("layers_to_transform", {0});
  ExpectRefused("\"layers_to_transform\" is set");
  with("rank_pattern", {{"q_proj", 4}});
  ExpectRefused("\"rank_pattern\" is set");
  {
    std::ofstream f(dir_ + "/adapter_config.json", std::ios::trunc);
    f << "{\"r\": 2,";
  }
  ExpectRefused("adapter_config.json: not valid JSON");
  fs::remove(dir_ + "/adapter_config.json");
  ExpectRefused("adapter_config.json: cannot read");
}

TEST_F(PeftTest, TensorMismatchesAreRefused) {
  const std::string path = dir_ + "/adapter_model.safetensors";
  auto rewrite = [&](const ModelSpec& spec) {
    std::vector<std::vector<float>> v;
    for (const auto& p : spec.params) v.emplace_back(p.numel, 0.5f);
    std::vector<SafetensorToWrite> t;
    for (size_t p = 0; p < spec.params.size(); ++p)
      t.push_back({PeftTensorName(spec.params[p].name), "F32", spec.params[p].shape, v[p].data(),
                   static_cast<uint64_t>(spec.params[p].numel) * 4});
    return t;
  };
  // One tensor missing.
  ModelSpec fewer = spec_;
  fewer.params.pop_back();
  auto t = rewrite(fewer);
  std::vector<std::vector<float>> keep;
  ASSERT_TRUE(WriteSafetensors(path, t).ok());
  ExpectRefused("no tensor \"base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight\"");
  // A tensor this job does not have (an adapter of k_proj).
  ModelSpec more = BuildModelSpec(Small(), Lora(2, {"q_proj", "k_proj", "v_proj"}));
  ASSERT_TRUE(WriteSafetensors(path, rewrite(more)).ok());
  ExpectRefused("k_proj.lora_A.weight\" is not an adapter of this model");
  // Wrong shape (rank 3 tensors under a rank-2 config).
  ASSERT_TRUE(
      WriteSafetensors(path, rewrite(BuildModelSpec(Small(), Lora(3, {"q_proj", "v_proj"})))).ok());
  ExpectRefused("has shape [3, 64], this job's adapter needs [2, 64]");
  fs::remove(path);
  ExpectRefused("adapter_model.safetensors: no such file");
}

}  // namespace
}  // namespace rp::core
