// SPDX-License-Identifier: Apache-2.0
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <vector>

#include <c10/core/GradMode.h>

#include "config/model_spec.h"
#include "model/documents.h"
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

// A Qwen3-MoE-shaped config: block 0 sparse, block 1 dense (mlp_only_layers).
core::ModelConfig MoeConfig(int64_t experts, int64_t top_k, bool norm_topk_prob) {
  core::ModelConfig c;
  c.vocab_size = 50;
  c.hidden_size = 32;
  c.intermediate_size = 48;
  c.num_layers = 2;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 8;
  c.init_std = 0.3;
  c.moe.num_experts = experts;
  c.moe.experts_per_token = top_k;
  c.moe.expert_intermediate_size = 12;
  c.moe.norm_topk_prob = norm_topk_prob;
  c.moe.dense_layers = {1};
  return c;
}

// Weights of one block for `cfg` (InitParam's values), keyed by role, with gradients.
LayerWeights BlockWeights(const core::ModelConfig& cfg, int layer, uint64_t seed) {
  const auto spec = core::BuildModelSpec(cfg);
  LayerWeights w;
  for (const auto& u : spec.layer_uses[layer]) {
    at::Tensor t = at::empty(spec.params[u.param].shape, at::kFloat);
    core::InitParam(spec, u.param, seed, t.data_ptr<float>());
    w.emplace(u.role, t.requires_grad_(true));
  }
  return w;
}

TEST(Moe, SparseBlocksFollowTransformersRule) {
  core::ModelConfig c = MoeConfig(4, 2, true);
  c.num_layers = 6;
  c.moe.sparse_step = 2;
  c.moe.dense_layers = {3};
  std::vector<bool> sparse;
  for (int64_t b = 0; b < 6; ++b) sparse.push_back(core::SparseBlock(c, b));
  EXPECT_EQ(sparse, (std::vector<bool>{false, true, false, false, false, true}));
  const auto spec = core::BuildModelSpec(c);
  int routers = 0;
  for (const auto& p : spec.params) routers += p.name.ends_with("mlp.gate.weight") ? 1 : 0;
  EXPECT_EQ(routers, 2);
  c.moe.num_experts = 0;
  EXPECT_FALSE(core::SparseBlock(c, 1));
}

// The block's experts against a token-by-token evaluation of transformers' formula: the MLP part
// of the block (its output less that of the same block without an MLP) equals, per token,
// sum over its top-k experts of weight x down(silu(gate x) * up x), the weights the softmax's
// top k (renormalized or not).
TEST(Moe, ExpertsEqualTheirFormulaTokenByToken) {
  c10::NoGradGuard no_grad;
  for (bool norm : {true, false}) {
    const core::ModelConfig cfg = MoeConfig(5, 2, norm);
    LayerWeights w = BlockWeights(cfg, 1, 3);
    at::manual_seed(2);
    at::Tensor x = at::randn({2, 7, 32});
    Transformer t(cfg);
    at::Tensor full = t.Block(w, x, 1);
    // The same block with the MLP removed: its output is x1, the residual after attention.
    LayerWeights no_mlp = w;
    no_mlp.erase("router");
    no_mlp.emplace("gate_proj", at::zeros({48, 32}));
    no_mlp.emplace("up_proj", at::zeros({48, 32}));
    no_mlp.emplace("down_proj", at::zeros({32, 48}));
    at::Tensor x1 = t.Block(no_mlp, x, 1);
    at::Tensor h = x1 * at::rsqrt(x1.pow(2).mean(-1, true) + cfg.rms_norm_eps) * w.at("post_norm");
    at::Tensor flat = h.reshape({-1, 32});
    at::Tensor want = at::zeros_like(flat);
    const at::Tensor& gu = w.at("experts.gate_up");
    const at::Tensor& dn = w.at("experts.down");
    for (int64_t i = 0; i < flat.size(0); ++i) {
      at::Tensor p = at::softmax(at::mv(w.at("router"), flat[i]), 0);
      auto [top, idx] = at::topk(p, 2);
      if (norm) top = top / top.sum();
      for (int64_t j = 0; j < 2; ++j) {
        const int64_t e = idx[j].item<int64_t>();
        at::Tensor g = at::mv(gu[e].narrow(0, 0, 12), flat[i]),
                   u = at::mv(gu[e].narrow(0, 12, 12), flat[i]);
        want[i] += top[j] * at::mv(dn[e], at::silu(g) * u);
      }
    }
    EXPECT_TRUE(at::allclose((full - x1).reshape({-1, 32}), want, 1e-5, 1e-6))
        << "norm_topk_prob " << norm;
  }
}

