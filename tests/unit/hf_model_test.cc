// SPDX-License-Identifier: Apache-2.0
#include "config/hf_config.h"
#include "io/hf_model.h"

#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <set>

#include <nlohmann/json.hpp>

#include "config/job_config.h"
#include "config/rope.h"
#include "io/safetensors.h"
#include "tests/testing/process_harness.h"

namespace rp::core {
namespace {

namespace fs = std::filesystem;

class HfModelTest : public ::testing::TestWithParam<std::tuple<std::string, bool>> {
 protected:
  void SetUp() override { dir_ = testing::MakeTempDir("rp-hf-"); }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  std::string dir_;
};

// A small model of `type` with what that family can carry: Qwen3's q/k norm, Qwen2's q/k/v
// biases, Llama's attention and MLP biases with llama3 RoPE, Mistral plain.
ModelConfig Small(const std::string& type, bool tied) {
  ModelConfig m;
  m.model_type = type;
  m.vocab_size = 300;
  m.hidden_size = 64;
  m.intermediate_size = 96;
  m.num_layers = 3;
  m.num_heads = 4;
  m.num_kv_heads = 2;
  m.head_dim = 16;
  m.rope.theta = 500000.0;
  m.rms_norm_eps = 1e-5;
  m.qk_norm = type == "qwen3" || type == "qwen3_moe";
  m.qkv_bias = type == "qwen2" || type == "llama";
  if (type == "qwen3_moe") {  // block 1 of 3 dense, the others with 4 experts
    m.moe.num_experts = 4;
    m.moe.experts_per_token = 2;
    m.moe.expert_intermediate_size = 24;
    m.moe.norm_topk_prob = true;
    m.moe.dense_layers = {1};
    m.moe.aux_loss_weight = tied ? 0.02 : 0.0;
  }
  m.o_bias = m.mlp_bias = type == "llama";
  m.tie_embeddings = tied;
  if (type == "llama") {
    m.rope.type = RopeConfig::Type::kLlama3;
    m.rope.factor = 8.0;
    m.rope.low_freq_factor = 1.0;
    m.rope.high_freq_factor = 4.0;
    m.rope.original_max_position = 8192;
  }
  if (type == "qwen3") {
    m.rope.type = RopeConfig::Type::kYarn;
    m.rope.factor = 4.0;
    m.rope.original_max_position = 32768;
    m.rope.attention_factor = 1.25;
    m.rope.beta_fast = 16.0;
    m.rope.truncate = false;
  }
  return m;
}
// Standard-normal values for every parameter of `spec`.
std::vector<std::vector<float>> RandomMasters(const ModelSpec& spec, unsigned seed) {
  std::mt19937 rng(seed);
  std::vector<std::vector<float>> masters;
  for (const auto& p : spec.params) {
    masters.emplace_back(p.numel);
    for (auto& x : masters.back()) x = std::normal_distribution<float>()(rng);
  }
  return masters;
}

ModelConfig Small(bool qwen3, bool tied) {
  return Small(std::string(qwen3 ? "qwen3" : "llama"), tied);
}

void ExpectSameArchitecture(const ModelConfig& a, const ModelConfig& b) {
  EXPECT_EQ(a.model_type, b.model_type);
  EXPECT_EQ(a.vocab_size, b.vocab_size);
  EXPECT_EQ(a.hidden_size, b.hidden_size);
  EXPECT_EQ(a.intermediate_size, b.intermediate_size);
  EXPECT_EQ(a.num_layers, b.num_layers);
  EXPECT_EQ(a.num_heads, b.num_heads);
  EXPECT_EQ(a.num_kv_heads, b.num_kv_heads);
  EXPECT_EQ(a.head_dim, b.head_dim);
  EXPECT_EQ(a.rms_norm_eps, b.rms_norm_eps);
  EXPECT_EQ(a.qk_norm, b.qk_norm);
  EXPECT_EQ(a.qkv_bias, b.qkv_bias);
  EXPECT_EQ(a.o_bias, b.o_bias);
  EXPECT_EQ(a.mlp_bias, b.mlp_bias);
  EXPECT_EQ(a.tie_embeddings, b.tie_embeddings);
  EXPECT_EQ(a.sliding_window, b.sliding_window);
  EXPECT_EQ(a.rope.type, b.rope.type);
  EXPECT_EQ(a.rope.theta, b.rope.theta);
  EXPECT_EQ(a.rope.factor, b.rope.factor);
  EXPECT_EQ(a.rope.low_freq_factor, b.rope.low_freq_factor);
  EXPECT_EQ(a.rope.high_freq_factor, b.rope.high_freq_factor);
  EXPECT_EQ(a.rope.original_max_position, b.rope.original_max_position);
  EXPECT_EQ(a.rope.attention_factor, b.rope.attention_factor);
  EXPECT_EQ(a.rope.beta_fast, b.rope.beta_fast);
  EXPECT_EQ(a.rope.beta_slow, b.rope.beta_slow);
  EXPECT_EQ(a.rope.truncate, b.rope.truncate);
  EXPECT_EQ(a.moe.num_experts, b.moe.num_experts);
  EXPECT_EQ(a.moe.experts_per_token, b.moe.experts_per_token);
  EXPECT_EQ(a.moe.expert_intermediate_size, b.moe.expert_intermediate_size);
  EXPECT_EQ(a.moe.norm_topk_prob, b.moe.norm_topk_prob);
  EXPECT_EQ(a.moe.sparse_step, b.moe.sparse_step);
  EXPECT_EQ(a.moe.dense_layers, b.moe.dense_layers);
  EXPECT_EQ(a.moe.aux_loss_weight, b.moe.aux_loss_weight);
  EXPECT_EQ(RopeInvFreq(a.rope, a.head_dim), RopeInvFreq(b.rope, b.head_dim));
}

// Every family, tied and untied: export, then read the directory back as a model would be
// loaded (config.json -> architecture, safetensors -> every parameter, bit for bit).
TEST_P(HfModelTest, ExportThenLoadRoundTrips) {
  const auto [type, tied] = GetParam();
  const ModelConfig m = Small(type, tied);
  const ModelSpec spec = BuildModelSpec(m);
  const auto masters = RandomMasters(spec, 3);
  ASSERT_TRUE(ExportHf(dir_, m, spec, [&](int p) { return masters[p].data(); }).ok());
  // The base is written twice: in rope_parameters for transformers 5, at the top for older readers.
  auto json = nlohmann::json::parse(testing::ReadFile(dir_ + "/config.json"));
  EXPECT_EQ(json["rope_theta"].get<double>(), m.rope.theta);
  EXPECT_EQ(json["rope_parameters"]["rope_theta"].get<double>(), m.rope.theta);
  EXPECT_EQ(json["model_type"].get<std::string>(), type);
  ModelConfig back;
  back.rope.theta = 7.0;  // nothing of what was there before may survive
  auto applied = ApplyHfConfig(dir_, &back);
  ASSERT_TRUE(applied.ok()) << applied.message();
  ExpectSameArchitecture(back, m);
  auto w = HfWeights::Open(dir_);
  ASSERT_TRUE(w.ok()) << w.status().message();
  const ModelSpec spec2 = BuildModelSpec(back);
  ASSERT_EQ(spec2.params.size(), spec.params.size());
  for (size_t p = 0; p < spec2.params.size(); ++p) {
    std::vector<float> got(spec2.params[p].numel);
    ASSERT_TRUE(w->Load(spec2.params[p], got.data()).ok()) << spec2.params[p].name;
    EXPECT_EQ(std::memcmp(got.data(), masters[p].data(), got.size() * 4), 0)
        << spec2.params[p].name;
  }
}
INSTANTIATE_TEST_SUITE_P(Families, HfModelTest,
                         ::testing::Combine(::testing::Values("llama", "qwen2", "qwen3",
                                                              "qwen3_moe", "mistral"),
                                            ::testing::Bool()));

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
  HfExport sharded;
  sharded.shard_bytes = largest;
  ASSERT_TRUE(ExportHf(dir, m, spec, master, sharded).ok());
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
                     std::to_string(files.size()) + ".safetensors"),
              std::string::npos)
        << f;
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
    bf16.emplace_back(spec.params[p].numel,
                      static_cast<uint16_t>(0x3f80 + p));  // 1.0, 1.0078125, ...
    auto& shard = p % 2 ? second : first;
    shard.push_back({spec.params[p].name, "BF16", spec.params[p].shape, bf16.back().data(),
                     static_cast<uint64_t>(spec.params[p].numel) * 2});
    map[spec.params[p].name] =
        p % 2 ? "model-00002-of-00002.safetensors" : "model-00001-of-00002.safetensors";
  }
  fs::remove(fs::path(dir) / "model.safetensors");
  ASSERT_TRUE(WriteSafetensors(dir + "/model-00001-of-00002.safetensors", first).ok());
  ASSERT_TRUE(WriteSafetensors(dir + "/model-00002-of-00002.safetensors", second).ok());
  std::ofstream(dir + "/model.safetensors.index.json")
      << nlohmann::json{{"weight_map", map}}.dump();
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

