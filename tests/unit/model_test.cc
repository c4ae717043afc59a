// SPDX-License-Identifier: Apache-2.0
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <c10/core/GradMode.h>

#include "config/model_spec.h"
#include "model/transformer.h"

namespace rp::model {
namespace {

struct Fixture {
  core::ModelConfig cfg;
  std::vector<at::Tensor> params;
  std::vector<LayerWeights> layers;
  explicit Fixture(bool tied) {
    cfg.vocab_size = 50;
    cfg.hidden_size = 32;
    cfg.intermediate_size = 48;
    cfg.num_layers = 2;
    cfg.num_heads = 4;
    cfg.num_kv_heads = 2;
    cfg.head_dim = 8;
    cfg.tie_embeddings = tied;
    cfg.init_std = 0.2;
    auto spec = core::BuildModelSpec(cfg);
    for (size_t p = 0; p < spec.params.size(); ++p) {
      at::Tensor t = at::empty(spec.params[p].shape, at::kFloat);
      core::InitParam(spec, static_cast<int>(p), 11, t.data_ptr<float>());
      params.push_back(t.requires_grad_(true));
    }
    layers.resize(spec.NumLayers());
    for (int l = 0; l < spec.NumLayers(); ++l)
      for (auto& u : spec.layer_uses[l]) layers[l].emplace(u.role, params[u.param]);
  }
  void ZeroGrads() {
    for (auto& p : params)
      if (p.grad().defined()) p.mutable_grad().zero_();
  }
};

TEST(Transformer, ChunkedHeadEqualsFullCrossEntropy) {
  for (bool tied : {true, false}) {
    Fixture f(tied);
    at::manual_seed(1);
    at::Tensor tokens = at::randint(0, 50, {2, 12}, at::kLong);
    at::Tensor labels = at::randint(0, 50, {2, 12}, at::kLong);
    labels.index_put_({0, 3}, -100);
    auto forward = [&](int64_t chunk, double* loss) {
      Transformer t(f.cfg, chunk);
      at::Tensor x = t.Embed(f.layers[0], tokens);
      for (int l = 1; l <= 2; ++l) x = t.Block(f.layers[l], x, l);
      auto r = t.HeadForwardBackward(f.layers[3], x, labels, 0.5, true);
      *loss = r.loss_sum;
      EXPECT_EQ(r.targets, 23);
      std::vector<at::Tensor> g;
      for (auto& p : f.params) g.push_back(p.grad().clone());
      f.ZeroGrads();
      return g;
    };
    double loss_small = 0, loss_big = 0;
    auto g_small = forward(5, &loss_small);  // 24 tokens in chunks of 5: includes a tail chunk
    auto g_big = forward(4096, &loss_big);
    EXPECT_NEAR(loss_small, loss_big, 1e-4);
    for (size_t i = 0; i < g_small.size(); ++i)
      EXPECT_TRUE(at::allclose(g_small[i], g_big[i], 1e-4, 1e-6)) << "param " << i;
    // And against the textbook formula on full logits.
    Transformer t(f.cfg);
    c10::NoGradGuard ng;
    at::Tensor x = t.Embed(f.layers[0], tokens);
    for (int l = 1; l <= 2; ++l) x = t.Block(f.layers[l], x, l);
    const auto& head = f.layers[3];
    at::Tensor h = x * at::rsqrt(x.pow(2).mean(-1, true) + f.cfg.rms_norm_eps) * head.at("final_norm");
    at::Tensor logits = at::linear(h, head.at("lm_head")).reshape({-1, 50});
    double ref = at::cross_entropy_loss(logits, labels.reshape(-1), {}, at::Reduction::Sum, -100).item<double>();
    EXPECT_NEAR(loss_big, ref, 1e-4);
  }
}

TEST(Transformer, RecomputeIsBitIdentical) {
  Fixture f(true);
  Transformer t(f.cfg);
  at::manual_seed(2);
  at::Tensor x = at::randn({2, 9, 32});
  at::Tensor a, b;
  {
    c10::NoGradGuard ng;
    a = t.Block(f.layers[1], x, 1);
  }
  b = t.Block(f.layers[1], x.clone().requires_grad_(true), 1);
  EXPECT_TRUE(at::equal(a, b.detach()));
}

TEST(Transformer, CausalAttentionIgnoresTheFuture) {
  Fixture f(true);
  Transformer t(f.cfg);
  c10::NoGradGuard ng;
  at::manual_seed(3);
  at::Tensor x = at::randn({1, 10, 32});
  at::Tensor y = x.clone();
  y.narrow(1, 6, 4).normal_();
  at::Tensor a = t.Block(f.layers[1], x, 1), b = t.Block(f.layers[1], y, 1);
  EXPECT_TRUE(at::allclose(a.narrow(1, 0, 6), b.narrow(1, 0, 6)));
  EXPECT_FALSE(at::allclose(a.narrow(1, 6, 4), b.narrow(1, 6, 4)));
}

}  // namespace
}  // namespace rp::model