// An expert no token chose gets a zero gradient (defined, so the optimizer's moments decay and
// weight decay applies, as torch's AdamW does on the fused expert tensors); the chosen ones and
// the router get non-zero gradients; a recompute routes and computes bit for bit alike.
TEST(Moe, UnchosenExpertsGetZeroGradientsAndRecomputeIsBitIdentical) {
  const core::ModelConfig cfg = MoeConfig(16, 1, false);
  LayerWeights w = BlockWeights(cfg, 1, 5);
  at::manual_seed(4);
  at::Tensor x = at::randn({1, 3, 32});
  Transformer t(cfg);
  at::Tensor y = t.Block(w, x, 1);
  at::Tensor y2 = t.Block(w, x, 1);
  EXPECT_TRUE(at::equal(y, y2));
  y.pow(2).sum().backward();
  const at::Tensor g = w.at("experts.gate_up").grad();
  ASSERT_TRUE(g.defined());
  const at::Tensor per_expert = g.abs().sum({1, 2});
  const int64_t chosen = per_expert.gt(0).sum().item<int64_t>();
  EXPECT_GE(chosen, 1);
  EXPECT_LE(chosen, 3) << "3 tokens, top-1: at most 3 experts chosen";
  EXPECT_EQ(w.at("experts.down").grad().abs().sum({1, 2}).gt(0).sum().item<int64_t>(), chosen);
  EXPECT_GT(w.at("router").grad().abs().sum().item<double>(), 0.0);
}

// A tiled MLP gives the untiled values: the block's output, its input's gradient and every
// weight's gradient (the post-attention norm's, which runs inside the tiles, included), in a full
// fine-tune and with LoRA adapters (dropout on, so each tile's mask must be its slice of the whole
// one) on the MLP alone and on every projection, MLP biases, and tiles that do not divide the
// tokens.
TEST(Transformer, TiledMlpEqualsTheWholeMicrobatch) {
  core::ModelConfig cfg = MoeConfig(0, 0, false);
  cfg.mlp_bias = true;
  const std::vector<std::vector<std::string>> targets = {
      {},
      {"gate_proj", "up_proj", "down_proj"},
      {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}};
  for (const auto& t : targets) {
    core::LoraConfig lora;
    lora.rank = t.empty() ? 0 : 4;
    lora.alpha = 8.0;
    lora.dropout = 0.25;
    lora.target_modules = t;
    const auto spec = core::BuildModelSpec(cfg, lora);
    LayerWeights w;
    at::manual_seed(7);
    for (const auto& u : spec.layer_uses[1]) {
      // Adapters' B matrices start at zero; random ones make the adapters matter.
      w.emplace(u.role, (at::randn(spec.params[u.param].shape) * 0.2).requires_grad_(true));
    }
    for (const auto& u : spec.layer_frozen[1])
      w.emplace(u.role, at::randn(spec.frozen[u.param].shape) * 0.2);
    at::Tensor x = at::randn({2, 7, 32}).requires_grad_(true);
    at::Tensor r = at::randn({2, 7, 32});
    auto run = [&](int64_t tile, std::map<std::string, at::Tensor>* grads) {
      Transformer m(cfg, 4096, lora);
      m.SetDropoutKey(99);
      m.SetMlpTileTokens(tile);
      at::Tensor y = m.Block(w, x, 1);
      (y * r).sum().backward();
      (*grads)["x"] = x.grad().clone();
      x.mutable_grad().zero_();
      for (auto& [role, p] : w)
        if (p.requires_grad()) {
          (*grads)[role] = p.grad().clone();
          p.mutable_grad().zero_();
        }
      return y.detach();
    };
    std::map<std::string, at::Tensor> whole, tiled;
    const at::Tensor y0 = run(0, &whole);
    const at::Tensor y1 = run(5, &tiled);  // 14 tokens: tiles of 5, 5 and 4
    EXPECT_TRUE(at::allclose(y0, y1, 1e-5, 1e-6)) << t.size() << " targets: output";
    ASSERT_EQ(whole.size(), tiled.size());
    for (const auto& [name, g] : whole)
      EXPECT_TRUE(at::allclose(g, tiled.at(name), 1e-5, 1e-6))
          << t.size() << " targets: gradient of " << name;
    if (t.empty()) {
      ASSERT_TRUE(whole.count("post_norm"));
      EXPECT_GT(whole.at("post_norm").abs().sum().item<double>(), 0.0);
    } else {
      EXPECT_GT(whole.at("gate_proj.lora_A").abs().sum().item<double>(), 0.0);
    }
  }
}

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
    at::Tensor h =
        x * at::rsqrt(x.pow(2).mean(-1, true) + f.cfg.rms_norm_eps) * head.at("final_norm");
    at::Tensor logits = at::linear(h, head.at("lm_head")).reshape({-1, 50});
    double ref = at::cross_entropy_loss(logits, labels.reshape(-1), {}, at::Reduction::Sum, -100)
                     .item<double>();
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