// The config.json files publishers ship (tests/testdata/publisher_configs): each resolves to the
// architecture its model card describes, down to the parameter count the publisher states.
TEST(HfModel, PublisherConfigsResolveToTheirArchitectures) {
  struct Want {
    const char* name;
    const char* type;
    int64_t params;
    int64_t head_dim;
    RopeConfig::Type rope;
    double theta;
    bool tied, qkv_bias, qk_norm;
  };
  const Want wants[] = {
      {"Llama-3.1-8B", "llama", 8030261248, 128, RopeConfig::Type::kLlama3, 500000.0, false, false,
       false},
      {"Llama-3.2-1B", "llama", 1235814400, 64, RopeConfig::Type::kLlama3, 500000.0, true, false,
       false},
      {"Qwen2.5-7B", "qwen2", 7615616512, 128, RopeConfig::Type::kDefault, 1000000.0, false, true,
       false},
      {"Qwen3-8B", "qwen3", 8190735360, 128, RopeConfig::Type::kDefault, 1000000.0, false, false,
       true},
      {"Qwen3-4B-Instruct-2507", "qwen3", 4022468096, 128, RopeConfig::Type::kDefault, 5000000.0,
       true, false, true},
      {"Mistral-7B-v0.3", "mistral", 7248023552, 128, RopeConfig::Type::kDefault, 1000000.0, false,
       false, false},
      // "30.5B in total": 48 blocks of 128 experts, 8 per token.
      {"Qwen3-30B-A3B", "qwen3_moe", 30532122624, 128, RopeConfig::Type::kDefault, 1000000.0, false,
       false, true},
  };
  for (const Want& w : wants) {
    SCOPED_TRACE(w.name);
    ModelConfig m;
    auto s =
        ApplyHfConfig(testing::SourceDir() + "/tests/testdata/publisher_configs/" + w.name, &m);
    ASSERT_TRUE(s.ok()) << s.message();
    EXPECT_EQ(m.model_type, w.type);
    EXPECT_EQ(BuildModelSpec(m).TrainableParams(), w.params);
    EXPECT_EQ(m.head_dim, w.head_dim);
    EXPECT_EQ(m.rope.type, w.rope);
    EXPECT_EQ(m.rope.theta, w.theta);
    EXPECT_EQ(m.tie_embeddings, w.tied);
    EXPECT_EQ(m.qkv_bias, w.qkv_bias);
    EXPECT_FALSE(m.o_bias);
    EXPECT_FALSE(m.mlp_bias);
    EXPECT_EQ(m.qk_norm, w.qk_norm);
    EXPECT_EQ(m.sliding_window, 0);  // none of them attends through a window
    if (w.rope == RopeConfig::Type::kLlama3) {
      EXPECT_EQ(m.rope.original_max_position, 8192);
      EXPECT_EQ(m.rope.factor, std::string(w.name) == "Llama-3.2-1B" ? 32.0 : 8.0);
    }
  }
}

