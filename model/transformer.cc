// SPDX-License-Identifier: Apache-2.0
#include "model/transformer.h"

#include <ATen/core/Reduction.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/version.h>

#include <cmath>
#include <sstream>
#include <stdexcept>

#include "common/rng.h"
#include "config/model_spec.h"
#include "config/rope.h"

namespace rp::model {

const at::Tensor& Get(const LayerWeights& w, const std::string& role) {
  auto it = w.find(role);
  if (it == w.end()) throw std::invalid_argument("layer weights lack '" + role + "'");
  return it->second;
}

uint64_t DropoutKey(int64_t seed, int64_t step, int64_t step_microbatch) {
  return HashKey({static_cast<uint64_t>(seed), 0xD20u, static_cast<uint64_t>(step),
                  static_cast<uint64_t>(step_microbatch)});
}

Transformer::Transformer(const core::ModelConfig& config, int64_t loss_chunk_tokens,
                         const core::LoraConfig& lora)
    : config_(config),
      lora_scale_(lora.enabled() ? lora.scale() : 0.0),
      lora_dropout_(lora.enabled() ? lora.dropout : 0.0),
      loss_chunk_tokens_(loss_chunk_tokens) {}

namespace {
// Logical right shift of int64 lanes (the tensor op is arithmetic: clear the sign copies).
at::Tensor ShiftRight(const at::Tensor& x, int s) {
  return x.__rshift__(s).bitwise_and_((int64_t{1} << (64 - s)) - 1);
}
// SplitMix64's finalizer on every lane; int64 multiplication wraps like uint64's.
at::Tensor Mix64(at::Tensor x) {
  x = x.bitwise_xor(ShiftRight(x, 30)).mul_(static_cast<int64_t>(0xBF58476D1CE4E5B9ull));
  x = x.bitwise_xor(ShiftRight(x, 27)).mul_(static_cast<int64_t>(0x94D049BB133111EBull));
  return x.bitwise_xor(ShiftRight(x, 31));
}
}  // namespace

at::Tensor Transformer::LoraDropout(const at::Tensor& h, int layer, int module,
                                    int64_t first_token) const {
  c10::NoGradGuard no_grad;  // the mask is a constant of the graph
  const uint64_t key =
      HashKey({dropout_key_, static_cast<uint64_t>(layer), static_cast<uint64_t>(module)});
  const int64_t first = first_token * h.size(-1);
  at::Tensor bits = Mix64(at::arange(first, first + h.numel(), h.options().dtype(at::kLong))
                              .add_(static_cast<int64_t>(key)));
  // The top 24 bits as a uniform integer; keep with probability 1 - p (exact in double).
  const int64_t keep_below = static_cast<int64_t>(std::llround((1.0 - lora_dropout_) * 16777216.0));
  return ShiftRight(bits, 40).lt(keep_below).to(h.scalar_type()).view(h.sizes());
}

at::Tensor Transformer::Proj(const LayerWeights& w, const std::string& role, const at::Tensor& h,
                             int layer, int module, int64_t first_token) const {
  auto bias = w.find(role + ".bias");
  at::Tensor y = ProjLinear(h, Get(w, role), bias == w.end() ? at::Tensor() : bias->second);
  auto a = w.find(role + ".lora_A");
  if (a == w.end()) return y;
  const at::Tensor& b = Get(w, role + ".lora_B");
  // Kept elements scaled by 1 / (1 - p) in one rounding (the 0/1 mask product is exact), as
  // torch's dropout does; a bf16 mask holding the scale would round it first.
  at::Tensor in =
      training_ && lora_dropout_ > 0.0
          ? (h * LoraDropout(h, layer, module, first_token)).mul_(1.0 / (1.0 - lora_dropout_))
          : h;
  return y + at::linear(at::linear(in, a->second), b) * lora_scale_;
}

void Transformer::RopeTables(int64_t seq, const at::Tensor& like, at::Tensor* cos,
                             at::Tensor* sin) {
  if (!cos_.defined() || cos_.size(0) != seq || cos_.device() != like.device() ||
      cos_.scalar_type() != like.scalar_type()) {
    c10::NoGradGuard no_grad;
    auto opts = at::TensorOptions().dtype(at::kDouble);
    const std::vector<double> rates = core::RopeInvFreq(config_.rope, config_.head_dim);
    at::Tensor inv_freq = at::tensor(at::ArrayRef<double>(rates), opts);
    at::Tensor pos = at::arange(seq, opts);
    at::Tensor freqs = at::outer(pos, inv_freq);
    at::Tensor emb = at::cat({freqs, freqs}, -1);
    // YaRN scales both tables (transformers' attention_scaling); 1 for every other variant.
    const double scale = core::RopeAttentionFactor(config_.rope);
    cos_ = (emb.cos() * scale).to(like.device(), like.scalar_type());
    // sin with the first half negated: rotate_half(x) * sin == roll(x, D/2) * this table.
    at::Tensor s = freqs.sin() * scale;
    sin_ = at::cat({-s, s}, -1).to(like.device(), like.scalar_type());
  }
  *cos = cos_;
  *sin = sin_;
}

at::Tensor Transformer::Rope(const at::Tensor& x, const at::Tensor& cos,
                             const at::Tensor& sin) const {
  // x: [B, heads, S, D]; rotate-half convention (as Hugging Face Llama / Qwen3):
  // x * cos + cat(-x2, x1) * sin, written as x * cos + roll(x, D/2) * (sin with its first half
  // negated): three kernels instead of five, the same values (a sign flip is exact).
  return at::addcmul(x * cos, at::roll(x, x.size(-1) / 2, -1), sin);
}

namespace {
// RoPE through the fused kernel with its own backward: the rotation is linear, so the backward
// is the same kernel with the transposed rotation, and nothing but the tables is saved.
struct FusedRopeFn : public torch::autograd::Function<FusedRopeFn> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& cos, const at::Tensor& sin, const FusedKernels* k) {
    ctx->saved_data["cos"] = cos;
    ctx->saved_data["sin"] = sin;
    ctx->saved_data["kernels"] = reinterpret_cast<int64_t>(k);
    return k->Rope(x.contiguous(), cos, sin, /*backward=*/false);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto* k = reinterpret_cast<const FusedKernels*>(ctx->saved_data["kernels"].toInt());
    at::Tensor dx = k->Rope(grads[0].contiguous(), ctx->saved_data["cos"].toTensor(),
                            ctx->saved_data["sin"].toTensor(), /*backward=*/true);
    return {dx, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};
// Qwen3's per-head q/k norm and RoPE in one kernel each way; the backward recomputes the norm's
// statistics from the saved input, so nothing but the input (which the composite keeps too) is
// saved.
struct HeadNormRopeFn : public torch::autograd::Function<HeadNormRopeFn> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& w, const at::Tensor& cos, const at::Tensor& sin,
                            const FusedKernels* k, double eps) {
    at::Tensor xc = x.contiguous();
    ctx->save_for_backward({xc, w});
    ctx->saved_data["cos"] = cos;
    ctx->saved_data["sin"] = sin;
    ctx->saved_data["kernels"] = reinterpret_cast<int64_t>(k);
    ctx->saved_data["eps"] = eps;
    return k->HeadNormRope(xc, w, cos, sin, eps);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto* k = reinterpret_cast<const FusedKernels*>(ctx->saved_data["kernels"].toInt());
    const auto saved = ctx->get_saved_variables();
    // A frozen norm weight (LoRA) needs no gradient: the kernel then skips its reduction.
    auto [dx, dw] = k->HeadNormRopeBackward(
        saved[0], saved[1], ctx->saved_data["cos"].toTensor(), ctx->saved_data["sin"].toTensor(),
        ctx->saved_data["eps"].toDouble(), grads[0].contiguous(), ctx->needs_input_grad(1));
    return {dx, dw, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// RMSNorm in one kernel each way. The backward recomputes the statistics from the saved input
// (LibTorch's fused rms_norm saves them, and its weight-gradient kernel took as long as its
// input-gradient one in a traced step).
struct RmsNormFn : public torch::autograd::Function<RmsNormFn> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& w, const FusedKernels* k, double eps) {
    ctx->save_for_backward({x, w});
    ctx->saved_data["kernels"] = reinterpret_cast<int64_t>(k);
    ctx->saved_data["eps"] = eps;
    return k->AddRmsNorm(x, at::Tensor(), w, eps).second;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto* k = reinterpret_cast<const FusedKernels*>(ctx->saved_data["kernels"].toInt());
    const auto saved = ctx->get_saved_variables();
    auto [dx, dw] =
        k->RmsNormBackward(saved[0], saved[1], ctx->saved_data["eps"].toDouble(),
                           grads[0].contiguous(), at::Tensor(), ctx->needs_input_grad(1));
    return {dx, dw, at::Tensor(), at::Tensor()};
  }
};

// s = x + res and RmsNorm(s) in one kernel; the backward adds the residual stream's gradient
// (dL/ds from s's other use) into the norm's input gradient in the same pass, which is then
// dL/dx and dL/dres alike. Saves the add's pass over s forward and autograd's add of the two
// gradients of s backward.
struct AddRmsNormFn : public torch::autograd::Function<AddRmsNormFn> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                const at::Tensor& x, const at::Tensor& res,
                                                const at::Tensor& w, const FusedKernels* k,
                                                double eps) {
    auto [s, y] = k->AddRmsNorm(x, res, w, eps);
    ctx->save_for_backward({s, w});
    ctx->saved_data["kernels"] = reinterpret_cast<int64_t>(k);
    ctx->saved_data["eps"] = eps;
    return {s, y};
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto* k = reinterpret_cast<const FusedKernels*>(ctx->saved_data["kernels"].toInt());
    const auto saved = ctx->get_saved_variables();
    const at::Tensor ds_other = grads[0].defined() ? grads[0].contiguous() : at::Tensor();
    at::Tensor dy = grads[1].defined() ? grads[1].contiguous() : at::zeros_like(saved[0]);
    auto [ds, dw] = k->RmsNormBackward(saved[0], saved[1], ctx->saved_data["eps"].toDouble(), dy,
                                       ds_other, ctx->needs_input_grad(2));
    return {ds, ds, dw, at::Tensor(), at::Tensor()};
  }
};