TEST(Documents, ReadFromPositionsAlone) {
  // Row 0: documents of 3 and 2 tokens, then a split record's piece starting at position 7;
  // row 1: one sequence 0..5 (a row start always starts a document).
  const std::vector<int64_t> pos = {0, 1, 2, 0, 1, 7, 0, 1, 2, 3, 4, 5};
  const DocumentBounds b = FindDocuments(pos.data(), 2, 6);
  EXPECT_FALSE(b.plain);
  EXPECT_EQ(b.starts, (std::vector<int64_t>{0, 3, 5, 6, 12}));
  EXPECT_EQ(b.max_length, 6);
  EXPECT_EQ(b.max_position, 7);
  const std::vector<int64_t> plain = {0, 1, 2, 0, 1, 2};
  EXPECT_TRUE(FindDocuments(plain.data(), 2, 3).plain);
  auto on_cpu = [](const int64_t* host, int64_t n) {
    return at::from_blob(const_cast<int64_t*>(host), {n}, at::kLong).clone();
  };
  EXPECT_FALSE(MakeDocuments(plain.data(), 2, 3, on_cpu).defined());
  const Documents d = MakeDocuments(pos.data(), 2, 6, on_cpu);
  ASSERT_TRUE(d.defined());
  EXPECT_TRUE(at::equal(d.segments,
                        at::tensor({0, 0, 0, 1, 1, 2, 3, 3, 3, 3, 3, 3}, at::kLong).view({2, 6})));
  EXPECT_TRUE(at::equal(d.cu_seqlens, at::tensor({0, 3, 5, 6, 12}, at::kInt)));
}

// Summed token loss of tokens/labels [rows, seq] through fixture f's model with `documents`
// set, and its gradients (zeros where a parameter got none).
struct DocumentRun {
  double loss_sum = 0.0;
  std::vector<at::Tensor> grads;
};
DocumentRun RunDocuments(Fixture& f, const at::Tensor& tokens, const at::Tensor& labels,
                         Documents documents, bool backward = true) {
  f.ZeroGrads();
  Transformer math(f.cfg);
  math.SetDocuments(std::move(documents));
  at::Tensor x = math.Embed(f.layers[0], tokens);
  for (int l = 1; l <= f.cfg.num_layers; ++l) x = math.Block(f.layers[l], x, l);
  DocumentRun r;
  r.loss_sum =
      math.HeadForwardBackward(f.layers[f.cfg.num_layers + 1], x, labels, 1.0, backward).loss_sum;
  if (backward)
    for (auto& p : f.params)
      r.grads.push_back(p.grad().defined() ? p.grad().clone() : at::zeros_like(p));
  return r;
}

at::Tensor Ids(const std::vector<int64_t>& v, int64_t rows) {
  return at::tensor(v, at::kLong).view({rows, static_cast<int64_t>(v.size()) / rows});
}

Documents OnCpu(const std::vector<int64_t>& positions, int64_t rows) {
  return MakeDocuments(positions.data(), rows, static_cast<int64_t>(positions.size()) / rows,
                       [](const int64_t* host, int64_t n) {
                         return at::from_blob(const_cast<int64_t*>(host), {n}, at::kLong).clone();
                       });
}

// The largest difference between a and b, relative to b's largest element.
double MaxDiff(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  double worst = 0.0, scale = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    worst = std::max(worst, (a[i] - b[i]).abs().max().item<double>());
    scale = std::max(scale, b[i].abs().max().item<double>());
  }
  return worst / scale;
}

