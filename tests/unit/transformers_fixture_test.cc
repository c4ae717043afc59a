// SPDX-License-Identifier: Apache-2.0
// The model math against transformers itself: tests/testdata/hf_fixtures holds tiny models of
// each family and RoPE variant saved by transformers' save_pretrained, with the loss and the
// per-parameter gradient norms transformers computed on a fixed batch, and negative controls
// (tools/make_hf_fixtures.py writes them). Each fixture is loaded exactly as a job with
// model.path loads it (ApplyHfConfig + HfWeights), run forward and backward in fp32 on the CPU
// through model::Transformer (the code CPU and CUDA workers and rp-train-ref run), and compared.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "config/hf_config.h"
#include "io/hf_model.h"
#include "config/model_spec.h"
#include "config/rope.h"
#include "model/transformer.h"
#include "tests/testing/process_harness.h"

namespace rp {
namespace {

namespace fs = std::filesystem;

std::string FixtureDir() { return testing::SourceDir() + "/tests/testdata/hf_fixtures"; }

struct Batch {
  at::Tensor ids, labels;
};

// The fixed batch: 4 windows of 64 tokens in file order, labels shifted by one (as the
// "tokens" data format with shuffle = false reads them).
Batch LoadBatch(int64_t seqs, int64_t seq) {
  std::ifstream f(FixtureDir() + "/tokens.bin", std::ios::binary);
  std::vector<uint16_t> raw(static_cast<size_t>(seqs * seq + 1));
  f.read(reinterpret_cast<char*>(raw.data()), static_cast<std::streamsize>(raw.size() * 2));
  EXPECT_TRUE(f.good()) << "tokens.bin is short";
  at::Tensor all = at::empty({static_cast<int64_t>(raw.size())}, at::kLong);
  for (size_t i = 0; i < raw.size(); ++i)
    all[static_cast<int64_t>(i)] = static_cast<int64_t>(raw[i]);
  return {all.narrow(0, 0, seqs * seq).reshape({seqs, seq}),
          all.narrow(0, 1, seqs * seq).reshape({seqs, seq})};
}

struct Result {
  double loss = 0.0;
  std::map<std::string, double> grad_norms;
  std::map<int, at::Tensor> routing;  // sparse blocks' chosen experts, by pipeline layer
};

// Loss (mean over tokens) and every trainable parameter's gradient norm for model `m`, weights
// from `dir`.
Result ForwardBackward(const core::ModelConfig& m, const std::string& dir, const Batch& batch) {
  const core::ModelSpec spec = core::BuildModelSpec(m);
  auto hf = core::HfWeights::Open(dir);
  EXPECT_TRUE(hf.ok()) << hf.status().message();
  std::vector<at::Tensor> params;
  for (const auto& ps : spec.params) {
    at::Tensor t = at::empty(ps.shape, at::kFloat);
    auto loaded = hf->Load(ps, t.data_ptr<float>());
    EXPECT_TRUE(loaded.ok()) << loaded.message();
    params.push_back(t.requires_grad_(true));
  }
  std::vector<model::LayerWeights> layers(spec.NumLayers());
  for (int l = 0; l < spec.NumLayers(); ++l)
    for (const auto& use : spec.layer_uses[l]) layers[l].emplace(use.role, params[use.param]);
  model::Transformer math(m, /*loss_chunk_tokens=*/100);  // several chunks, as real runs have
  Result r;
  math.RecordRouting(&r.routing);
  // The routers' load-balancing loss, when the config asks for it, over this one forward (its
  // weight is the coefficient itself: one microbatch).
  at::Tensor aux_grad;
  if (m.moe.aux_loss_weight > 0.0) {
    aux_grad = at::zeros({m.moe.num_experts}, at::kFloat);
    math.SetRouterAuxGrad(aux_grad);
  }
  const int L = static_cast<int>(m.num_layers);
  at::Tensor x = math.Embed(layers[0], batch.ids);
  for (int l = 1; l <= L; ++l) x = math.Block(layers[l], x, l);
  double aux = 0.0;
  if (aux_grad.defined()) {
    const model::RouterAux a = math.WholeModelRouterAux(batch.ids.numel(), m.moe.aux_loss_weight);
    aux_grad.copy_(at::tensor(a.grad, at::kFloat));
    aux = a.value;
  }
  const double targets = static_cast<double>(batch.labels.numel());
  auto head =
      math.HeadForwardBackward(layers[L + 1], x, batch.labels, 1.0 / targets, /*backward=*/true);
  r.loss = head.loss_sum / targets + aux;
  for (size_t p = 0; p < params.size(); ++p)
    r.grad_norms[spec.params[p].name] = params[p].grad().to(at::kDouble).norm().item<double>();
  return r;
}

core::ModelConfig Load(const std::string& dir) {
  core::ModelConfig m;
  m.path = dir;
  auto s = core::ApplyHfConfig(dir, &m);
  EXPECT_TRUE(s.ok()) << s.message();
  return m;
}

double Rel(double a, double b) { return std::abs(a - b) / std::abs(b); }

class TransformersFixture : public ::testing::TestWithParam<std::string> {};

TEST_P(TransformersFixture, LossAndGradientNormsMatchTransformers) {
  const std::string dir = FixtureDir() + "/" + GetParam();
  const auto expected = nlohmann::json::parse(testing::ReadFile(dir + "/expected.json"));
  const core::ModelConfig m = Load(dir);
  EXPECT_EQ(m.model_type, expected["model_type"].get<std::string>());
  const Batch batch = LoadBatch(4, 64);
  const Result ours = ForwardBackward(m, dir, batch);
  // Mixture of experts: every token of every sparse block chose what it chose in transformers
  // (whose layer i is our pipeline layer i + 1), in the same order.
  if (expected.contains("routing")) {
    ASSERT_EQ(ours.routing.size(), expected["routing"].size());
    for (const auto& [layer, chosen] : expected["routing"].items()) {
      const int ours_layer = std::stoi(layer) + 1;
      ASSERT_TRUE(ours.routing.count(ours_layer)) << "layer " << layer << " is not sparse in ours";
      const at::Tensor& got = ours.routing.at(ours_layer);
      ASSERT_EQ(got.size(0), static_cast<int64_t>(chosen.size()));
      int64_t differ = 0;
      for (int64_t t = 0; t < got.size(0); ++t)
        for (int64_t j = 0; j < got.size(1); ++j)
          differ += got[t][j].item<int64_t>() != chosen[t][j].get<int64_t>() ? 1 : 0;
      EXPECT_EQ(differ, 0) << "layer " << layer << ": choices that differ from transformers'";
    }
  }
  const double want = expected["loss"].get<double>();
  EXPECT_LT(Rel(ours.loss, want), 1e-6) << "ours " << ours.loss << ", transformers " << want;
  ASSERT_EQ(ours.grad_norms.size(), expected["grad_norms"].size());
  double worst = 0.0;
  for (const auto& [name, norm] : expected["grad_norms"].items()) {
    ASSERT_TRUE(ours.grad_norms.count(name)) << name << " is not a parameter of ours";
    EXPECT_LT(Rel(ours.grad_norms.at(name), norm.get<double>()), 1e-4)
        << name << ": ours " << ours.grad_norms.at(name) << ", transformers " << norm.get<double>();
    worst = std::max(worst, Rel(ours.grad_norms.at(name), norm.get<double>()));
  }
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.2e", Rel(ours.loss, want));
  RecordProperty("loss_rel_diff", buf);
  std::snprintf(buf, sizeof(buf), "%.2e", worst);
  RecordProperty("worst_grad_norm_rel_diff", buf);
  // Negative controls: each moved transformers' loss by >= 1e-3, so ours must be clearly apart
  // from it; a RoPE control, applied to our config, must land on transformers' control loss.
  for (const auto& [name, control] : expected["controls"].items()) {
    const double c = control["loss"].get<double>();
    EXPECT_GE(Rel(c, want), 1e-3) << name;
    EXPECT_GT(Rel(ours.loss, c), 5e-4)
        << name << ": our loss is as close to the control as to the real one";
    // Controls that change config.json (another RoPE, another key) are recomputed by us.
    if (!control.contains("rope_parameters") && !control.contains("config")) continue;
    const std::string alt = ::testing::TempDir() + "/rp-control-" + GetParam() + "-" + name;
    fs::create_directories(alt);
    auto cfg = nlohmann::json::parse(testing::ReadFile(dir + "/config.json"));
    if (control.contains("rope_parameters")) cfg["rope_parameters"] = control["rope_parameters"];
    if (control.contains("config")) cfg.update(control["config"]);
    std::ofstream(alt + "/config.json") << cfg.dump();
    const Result other = ForwardBackward(Load(alt), dir, batch);
    EXPECT_LT(Rel(other.loss, c), 1e-6)
        << name << ": ours " << other.loss << ", transformers " << c;
    fs::remove_all(alt);
  }
}

INSTANTIATE_TEST_SUITE_P(Families, TransformersFixture,
                         ::testing::Values("qwen3", "qwen3_yarn", "llama3", "llama_tied_linear",
                                           "llama_bias", "qwen2", "mistral", "qwen3_moe",
                                           "qwen3_moe_aux"));

// Every fixture directory is tested above, so a new fixture cannot go untested.
TEST(TransformersFixture, EveryFixtureIsTested) {
  int dirs = 0;
  for (const auto& e : fs::directory_iterator(FixtureDir())) dirs += e.is_directory() ? 1 : 0;
  EXPECT_EQ(dirs, 9);
}

// The rates' shape for each variant, independent of the fixtures: linear divides every rate;
// llama3 keeps the short wavelengths, divides the long ones and blends between; YaRN likewise
// over its ramp, and scales the tables.
TEST(Rope, VariantsReshapeTheDefaultRates) {
  core::RopeConfig r;
  r.theta = 500000.0;
  const auto base = core::RopeInvFreq(r, 128);
  ASSERT_EQ(base.size(), 64u);
  EXPECT_DOUBLE_EQ(base[0], 1.0);
  EXPECT_DOUBLE_EQ(base[10], std::pow(500000.0, -20.0 / 128.0));
  core::RopeConfig lin = r;
  lin.type = core::RopeConfig::Type::kLinear;
  lin.factor = 4.0;
  EXPECT_DOUBLE_EQ(core::RopeInvFreq(lin, 128)[10], base[10] / 4.0);
  core::RopeConfig l3 = r;
  l3.type = core::RopeConfig::Type::kLlama3;
  l3.factor = 8.0;
  l3.original_max_position = 8192;
  const auto l3r = core::RopeInvFreq(l3, 128);
  const double kTwoPi = 2.0 * M_PI;
  int kept = 0, scaled = 0, blended = 0;
  for (size_t i = 0; i < base.size(); ++i) {
    const double wave = kTwoPi / base[i];
    if (wave < 8192.0 / 4.0) {
      EXPECT_EQ(l3r[i], base[i]);
      ++kept;
    } else if (wave > 8192.0) {
      EXPECT_DOUBLE_EQ(l3r[i], base[i] / 8.0);
      ++scaled;
    } else {
      EXPECT_LT(l3r[i], base[i]);
      EXPECT_GT(l3r[i], base[i] / 8.0);
      ++blended;
    }
  }
  EXPECT_GT(kept, 0);
  EXPECT_GT(scaled, 0);
  EXPECT_GT(blended, 0);
  core::RopeConfig y = r;
  y.type = core::RopeConfig::Type::kYarn;
  y.factor = 4.0;
  y.original_max_position = 4096;
  y.attention_factor = 1.2;
  const auto yr = core::RopeInvFreq(y, 128);
  EXPECT_EQ(yr.front(), base.front());
  EXPECT_DOUBLE_EQ(yr.back(), base.back() / 4.0);
  EXPECT_EQ(core::RopeAttentionFactor(y), 1.2);
  EXPECT_EQ(core::RopeAttentionFactor(l3), 1.0);
}

}  // namespace
}  // namespace rp