// Applies `text` as config.json; returns the status message ("" when accepted).
std::string Apply(const std::string& dir, const std::string& text, ModelConfig* m) {
  std::ofstream(dir + "/config.json") << text;
  return ApplyHfConfig(dir, m).message();
}

const char* kLlamaShape =
    R"("model_type":"llama","vocab_size":10,"hidden_size":8,"intermediate_size":8,"num_hidden_layers":1,"num_attention_heads":2)";

std::string Llama(const std::string& extra) { return std::string("{") + kLlamaShape + extra + "}"; }

// transformers 5 writes the base inside rope_parameters only; transformers 4 at the top level
// (with rope_scaling for scaled RoPE). Both spellings are one model.
TEST(HfModel, RopeBaseIsReadFromEveryPlaceTransformersPutsIt) {
  const std::string dir = testing::MakeTempDir("rp-hf-rope-");
  ModelConfig v5, v4, none;
  v5.rope.theta = v4.rope.theta = none.rope.theta = 123.0;  // a job key's value must not leak in
  EXPECT_EQ(
      Apply(dir, Llama(R"(,"rope_parameters":{"rope_theta":1000000.0,"rope_type":"default"})"),
            &v5),
      "");
  EXPECT_EQ(v5.rope.theta, 1000000.0);
  EXPECT_EQ(Apply(dir, Llama(R"(,"rope_theta":1000000.0)"), &v4), "");
  ExpectSameArchitecture(v5, v4);
  // Neither: transformers' default base, never the job's.
  EXPECT_EQ(Apply(dir, Llama(""), &none), "");
  EXPECT_EQ(none.rope.theta, 10000.0);
  // The dictionary's base wins over the top level's, as transformers 5 standardizes them.
  ModelConfig both;
  EXPECT_EQ(Apply(dir, Llama(R"(,"rope_theta":5.0,"rope_parameters":{"rope_theta":77.0})"), &both),
            "");
  EXPECT_EQ(both.rope.theta, 77.0);
  // Llama 3.1 as transformers 4 wrote it: rope_scaling with rope_type llama3, base at the top.
  ModelConfig l31;
  EXPECT_EQ(
      Apply(
          dir,
          Llama(
              R"(,"rope_theta":500000.0,"rope_scaling":{"factor":8.0,"low_freq_factor":1.0,"high_freq_factor":4.0,"original_max_position_embeddings":8192,"rope_type":"llama3"})"),
          &l31),
      "");
  EXPECT_EQ(l31.rope.type, RopeConfig::Type::kLlama3);
  EXPECT_EQ(l31.rope.theta, 500000.0);
  EXPECT_EQ(l31.rope.original_max_position, 8192);
  // transformers 4's "type" spelling, and YaRN's default attention factor 0.1 ln(factor) + 1.
  ModelConfig yarn;
  EXPECT_EQ(
      Apply(
          dir,
          Llama(
              R"(,"max_position_embeddings":131072,"rope_scaling":{"type":"yarn","factor":4.0,"original_max_position_embeddings":32768})"),
          &yarn),
      "");
  EXPECT_EQ(yarn.rope.type, RopeConfig::Type::kYarn);
  EXPECT_DOUBLE_EQ(yarn.rope.attention_factor, 0.1 * std::log(4.0) + 1.0);
  // Without a factor YaRN takes max_position_embeddings / original_max_position_embeddings.
  ModelConfig implied;
  EXPECT_EQ(
      Apply(
          dir,
          Llama(
              R"(,"max_position_embeddings":65536,"rope_parameters":{"rope_type":"yarn","original_max_position_embeddings":8192})"),
          &implied),
      "");
  EXPECT_EQ(implied.rope.factor, 8.0);
  std::error_code ec;
  fs::remove_all(dir, ec);
}