// silu(gate) * up in one pass each way; saves the two inputs (the composite saves those and
// silu(gate) as well).
struct SwiGluFn : public torch::autograd::Function<SwiGluFn> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& gate,
                            const at::Tensor& up, const FusedKernels* k) {
    ctx->save_for_backward({gate, up});
    ctx->saved_data["kernels"] = reinterpret_cast<int64_t>(k);
    return k->SwiGlu(gate, up);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto* k = reinterpret_cast<const FusedKernels*>(ctx->saved_data["kernels"].toInt());
    const auto saved = ctx->get_saved_variables();
    auto [dg, du] = k->SwiGluBackward(saved[0], saved[1], grads[0].contiguous());
    return {dg, du, at::Tensor()};
  }
};

// Identity whose backward adds `extra` (read then, so it may be filled after the forward) to
// the gradient of every row: the router load-balancing loss's gradient with respect to the
// probabilities.
struct AddRowGradFn : public torch::autograd::Function<AddRowGradFn> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& extra) {
    ctx->saved_data["extra"] = extra;
    return x.clone();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    return {grads[0] + ctx->saved_data["extra"].toTensor(), at::Tensor()};
  }
};

// The stacked expert weights unchanged; in the backward, the gradient of every expert without
// rows in this product (has_tokens false) is exactly zero. Why: the grouped GEMM's weight
// gradient for an empty group is zero on Hopper but was reported not to be on Blackwell, and an
// expert that no token chose must get exactly zero (its moments decay, as torch's AdamW does on
// a fused expert tensor). A select, not a product: zero times a garbage NaN would stay NaN.
struct EmptyExpertsZeroGradFn : public torch::autograd::Function<EmptyExpertsZeroGradFn> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& w,
                            const at::Tensor& has_tokens) {
    ctx->saved_data["has_tokens"] = has_tokens;
    return w.view_as(w);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const at::Tensor has = ctx->saved_data["has_tokens"].toTensor().view({-1, 1, 1});
    return {at::where(has, grads[0], at::zeros({}, grads[0].options())), at::Tensor()};
  }
};