// Document-isolated packing in the layer math: a window of several documents gives, per
// document, the loss and the gradients of the same documents run alone; a broken mask does not.
class PackedDocuments : public ::testing::Test {
 protected:
  static constexpr int64_t kIgnore = -100;
  // Two rows of 12: documents of 4, 5 and 3 tokens; documents of 6 and 4 tokens, then 2 tokens
  // of padding (token 0, no target, a document of its own), as io/data.cc packs them.
  std::vector<std::vector<int64_t>> docs = {
      {3, 17, 9, 41}, {8, 8, 30, 2, 11}, {45, 6, 19}, {1, 2, 3, 4, 5, 6}, {33, 21, 7, 9}};
  std::vector<int64_t> tokens, labels, positions;
  std::vector<std::pair<int64_t, int64_t>> where;  // each document's first token and length
  void SetUp() override {
    for (size_t d = 0; d < docs.size(); ++d) {
      where.push_back({static_cast<int64_t>(tokens.size()), static_cast<int64_t>(docs[d].size())});
      for (size_t i = 0; i < docs[d].size(); ++i) {
        tokens.push_back(docs[d][i]);
        labels.push_back(i + 1 < docs[d].size() ? docs[d][i + 1] : kIgnore);
        positions.push_back(static_cast<int64_t>(i));
      }
    }
    for (int64_t i = 0; i < 2; ++i) {
      tokens.push_back(0);
      labels.push_back(kIgnore);
      positions.push_back(i);
    }
  }
  // The labels of document d alone, every other target ignored.
  std::vector<int64_t> LabelsOf(size_t d) const {
    std::vector<int64_t> l(labels.size(), kIgnore);
    std::copy_n(labels.begin() + where[d].first, where[d].second, l.begin() + where[d].first);
    return l;
  }
};

TEST_F(PackedDocuments, EachDocumentGivesItsLossAndGradientsAlone) {
  Fixture f(/*tied=*/true);
  // Alone: each document its own microbatch of one row, plain causal attention from position 0.
  std::vector<double> alone_loss;
  std::vector<at::Tensor> alone_grads;
  for (size_t d = 0; d < docs.size(); ++d) {
    std::vector<int64_t> lab(docs[d].begin() + 1, docs[d].end());
    lab.push_back(kIgnore);
    auto r = RunDocuments(f, Ids(docs[d], 1), Ids(lab, 1), Documents{});
    alone_loss.push_back(r.loss_sum);
    if (alone_grads.empty()) alone_grads = r.grads;
    else
      for (size_t p = 0; p < r.grads.size(); ++p) alone_grads[p] += r.grads[p];
  }
  double alone_total = 0.0;
  for (double l : alone_loss) alone_total += l;

  const Documents packed = OnCpu(positions, 2);
  ASSERT_TRUE(packed.defined());
  auto whole = RunDocuments(f, Ids(tokens, 2), Ids(labels, 2), packed);
  EXPECT_NEAR(whole.loss_sum, alone_total, 1e-6 * alone_total);
  EXPECT_LE(MaxDiff(whole.grads, alone_grads), 1e-6);
  for (size_t d = 0; d < docs.size(); ++d) {
    auto one = RunDocuments(f, Ids(tokens, 2), Ids(LabelsOf(d), 2), packed, /*backward=*/false);
    EXPECT_NEAR(one.loss_sum, alone_loss[d], 1e-6 * alone_loss[d]) << "document " << d;
  }

  // What the comparison catches. Attention across the documents (plain causal rows):
  auto crossing = RunDocuments(f, Ids(tokens, 2), Ids(labels, 2), Documents{});
  EXPECT_GT(std::abs(crossing.loss_sum - alone_total), 1e-3);
  EXPECT_GT(MaxDiff(crossing.grads, alone_grads), 1e-3);
  // Isolated attention at positions that do not restart: RoPE's scores depend on position
  // differences only, so a document at any offset is the same math up to rounding. The mask is
  // what isolates; restarting the positions (as Hugging Face's position_ids do) is for the
  // tables' rounding and for models whose positions are absolute.
  Documents no_reset = packed;
  no_reset.positions = at::arange(12, at::kLong).repeat({2, 1}) + 1000;
  no_reset.max_position = 1011;
  auto shifted = RunDocuments(f, Ids(tokens, 2), Ids(labels, 2), no_reset);
  EXPECT_NEAR(shifted.loss_sum, alone_total, 1e-5 * alone_total);
  // Positions that do reach the rotation: every token of a document at its own position 0.
  Documents unrotated = packed;
  unrotated.positions = at::zeros({2, 12}, at::kLong);
  auto flat = RunDocuments(f, Ids(tokens, 2), Ids(labels, 2), unrotated);
  EXPECT_GT(std::abs(flat.loss_sum - alone_total), 1e-3);
  // Restarted positions but a mask that lets each row's documents see each other:
  Documents one_mask = packed;
  one_mask.segments = at::arange(2, at::kLong).view({2, 1}).expand({2, 12}).contiguous();
  auto leaking = RunDocuments(f, Ids(tokens, 2), Ids(labels, 2), one_mask);
  EXPECT_GT(std::abs(leaking.loss_sum - alone_total), 1e-3);
  EXPECT_GT(MaxDiff(leaking.grads, alone_grads), 1e-3);
}

}  // namespace
}  // namespace rp::model