// Qwen3-MoE: Qwen3MoeConfig's defaults, num_local_experts as the experts' other name, the
// load-balancing loss's weight, and what is refused by key.
TEST(HfModel, MoeConfigsFollowTransformersAndBadValuesAreRefusedByKey) {
  const std::string dir = testing::MakeTempDir("rp-hf-moe-");
  const std::string shape =
      R"("model_type":"qwen3_moe","vocab_size":10,"hidden_size":64,"intermediate_size":8,"num_hidden_layers":4,"num_attention_heads":4)";
  ModelConfig d;
  EXPECT_EQ(Apply(dir, "{" + shape + "}", &d), "");
  EXPECT_EQ(d.head_dim, 16);  // derived, unlike dense Qwen3's 128
  EXPECT_TRUE(d.qk_norm);
  EXPECT_EQ(d.moe.num_experts, 128);
  EXPECT_EQ(d.moe.experts_per_token, 8);
  EXPECT_EQ(d.moe.expert_intermediate_size, 768);
  EXPECT_FALSE(d.moe.norm_topk_prob);
  EXPECT_EQ(d.moe.sparse_step, 1);
  EXPECT_TRUE(d.moe.dense_layers.empty());
  ModelConfig local;
  EXPECT_EQ(Apply(dir,
                  "{" + shape +
                      R"(,"num_local_experts":6,"num_experts_per_tok":2,"mlp_only_layers":[0,3]})",
                  &local),
            "");
  EXPECT_EQ(local.moe.num_experts, 6);
  EXPECT_EQ(local.moe.dense_layers, (std::vector<int64_t>{0, 3}));
  // The load-balancing loss weighs router_aux_loss_coef (0.001 by default) exactly when
  // output_router_logits is true.
  EXPECT_EQ(d.moe.aux_loss_weight, 0.0);
  ModelConfig aux, aux_default, aux_off;
  EXPECT_EQ(Apply(dir, "{" + shape + R"(,"output_router_logits":true,"router_aux_loss_coef":0.02})",
                  &aux),
            "");
  EXPECT_EQ(aux.moe.aux_loss_weight, 0.02);
  EXPECT_EQ(Apply(dir, "{" + shape + R"(,"output_router_logits":true})", &aux_default), "");
  EXPECT_EQ(aux_default.moe.aux_loss_weight, 0.001);
  EXPECT_EQ(
      Apply(dir, "{" + shape + R"(,"output_router_logits":false,"router_aux_loss_coef":0.02})",
            &aux_off),
      "");
  EXPECT_EQ(aux_off.moe.aux_loss_weight, 0.0);
  const std::pair<const char*, const char*> bad[] = {
      {R"(,"output_router_logits":true,"router_aux_loss_coef":-0.1)", "router_aux_loss_coef"},
      {R"(,"output_router_logits":1)", "output_router_logits"},
      {R"(,"num_experts":4,"num_experts_per_tok":5)", "num_experts_per_tok"},
      {R"(,"num_experts":4,"num_local_experts":5)", "num_local_experts"},
      {R"(,"mlp_only_layers":[4])", "mlp_only_layers"},
      {R"(,"mlp_only_layers":3)", "mlp_only_layers"},
      {R"(,"decoder_sparse_step":0)", "decoder_sparse_step"},
      {R"(,"moe_intermediate_size":"big")", "moe_intermediate_size"},
      {R"(,"norm_topk_prob":1)", "norm_topk_prob"},
  };
  for (const auto& [extra, key] : bad) {
    ModelConfig m;
    const std::string msg = Apply(dir, "{" + shape + extra + "}", &m);
    EXPECT_NE(msg.find(key), std::string::npos) << extra << ": " << msg;
  }
  std::error_code ec;
  fs::remove_all(dir, ec);
}