// x W^T whose weight gradient goes into `sink` (fp32, W's shape) instead of W.grad: the kernel
// adds dy^T x, accumulated in fp32, to the sink in the GEMM's own epilogue. The input gradient
// is autograd's (dy W).
struct LinearSinkFn : public torch::autograd::Function<LinearSinkFn> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& w, const at::Tensor& sink, const FusedKernels* k) {
    ctx->save_for_backward({x, w});
    ctx->saved_data["sink"] = sink;
    ctx->saved_data["kernels"] = reinterpret_cast<int64_t>(k);
    return at::linear(x, w);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto* k = reinterpret_cast<const FusedKernels*>(ctx->saved_data["kernels"].toInt());
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const at::Tensor& w = saved[1];
    const at::Tensor dy = grads[0].contiguous();
    at::Tensor dx = ctx->needs_input_grad(0) ? at::matmul(dy, w) : at::Tensor();
    if (ctx->needs_input_grad(1))  // a frozen weight's sum stays as it is
      k->AddWeightGrad(ctx->saved_data["sink"].toTensor(), dy.reshape({-1, dy.size(-1)}),
                       x.reshape({-1, x.size(-1)}).contiguous());
    return {dx, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// x W^T from e4m3 operands quantized by rows (model/fp8.h), summed in fp32, rounded to bf16; the
// input gradient dy W likewise from dy's rows and W^T's rows (W's columns: its scales must run
// along the input dimension). The weight gradient dy^T x stays bf16 with fp32 sums, into the
// weight's sink when it has one: in e4m3 its operands would be scaled along the tokens, thousands
// of them per scale, and it is only a third of the products.
struct E4m3LinearFn : public torch::autograd::Function<E4m3LinearFn> {
  // `sink`: null for autograd's weight gradient (an undefined tensor cannot be an argument).
  // `input`: the last quantized input, reused when it is x's (Transformer::E4m3Input).
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& w, const at::Tensor* sink, const FusedKernels* k,
                            Transformer::E4m3Input* input) {
    // What each gradient needs, as at::linear keeps it: x for the weight's, W for the input's (a
    // frozen base weight under LoRA keeps no input alive).
    ctx->save_for_backward(
        {w.requires_grad() ? x : at::Tensor(), x.requires_grad() ? w : at::Tensor()});
    ctx->saved_data["x_sizes"] = x.sizes().vec();
    ctx->saved_data["has_sink"] = sink != nullptr;
    if (sink != nullptr) ctx->saved_data["sink"] = *sink;
    ctx->saved_data["kernels"] = reinterpret_cast<int64_t>(k);
    if (!input->x.defined() || input->x.unsafeGetTensorImpl() != x.unsafeGetTensorImpl() ||
        input->version != static_cast<int64_t>(x._version())) {
      auto [xq, xs] = k->QuantizeRowsE4m3(x.reshape({-1, x.size(-1)}).contiguous());
      *input = {x, xq, xs, static_cast<int64_t>(x._version())};
    }
    auto [wq, ws] = k->QuantizeRowsE4m3(w.contiguous());
    std::vector<int64_t> shape = x.sizes().vec();
    shape.back() = w.size(0);
    // Fast accumulation in the forward only, where the sums are short-lived; the gradients get
    // the promoted sums.
    return k->MatmulE4m3(input->values, input->scales, wq, ws, /*fast_accum=*/true).view(shape);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto* k = reinterpret_cast<const FusedKernels*>(ctx->saved_data["kernels"].toInt());
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const at::Tensor& w = saved[1];
    const at::Tensor dy = grads[0].reshape({-1, grads[0].size(-1)}).contiguous();
    at::Tensor dx, dw;
    if (ctx->needs_input_grad(0)) {
      auto [dq, ds] = k->QuantizeRowsE4m3(dy);
      auto [wtq, wts] = k->QuantizeRowsE4m3(w.t().contiguous());
      dx = k->MatmulE4m3(dq, ds, wtq, wts, /*fast_accum=*/false)
               .view(ctx->saved_data["x_sizes"].toIntVector());
    }
    if (ctx->needs_input_grad(1)) {  // a frozen weight's sum stays as it is
      const at::Tensor x2 = x.reshape({-1, x.size(-1)}).contiguous();
      if (ctx->saved_data["has_sink"].toBool())
        k->AddWeightGrad(ctx->saved_data["sink"].toTensor(), dy, x2);
      else dw = at::mm(dy.t(), x2);
    }
    return {dx, dw, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// A tile of a dense block's post-attention norm and MLP, checkpointed: the forward keeps only the
// tile's input (the residual stream after attention, which the block keeps anyway); the backward
// recomputes the tile with autograd (the microbatch's dropout key restored) and backpropagates
// through it, so the weights' gradients (the norm's included) accumulate where the untiled
// block's would (.grad or a sink) and only the input's gradient is returned.
struct MlpTileFn : public torch::autograd::Function<MlpTileFn> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& h,
                            Transformer* math, const LayerWeights* w, int64_t layer,
                            int64_t first_token) {
    ctx->save_for_backward({h});
    ctx->saved_data["math"] = reinterpret_cast<int64_t>(math);
    ctx->saved_data["weights"] = reinterpret_cast<int64_t>(w);
    ctx->saved_data["layer"] = layer;
    ctx->saved_data["first_token"] = first_token;
    ctx->saved_data["key"] = static_cast<int64_t>(math->dropout_key());
    return math->NormMlp(*w, h, static_cast<int>(layer), first_token);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto* math = reinterpret_cast<Transformer*>(ctx->saved_data["math"].toInt());
    const auto* w = reinterpret_cast<const LayerWeights*>(ctx->saved_data["weights"].toInt());
    at::Tensor h = ctx->get_saved_variables()[0].detach().requires_grad_(true);
    const uint64_t key = math->dropout_key();
    math->SetDropoutKey(static_cast<uint64_t>(ctx->saved_data["key"].toInt()));
    at::Tensor y;
    {
      at::AutoGradMode grad_on(true);
      y = math->NormMlp(*w, h, static_cast<int>(ctx->saved_data["layer"].toInt()),
                        ctx->saved_data["first_token"].toInt());
    }
    math->SetDropoutKey(key);
    torch::autograd::backward({y}, {grads[0]});
    return {h.grad(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};
}  // namespace

at::Tensor Transformer::Mlp(const LayerWeights& w, const at::Tensor& h, int layer,
                            int64_t first_token) {
  at::Tensor gate = Proj(w, "gate_proj", h, layer, 4, first_token);
  at::Tensor up = Proj(w, "up_proj", h, layer, 5, first_token);
  at::Tensor act = Fused(gate) ? SwiGluFn::apply(gate, up, fused_) : at::silu(gate) * up;
  at::Tensor out = Proj(w, "down_proj", act, layer, 6, first_token);
  e4m3_input_ = {};
  return out;
}

at::Tensor Transformer::NormMlp(const LayerWeights& w, const at::Tensor& x1, int layer,
                                int64_t first_token) {
  return Mlp(w, RmsNorm(x1, Get(w, "post_norm")), layer, first_token);
}

at::Tensor Transformer::RmsNorm(const at::Tensor& x, const at::Tensor& weight) const {
  if (FusedNorm(x)) return RmsNormFn::apply(x, weight, fused_, config_.rms_norm_eps);
#if TORCH_VERSION_MAJOR >= 2
  // One fused kernel on the GPU instead of six memory-bound ones (fp32 statistics inside). The
  // explicit path below stays the CPU oracle.
  if (x.is_cuda()) return at::rms_norm(x, {x.size(-1)}, weight, config_.rms_norm_eps);
#endif
  at::Tensor xf = x.to(at::kFloat);
  at::Tensor var = xf.pow(2).mean(-1, /*keepdim=*/true);
  at::Tensor normed = xf * at::rsqrt(var + config_.rms_norm_eps);
  return weight * normed.to(x.scalar_type());
}

std::pair<at::Tensor, at::Tensor> Transformer::AddRmsNorm(const at::Tensor& x,
                                                          const at::Tensor& res,
                                                          const at::Tensor& weight) const {
  if (FusedNorm(x) && res.is_contiguous() && res.sizes().equals(x.sizes())) {
    auto out = AddRmsNormFn::apply(x, res, weight, fused_, config_.rms_norm_eps);
    return {out[0], out[1]};
  }
  at::Tensor s = x + res;
  return {s, RmsNorm(s, weight)};
}

bool Transformer::SinkableRole(const std::string& role) { return core::SinkableRole(role); }

const at::Tensor* Transformer::SinkOf(const at::Tensor& weight) const {
  auto it = sinks_.find(weight.unsafeGetTensorImpl());
  return it == sinks_.end() ? nullptr : &it->second;
}

at::Tensor Transformer::Linear(const at::Tensor& x, const at::Tensor& weight,
                               const at::Tensor& bias) const {
  if (const at::Tensor* sink = Fused(x) ? SinkOf(weight) : nullptr) {
    at::Tensor y = LinearSinkFn::apply(x, weight, *sink, fused_);
    return bias.defined() ? y + bias : y;
  }
  return at::linear(x, weight, bias);
}

at::Tensor Transformer::ProjLinear(const at::Tensor& x, const at::Tensor& weight,
                                   const at::Tensor& bias) const {
  // The e4m3 product takes operands whose inner and output sizes are multiples of 16; any other
  // projection stays bf16 (docs/features.md).
  if (!e4m3_projections_ || !Fused(x) || x.scalar_type() != at::kBFloat16 ||
      weight.scalar_type() != at::kBFloat16 || x.numel() == 0 || weight.size(0) % 16 != 0 ||
      weight.size(1) % 16 != 0)
    return Linear(x, weight, bias);
  at::Tensor y = E4m3LinearFn::apply(x, weight, SinkOf(weight), fused_, &e4m3_input_);
  return bias.defined() ? y + bias : y;
}

namespace {
// Softmax attention of q over k and v (as many heads each), fp32 scores and softmax; `blocked`
// (broadcast to [B, heads, S, S]) is true where a query may not see a key.
at::Tensor MaskedAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const at::Tensor& blocked) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
  at::Tensor scores = at::matmul(q, k.transpose(-2, -1)).to(at::kFloat) * scale;
  scores = scores.masked_fill(blocked, -std::numeric_limits<float>::infinity());
  at::Tensor probs = at::softmax(scores, -1).to(q.scalar_type());
  return at::matmul(probs, v);
}

#if TORCH_VERSION_MAJOR >= 2
// Causal flash attention over variable-length sequences packed back to back: q [tokens, nh, D],
// k and v [tokens, nkv, D], sequence d = tokens [cu[d], cu[d + 1]). LibTorch's
// aten::_flash_attention_forward (differentiable; its backward is the flash backward), called
// through the dispatcher by name so that the arguments later LibTorch versions added after the
// first ten take their schema's defaults.
at::Tensor VarlenFlashAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const at::Tensor& cu_seqlens, int64_t max_length) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("aten::_flash_attention_forward", "");
  const auto& args = op.schema().arguments();
  torch::jit::Stack stack;
  stack.emplace_back(q);
  stack.emplace_back(k);
  stack.emplace_back(v);
  stack.emplace_back(cu_seqlens);
  stack.emplace_back(cu_seqlens);
  stack.emplace_back(max_length);
  stack.emplace_back(max_length);
  stack.emplace_back(0.0);    // dropout_p
  stack.emplace_back(true);   // is_causal
  stack.emplace_back(false);  // return_debug_mask
  for (size_t i = stack.size(); i < args.size(); ++i) {
    if (!args[i].default_value()) {
      std::ostringstream schema;
      schema << op.schema();
      throw std::runtime_error("aten::_flash_attention_forward: argument " + args[i].name() +
                               " has no default in this LibTorch (" + schema.str() + ")");
    }
    stack.push_back(*args[i].default_value());
  }
  op.callBoxed(&stack);
  return stack[0].toTensor();
}
#endif
}  // namespace

