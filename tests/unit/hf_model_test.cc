// SPDX-License-Identifier: Apache-2.0
#include "core/hf_model.h"

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <set>

#include <nlohmann/json.hpp>

#include "tests/testing/process_harness.h"

namespace rp::core {
namespace {

namespace fs = std::filesystem;

class HfModelTest : public ::testing::TestWithParam<std::tuple<bool, bool>> {
 protected:
  void SetUp() override { dir_ = testing::MakeTempDir("rp-hf-"); }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  std::string dir_;
};

ModelConfig Small(bool qwen3, bool tied) {
  ModelConfig m;
  m.vocab_size = 300;
  m.hidden_size = 64;
  m.intermediate_size = 96;
  m.num_layers = 3;
  m.num_heads = 4;
  m.num_kv_heads = 2;
  m.head_dim = 16;
  m.rope_theta = 500000.0;
  m.rms_norm_eps = 1e-5;
  m.qk_norm = qwen3;
  m.tie_embeddings = tied;
  return m;
}

// Llama-style and Qwen3-style, tied and untied: export, then read the directory back as a model
// would be loaded (config.json -> architecture, safetensors -> every parameter, bit for bit).
TEST_P(HfModelTest, ExportThenLoadRoundTrips) {
  const auto [qwen3, tied] = GetParam();
  const ModelConfig m = Small(qwen3, tied);
  const ModelSpec spec = BuildModelSpec(m);
  std::mt19937 rng(3);
  std::vector<std::vector<float>> masters;
  for (const auto& p : spec.params) {
    masters.emplace_back(p.numel);
    for (auto& x : masters.back()) x = std::normal_distribution<float>()(rng);
  }
  ASSERT_TRUE(ExportHf(dir_, m, spec, [&](int p) { return masters[p].data(); }).ok());
  ModelConfig back;
  ASSERT_TRUE(ApplyHfConfig(dir_, &back).ok());
  EXPECT_EQ(back.vocab_size, m.vocab_size);
  EXPECT_EQ(back.hidden_size, m.hidden_size);
  EXPECT_EQ(back.intermediate_size, m.intermediate_size);
  EXPECT_EQ(back.num_layers, m.num_layers);
  EXPECT_EQ(back.num_kv_heads, m.num_kv_heads);
  EXPECT_EQ(back.head_dim, m.head_dim);
  EXPECT_EQ(back.rope_theta, m.rope_theta);
  EXPECT_EQ(back.qk_norm, qwen3);
  EXPECT_EQ(back.tie_embeddings, tied);
  auto w = HfWeights::Open(dir_);
  ASSERT_TRUE(w.ok()) << w.status().message();
  const ModelSpec spec2 = BuildModelSpec(back);
  ASSERT_EQ(spec2.params.size(), spec.params.size());
  for (size_t p = 0; p < spec2.params.size(); ++p) {
    std::vector<float> got(spec2.params[p].numel);
    ASSERT_TRUE(w->Load(spec2.params[p], got.data()).ok()) << spec2.params[p].name;
    EXPECT_EQ(std::memcmp(got.data(), masters[p].data(), got.size() * 4), 0) << spec2.params[p].name;
  }
}
INSTANTIATE_TEST_SUITE_P(LlamaQwen3TiedUntied, HfModelTest,
                         ::testing::Combine(::testing::Bool(), ::testing::Bool()));

TEST(HfModel, ShardedExportLoadsBackAndReplacesTheOtherLayout) {
  const std::string dir = testing::MakeTempDir("rp-hf-export-shards-");
  const ModelConfig m = Small(true, true);
  const ModelSpec spec = BuildModelSpec(m);
  std::mt19937 rng(9);
  std::vector<std::vector<float>> masters;
  uint64_t largest = 0;
  for (const auto& p : spec.params) {
    masters.emplace_back(p.numel);
    for (auto& x : masters.back()) x = std::normal_distribution<float>()(rng);
    largest = std::max<uint64_t>(largest, static_cast<uint64_t>(p.numel) * 4);
  }
  auto master = [&](int p) { return masters[p].data(); };
  // First a single-file export, then a sharded one into the same directory.
  ASSERT_TRUE(ExportHf(dir, m, spec, master).ok());
  ASSERT_TRUE(ExportHf(dir, m, spec, master, largest).ok());
  EXPECT_FALSE(fs::exists(fs::path(dir) / "model.safetensors")) << "the old layout is gone";
  auto index = nlohmann::json::parse(testing::ReadFile(dir + "/model.safetensors.index.json"));
  std::set<std::string> files;
  uint64_t total = 0;
  for (const auto& p : spec.params) {
    ASSERT_TRUE(index["weight_map"].contains(p.name)) << p.name;
    files.insert(index["weight_map"][p.name].get<std::string>());
    total += static_cast<uint64_t>(p.numel) * 4;
  }
  EXPECT_GT(files.size(), 2u);
  EXPECT_EQ(index["metadata"]["total_size"].get<uint64_t>(), total);
  for (const auto& f : files) {
    EXPECT_TRUE(fs::exists(fs::path(dir) / f)) << f;
    EXPECT_NE(f.find("-of-" + std::string(5 - std::to_string(files.size()).size(), '0') +
                     std::to_string(files.size()) + ".safetensors"), std::string::npos) << f;
  }
  auto w = HfWeights::Open(dir);
  ASSERT_TRUE(w.ok()) << w.status().message();
  for (size_t p = 0; p < spec.params.size(); ++p) {
    std::vector<float> got(spec.params[p].numel);
    ASSERT_TRUE(w->Load(spec.params[p], got.data()).ok()) << spec.params[p].name;
    EXPECT_EQ(std::memcmp(got.data(), masters[p].data(), got.size() * 4), 0) << spec.params[p].name;
  }
  // And back to one file: shards and index are removed.
  ASSERT_TRUE(ExportHf(dir, m, spec, master).ok());
  EXPECT_TRUE(fs::exists(fs::path(dir) / "model.safetensors"));
  EXPECT_FALSE(fs::exists(fs::path(dir) / "model.safetensors.index.json"));
  for (const auto& f : files) EXPECT_FALSE(fs::exists(fs::path(dir) / f)) << f;
  fs::remove_all(dir);
}

TEST(HfModel, ShardedCheckpointWithIndexLoads) {
  const std::string dir = testing::MakeTempDir("rp-hf-shards-");
  const ModelConfig m = Small(true, false);
  const ModelSpec spec = BuildModelSpec(m);
  // config.json as an export writes it; the weights come as two bf16 shards with an index.
  std::vector<float> zeros(static_cast<size_t>(m.vocab_size * m.hidden_size), 0.0f);
  ASSERT_TRUE(ExportHf(dir, m, spec, [&](int) { return zeros.data(); }).ok());
  std::vector<std::vector<uint16_t>> bf16;  // stored as bf16 on disk, as most published models are
  std::vector<SafetensorToWrite> first, second;
  nlohmann::json map;
  for (size_t p = 0; p < spec.params.size(); ++p) {
    bf16.emplace_back(spec.params[p].numel, static_cast<uint16_t>(0x3f80 + p));  // 1.0, 1.0078125, ...
    auto& shard = p % 2 ? second : first;
    shard.push_back({spec.params[p].name, "BF16", spec.params[p].shape, bf16.back().data(),
                     static_cast<uint64_t>(spec.params[p].numel) * 2});
    map[spec.params[p].name] = p % 2 ? "model-00002-of-00002.safetensors" : "model-00001-of-00002.safetensors";
  }
  fs::remove(fs::path(dir) / "model.safetensors");
  ASSERT_TRUE(WriteSafetensors(dir + "/model-00001-of-00002.safetensors", first).ok());
  ASSERT_TRUE(WriteSafetensors(dir + "/model-00002-of-00002.safetensors", second).ok());
  std::ofstream(dir + "/model.safetensors.index.json") << nlohmann::json{{"weight_map", map}}.dump();
  auto w = HfWeights::Open(dir);
  ASSERT_TRUE(w.ok()) << w.status().message();
  for (size_t p = 0; p < spec.params.size(); ++p) {
    std::vector<float> got(spec.params[p].numel);
    ASSERT_TRUE(w->Load(spec.params[p], got.data()).ok());
    uint32_t bits = static_cast<uint32_t>(bf16[p][0]) << 16;
    float want;
    std::memcpy(&want, &bits, 4);
    EXPECT_EQ(got[0], want) << spec.params[p].name;
  }
  // A tensor the model needs but the checkpoint lacks, and a wrong shape, are named.
  ParamSpec extra{"model.layers.9.mlp.up_proj.weight", {96, 64}, 96 * 64};
  std::vector<float> buf(96 * 64);
  auto missing = w->Load(extra, buf.data());
  EXPECT_NE(missing.message().find("model.layers.9.mlp.up_proj.weight"), std::string::npos);
  ParamSpec wrong = spec.params[0];
  wrong.shape = {1, 1};
  auto shape = w->Load(wrong, buf.data());
  EXPECT_NE(shape.message().find("has shape"), std::string::npos) << shape.message();
  std::error_code ec;
  fs::remove_all(dir, ec);
}

TEST(HfModel, UnsupportedConfigsAreRefusedByKey) {
  const std::string dir = testing::MakeTempDir("rp-hf-cfg-");
  auto write = [&](const std::string& text) { std::ofstream(dir + "/config.json") << text; };
  ModelConfig m;
  write(R"({"model_type":"mistral","vocab_size":10})");
  EXPECT_NE(ApplyHfConfig(dir, &m).message().find("model_type"), std::string::npos);
  write(R"({"model_type":"llama","vocab_size":10,"hidden_size":8,"intermediate_size":8,"num_hidden_layers":1,"num_attention_heads":2,"rope_scaling":{"type":"llama3"}})");
  EXPECT_NE(ApplyHfConfig(dir, &m).message().find("rope_scaling"), std::string::npos);
  write(R"({"model_type":"llama","vocab_size":10,"hidden_size":8})");
  EXPECT_NE(ApplyHfConfig(dir, &m).message().find("intermediate_size is missing"), std::string::npos);
  write("not json");
  EXPECT_FALSE(ApplyHfConfig(dir, &m).ok());
  std::error_code ec;
  fs::remove_all(dir, ec);
}

}  // namespace
}  // namespace rp::core