TEST(HfModel, FamilyDefaultsFollowTransformers) {
  const std::string dir = testing::MakeTempDir("rp-hf-defaults-");
  const std::string shape =
      R"("vocab_size":10,"hidden_size":64,"intermediate_size":8,"num_hidden_layers":30,"num_attention_heads":4)";
  ModelConfig q3, q2, mi, mi_null;
  EXPECT_EQ(Apply(dir, "{\"model_type\":\"qwen3\"," + shape + "}", &q3), "");
  EXPECT_EQ(q3.head_dim, 128);  // Qwen3's config class default, not hidden / heads
  EXPECT_TRUE(q3.qk_norm);
  EXPECT_FALSE(q3.qkv_bias);
  EXPECT_EQ(q3.sliding_window, 0);
  EXPECT_EQ(Apply(dir, "{\"model_type\":\"qwen2\"," + shape + ",\"attention_bias\":false}", &q2),
            "");
  EXPECT_EQ(q2.head_dim, 16);
  EXPECT_TRUE(q2.qkv_bias);  // Qwen2's attention always has them
  EXPECT_FALSE(q2.o_bias);
  EXPECT_FALSE(q2.qk_norm);
  EXPECT_EQ(Apply(dir, "{\"model_type\":\"mistral\"," + shape + "}", &mi), "");
  EXPECT_EQ(mi.sliding_window, 4096);  // MistralConfig's default window
  EXPECT_EQ(
      Apply(dir, "{\"model_type\":\"mistral\"," + shape + ",\"sliding_window\":null}", &mi_null),
      "");
  EXPECT_EQ(mi_null.sliding_window, 0);
  ModelConfig q2w;
  EXPECT_EQ(Apply(dir,
                  "{\"model_type\":\"qwen2\"," + shape +
                      R"(,"use_sliding_window":true,"sliding_window":512,"max_window_layers":28})",
                  &q2w),
            "");
  EXPECT_EQ(q2w.sliding_window, 512);
  ModelConfig q2n;
  EXPECT_EQ(Apply(dir,
                  "{\"model_type\":\"qwen2\"," + shape +
                      R"(,"use_sliding_window":true,"sliding_window":512,"max_window_layers":30})",
                  &q2n),
            "");
  EXPECT_EQ(q2n.sliding_window, 0);  // every layer below max_window_layers: full attention
  std::error_code ec;
  fs::remove_all(dir, ec);
}