at::Tensor Transformer::Attention(const at::Tensor& q, const at::Tensor& k,
                                  const at::Tensor& v) const {
  // q: [B, nh, S, D]; k, v: [B, nkv, S, D]. Expand kv heads for grouped-query attention.
  const int64_t groups = config_.num_heads / config_.num_kv_heads;
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 5)
  // Fused kernels on the GPU, grouped-query attention without expanding k and v in half
  // precision (the flash kernel indexes the shared heads); the CPU keeps the explicit path below,
  // the oracle.
  if (q.is_cuda() && (q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf))
    return at::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true, std::nullopt,
                                            /*enable_gqa=*/groups > 1);
#endif
  at::Tensor ke = groups > 1 ? k.repeat_interleave(groups, 1) : k;
  at::Tensor ve = groups > 1 ? v.repeat_interleave(groups, 1) : v;
#if TORCH_VERSION_MAJOR >= 2
  // fp32 takes the memory-efficient kernel, which keeps no score matrix but takes no shared
  // heads: asked for grouped-query attention, SDPA would fall back to the kernel that holds every
  // score (seq x seq per head), so k and v are expanded instead (their size is linear in seq).
  if (q.is_cuda()) return at::scaled_dot_product_attention(q, ke, ve, {}, 0.0, /*is_causal=*/true);