namespace rp::model {
namespace {

// One block's output and its input's and weights' gradients for a fixed output gradient.
struct BlockGrads {
  at::Tensor y;
  std::vector<at::Tensor> grads;  // the input's, then the block's weights' in role order
};
BlockGrads BlockBackward(Fixture& f, Transformer& t, const at::Tensor& x, const at::Tensor& dy) {
  f.ZeroGrads();
  at::Tensor in = x.clone().requires_grad_(true);
  BlockGrads r;
  r.y = t.Block(f.layers[1], in, 1);
  r.y.backward(dy);
  r.grads.push_back(in.grad().clone());
  for (const auto& [role, w] : f.layers[1]) r.grads.push_back(w.grad().clone());
  r.y = r.y.detach();
  return r;
}

// schedule.keep_attention's attention (explicit fp32 scores on the CPU, grouped-query heads,
// causal or inside documents): the values of the composite attention up to rounding, and with a
// record kept by the forward the very bits of recomputing it; the backward reads the record (a
// changed one changes the gradients), and a read takes it out.
TEST(RecordedAttention, EqualsTheCompositeAndItsRecordStandsInForTheForward) {
  Fixture f(/*tied=*/true);
  at::manual_seed(5);
  const at::Tensor x = at::randn({2, 12, 32}), dy = at::randn({2, 12, 32});
  for (bool documents : {false, true}) {
    SCOPED_TRACE(documents ? "documents" : "causal");
    Transformer plain(f.cfg), kept(f.cfg);
    kept.UseRecordedAttention(true);
    if (documents) {
      const std::vector<int64_t> pos = {0, 1, 2, 3, 0, 1, 2, 3, 4, 0, 1, 2,
                                        0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 0, 1};
      plain.SetDocuments(OnCpu(pos, 2));
      kept.SetDocuments(OnCpu(pos, 2));
    }
    const BlockGrads composite = BlockBackward(f, plain, x, dy);
    const BlockGrads recomputed = BlockBackward(f, kept, x, dy);
    EXPECT_LT(MaxDiff({recomputed.y}, {composite.y}), 1e-6);
    EXPECT_LT(MaxDiff(recomputed.grads, composite.grads), 1e-5);

    // The forward stage: no autograd, the record written.
    AttentionRecords records;
    at::Tensor forward;
    {
      c10::NoGradGuard no_grad;
      kept.SetAttentionRecords(&records, /*write=*/true);
      forward = kept.Block(f.layers[1], x, 1);
    }
    ASSERT_EQ(records.count(1), 1u);
    EXPECT_TRUE(at::equal(forward, recomputed.y));
    EXPECT_GT(records.at(1).Bytes(), 0);
    // Read without autograd (a layer-by-layer recompute's first pass): left in place.
    {
      c10::NoGradGuard no_grad;
      kept.SetAttentionRecords(&records, /*write=*/false);
      EXPECT_TRUE(at::equal(kept.Block(f.layers[1], x, 1), forward));
    }
    ASSERT_EQ(records.count(1), 1u);
    AttentionRecord saved = records.at(1);
    saved.out = saved.out.clone();
    saved.lse = saved.lse.clone();
    // The backward stage's recompute: the record taken, the same bits as recomputing.
    const BlockGrads replayed = BlockBackward(f, kept, x, dy);
    EXPECT_EQ(records.count(1), 0u);
    EXPECT_TRUE(at::equal(replayed.y, recomputed.y));
    for (size_t i = 0; i < replayed.grads.size(); ++i)
      EXPECT_TRUE(at::equal(replayed.grads[i], recomputed.grads[i])) << "gradient " << i;
    // A changed output or log-sum-exp in the record changes the result: the backward uses them.
    for (int part = 0; part < 2; ++part) {
      records[1] = saved;
      records[1].out = saved.out.clone();
      records[1].lse = saved.lse.clone();
      (part == 0 ? records[1].out : records[1].lse).add_(0.5);
      const BlockGrads poisoned = BlockBackward(f, kept, x, dy);
      EXPECT_GT(MaxDiff(poisoned.grads, recomputed.grads), 1e-3) << "part " << part;
    }
    kept.SetAttentionRecords(nullptr, false);
  }
}

}  // namespace
}  // namespace rp::model