TEST(HfModel, UnsupportedOrMalformedConfigsAreRefusedByKey) {
  const std::string dir = testing::MakeTempDir("rp-hf-cfg-");
  ModelConfig m;
  auto refused = [&](const std::string& text, const std::string& key) {
    const std::string msg = Apply(dir, text, &m);
    EXPECT_NE(msg.find(key), std::string::npos) << text << " -> " << msg;
    EXPECT_NE(msg.find("config.json"), std::string::npos) << msg;
  };
  refused(R"({"model_type":"gemma","vocab_size":10})", "model_type");
  refused(Llama(R"(,"rope_scaling":{"type":"llama3"})"), "rope_scaling.factor");
  refused(Llama(R"(,"rope_parameters":{"rope_type":"dynamic","factor":2.0})"),
          "rope_parameters.rope_type");
  refused(Llama(R"(,"rope_parameters":{"rope_type":"longrope"})"), "rope_parameters.rope_type");
  refused(Llama(R"(,"rope_parameters":{"rope_type":"default","partial_rotary_factor":0.5})"),
          "rope_parameters.partial_rotary_factor");
  refused(Llama(R"(,"rope_parameters":{"full_attention":{"rope_type":"default"}})"),
          "rope_parameters.full_attention");
  refused(
      Llama(
          R"(,"rope_scaling":{"rope_type":"llama3","factor":8,"low_freq_factor":4,"high_freq_factor":1})"),
      "high_freq_factor");
  refused(Llama(R"(,"hidden_act":"gelu")"), "hidden_act");
  refused(Llama(R"(,"attention_dropout":0.1)"), "attention_dropout");
  refused(Llama(R"(,"quantization_config":{"quant_method":"gptq"})"), "quantization_config");
  refused(Llama(R"(,"architectures":["LlamaForSequenceClassification"])"), "architectures");
  // Wrong JSON types name the key, never throw.
  refused(Llama(R"(,"rope_theta":"1e6")"), "rope_theta");
  refused(Llama(R"(,"rope_parameters":{"rope_theta":[1]})"), "rope_parameters.rope_theta");
  refused(Llama(R"(,"rope_parameters":"default")"), "rope_parameters");
  refused(Llama(R"(,"tie_word_embeddings":"yes")"), "tie_word_embeddings");
  refused(Llama(R"(,"rms_norm_eps":-1)"), "rms_norm_eps");
  refused(Llama(R"(,"num_key_value_heads":1.5)"), "num_key_value_heads");
  refused(Llama(R"(,"head_dim":0)"), "head_dim");
  refused(
      R"({"model_type":"qwen2","vocab_size":10,"hidden_size":8,"intermediate_size":8,"num_hidden_layers":1,"num_attention_heads":2,"use_sliding_window":true,"layer_types":["chunked_attention"]})",
      "layer_types");
  refused(R"({"model_type":"llama","vocab_size":10,"hidden_size":8})", "intermediate_size");
  EXPECT_FALSE(ApplyHfConfig(dir, &m).ok());
  std::ofstream(dir + "/config.json") << "not json";
  EXPECT_FALSE(ApplyHfConfig(dir, &m).ok());
  // Out of the job keys' ranges, with their messages.
  refused(Llama(R"(,"num_hidden_layers":100000)"), "num_hidden_layers: must be in [1, 4096]");
  refused(Llama(R"(,"rope_theta":-5)"), "rope_theta");
  refused(Llama(R"(,"rope_parameters":{"rope_theta":0.5})"), "rope_theta");
  refused(Llama(R"(,"rms_norm_eps":2)"), "rms_norm_eps: must be in [0, 1]");
  // Keys that do not change the math are ignored.
  EXPECT_EQ(
      Apply(
          dir,
          Llama(
              R"(,"bos_token_id":1,"use_cache":true,"pretraining_tp":1,"dtype":"bfloat16","some_future_key":[1,2])"),
          &m),
      "");
  std::error_code ec;
  fs::remove_all(dir, ec);
}