#endif
  const int64_t S = q.size(2);
  return MaskedAttention(q, ke, ve, at::ones({S, S}, q.options().dtype(at::kBool)).triu(1));
}

at::Tensor Transformer::DocumentAttention(const at::Tensor& q, const at::Tensor& k,
                                          const at::Tensor& v) const {
  // q: [B, nh, S, D]; k, v: [B, nkv, S, D].
  const int64_t nh = q.size(1), S = q.size(2), nkv = k.size(1);
  const int64_t groups = nh / nkv;
#if TORCH_VERSION_MAJOR >= 2
  if (q.is_cuda() && (q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf)) {
    const int64_t B = q.size(0), D = q.size(3);
    // The flash kernel over the documents as variable-length sequences of the B * S tokens
    // (documents never cross rows), shared kv heads indexed by the kernel itself.
    auto flat = [&](const at::Tensor& t) {
      return t.transpose(1, 2).reshape({B * S, t.size(1), D});
    };
    at::Tensor out = VarlenFlashAttention(flat(q), flat(k), flat(v), documents_.cu_seqlens,
                                          documents_.max_length);
    return out.view({B, S, nh, D}).transpose(1, 2);
  }
#endif
  // Token i sees token j when both are in one document and j <= i.
  const at::Tensor& seg = documents_.segments;
  at::Tensor causal = at::ones({S, S}, seg.options().dtype(at::kBool)).tril();
  at::Tensor allowed =
      (seg.unsqueeze(2) == seg.unsqueeze(1)).logical_and_(causal).unsqueeze(1);  // [B, 1, S, S]
  at::Tensor ke = groups > 1 ? k.repeat_interleave(groups, 1) : k;
  at::Tensor ve = groups > 1 ? v.repeat_interleave(groups, 1) : v;
#if TORCH_VERSION_MAJOR >= 2
  if (q.is_cuda())
    return at::scaled_dot_product_attention(q, ke, ve, allowed, 0.0, /*is_causal=*/false);
#endif
  return MaskedAttention(q, ke, ve, allowed.logical_not());
}

at::Tensor Transformer::Embed(const LayerWeights& w, const at::Tensor& tokens) const {
  at::Tensor h = at::embedding(Get(w, "embed"), tokens);
  if (embed_rounding_ && h.scalar_type() != *embed_rounding_)
    h = h.to(*embed_rounding_).to(h.scalar_type());
  return embed_dtype_ && h.scalar_type() != *embed_dtype_ ? h.to(*embed_dtype_) : h;
}

