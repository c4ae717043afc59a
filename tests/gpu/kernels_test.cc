// SPDX-License-Identifier: Apache-2.0
// The CUDA backend's fused kernels against LibTorch's composite ops on the same device (label
// gpu; built only with CUDA, skipped without a device): values and gradients, both dtypes,
// packed and unpacked rows, ignored and out-of-range labels.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/core/Reduction.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>

#include "config/job_config.h"
#include "config/model_spec.h"
#include "optim/adamw.h"
#include "gpu_worker/cuda/fused_kernels.h"
#include "gpu_worker/device.h"
#include "model/fp8.h"
#include "model/transformer.h"

namespace rp {
namespace {

bool HaveCuda() { return at::hasCUDA() && torch::cuda::device_count() > 0; }

// Block 1's weights as the job initializes them, on the device in `dev`'s dtype, requiring
// gradients; norm weights (InitParam gives ones) perturbed, so their gradients are not special.
model::LayerWeights BlockWeights(const core::ModelSpec& spec, const at::TensorOptions& dev) {
  model::LayerWeights w;
  for (const auto& use : spec.layer_uses[1]) {
    at::Tensor t = at::empty(spec.params[use.param].shape, at::kFloat);
    core::InitParam(spec, use.param, 11, t.data_ptr<float>());
    if (t.dim() == 1) t.add_(0.1 * at::randn(t.sizes()));
    w[use.role] = t.to(dev).requires_grad_(true);
  }
  return w;
}

double MaxAbs(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

class FusedCrossEntropy : public ::testing::TestWithParam<std::tuple<at::ScalarType, int64_t>> {};

TEST_P(FusedCrossEntropy, MatchesCompositeLossAndGradient) {
  if (!HaveCuda()) GTEST_SKIP() << "no CUDA device";
  const auto [dtype, vocab] = GetParam();
  const int64_t rows = 37;
  const double scale = 0.37;
  at::manual_seed(7);
  auto dev = at::TensorOptions().device(at::kCUDA);
  at::Tensor logits = (at::randn({rows, vocab}, dev) * 4.0).to(dtype);
  at::Tensor labels = at::randint(0, vocab, {rows}, dev.dtype(at::kLong));
  labels.index_put_({at::arange(0, rows, 5, dev.dtype(at::kLong))}, -100);  // ignored rows

  // Reference: what the composite path computes (fp32 logits, cross-entropy, autograd).
  at::Tensor lf = logits.to(at::kFloat).detach().requires_grad_(true);
  at::Tensor ref_rows = at::cross_entropy_loss(lf, labels, {}, at::Reduction::None, -100);
  (ref_rows.sum() * scale).backward();
  at::Tensor ref_grad = lf.grad();

  at::Tensor buf = logits.clone();
  at::Tensor got_rows = rp::worker::CudaKernels().CrossEntropyInPlace(buf, labels, scale, true);
  const double loss_tol = dtype == at::kFloat ? 1e-5 : 1e-4;
  EXPECT_LE(MaxAbs(got_rows, ref_rows), loss_tol * ref_rows.abs().max().item<double>());
  // fp32: the two paths round exp() of differently rounded arguments (measured 3.3e-7 on gradients
  // up to `scale` = 0.37, about ten ulps of the largest); bf16: one rounding of the fp32 value.
  const double grad_tol = dtype == at::kFloat ? 1e-6 : scale * std::pow(2.0, -8);
  EXPECT_LE(MaxAbs(buf, ref_grad), grad_tol);
  // Ignored rows: zero loss and zero gradient.
  EXPECT_EQ(got_rows.index({0}).item<float>(), 0.0f);
  EXPECT_EQ(buf.index({0}).abs().sum().item<double>(), 0.0);

  // Without write_grad the logits are left alone.
  at::Tensor keep = logits.clone();
  at::Tensor again = rp::worker::CudaKernels().CrossEntropyInPlace(keep, labels, scale, false);
  EXPECT_TRUE(at::equal(keep, logits));
  EXPECT_TRUE(at::allclose(again, got_rows));
}

INSTANTIATE_TEST_SUITE_P(DtypesAndVocabularies, FusedCrossEntropy,
                         ::testing::Combine(::testing::Values(at::kFloat, at::kBFloat16),
                                            ::testing::Values<int64_t>(4096, 4099, 151936)));

TEST(FusedCrossEntropyLabels, OutOfRangeLabelGivesNaN) {
  if (!HaveCuda()) GTEST_SKIP() << "no CUDA device";
  auto dev = at::TensorOptions().device(at::kCUDA);
  at::Tensor logits = at::randn({2, 64}, dev);
  at::Tensor labels = at::tensor({int64_t{3}, int64_t{64}}, dev.dtype(at::kLong));
  at::Tensor rows = rp::worker::CudaKernels().CrossEntropyInPlace(logits, labels, 1.0, false);
  EXPECT_FALSE(std::isnan(rows.index({0}).item<float>()));
  EXPECT_TRUE(std::isnan(rows.index({1}).item<float>()));
}

TEST(FusedCrossEntropyLabels, RejectsWrongDtypeNamingIt) {
  if (!HaveCuda()) GTEST_SKIP() << "no CUDA device";
  auto dev = at::TensorOptions().device(at::kCUDA);
  at::Tensor logits = at::randn({2, 8}, dev.dtype(at::kHalf));
  at::Tensor labels = at::zeros({2}, dev.dtype(at::kLong));
  try {
    rp::worker::CudaKernels().CrossEntropyInPlace(logits, labels, 1.0, false);
    FAIL() << "half logits accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("logits has dtype"), std::string::npos) << e.what();
  }
}

class FusedRope : public ::testing::TestWithParam<at::ScalarType> {};

TEST_P(FusedRope, MatchesCompositeForwardAndBackward) {
  if (!HaveCuda()) GTEST_SKIP() << "no CUDA device";
  const at::ScalarType dtype = GetParam();
  const int64_t B = 2, S = 33, H = 3, D = 64;
  at::manual_seed(11);
  auto dev = at::TensorOptions().device(at::kCUDA);
  at::Tensor x = at::randn({B, S, H, D}, dev).to(dtype);
  at::Tensor ang = at::rand({S, D / 2}, dev) * 6.0;
  at::Tensor cos = at::cat({ang.cos(), ang.cos()}, -1).to(dtype);
  at::Tensor sin = at::cat({-ang.sin(), ang.sin()}, -1).to(dtype);

  // Composite, in fp32 from the same rounded inputs: x * cos + roll(x, D/2) * sin.
  at::Tensor xf = x.to(at::kFloat).detach().requires_grad_(true);
  at::Tensor c4 = cos.to(at::kFloat).view({1, S, 1, D}), s4 = sin.to(at::kFloat).view({1, S, 1, D});
  at::Tensor ref = xf * c4 + at::roll(xf, D / 2, -1) * s4;
  at::Tensor dy = at::randn({B, S, H, D}, dev).to(dtype);
  ref.backward(dy.to(at::kFloat));

  const auto& k = rp::worker::CudaKernels();
  at::Tensor y = k.Rope(x, cos, sin, /*backward=*/false);
  at::Tensor dx = k.Rope(dy, cos, sin, /*backward=*/true);
  const double tol = dtype == at::kFloat ? 1e-6 : 2.0 * std::pow(2.0, -8) * 4.0;
  EXPECT_LE(MaxAbs(y, ref), tol);
  EXPECT_LE(MaxAbs(dx, xf.grad()), tol);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, FusedRope, ::testing::Values(at::kFloat, at::kBFloat16));

// Per-head RMSNorm + RoPE against the composite (norm then rotation, in fp32 from the same
// rounded inputs): values and both gradients, each head size the kernel takes, both dtypes.
class FusedHeadNormRope : public ::testing::TestWithParam<std::tuple<at::ScalarType, int64_t>> {};

TEST_P(FusedHeadNormRope, MatchesCompositeForwardAndBackward) {
  if (!HaveCuda()) GTEST_SKIP() << "no CUDA device";
  const auto [dtype, D] = GetParam();
  const int64_t B = 2, S = 37, H = 3;
  const double eps = 1e-6;
  at::manual_seed(13);
  auto dev = at::TensorOptions().device(at::kCUDA);
  at::Tensor x = (at::randn({B, S, H, D}, dev) * 2.0).to(dtype);
  at::Tensor w = (at::rand({D}, dev) + 0.5).to(dtype);
  at::Tensor ang = at::rand({S, D / 2}, dev) * 6.0;
  at::Tensor cos = at::cat({ang.cos(), ang.cos()}, -1).to(dtype);
  at::Tensor sin = at::cat({-ang.sin(), ang.sin()}, -1).to(dtype);

  at::Tensor xf = x.to(at::kFloat).detach().requires_grad_(true);
  at::Tensor wf = w.to(at::kFloat).detach().requires_grad_(true);
  at::Tensor n = xf * at::rsqrt(xf.pow(2).mean(-1, true) + eps) * wf;
  at::Tensor c4 = cos.to(at::kFloat).view({1, S, 1, D}), s4 = sin.to(at::kFloat).view({1, S, 1, D});
  at::Tensor ref = n * c4 + at::roll(n, D / 2, -1) * s4;
  at::Tensor dy = at::randn({B, S, H, D}, dev).to(dtype);
  ref.backward(dy.to(at::kFloat));

  const auto& k = rp::worker::CudaKernels();
  ASSERT_TRUE(k.HeadNormRopeSupports(D));
  at::Tensor y = k.HeadNormRope(x, w, cos, sin, eps);
  auto [dx, dw] = k.HeadNormRopeBackward(x, w, cos, sin, eps, dy, /*weight_grad=*/true);
  auto [dx_only, no_dw] = k.HeadNormRopeBackward(x, w, cos, sin, eps, dy, /*weight_grad=*/false);
  EXPECT_FALSE(no_dw.defined());
  EXPECT_TRUE(at::equal(dx_only, dx));
  EXPECT_EQ(dw.scalar_type(), dtype);
  // fp32: rounding order only. bf16: one rounding of values of magnitude up to ~8 (|n| <= 1.5
  // sqrt(D)-scaled entries times |cos| + |sin|), and dw sums B*S*H = 222 products before its one
  // rounding.
  const bool f32 = dtype == at::kFloat;
  EXPECT_LE(MaxAbs(y, ref), f32 ? 1e-5 : 8.0 * std::pow(2.0, -8));
  EXPECT_LE(MaxAbs(dx, xf.grad()), f32 ? 1e-4 : 0.05 * xf.grad().abs().max().item<double>());
  EXPECT_LE(MaxAbs(dw, wf.grad()),
            f32 ? 1e-3 : std::pow(2.0, -7) * wf.grad().abs().max().item<double>());
}

INSTANTIATE_TEST_SUITE_P(DtypesAndHeadSizes, FusedHeadNormRope,
                         ::testing::Combine(::testing::Values(at::kFloat, at::kBFloat16),
                                            ::testing::Values(int64_t{64}, int64_t{128},
                                                              int64_t{256})));

TEST(FusedHeadNormRopeShapes, RefusesAHeadSizeItDoesNotTake) {
  if (!HaveCuda()) GTEST_SKIP() << "no CUDA device";
  const auto& k = rp::worker::CudaKernels();
  EXPECT_FALSE(k.HeadNormRopeSupports(96));
  auto dev = at::TensorOptions().device(at::kCUDA);
  at::Tensor x = at::randn({1, 4, 2, 96}, dev), w = at::ones({96}, dev), t = at::ones({4, 96}, dev);
  EXPECT_THROW(k.HeadNormRope(x, w, t, t, 1e-6), std::runtime_error);
}

// RMSNorm, alone and after the residual add, against the fp32 formula and its autograd
// gradients; the add's sum bit for bit against LibTorch's add. 2,100 rows: more than the grid's
// blocks, so blocks take several rows and add their weight-gradient partial sums once.
class FusedRmsNorm : public ::testing::TestWithParam<std::tuple<at::ScalarType, int64_t, bool>> {};

TEST_P(FusedRmsNorm, MatchesCompositeForwardAndBackward) {
  if (!HaveCuda()) GTEST_SKIP() << "no CUDA device";
  const auto [dtype, D, residual] = GetParam();
  const int64_t rows = 2100;
  const double eps = 1e-6;
  at::manual_seed(19);
  auto dev = at::TensorOptions().device(at::kCUDA);
  at::Tensor x = (at::randn({3, rows / 3, D}, dev) * 2.0).to(dtype);
  at::Tensor res = residual ? (at::randn({3, rows / 3, D}, dev)).to(dtype) : at::Tensor();
  at::Tensor w = (at::rand({D}, dev) + 0.5).to(dtype);
  at::Tensor dy = at::randn({3, rows / 3, D}, dev).to(dtype);
  at::Tensor ds_other = residual ? at::randn({3, rows / 3, D}, dev).to(dtype) : at::Tensor();

  const auto& k = rp::worker::CudaKernels();
  ASSERT_TRUE(k.RmsNormSupports(D));
  auto [sum, y] = k.AddRmsNorm(x, res, w, eps);
  const at::Tensor s = residual ? x + res : x;
  EXPECT_EQ(sum.defined(), residual);
  if (residual) EXPECT_TRUE(at::equal(sum, s));

  at::Tensor sf = s.to(at::kFloat).detach().requires_grad_(true);
  at::Tensor wf = w.to(at::kFloat).detach().requires_grad_(true);
  at::Tensor ref = sf * at::rsqrt(sf.pow(2).mean(-1, true) + eps) * wf;
  ref.backward(dy.to(at::kFloat));
  at::Tensor want_ds = residual ? sf.grad() + ds_other.to(at::kFloat) : sf.grad();

  auto [ds, dw] = k.RmsNormBackward(s, w, eps, dy, ds_other, /*weight_grad=*/true);
  auto [ds_only, no_dw] = k.RmsNormBackward(s, w, eps, dy, ds_other, /*weight_grad=*/false);
  EXPECT_FALSE(no_dw.defined());
  EXPECT_TRUE(at::equal(ds_only, ds));
  EXPECT_EQ(dw.scalar_type(), dtype);
  // fp32: summation order only. bf16: one rounding of each output; dw sums 2,100 products in
  // fp32 before its one rounding.
  const bool f32 = dtype == at::kFloat;
  auto rel = [](const at::Tensor& r, double f) { return f * r.abs().max().item<double>(); };
  EXPECT_LE(MaxAbs(y, ref), f32 ? rel(ref, 1e-6) : rel(ref, std::pow(2.0, -8)));
  EXPECT_LE(MaxAbs(ds, want_ds), f32 ? rel(want_ds, 1e-5) : rel(want_ds, std::pow(2.0, -7)));
  EXPECT_LE(MaxAbs(dw, wf.grad()), f32 ? rel(wf.grad(), 1e-5) : rel(wf.grad(), std::pow(2.0, -7)));
}

INSTANTIATE_TEST_SUITE_P(DtypesSizesAndResidual, FusedRmsNorm,
                         ::testing::Combine(::testing::Values(at::kFloat, at::kBFloat16),
                                            ::testing::Values(int64_t{1024}, int64_t{2048},
                                                              int64_t{2560}, int64_t{4096}),
                                            ::testing::Bool()));

TEST(FusedRmsNormShapes, RefusesASizeItDoesNotTake) {
  if (!HaveCuda()) GTEST_SKIP() << "no CUDA device";
  const auto& k = rp::worker::CudaKernels();
  EXPECT_FALSE(k.RmsNormSupports(96));
  EXPECT_FALSE(k.RmsNormSupports(1280));
  auto dev = at::TensorOptions().device(at::kCUDA);
  at::Tensor x = at::randn({4, 96}, dev), w = at::ones({96}, dev);
  EXPECT_THROW(k.AddRmsNorm(x, at::Tensor(), w, 1e-6), std::invalid_argument);
}

// Rows the forward cannot take 16 bytes at a time (an input 2 bytes into its allocation) go to
// the element-by-element kernel, which agrees with the packed one: the sum bit for bit, the rest
// up to the order of the row sums. (The backward is element by element either way.)
TEST(FusedRmsNormShapes, UnalignedRowsTakeTheScalarKernels) {
  if (!HaveCuda()) GTEST_SKIP() << "no CUDA device";
  const auto& k = rp::worker::CudaKernels();
  const int64_t rows = 700, D = 2560;
  const double eps = 1e-6;
  at::manual_seed(23);
  auto dev = at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16);
  at::Tensor x = at::randn({rows, D}, dev), res = at::randn({rows, D}, dev),
             dy = at::randn({rows, D}, dev);
  at::Tensor w = at::rand({D}, dev) + 0.5;
  auto shifted = [&](const at::Tensor& t) {
    return at::empty({rows * D + 1}, dev).narrow(0, 1, rows * D).view({rows, D}).copy_(t);
  };
  const at::Tensor xu = shifted(x);
  ASSERT_NE(reinterpret_cast<uintptr_t>(xu.data_ptr()) % 16, 0u);
  auto [sum, y] = k.AddRmsNorm(x, res, w, eps);
  auto [sum_u, y_u] = k.AddRmsNorm(xu, res, w, eps);
  EXPECT_TRUE(at::equal(sum_u, sum));
  auto rel = [](const at::Tensor& r, double f) { return f * r.abs().max().item<double>(); };
  EXPECT_LE(MaxAbs(y_u, y), rel(y, std::pow(2.0, -7)));  // one rounding step at most
  auto [ds, dw] = k.RmsNormBackward(sum, w, eps, dy, res, /*weight_grad=*/true);
  auto [ds_u, dw_u] = k.RmsNormBackward(shifted(sum), w, eps, dy, res, /*weight_grad=*/true);
  EXPECT_LE(MaxAbs(ds_u, ds), rel(ds, std::pow(2.0, -7)));
  EXPECT_LE(MaxAbs(dw_u, dw), rel(dw, std::pow(2.0, -7)));
}

// Through the model: a decoder block (hidden 1024, so the fused norm applies) with the fused
// norms against the same block with LibTorch's rms_norm and add: output, input gradient and
// every weight gradient (the fused add's backward hands one gradient to both of its inputs).
class BlockFusedNorms : public ::testing::TestWithParam<at::ScalarType> {};

TEST_P(BlockFusedNorms, MatchLibTorchsNormsThroughAutograd) {
  if (!HaveCuda()) GTEST_SKIP() << "no CUDA device";
  const at::ScalarType dtype = GetParam();
  core::ModelConfig mc;
  mc.hidden_size = 1024;
  mc.intermediate_size = 512;
  const core::ModelSpec spec = core::BuildModelSpec(mc);
  at::manual_seed(31);
  auto dev = at::TensorOptions().device(at::kCUDA).dtype(dtype);
  model::LayerWeights w = BlockWeights(spec, dev);
  at::Tensor x = at::randn({2, 16, mc.hidden_size}, dev),
             dy = at::randn({2, 16, mc.hidden_size}, dev);
  auto run = [&](bool fused_norms, std::map<std::string, at::Tensor>* grads, at::Tensor* dx) {
    model::Transformer m(mc);
    m.UseFusedKernels(&rp::worker::CudaKernels());
    m.UseFusedNorms(fused_norms);
    at::Tensor xi = x.detach().requires_grad_(true);
    at::Tensor out = m.Block(w, xi, 1);
    out.backward(dy);
    *dx = xi.grad();
    for (auto& [role, t] : w) {
      (*grads)[role] = t.grad().to(at::kFloat).clone();
      t.mutable_grad().reset();
    }
    return out.detach();
  };
  std::map<std::string, at::Tensor> want, got;
  at::Tensor want_dx, got_dx;
  const at::Tensor want_out = run(false, &want, &want_dx);
  const at::Tensor got_out = run(true, &got, &got_dx);
  const bool f32 = dtype == at::kFloat;
  auto tol = [f32](const at::Tensor& r) {
    return (f32 ? 1e-5 : std::pow(2.0, -6)) * r.abs().max().item<double>();
  };
  EXPECT_LE(MaxAbs(got_out, want_out), tol(want_out));
  EXPECT_LE(MaxAbs(got_dx, want_dx), tol(want_dx));
  for (auto& [role, g] : want) EXPECT_LE(MaxAbs(got[role], g), tol(g)) << role;
}

INSTANTIATE_TEST_SUITE_P(Dtypes, BlockFusedNorms, ::testing::Values(at::kFloat, at::kBFloat16));

// Document-isolated packing on the device: a block run on two packed rows of documents (bf16:
// the variable-length flash kernel; fp32: the masked scores) gives each document's output, input
// gradient and the summed weight gradients of the same documents run alone, through the fused
// per-head norm + RoPE kernel (qk_norm) and the fused RoPE kernel (no qk_norm).
class BlockDocuments : public ::testing::TestWithParam<std::tuple<at::ScalarType, bool>> {};

TEST_P(BlockDocuments, PackedRowsGiveEachDocumentAlone) {
  if (!HaveCuda()) GTEST_SKIP() << "no CUDA device";
  const auto [dtype, qk_norm] = GetParam();
  core::ModelConfig mc;
  mc.hidden_size = 256;
  mc.intermediate_size = 512;
  mc.num_heads = 4;
  mc.num_kv_heads = 2;
  mc.head_dim = 64;
  mc.qk_norm = qk_norm;
  const core::ModelSpec spec = core::BuildModelSpec(mc);
  at::manual_seed(41);
  auto dev = at::TensorOptions().device(at::kCUDA).dtype(dtype);
  model::LayerWeights w = BlockWeights(spec, dev);
  // Row 0: documents of 20, 17 and 11 tokens; row 1: 18 tokens at positions 30..47 (a split
  // record's piece, which always starts a row), then 30 tokens from position 0.
  const int64_t S = 48;
  const std::vector<std::pair<int64_t, int64_t>> docs = {
      {0, 20}, {20, 17}, {37, 11}, {48, 18}, {66, 30}};
  const std::vector<int64_t> first_position = {0, 0, 0, 30, 0};
  std::vector<int64_t> positions;
  for (size_t d = 0; d < docs.size(); ++d)
    for (int64_t i = 0; i < docs[d].second; ++i) positions.push_back(first_position[d] + i);
  at::Tensor x = at::randn({2, S, mc.hidden_size}, dev),
             dy = at::randn({2, S, mc.hidden_size}, dev);
  auto to_device = [](const int64_t* host, int64_t n) {
    return at::from_blob(const_cast<int64_t*>(host), {n}, at::kLong).to(at::kCUDA);
  };
  auto run = [&](const at::Tensor& in, const at::Tensor& grad_out, model::Documents documents,
                 at::Tensor* dx) {
    model::Transformer m(mc);
    m.UseFusedKernels(&rp::worker::CudaKernels());
    m.SetDocuments(std::move(documents));
    at::Tensor xi = in.detach().requires_grad_(true);
    at::Tensor out = m.Block(w, xi, 1);
    out.backward(grad_out);
    *dx = xi.grad();
    return out.detach();
  };
  auto grads = [&] {
    std::map<std::string, at::Tensor> g;
    for (auto& [role, t] : w) {
      g[role] = t.grad().to(at::kFloat).clone();
      t.mutable_grad().reset();
    }
    return g;
  };
  at::Tensor packed_dx;
  const at::Tensor packed =
      run(x, dy, model::MakeDocuments(positions.data(), 2, S, to_device), &packed_dx);
  const auto packed_grads = grads();
  std::map<std::string, at::Tensor> alone_grads;
  const bool f32 = dtype == at::kFloat;
  auto tol = [f32](const at::Tensor& r) {
    return (f32 ? 1e-5 : std::pow(2.0, -6)) * r.abs().max().item<double>();
  };
  for (size_t d = 0; d < docs.size(); ++d) {
    auto slice = [&](const at::Tensor& t) {
      return t.view({2 * S, mc.hidden_size}).narrow(0, docs[d].first, docs[d].second).unsqueeze(0);
    };
    // Alone from position 0, or, for the piece, at its own positions (a one-row microbatch
    // whose positions are not 0..n-1 is a document too).
    std::vector<int64_t> own(positions.begin() + docs[d].first,
                             positions.begin() + docs[d].first + docs[d].second);
    at::Tensor dx;
    const at::Tensor out = run(slice(x), slice(dy),
                               model::MakeDocuments(own.data(), 1, docs[d].second, to_device), &dx);
    EXPECT_LE(MaxAbs(slice(packed), out), tol(out)) << "document " << d << " output";
    EXPECT_LE(MaxAbs(slice(packed_dx), dx), tol(dx)) << "document " << d << " input gradient";
    for (auto& [role, g] : grads())
      alone_grads[role] = alone_grads.count(role) ? alone_grads[role] + g : g;
  }
  for (auto& [role, g] : alone_grads) EXPECT_LE(MaxAbs(packed_grads.at(role), g), tol(g)) << role;
  // The same rows without documents are not the documents alone.
  at::Tensor crossing_dx;
  const at::Tensor crossing = run(x, dy, model::Documents{}, &crossing_dx);
  grads();
  EXPECT_GT(MaxAbs(crossing, packed), 0.05 * packed.abs().max().item<double>());
}

INSTANTIATE_TEST_SUITE_P(DtypesAndNorms, BlockDocuments,
                         ::testing::Combine(::testing::Values(at::kFloat, at::kBFloat16),
                                            ::testing::Bool()));

// SwiGLU against silu(gate) * up and its autograd gradients: separate tensors (packed rows),
// the two halves of one [rows, 2 * cols] tensor (strided rows), and an odd width (scalar path).
class FusedSwiGlu : public ::testing::TestWithParam<std::tuple<at::ScalarType, int64_t, bool>> {};

TEST_P(FusedSwiGlu, MatchesCompositeForwardAndBackward) {
  if (!HaveCuda()) GTEST_SKIP() << "no CUDA device";
  const auto [dtype, cols, halves] = GetParam();
  const int64_t rows = 53;
  at::manual_seed(17);
  auto dev = at::TensorOptions().device(at::kCUDA);
  at::Tensor both = (at::randn({2, rows, 2 * cols}, dev) * 3.0).to(dtype);
  at::Tensor gate = halves ? both.narrow(-1, 0, cols) : both.narrow(-1, 0, cols).contiguous();
  at::Tensor up = halves ? both.narrow(-1, cols, cols) : both.narrow(-1, cols, cols).contiguous();
  at::Tensor gf = gate.to(at::kFloat).detach().requires_grad_(true);
  at::Tensor uf = up.to(at::kFloat).detach().requires_grad_(true);
  at::Tensor ref = at::silu(gf) * uf;
  at::Tensor dy = at::randn({2, rows, cols}, dev).to(dtype);
  ref.backward(dy.to(at::kFloat));

  const auto& k = rp::worker::CudaKernels();
  at::Tensor y = k.SwiGlu(gate, up);
  auto [dg, du] = k.SwiGluBackward(gate, up, dy);
  const bool f32 = dtype == at::kFloat;
  auto tol = [f32](const at::Tensor& r) {
    return (f32 ? 1e-5 : std::pow(2.0, -8)) * std::max(1.0, r.abs().max().item<double>());
  };
  EXPECT_LE(MaxAbs(y, ref), tol(ref));
  EXPECT_LE(MaxAbs(dg, gf.grad()), tol(gf.grad()));
  EXPECT_LE(MaxAbs(du, uf.grad()), tol(uf.grad()));
}

INSTANTIATE_TEST_SUITE_P(DtypesAndLayouts, FusedSwiGlu,
                         ::testing::Combine(::testing::Values(at::kFloat, at::kBFloat16),
                                            ::testing::Values(int64_t{64}, int64_t{37}),
                                            ::testing::Bool()));

// The weight-gradient GEMM adds dy^T x into an fp32 sink: against the float64 product of the
// same inputs, twice into a sink that starts non-zero, for both input dtypes. bf16 products are
// exact in fp32, so both dtypes are held to fp32 summation error (rows = 300 terms).
class FusedWeightGrad : public ::testing::TestWithParam<at::ScalarType> {};

TEST_P(FusedWeightGrad, AddsTheProductIntoAnFp32Sink) {
  if (!HaveCuda()) GTEST_SKIP() << "no CUDA device";
  const at::ScalarType dtype = GetParam();
  const int64_t rows = 300, out = 48, in = 72;
  at::manual_seed(23);
  auto dev = at::TensorOptions().device(at::kCUDA);
  at::Tensor dy = at::randn({rows, out}, dev).to(dtype), x = at::randn({rows, in}, dev).to(dtype);
  at::Tensor sink = at::randn({out, in}, dev);
  const at::Tensor before = sink.to(at::kDouble);
  at::Tensor want = before + 2.0 * at::mm(dy.to(at::kDouble).t(), x.to(at::kDouble));
  const auto& k = rp::worker::CudaKernels();
  k.AddWeightGrad(sink, dy, x);
  k.AddWeightGrad(sink, dy, x);
  const double scale =
      at::mm(dy.to(at::kDouble).abs().t(), x.to(at::kDouble).abs()).max().item<double>();
  EXPECT_LE(MaxAbs(sink, want), 2e-6 * scale);
  // Overwriting the sink (beta = 0) would lose its starting values: far from `want`.
  EXPECT_GT(MaxAbs(want - before, want), 1e-3);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, FusedWeightGrad, ::testing::Values(at::kFloat, at::kBFloat16));

TEST(FusedWeightGradArgs, RefusesABf16SinkNamingIt) {
  if (!HaveCuda()) GTEST_SKIP() << "no CUDA device";
  auto dev = at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16);
  at::Tensor dy = at::randn({8, 4}, dev), x = at::randn({8, 6}, dev), sink = at::zeros({4, 6}, dev);
  try {
    rp::worker::CudaKernels().AddWeightGrad(sink, dy, x);
    FAIL() << "a bf16 sink was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("sink"), std::string::npos) << e.what();
  }
  EXPECT_THROW(
      rp::worker::CudaKernels().AddWeightGrad(at::zeros({6, 4}, dev.dtype(at::kFloat)), dy, x),
      std::invalid_argument);
}

// A decoder block whose projections have sinks gives the same input gradient and, in the
// sinks, the weight gradients autograd gives without them (fp32: to summation order; bf16:
// autograd's are rounded to bf16, the sinks are not), and leaves those weights' .grad undefined.
class BlockWeightGradSinks : public ::testing::TestWithParam<at::ScalarType> {};

TEST_P(BlockWeightGradSinks, MatchAutogradsWeightGradients) {
  if (!HaveCuda()) GTEST_SKIP() << "no CUDA device";
  const at::ScalarType dtype = GetParam();
  const core::ModelConfig mc;  // the defaults: a small Qwen3-style block with q/k norm
  const core::ModelSpec spec = core::BuildModelSpec(mc);
  at::manual_seed(29);
  auto dev = at::TensorOptions().device(at::kCUDA).dtype(dtype);
  const int64_t H = mc.hidden_size;
  model::LayerWeights w = BlockWeights(spec, dev);
  at::Tensor x = at::randn({2, 16, H}, dev), dy = at::randn({2, 16, H}, dev);

  model::Transformer plain(mc);
  plain.UseFusedKernels(&rp::worker::CudaKernels());
  at::Tensor x1 = x.detach().requires_grad_(true);
  plain.Block(w, x1, 1).backward(dy);
  std::map<std::string, at::Tensor> want;
  for (auto& [role, t] : w) {
    want[role] = t.grad().to(at::kFloat).clone();
    t.mutable_grad().reset();
  }

  model::Transformer sunk(mc);
  sunk.UseFusedKernels(&rp::worker::CudaKernels());
  model::Transformer::WeightGradSinks sinks;
  std::map<std::string, at::Tensor> sink_of;
  for (auto& [role, t] : w)
    if (model::Transformer::SinkableRole(role)) {
      sink_of[role] = at::zeros(t.sizes(), dev.dtype(at::kFloat));
      sinks.emplace(t.unsafeGetTensorImpl(), sink_of[role]);
    }
  ASSERT_EQ(sink_of.size(), 7u);
  sunk.SetWeightGradSinks(sinks);
  at::Tensor x2 = x.detach().requires_grad_(true);
  sunk.Block(w, x2, 1).backward(dy);
  const bool f32 = dtype == at::kFloat;
  auto tol = [f32](const at::Tensor& r) {
    return (f32 ? 1e-5 : std::pow(2.0, -7)) * r.abs().max().item<double>();
  };
  EXPECT_LE(MaxAbs(x2.grad(), x1.grad()), tol(x1.grad()));
  for (auto& [role, t] : w) {
    if (sink_of.count(role)) {
      EXPECT_FALSE(t.grad().defined()) << role;
      EXPECT_LE(MaxAbs(sink_of[role], want[role]), tol(want[role])) << role;
    } else {
      ASSERT_TRUE(t.grad().defined()) << role;
      EXPECT_LE(MaxAbs(t.grad(), want[role]), tol(want[role])) << role;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, BlockWeightGradSinks,
                         ::testing::Values(at::kFloat, at::kBFloat16));

// A worker fetching fp32 masters for bf16 compute (schedule.weights_source = "auto" in exact mode)
// must see exactly the weights a compute copy would hold: round-to-nearest-even, bit for bit.
// Through the real fetch path: pinned host memory, 64 MiB staging chunks (this tensor takes two and
// a tail), the rounding kernel on the weights stream.
TEST(MasterFetch, RoundsLikeTheComputeCopyBitForBit) {
  if (!HaveCuda()) GTEST_SKIP() << "no CUDA device";
  const int64_t n = (80ll << 20) / 4 + 7;  // odd: the kernel's scalar tail runs too
  at::manual_seed(5);
  at::Tensor host = at::randn({n}) * 3.0;
  // Bit patterns the rounding must get right: ties to even both ways, subnormals, the largest
  // finite value (rounds to infinity), infinities, signed zero.
  const uint32_t special[] = {0x3f808000u, 0x3f818000u, 0x00000001u, 0x80008000u, 0x007fffffu,
                              0x7f7fffffu, 0x7f800000u, 0xff800000u, 0x80000000u, 0x3f807fffu};
  auto* h = host.data_ptr<float>();
  for (size_t i = 0; i < sizeof(special) / sizeof(special[0]); ++i)
    std::memcpy(&h[n - 1 - i], &special[i], 4);
  auto dev = rp::worker::MakeCudaDevice(0, host.data_ptr(), static_cast<uint64_t>(host.nbytes()));
  ASSERT_TRUE(dev.ok()) << dev.status().message();
  at::Tensor got = (*dev)->FetchWeights(host.data_ptr(), {n}, at::kFloat, at::kBFloat16);
  (*dev)->WaitWeights((*dev)->WeightsFence());
  ASSERT_EQ(got.scalar_type(), at::kBFloat16);
  at::Tensor want = host.to(at::kBFloat16);  // LibTorch's CPU rounding: nearest even
  EXPECT_TRUE(at::equal(got.cpu().view(at::kShort), want.view(at::kShort)));
  // And a NaN stays a NaN.
  host.index_put_({0}, std::nanf(""));
  at::Tensor nan = (*dev)->FetchWeights(host.data_ptr(), {4}, at::kFloat, at::kBFloat16);
  (*dev)->WaitWeights((*dev)->WeightsFence());
  EXPECT_TRUE(std::isnan(nan.cpu().to(at::kFloat).index({0}).item<float>()));
}

// schedule.embedding_lookup = "auto" (where it reads the masters): the lookup reads the fp32
// masters in place through the mapped segment (Device::MapWeights) and rounds the rows it read. Its
// output and the table's gradient must be bit for bit those of the copy path (the table rounded to
// bf16 on the device, then looked up), with the gradient summed in fp32 instead of bf16, so
// compared in fp32 against the fp32 sum of the copy path's per-token gradients.
TEST(MappedLookup, MatchesTheCopiedTableBitForBit) {
  if (!HaveCuda()) GTEST_SKIP() << "no CUDA device";
  const int64_t vocab = 5000, hidden = 2048;
  at::manual_seed(6);
  at::Tensor host = at::randn({vocab, hidden});
  auto dev = rp::worker::MakeCudaDevice(0, host.data_ptr(), static_cast<uint64_t>(host.nbytes()));
  ASSERT_TRUE(dev.ok()) << dev.status().message();
  at::Tensor tokens = at::randint(vocab, {2, 300}, at::TensorOptions().dtype(at::kLong)).cuda();
  core::ModelConfig mc;
  mc.vocab_size = vocab;
  mc.hidden_size = hidden;
  model::Transformer math(mc);
  math.SetEmbedDtype(at::kBFloat16);

  at::Tensor mapped = (*dev)->MapWeights(host.data_ptr(), {vocab, hidden}, at::kFloat);
  ASSERT_TRUE(mapped.is_cuda());
  mapped.requires_grad_(true);
  at::Tensor got = math.Embed({{"embed", mapped}}, tokens);
  ASSERT_EQ(got.scalar_type(), at::kBFloat16);

  at::Tensor copied =
      (*dev)->FetchWeights(host.data_ptr(), {vocab, hidden}, at::kFloat, at::kBFloat16);
  (*dev)->WaitWeights((*dev)->WeightsFence());
  copied.requires_grad_(true);
  at::Tensor want = math.Embed({{"embed", copied}}, tokens);
  EXPECT_TRUE(at::equal(got.view(at::kShort), want.view(at::kShort)));

  at::Tensor dy = at::randn(got.sizes(), got.options());
  got.backward(dy);
  ASSERT_EQ(mapped.grad().scalar_type(), at::kFloat);
  at::Tensor ref =
      at::zeros({vocab, hidden}, at::TensorOptions().dtype(at::kFloat).device(at::kCUDA));
  ref.index_add_(0, tokens.reshape(-1), dy.reshape({-1, hidden}).to(at::kFloat));
  EXPECT_TRUE(at::allclose(mapped.grad(), ref, 1e-6, 1e-6));
  // The table in host memory is only read.
  EXPECT_FALSE(host.requires_grad());
}

}  // namespace
}  // namespace rp

namespace rp {
namespace {

bool HaveE4m3() { return HaveCuda() && rp::worker::CudaKernels().E4m3MatmulSupported(); }

// The fused quantization gives model/fp8.h's scales and rounding bit for bit, for bf16 and fp32
// rows of very different magnitudes, a row of zeros and a row holding a NaN (scale NaN).
class E4m3Quantization : public ::testing::TestWithParam<at::ScalarType> {};

TEST_P(E4m3Quantization, GivesTheEmulationsBitsAndScales) {
  if (!HaveE4m3()) GTEST_SKIP() << "no CUDA device with e4m3 products";
  const at::ScalarType dtype = GetParam();
  at::manual_seed(41);
  auto dev = at::TensorOptions().device(at::kCUDA);
  at::Tensor x =
      (at::randn({37, 2051}, dev) * at::exp2(at::rand({37, 1}, dev) * 40.0 - 20.0)).to(dtype);
  x[5].zero_();
  x[9][100] = std::nanf("");
  x[13][7] = std::numeric_limits<float>::infinity();
  x[21].copy_(at::randn({2051}, dev) * 2e-38);  // amax / 448 below 2^-126: the scale at its floor
  const auto [q, scales] = rp::worker::CudaKernels().QuantizeRowsE4m3(x);
  ASSERT_EQ(q.scalar_type(), at::kFloat8_e4m3fn);
  ASSERT_EQ(scales.sizes(), (std::vector<int64_t>{37, 1}));
  const at::Tensor want_scales = model::E4m3RowScales(x);
  const at::Tensor finite = at::isfinite(want_scales).view({-1});
  EXPECT_FALSE(finite[9].item<bool>());
  EXPECT_FALSE(finite[13].item<bool>());
  EXPECT_TRUE(std::isnan(scales[13][0].item<float>()));
  EXPECT_EQ(want_scales[21][0].item<float>(), std::ldexp(1.0f, -126));
  EXPECT_TRUE(std::isnan(scales[9][0].item<float>()));
  EXPECT_TRUE(scales.index({finite}).equal(want_scales.index({finite})));
  const at::Tensor want = model::RoundToE4m3(x.to(at::kFloat) / want_scales);
  EXPECT_TRUE(q.to(at::kFloat).index({finite}).equal(want.index({finite})));
  EXPECT_EQ(scales[5][0].item<float>(), 1.0f);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, E4m3Quantization, ::testing::Values(at::kBFloat16, at::kFloat));

// The e4m3 product equals the fp32 product of the rounded operands (model::E4m3RoundTripRows)
// up to its bf16 output's rounding and the tensor cores' accumulation, which keeps fewer bits
// than fp32 (measured against the sum of the products' magnitudes, which bounds it), with and
// without fast accumulation; shapes as a projection's. A wrong scale or orientation is off by
// the order of the values themselves.
TEST(E4m3Matmul, IsTheProductOfTheRoundedOperands) {
  if (!HaveE4m3()) GTEST_SKIP() << "no CUDA device with e4m3 products";
  at::manual_seed(43);
  auto dev = at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16);
  const at::Tensor a = at::randn({300, 512}, dev) * 3.0, b = at::randn({384, 512}, dev) * 0.02;
  const auto& k = rp::worker::CudaKernels();
  const auto [aq, as] = k.QuantizeRowsE4m3(a);
  const auto [bq, bs] = k.QuantizeRowsE4m3(b);
  const at::Tensor want = at::mm(model::E4m3RoundTripRows(a), model::E4m3RoundTripRows(b).t());
  for (bool fast : {false, true}) {
    const at::Tensor got = k.MatmulE4m3(aq, as, bq, bs, fast);
    ASSERT_EQ(got.scalar_type(), at::kBFloat16);
    ASSERT_EQ(got.sizes(), (std::vector<int64_t>{300, 384}));
    const at::Tensor magnitude =
        at::mm(model::E4m3RoundTripRows(a).abs(), model::E4m3RoundTripRows(b).abs().t());
    const at::Tensor excess = (got.to(at::kFloat) - want).abs() - want.abs() * std::pow(2.0, -8);
    const double err = (excess / magnitude).max().item<double>();
    EXPECT_LE(err, std::pow(2.0, -8)) << "fast_accum " << fast;
    std::printf(
        "e4m3 product, fast_accum %d: error beyond bf16 rounding %.3g of the products' magnitude\n",
        static_cast<int>(fast), err);
  }
  EXPECT_THROW(k.MatmulE4m3(aq.narrow(1, 0, 500).contiguous(), as,
                            bq.narrow(1, 0, 500).contiguous(), bs, false),
               std::invalid_argument);
}

// A decoder block with e4m3 projections, through autograd, with and without weight-gradient
// sinks: close to the bf16 block (e4m3 keeps 3 mantissa bits, so a few percent), and not the
// bf16 block itself; with sinks, the same up to the sinks' unrounded sums.
TEST(BlockE4m3Projections, FollowTheBf16BlockThroughAutograd) {
  if (!HaveE4m3()) GTEST_SKIP() << "no CUDA device with e4m3 products";
  const core::ModelConfig mc;
  const core::ModelSpec spec = core::BuildModelSpec(mc);
  at::manual_seed(47);
  auto dev = at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16);
  model::LayerWeights w = BlockWeights(spec, dev);
  at::Tensor x = at::randn({2, 64, mc.hidden_size}, dev),
             dy = at::randn({2, 64, mc.hidden_size}, dev);
  auto rel = [](const at::Tensor& a, const at::Tensor& b) {
    return ((a.to(at::kDouble) - b.to(at::kDouble)).norm() / b.to(at::kDouble).norm())
        .item<double>();
  };
  auto run = [&](bool e4m3, bool sinks, std::map<std::string, at::Tensor>* grads) {
    model::Transformer math(mc);
    math.UseFusedKernels(&rp::worker::CudaKernels());
    math.UseE4m3Projections(e4m3);
    model::Transformer::WeightGradSinks sink_map;
    std::map<std::string, at::Tensor> sink_of;
    if (sinks) {
      for (auto& [role, t] : w)
        if (model::Transformer::SinkableRole(role)) {
          sink_of[role] = at::zeros(t.sizes(), dev.dtype(at::kFloat));
          sink_map.emplace(t.unsafeGetTensorImpl(), sink_of[role]);
        }
      math.SetWeightGradSinks(sink_map);
    }
    at::Tensor xi = x.detach().requires_grad_(true);
    at::Tensor y = math.Block(w, xi, 1);
    y.backward(dy);
    for (auto& [role, t] : w) {
      (*grads)[role] = sink_of.count(role) ? sink_of[role] : t.grad().to(at::kFloat).clone();
      t.mutable_grad().reset();
    }
    (*grads)["x"] = xi.grad().to(at::kFloat);
    return y.detach();
  };
  std::map<std::string, at::Tensor> g16, g8, g8s;
  const at::Tensor y16 = run(false, false, &g16), y8 = run(true, false, &g8),
                   y8s = run(true, true, &g8s);
  const double out_err = rel(y8, y16);
  EXPECT_GT(out_err, 0.0);
  EXPECT_LE(out_err, 0.05);
  EXPECT_TRUE(y8.equal(y8s));
  EXPECT_LE(rel(g8["x"], g16["x"]), 0.1);
  EXPECT_LE(rel(g8s["x"], g8["x"]), std::pow(2.0, -7));
  for (auto& [role, g] : g16) {
    if (role == "x") continue;
    EXPECT_LE(rel(g8[role], g), 0.1) << role;
    EXPECT_LE(rel(g8s[role], g8[role]), std::pow(2.0, -7)) << role;
  }
  std::printf("e4m3 block against bf16: output %.4f, input gradient %.4f relative (Frobenius)\n",
              out_err, rel(g8["x"], g16["x"]));
}

// optimizer.device_update_blocks: the CUDA backend's AdamW compute copy must give the CPU's scalar
// loop's bits (the host updates the same blocks, and a backward recomputes with the host's copy),
// for both output dtypes, clipped and unclipped, with zero second moments and spread magnitudes.
TEST(DeviceAdamW, CudaComputeCopyHasTheCpuScalarLoopsBits) {
  if (!HaveCuda()) GTEST_SKIP() << "no CUDA device";
  constexpr uint64_t kPinned = 1 << 20;  // the device pins a segment; any page-aligned buffer
  std::unique_ptr<void, decltype(&std::free)> pinned(std::aligned_alloc(4096, kPinned), &std::free);
  auto device = worker::MakeCudaDevice(0, pinned.get(), kPinned);
  ASSERT_TRUE(device.ok()) << device.status().ToString();
  at::manual_seed(3);
  const int64_t n = (1 << 20) + 7;
  const at::Tensor magnitude = at::pow(10.0, at::rand({n}) * 8.0 - 6.0);
  const at::Tensor grad = at::randn({n}) * magnitude;
  const at::Tensor master = at::randn({n}) * 0.05;
  const at::Tensor m = at::randn({n}) * magnitude * 0.1;
  at::Tensor v = at::rand({n}) * magnitude * magnitude * 0.01;
  v.narrow(0, 0, 1000).zero_();
  auto cuda = [](const at::Tensor& t) { return t.to(at::kCUDA); };
  for (const at::ScalarType dtype : {at::kBFloat16, at::kFloat}) {
    for (const float grad_scale : {1.0f, 0.3172f}) {
      const coord::AdamWHyper h{3e-4, 0.9, 0.95, 1e-8, 0.1, 7};
      at::Tensor want = at::empty({n}, dtype);
      at::Tensor mc = master.clone(), m1 = m.clone(), v1 = v.clone();
      coord::AdamWUpdateWith(
          coord::SimdLevel::kScalar, h, grad_scale, grad.data_ptr<float>(), mc.data_ptr<float>(),
          m1.data_ptr<float>(), v1.data_ptr<float>(), n, want.data_ptr(),
          dtype == at::kFloat ? coord::ComputeDtype::kFloat32 : coord::ComputeDtype::kBFloat16,
          coord::UpdateWrites::kFetched);
      at::Tensor got = at::empty({n}, at::TensorOptions().dtype(dtype).device(at::kCUDA));
      (*device)->AdamWComputeCopy(h, grad_scale, cuda(grad), cuda(master), cuda(m), cuda(v), got);
      const at::ScalarType bits = dtype == at::kFloat ? at::kInt : at::kShort;
      const at::Tensor differ = want.view(bits).ne(got.cpu().view(bits));
      EXPECT_EQ(differ.sum().item<int64_t>(), 0)
          << c10::toString(dtype) << ", grad_scale " << grad_scale;
    }
  }
}

}  // namespace
}  // namespace rp