// Every key the reader takes, given a value of the wrong JSON type, is refused naming the key,
// in every family that reads it.
TEST(HfModel, EveryReadKeyWithAWrongTypeIsRefusedByName) {
  const std::string dir = testing::MakeTempDir("rp-hf-types-");
  const char* const numeric[] = {
      "vocab_size",          "hidden_size",         "intermediate_size", "num_hidden_layers",
      "num_attention_heads", "num_key_value_heads", "head_dim",          "max_position_embeddings",
      "rope_theta",          "rms_norm_eps",        "attention_dropout", "partial_rotary_factor"};
  const char* const flags[] = {"tie_word_embeddings", "attention_bias", "mlp_bias"};
  const std::string shape =
      R"("vocab_size":10,"hidden_size":8,"intermediate_size":8,"num_hidden_layers":1,"num_attention_heads":2)";
  for (const std::string type : {"llama", "qwen2", "qwen3", "mistral"}) {
    auto config = [&](const std::string& key, const std::string& value) {
      nlohmann::json j = nlohmann::json::parse("{" + shape + "}");
      j["model_type"] = type;
      j[key] = nlohmann::json::parse(value);
      return j.dump();
    };
    std::vector<std::pair<std::string, std::string>> cases;
    for (const char* k : numeric) cases.push_back({k, R"("12")"});
    for (const char* k : flags) cases.push_back({k, "1"});
    cases.insert(cases.end(), {{"model_type", "3"},
                               {"hidden_act", "[1]"},
                               {"architectures", R"("LlamaForCausalLM")"},
                               {"rope_parameters", "[]"},
                               {"rope_scaling", "2.0"}});
    if (type == "qwen2" || type == "qwen3")
      cases.insert(cases.end(), {{"use_sliding_window", R"("no")"}});
    for (const auto& [key, value] : cases) {
      ModelConfig m;
      const std::string msg = Apply(dir, config(key, value), &m);
      EXPECT_NE(msg.find(key), std::string::npos)
          << type << " " << key << "=" << value << " -> " << msg;
    }
    // sliding_window is read where the family attends through one: always for Mistral, with
    // use_sliding_window for Qwen2/Qwen3 (Llama has none).
    if (type == "llama") continue;
    nlohmann::json j = nlohmann::json::parse(config("sliding_window", R"("4096")"));
    if (type != "mistral") j["use_sliding_window"] = true;
    ModelConfig m;
    const std::string msg = Apply(dir, j.dump(), &m);
    EXPECT_NE(msg.find("sliding_window"), std::string::npos) << type << " -> " << msg;
  }
  std::error_code ec;
  fs::remove_all(dir, ec);
}

// fp32 -> bf16 / half as torch rounds: random values over many scales, ties, the range's ends.
TEST(HfExport, RoundsToBf16AndHalfAsTorchDoes) {
  std::mt19937 rng(5);
  std::vector<float> v;
  for (int i = 0; i < 20000; ++i)
    v.push_back(std::normal_distribution<float>()(rng) *
                std::pow(2.0f, std::uniform_int_distribution<int>(-30, 20)(rng)));
  for (float x : {0.0f, -0.0f, 1.0f + 1.0f / 256, 1.0f + 3.0f / 256, 65504.0f, 65519.0f, 65520.0f,
                  1e30f, -1e30f, 5.96e-8f, 2.9e-8f, 3.0e-8f, 6.1e-5f, 1e-45f,
                  std::numeric_limits<float>::infinity()})
    v.push_back(x);
  for (uint32_t bits :
       {0x3f808000u, 0x3f818000u, 0x33000000u, 0x33000001u, 0x387fe000u, 0x387ff000u}) {
    float x;
    std::memcpy(&x, &bits, 4);
    v.push_back(x);
  }
  const int64_t n = static_cast<int64_t>(v.size());
  const at::Tensor t = at::from_blob(v.data(), {n}, at::kFloat);
  std::vector<uint16_t> bf(n), half(n);
  FloatToBf16(v.data(), n, bf.data());
  FloatToHalf(v.data(), n, half.data());
  const at::Tensor tb = t.to(at::kBFloat16), th = t.to(at::kHalf);
  int64_t wrong_bf = 0, wrong_half = 0;
  for (int64_t i = 0; i < n; ++i) {
    wrong_bf += bf[i] != tb.data_ptr<at::BFloat16>()[i].x;
    wrong_half += half[i] != th.data_ptr<at::Half>()[i].x;
  }
  EXPECT_EQ(wrong_bf, 0);
  EXPECT_EQ(wrong_half, 0);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  uint16_t b, h;
  FloatToBf16(&nan, 1, &b);
  FloatToHalf(&nan, 1, &h);
  EXPECT_TRUE((b & 0x7f80u) == 0x7f80u && (b & 0x7fu) != 0);
  EXPECT_TRUE((h & 0x7c00u) == 0x7c00u && (h & 0x3ffu) != 0);
}