at::Tensor Transformer::Block(const LayerWeights& w, const at::Tensor& x, int layer) {
  const int64_t B = x.size(0), S = x.size(1);
  const int64_t nh = config_.num_heads, nkv = config_.num_kv_heads, D = config_.head_dim;
  // Module numbers key the dropout masks: the order of core::LoraTargetableModules().
  at::Tensor h = RmsNorm(x, Get(w, "input_norm"));
  at::Tensor q = Proj(w, "q_proj", h, layer, 0).view({B, S, nh, D});
  at::Tensor k = Proj(w, "k_proj", h, layer, 1).view({B, S, nkv, D});
  at::Tensor v = Proj(w, "v_proj", h, layer, 2).view({B, S, nkv, D});
  e4m3_input_ = {};
  at::Tensor cos, sin;
  const bool documents = documents_.defined();
  RopeTables(documents ? std::max(S, documents_.max_position + 1) : S, q, &cos, &sin);
  if (documents) {
    // Each token's own row of the tables, [B * S, D]: the kernels then take the microbatch as one
    // sequence of B * S tokens, and the composite path broadcasts over the heads.
    const at::Tensor rows = documents_.positions.reshape({B * S});
    cos = cos.index_select(0, rows);
    sin = sin.index_select(0, rows);
  }
  auto one_sequence = [&](const at::Tensor& t) {
    return documents ? t.reshape({1, B * S, t.size(2), D}) : t;
  };
  auto per_row = [&](const at::Tensor& t) { return documents ? t.view({B, S, t.size(2), D}) : t; };
  // Qwen3's per-head norm and the rotation in one kernel where the head size allows.
  const bool norm_in_rope = config_.qk_norm && Fused(q) && fused_->HeadNormRopeSupports(D);
  if (config_.qk_norm && !norm_in_rope) {
    q = RmsNorm(q, Get(w, "q_norm"));
    k = RmsNorm(k, Get(w, "k_norm"));
  }
  if (norm_in_rope) {
    // In [B, S, heads, D] order, where the projections left them contiguous; the attention
    // takes the transposed views as they are.
    q = per_row(HeadNormRopeFn::apply(one_sequence(q), Get(w, "q_norm"), cos, sin, fused_,
                                      config_.rms_norm_eps))
            .transpose(1, 2);
    k = per_row(HeadNormRopeFn::apply(one_sequence(k), Get(w, "k_norm"), cos, sin, fused_,
                                      config_.rms_norm_eps))
            .transpose(1, 2);
  } else if (Fused(q)) {
    q = per_row(FusedRopeFn::apply(one_sequence(q), cos, sin, fused_)).transpose(1, 2);
    k = per_row(FusedRopeFn::apply(one_sequence(k), cos, sin, fused_)).transpose(1, 2);
  } else {
    const at::Tensor c = documents ? cos.view({B, 1, S, D}) : cos,
                     s = documents ? sin.view({B, 1, S, D}) : sin;
    q = Rope(q.transpose(1, 2), c, s);
    k = Rope(k.transpose(1, 2), c, s);
  }
  v = v.transpose(1, 2);
  at::Tensor attn =
      (recorded_attention_ ? RecordedAttention(q, k, v, documents_, layer, attention_records_,
                                               write_attention_ && layer >= first_written_)
       : documents         ? DocumentAttention(q, k, v)
                           : Attention(q, k, v))
          .transpose(1, 2)
          .reshape({B, S, nh * D});
  at::Tensor o = Proj(w, "o_proj", attn, layer, 3);
  e4m3_input_ = {};
  const int64_t tokens = B * S, tile = mlp_tile_tokens_;
  const bool sparse = w.count("router") > 0;
  if (sparse || tile <= 0 || tile >= tokens) {
    auto [x1, h2] = AddRmsNorm(x, o, Get(w, "post_norm"));
    return x1 + (sparse ? Experts(w, h2, layer) : Mlp(w, h2, layer, 0));
  }
  // Tiled: the post-attention norm runs inside each tile (NormMlp), so the block does not keep
  // the normed whole-sequence tensor for the backward, only the residual it keeps anyway.
  at::Tensor x1 = x + o;
  at::Tensor flat = x1.reshape({tokens, x1.size(-1)});
  const bool checkpointed = c10::GradMode::is_enabled();
  std::vector<at::Tensor> tiles;
  for (int64_t t0 = 0; t0 < tokens; t0 += tile) {
    at::Tensor part = flat.narrow(0, t0, std::min(tile, tokens - t0));
    // The tile's output must require grad when only the MLP's weights do (adapters on the MLP
    // alone): give the checkpoint an input that does.
    if (checkpointed && !part.requires_grad()) part = part.detach().requires_grad_(true);
    tiles.push_back(checkpointed ? MlpTileFn::apply(part, this, &w, static_cast<int64_t>(layer), t0)
                                 : NormMlp(w, part, layer, t0));
  }
  return x1 + at::cat(tiles).view(x1.sizes());
}

namespace {
// One adapter on stacked expert tensors, viewed per expert (core::ParamSpec::experts' layout).
struct ExpertAdapter {
  at::Tensor a_stacked;  // [E, r, in]: lora_A's rows, expert-major
  at::Tensor b_stacked;  // [out, r, E]: lora_B's columns, rank-major
  bool defined() const { return a_stacked.defined(); }
  // Views taken once, so autograd stacks the experts' gradients into one tensor.
  std::vector<at::Tensor> PerExpertA() const {
    return defined() ? a_stacked.unbind(0) : std::vector<at::Tensor>{};
  }
  std::vector<at::Tensor> PerExpertB() const {
    return defined() ? b_stacked.unbind(2) : std::vector<at::Tensor>{};
  }
};

ExpertAdapter ExpertLora(const LayerWeights& w, const std::string& role, int64_t experts) {
  auto a = w.find(role + ".lora_A");
  if (a == w.end()) return {};
  const at::Tensor& b = Get(w, role + ".lora_B");
  const int64_t rank = a->second.size(0) / experts;
  return {a->second.view({experts, rank, a->second.size(1)}), b.view({b.size(0), rank, experts})};
}
}  // namespace