// An export in the base's dtype carries what a server needs from the base: its special-token ids,
// tokenizer and generation config; a job's export_dtype "auto" reads the base's dtype.
TEST(HfExport, InTheBasesDtypeWithItsTokenizerAndSpecialTokens) {
  const std::string base = testing::MakeTempDir("rp-base-"),
                    out = testing::MakeTempDir("rp-export-");
  const ModelConfig m = Small(std::string("qwen3"), false);
  const ModelSpec spec = BuildModelSpec(m);
  const auto masters = RandomMasters(spec, 9);
  auto master = [&](int p) { return masters[p].data(); };
  HfExport bf16;
  bf16.dtype = ExportDtype::kBfloat16;
  ASSERT_TRUE(ExportHf(base, m, spec, master, bf16).ok());
  auto config = nlohmann::json::parse(testing::ReadFile(base + "/config.json"));
  config["eos_token_id"] = 151645;
  config["bos_token_id"] = nullptr;
  config["pad_token_id"] = 151643;
  std::ofstream(base + "/config.json") << config.dump();
  std::ofstream(base + "/tokenizer.json") << R"({"model": {"type": "BPE"}})";
  std::ofstream(base + "/tokenizer_config.json") << R"({"eos_token": "<|im_end|>"})";
  std::ofstream(base + "/generation_config.json")
      << R"({"eos_token_id": [151645, 151643], "temperature": 0.6})";

  // The job resolves "auto" to the base's bfloat16.
  auto job =
      ParseJobConfig("[data]\nformat = \"random\"\n[model]\npath = \"" + base + "\"\n", base, {});
  ASSERT_TRUE(job.ok()) << job.status().message();
  EXPECT_EQ(job->checkpoint.export_dtype, ExportDtype::kBfloat16);
  auto chosen = ParseJobConfig("[data]\nformat = \"random\"\n[model]\npath = \"" + base +
                                   "\"\n[checkpoint]\nexport_dtype = \"float32\"\n",
                               base, {});
  ASSERT_TRUE(chosen.ok());
  EXPECT_EQ(chosen->checkpoint.export_dtype, ExportDtype::kFloat32);
  config["torch_dtype"] = config["dtype"] = "float8_e4m3fn";
  std::ofstream(base + "/config.json") << config.dump();
  auto odd =
      ParseJobConfig("[data]\nformat = \"random\"\n[model]\npath = \"" + base + "\"\n", base, {});
  ASSERT_FALSE(odd.ok());
  EXPECT_NE(odd.status().message().find("checkpoint.export_dtype"), std::string::npos)
      << odd.status().message();
  config["torch_dtype"] = config["dtype"] = "bfloat16";
  std::ofstream(base + "/config.json") << config.dump();

  ASSERT_TRUE(ExportHf(out, m, spec, master,
                       HfExport{.dtype = job->checkpoint.export_dtype, .base_dir = base})
                  .ok());
  const auto exported = nlohmann::json::parse(testing::ReadFile(out + "/config.json"));
  EXPECT_EQ(exported["dtype"], "bfloat16");
  EXPECT_EQ(exported["torch_dtype"], "bfloat16");
  EXPECT_EQ(exported["eos_token_id"], 151645);
  EXPECT_TRUE(exported["bos_token_id"].is_null());
  EXPECT_EQ(exported["pad_token_id"], 151643);
  for (const char* f : {"tokenizer.json", "tokenizer_config.json", "generation_config.json"})
    EXPECT_EQ(testing::ReadFile(out + "/" + f), testing::ReadFile(base + "/" + f)) << f;
  EXPECT_FALSE(fs::exists(out + "/special_tokens_map.json"));
  // The tensors are BF16 on disk and read back as the bf16 rounding of the masters.
  auto weights = HfWeights::Open(out);
  ASSERT_TRUE(weights.ok()) << weights.status().message();
  for (size_t p = 0; p < spec.params.size(); ++p) {
    std::vector<float> back(spec.params[p].numel);
    ASSERT_TRUE(weights->Load(spec.params[p], back.data()).ok());
    const at::Tensor want =
        at::from_blob(const_cast<float*>(masters[p].data()), {spec.params[p].numel}, at::kFloat)
            .to(at::kBFloat16)
            .to(at::kFloat);
    EXPECT_TRUE(at::equal(at::from_blob(back.data(), {spec.params[p].numel}, at::kFloat), want))
        << spec.params[p].name;
  }
  EXPECT_LT(fs::file_size(out + "/model.safetensors"),
            fs::file_size(base + "/model.safetensors") + 4096);
  std::error_code ec;
  fs::remove_all(base, ec);
  fs::remove_all(out, ec);
}

}  // namespace
}  // namespace rp::core