at::Tensor Transformer::Experts(const LayerWeights& w, const at::Tensor& h, int layer) {
  const int64_t H = h.size(-1), E = config_.moe.num_experts, k = config_.moe.experts_per_token;
  const int64_t I = config_.moe.expert_intermediate_size;
  at::Tensor flat = h.reshape({-1, H});
  // Routing as transformers: softmax in fp32 over every expert, the top k kept (in order of
  // probability), renormalized to sum 1 when norm_topk_prob, then in the compute dtype.
  at::Tensor probs = at::softmax(at::linear(flat, Get(w, "router")).to(at::kFloat), -1);
  if (router_aux_grad_.defined() && probs.requires_grad())
    probs = AddRowGradFn::apply(probs, router_aux_grad_);
  auto [top, chosen] = at::topk(probs, k, -1);
  if (config_.moe.norm_topk_prob) top = top / top.sum(-1, /*keepdim=*/true);
  top = top.to(h.scalar_type());
  if (routing_ != nullptr) (*routing_)[layer] = chosen.to(at::kCPU);
  // The (token, choice) pairs grouped by expert, tokens in order within an expert: each expert
  // runs once over a contiguous block of its tokens.
  at::Tensor expert_of = chosen.reshape({-1});
  at::Tensor order =
      std::get<1>(at::sort(expert_of, /*stable=*/true, /*dim=*/0, /*descending=*/false));
  at::Tensor token = at::div(order, k, "floor");
  at::Tensor on_device = at::bincount(expert_of, {}, E);
  if (config_.moe.aux_loss_weight > 0.0) {
    c10::NoGradGuard no_grad;
    router_stats_[layer] =
        at::stack({on_device.to(at::kDouble), probs.sum(0).to(at::kDouble)}).to(at::kCPU);
  }
  at::Tensor x = flat.index_select(0, token);
  at::Tensor scale = top.reshape({-1}).index_select(0, order).unsqueeze(1);
  // Adapters on the stacked expert tensors (PEFT's layout, core::ParamSpec::experts): expert e's
  // A is rows e*r .. e*r+r-1 of lora_A, its B the columns k*E + e of lora_B. PEFT adds s B_e A_e
  // to W_e before the product; x (W_e + s B_e A_e)^T = x W_e^T + s (x A_e^T) B_e^T is the same
  // function at rank-r cost.
  const ExpertAdapter gate_up_lora = ExpertLora(w, "experts.gate_up", E);
  const ExpertAdapter down_lora = ExpertLora(w, "experts.down", E);
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 8)
  // Grouped: the rows of each expert are contiguous (the stable sort), so one GEMM per projection
  // takes every expert at once, each row block with its own expert's matrix (group ends `offs`);
  // the counts never leave the device. Its kernels take bf16 with rows of 16-byte multiples.
  // Trained experts (a full fine-tune) enter through EmptyExpertsZeroGradFn: an expert without
  // tokens gets exactly zero gradient whatever the kernel leaves for an empty group.
  // Expert adapters join the grouped GEMMs when their rank's rows are 16-byte multiples.
  const ExpertAdapter& any_lora = gate_up_lora.defined() ? gate_up_lora : down_lora;
  const bool adapters_align = !any_lora.defined() || any_lora.a_stacked.size(1) % 8 == 0;
  if (grouped_experts_ && adapters_align && x.is_cuda() && x.scalar_type() == at::kBFloat16 &&
      H % 8 == 0 && I % 8 == 0) {
    const at::Tensor offs = at::cumsum(on_device, 0, at::kInt);
    const at::Tensor has_tokens = on_device.gt(0);
    auto grouped = [&](const at::Tensor& in, const at::Tensor& weight, const ExpertAdapter& a) {
      const at::Tensor used =
          weight.requires_grad() ? EmptyExpertsZeroGradFn::apply(weight, has_tokens) : weight;
      at::Tensor out = at::_grouped_mm(in, used.transpose(-2, -1), offs);
      if (!a.defined()) return out;
      // An expert without tokens must get exactly zero adapter gradients; the kernel's gradient
      // for an empty group is not guaranteed on every architecture, so those experts' matrices
      // enter through a select whose backward is exactly zero there (no rows read them).
      const at::Tensor zero = at::zeros({}, a.a_stacked.options());
      at::Tensor a_used = at::where(has_tokens.view({-1, 1, 1}), a.a_stacked, zero);
      at::Tensor b_used = at::where(has_tokens.view({1, 1, -1}), a.b_stacked, zero);
      // A^T [E, in, r] and B^T [E, r, out], each expert's matrix in one block.
      at::Tensor low = at::_grouped_mm(in, a_used.transpose(-2, -1), offs);
      return out + at::_grouped_mm(low, b_used.permute({2, 1, 0}).contiguous(), offs) * lora_scale_;
    };
    at::Tensor gu = grouped(x, Get(w, "experts.gate_up"), gate_up_lora);
    at::Tensor gate = gu.narrow(-1, 0, I), up = gu.narrow(-1, I, I);
    at::Tensor act = Fused(gate) ? SwiGluFn::apply(gate.contiguous(), up.contiguous(), fused_)
                                 : at::silu(gate) * up;
    at::Tensor y = grouped(act.contiguous(), Get(w, "experts.down"), down_lora) * scale;
    return at::zeros_like(flat).index_add(0, token, y).view(h.sizes());
  }
#endif
  at::Tensor counts = on_device.to(at::kCPU);
  // One view per expert, taken once: autograd then stacks the experts' gradients into one
  // tensor (zeros for an expert without tokens) instead of a full-size gradient per view.
  const std::vector<at::Tensor> gate_up = Get(w, "experts.gate_up").unbind(0);
  const std::vector<at::Tensor> down = Get(w, "experts.down").unbind(0);
  std::vector<at::Tensor> outs;
  int64_t begin = 0;
  const int64_t* n = counts.data_ptr<int64_t>();
  const std::vector<at::Tensor> gate_up_a = gate_up_lora.PerExpertA(),
                                gate_up_b = gate_up_lora.PerExpertB();
  const std::vector<at::Tensor> down_a = down_lora.PerExpertA(), down_b = down_lora.PerExpertB();
  auto project = [&](const at::Tensor& in, const at::Tensor& weight,
                     const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b,
                     int64_t e) {
    at::Tensor out = at::linear(in, weight);
    if (a.empty()) return out;
    return out + at::linear(at::linear(in, a[e]), b[e]) * lora_scale_;
  };
  for (int64_t e = 0; e < E; ++e) {
    if (n[e] == 0) continue;
    at::Tensor gu = project(x.narrow(0, begin, n[e]), gate_up[e], gate_up_a, gate_up_b, e);
    at::Tensor gate = gu.narrow(-1, 0, I), up = gu.narrow(-1, I, I);
    at::Tensor act = Fused(gate) ? SwiGluFn::apply(gate.contiguous(), up.contiguous(), fused_)
                                 : at::silu(gate) * up;
    outs.push_back(project(act, down[e], down_a, down_b, e));
    begin += n[e];
  }
  at::Tensor y = at::cat(outs) * scale;
  return at::zeros_like(flat).index_add(0, token, y).view(h.sizes());
}

at::Tensor Transformer::RouterStats(int layer) const {
  auto it = router_stats_.find(layer);
  if (it == router_stats_.end())
    throw std::invalid_argument("no router statistics for layer " + std::to_string(layer) +
                                " (not a sparse block, or the load-balancing loss is off)");
  return it->second;
}

RouterAux Transformer::WholeModelRouterAux(int64_t tokens, double weight) const {
  const int64_t E = config_.moe.num_experts;
  std::vector<double> sums(static_cast<size_t>(2 * E));
  int64_t blocks = 0;
  for (int64_t b = 0; b < config_.num_layers; ++b) {
    if (!core::SparseBlock(config_, b)) continue;
    const at::Tensor s = RouterStats(static_cast<int>(b) + 1).contiguous();
    for (int64_t i = 0; i < 2 * E; ++i) sums[static_cast<size_t>(i)] += s.data_ptr<double>()[i];
    ++blocks;
  }
  return RouterAuxLoss(sums.data(), sums.data() + E, E, blocks * tokens, weight);
}

RouterAux RouterAuxLoss(const double* choices, const double* prob_sums, int64_t experts,
                        int64_t rows, double weight) {
  RouterAux r;
  const double n = static_cast<double>(rows), e = static_cast<double>(experts);
  double dot = 0.0;
  r.grad.resize(static_cast<size_t>(experts));
  for (int64_t i = 0; i < experts; ++i) {
    dot += choices[i] * prob_sums[i];
    r.grad[static_cast<size_t>(i)] = static_cast<float>(weight * e * choices[i] / (n * n));
  }
  r.value = weight * e * dot / (n * n);
  return r;
}

HeadResult Transformer::HeadForwardBackward(const LayerWeights& w, const at::Tensor& x,
                                            const at::Tensor& labels, double loss_scale,
                                            bool backward, bool defer_read) {
  HeadResult r;
  const at::Tensor& lm_head = Get(w, "lm_head");
  at::Tensor h = RmsNorm(x, Get(w, "final_norm"));
  // Cut the graph after the norm: each chunk's logits are created, backpropagated into h_leaf
  // and the head weight, and freed before the next chunk. One backward through the norm follows.
  at::Tensor h_leaf = h.detach().requires_grad_(backward);
  at::Tensor flat = h_leaf.reshape({-1, h.size(-1)});
  at::Tensor flat_labels = labels.reshape({-1});
  if (Fused(flat)) {
    HeadResult fused = FusedHead(flat, flat_labels, lm_head, loss_scale, backward, defer_read);
    if (backward) h.backward(h_leaf.grad());
    return fused;
  }
  const int64_t n = flat.size(0);
  for (int64_t c0 = 0; c0 < n; c0 += loss_chunk_tokens_) {
    const int64_t len = std::min(loss_chunk_tokens_, n - c0);
    at::Tensor lab = flat_labels.narrow(0, c0, len);
    at::Tensor logits = at::linear(flat.narrow(0, c0, len), lm_head).to(at::kFloat);
    at::Tensor ce = at::cross_entropy_loss(logits, lab, {}, at::Reduction::Sum, -100);
    r.loss_sum += ce.item<double>();
    r.targets += lab.ne(-100).sum().item<int64_t>();
    if (backward) (ce * loss_scale).backward();
  }
  if (backward) h.backward(h_leaf.grad());
  return r;
}

// The fused loss: per chunk, the logits in the compute dtype are overwritten by their gradient
// (no fp32 copy, no softmax tensors) and handed to the projection's backward; losses stay on the
// device until the end of the head (read once per head, or, deferred, once the microbatch is done).
HeadResult Transformer::FusedHead(const at::Tensor& flat, const at::Tensor& flat_labels,
                                  const at::Tensor& lm_head, double loss_scale, bool backward,
                                  bool defer_read) const {
  const int64_t n = flat.size(0);
  std::vector<at::Tensor> chunk_sums;
  for (int64_t c0 = 0; c0 < n; c0 += loss_chunk_tokens_) {
    const int64_t len = std::min(loss_chunk_tokens_, n - c0);
    at::Tensor lab = flat_labels.narrow(0, c0, len).contiguous();
    at::Tensor logits = Linear(flat.narrow(0, c0, len), lm_head);
    // The projection's backward reads its input and weight, never its output, so the output's
    // storage can carry the gradient.
    at::Tensor buffer = logits.detach();
    at::Tensor row_loss = fused_->CrossEntropyInPlace(buffer, lab, loss_scale, backward);
    chunk_sums.push_back(row_loss.to(at::kDouble).sum());
    if (backward) logits.backward(buffer);
  }
  HeadResult r;
  at::Tensor loss_sum = at::stack(chunk_sums).sum();
  at::Tensor targets = flat_labels.ne(-100).sum();
  if (defer_read) {
    r.pending = at::stack({loss_sum, targets.to(at::kDouble)});  // exact: counts < 2^53
    return r;
  }
  r.loss_sum = loss_sum.item<double>();
  r.targets = targets.item<int64_t>();
  return r;
}

}  // namespace rp::model
