// SPDX-License-Identifier: Apache-2.0
#include "model/recorded_attention.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cmath>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace rp::model {

int64_t AttentionRecord::Bytes() const {
  int64_t n = 0;
  for (const at::Tensor* t : {&out, &lse})
    if (t->defined()) n += static_cast<int64_t>(t->nbytes());
  for (const auto& t : kernel_state)
    if (t.defined()) n += static_cast<int64_t>(t.nbytes());
  return n;
}

namespace {

// kVarlen*: the variable-length kernels over [tokens, heads, D] (documents, and what SDPA would not
// run fused); kSdpa*: the kernel scaled_dot_product_attention itself picks for [B, heads, S, D]
// inputs (at::_fused_sdp_choice), called as it calls it, so a recorded job computes the values and
// at the speed of the job without records.
enum class Kernel : int64_t {
  kVarlenFlash = 0,
  kVarlenEfficient = 1,
  kMath = 2,
  kSdpaFlash = 3,
  kSdpaEfficient = 4,
  kSdpaCudnn = 5,
};

// Calls a LibTorch operator through the dispatcher with its arguments by name, so that arguments
// a later LibTorch added or renamed take their schema's defaults (an argument missing here
// without a default is an error naming it). `args` may hold aliases the schema does not use.
std::vector<c10::IValue> CallByName(const char* name,
                                    const std::map<std::string, c10::IValue>& args) {
  const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
  torch::jit::Stack stack;
  for (const auto& a : op.schema().arguments()) {
    auto it = args.find(a.name());
    if (it != args.end()) {
      stack.push_back(it->second);
    } else if (a.default_value()) {
      stack.push_back(*a.default_value());
    } else {
      std::ostringstream schema;
      schema << op.schema();
      throw std::runtime_error(std::string(name) + ": no value for its argument " + a.name() +
                               " (" + schema.str() + ")");
    }
  }
  op.callBoxed(&stack);
  return stack;
}

// What one call's kernel needs besides q, k and v, in the layouts RecordedAttention prepares:
// varlen flash q [T, nh, D], k and v [T, nkv, D]; varlen efficient [1, T, nh, D] each; math and
// SDPA's kernels [B, heads, S, D] (SDPA's as its caller passes them).
struct Call {
  Kernel kernel = Kernel::kMath;
  at::Tensor cu;        // CUDA: [sequences + 1] int32 starts over the T = B x S tokens
  int64_t max_len = 0;  // CUDA: the longest sequence
  at::Tensor blocked;   // math: true where a query may not see a key (broadcast to the scores)
  double scale = 1.0;
};

at::Tensor MathScores(const Call& c, const at::Tensor& q, const at::Tensor& k) {
  at::Tensor s = at::matmul(q, k.transpose(-2, -1)).to(at::kFloat) * c.scale;
  return s.masked_fill(c.blocked, -std::numeric_limits<float>::infinity());
}

AttentionRecord KernelForward(const Call& c, const at::Tensor& q, const at::Tensor& k,
                              const at::Tensor& v) {
  AttentionRecord r;
  r.kernel = static_cast<int64_t>(c.kernel);
  switch (c.kernel) {
    case Kernel::kVarlenFlash: {
      auto out = CallByName("aten::_flash_attention_forward", {{"query", q},
                                                               {"key", k},
                                                               {"value", v},
                                                               {"cum_seq_q", c.cu},
                                                               {"cum_seq_k", c.cu},
                                                               {"max_q", c.max_len},
                                                               {"max_k", c.max_len},
                                                               {"dropout_p", 0.0},
                                                               {"is_causal", true},
                                                               {"return_debug_mask", false}});
      r.out = out.at(0).toTensor();
      r.lse = out.at(1).toTensor();
      r.kernel_state = {out.at(2).toTensor(), out.at(3).toTensor()};
      break;
    }
    case Kernel::kVarlenEfficient: {
      auto out = CallByName("aten::_efficient_attention_forward",
                            {{"query", q},
                             {"key", k},
                             {"value", v},
                             {"bias", c10::IValue()},
                             {"cu_seqlens_q", c.cu},
                             {"cu_seqlens_k", c.cu},
                             {"max_seqlen_q", c.max_len},
                             {"max_seqlen_k", c.max_len},
                             {"dropout_p", 0.0},
                             {"custom_mask_type", static_cast<int64_t>(1)},  // causal
                             {"compute_log_sumexp", true}});
      r.out = out.at(0).toTensor();
      r.lse = out.at(1).toTensor();
      r.kernel_state = {out.at(2).toTensor(), out.at(3).toTensor()};
      break;
    }
    case Kernel::kSdpaFlash:
    case Kernel::kSdpaCudnn: {
      const bool cudnn = c.kernel == Kernel::kSdpaCudnn;
      auto out = cudnn ? CallByName("aten::_scaled_dot_product_cudnn_attention",
                                    {{"query", q},
                                     {"key", k},
                                     {"value", v},
                                     {"attn_bias", c10::IValue()},
                                     {"compute_log_sumexp", true},
                                     {"dropout_p", 0.0},
                                     {"is_causal", true},
                                     {"return_debug_mask", false}})
                       : CallByName("aten::_scaled_dot_product_flash_attention",
                                    {{"query", q},
                                     {"key", k},
                                     {"value", v},
                                     {"dropout_p", 0.0},
                                     {"is_causal", true},
                                     {"return_debug_mask", false}});
      // (output, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, philox_seed, philox_offset, ...)
      r.out = out.at(0).toTensor();
      r.lse = out.at(1).toTensor();
      r.kernel_state = {out.at(2).toTensor(), out.at(3).toTensor(), out.at(6).toTensor(),
                        out.at(7).toTensor()};
      r.max_q = out.at(4).toInt();
      r.max_k = out.at(5).toInt();
      break;
    }
    case Kernel::kSdpaEfficient: {
      auto out =
          CallByName("aten::_scaled_dot_product_efficient_attention", {{"query", q},
                                                                       {"key", k},
                                                                       {"value", v},
                                                                       {"attn_bias", c10::IValue()},
                                                                       {"compute_log_sumexp", true},
                                                                       {"dropout_p", 0.0},
                                                                       {"is_causal", true}});
      r.out = out.at(0).toTensor();
      r.lse = out.at(1).toTensor();
      r.kernel_state = {out.at(2).toTensor(), out.at(3).toTensor()};
      break;
    }
    case Kernel::kMath: {
      at::Tensor s = MathScores(c, q, k);
      r.lse = at::logsumexp(s, -1, /*keepdim=*/true);
      r.out = at::matmul(at::exp(s - r.lse).to(q.scalar_type()), v);
      break;
    }
  }
  return r;
}

// {dq, dk, dv} from the output's gradient `dout` (the layout of r.out).
std::vector<at::Tensor> KernelBackward(const Call& c, const at::Tensor& q, const at::Tensor& k,
                                       const at::Tensor& v, const AttentionRecord& r,
                                       const at::Tensor& dout) {
  switch (c.kernel) {
    case Kernel::kVarlenFlash: {
      const at::Tensor& seed = r.kernel_state.at(0);
      const at::Tensor& offset = r.kernel_state.at(1);
      auto out = CallByName("aten::_flash_attention_backward", {{"grad_out", dout.contiguous()},
                                                                {"query", q},
                                                                {"key", k},
                                                                {"value", v},
                                                                {"out", r.out},
                                                                {"logsumexp", r.lse},
                                                                {"cum_seq_q", c.cu},
                                                                {"cum_seq_k", c.cu},
                                                                {"max_q", c.max_len},
                                                                {"max_k", c.max_len},
                                                                {"dropout_p", 0.0},
                                                                {"is_causal", true},
                                                                {"philox_seed", seed},
                                                                {"rng_state", seed},
                                                                {"philox_offset", offset},
                                                                {"unused", offset}});
      return {out.at(0).toTensor(), out.at(1).toTensor(), out.at(2).toTensor()};
    }
    case Kernel::kVarlenEfficient: {
      auto out = CallByName("aten::_efficient_attention_backward",
                            {{"grad_out_", dout.contiguous()},
                             {"grad_out", dout.contiguous()},
                             {"query", q},
                             {"key", k},
                             {"value", v},
                             {"bias", c10::IValue()},
                             {"out", r.out},
                             {"cu_seqlens_q", c.cu},
                             {"cu_seqlens_k", c.cu},
                             {"max_seqlen_q", c.max_len},
                             {"max_seqlen_k", c.max_len},
                             {"logsumexp", r.lse},
                             {"dropout_p", 0.0},
                             {"philox_seed", r.kernel_state.at(0)},
                             {"philox_offset", r.kernel_state.at(1)},
                             {"custom_mask_type", static_cast<int64_t>(1)},
                             {"bias_requires_grad", false}});
      return {out.at(0).toTensor(), out.at(1).toTensor(), out.at(2).toTensor()};
    }
    case Kernel::kSdpaFlash: {
      const auto& st = r.kernel_state;  // cum_seq_q, cum_seq_k, philox_seed, philox_offset
      auto out = CallByName("aten::_scaled_dot_product_flash_attention_backward",
                            {{"grad_out", dout},
                             {"query", q},
                             {"key", k},
                             {"value", v},
                             {"out", r.out},
                             {"logsumexp", r.lse},
                             {"cum_seq_q", st.at(0)},
                             {"cum_seq_k", st.at(1)},
                             {"max_q", r.max_q},
                             {"max_k", r.max_k},
                             {"dropout_p", 0.0},
                             {"is_causal", true},
                             {"philox_seed", st.at(2)},
                             {"philox_offset", st.at(3)}});
      return {out.at(0).toTensor(), out.at(1).toTensor(), out.at(2).toTensor()};
    }
    case Kernel::kSdpaCudnn: {
      const auto& st = r.kernel_state;
      auto out = CallByName("aten::_scaled_dot_product_cudnn_attention_backward",
                            {{"grad_out", dout},
                             {"query", q},
                             {"key", k},
                             {"value", v},
                             {"out", r.out},
                             {"logsumexp", r.lse},
                             {"philox_seed", st.at(2)},
                             {"philox_offset", st.at(3)},
                             {"attn_bias", at::Tensor()},
                             {"cum_seq_q", st.at(0)},
                             {"cum_seq_k", st.at(1)},
                             {"max_q", r.max_q},
                             {"max_k", r.max_k},
                             {"dropout_p", 0.0},
                             {"is_causal", true}});
      return {out.at(0).toTensor(), out.at(1).toTensor(), out.at(2).toTensor()};
    }
    case Kernel::kSdpaEfficient: {
      auto out = CallByName("aten::_scaled_dot_product_efficient_attention_backward",
                            {{"grad_out_", dout},
                             {"query", q},
                             {"key", k},
                             {"value", v},
                             {"attn_bias", at::Tensor()},
                             {"out", r.out},
                             {"logsumexp", r.lse},
                             {"philox_seed", r.kernel_state.at(0)},
                             {"philox_offset", r.kernel_state.at(1)},
                             {"dropout_p", 0.0},
                             {"grad_input_mask", c10::List<bool>({true, true, true, false})},
                             {"is_causal", true}});
      return {out.at(0).toTensor(), out.at(1).toTensor(), out.at(2).toTensor()};
    }
    case Kernel::kMath: {
      // The softmax's backward from the probabilities rebuilt with the kept log-sum-exp:
      // dS = P (dP - rowsum(dO o O)), dP = dO V^T; fp32 throughout, as the forward's softmax.
      const at::ScalarType dt = q.scalar_type();
      at::Tensor p = at::exp(MathScores(c, q, k) - r.lse);
      at::Tensor dv = at::matmul(p.to(dt).transpose(-2, -1), dout);
      at::Tensor dp = at::matmul(dout, v.transpose(-2, -1)).to(at::kFloat);
      at::Tensor delta = (dout.to(at::kFloat) * r.out.to(at::kFloat)).sum(-1, /*keepdim=*/true);
      at::Tensor ds = (p * (dp - delta)).to(dt);
      return {at::matmul(ds, k) * c.scale, at::matmul(ds.transpose(-2, -1), q) * c.scale, dv};
    }
  }
  throw std::logic_error("RecordedAttention: unknown kernel");
}

// The forward from a record when one is given (moved from), else from the kernel; the backward
// from the kernel's backward on what the forward kept.
struct RecordedAttentionFn : public torch::autograd::Function<RecordedAttentionFn> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q,
                            const at::Tensor& k, const at::Tensor& v, const Call* call,
                            AttentionRecord* given) {
    AttentionRecord r = given != nullptr ? std::move(*given) : KernelForward(*call, q, k, v);
    std::vector<at::Tensor> saved = {q, k, v, r.out, r.lse, call->cu, call->blocked};
    for (auto& t : r.kernel_state) saved.push_back(t);
    ctx->save_for_backward(saved);
    ctx->saved_data["kernel"] = r.kernel;
    ctx->saved_data["max_q"] = r.max_q;
    ctx->saved_data["max_k"] = r.max_k;
    ctx->saved_data["max_len"] = call->max_len;
    ctx->saved_data["scale"] = call->scale;
    return r.out;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto s = ctx->get_saved_variables();
    Call c;
    c.kernel = static_cast<Kernel>(ctx->saved_data["kernel"].toInt());
    c.max_len = ctx->saved_data["max_len"].toInt();
    c.scale = ctx->saved_data["scale"].toDouble();
    c.cu = s[5];
    c.blocked = s[6];
    AttentionRecord r;
    r.out = s[3];
    r.lse = s[4];
    r.max_q = ctx->saved_data["max_q"].toInt();
    r.max_k = ctx->saved_data["max_k"].toInt();
    r.kernel_state.assign(s.begin() + 7, s.end());
    auto g = KernelBackward(c, s[0], s[1], s[2], r, grads[0]);
    return {g[0], g[1], g[2], at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor RecordedAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const Documents& documents, int layer, AttentionRecords* records,
                             bool write) {
  const int64_t B = q.size(0), nh = q.size(1), S = q.size(2), D = q.size(3);
  const int64_t groups = nh / k.size(1);
  Call c;
  c.scale = 1.0 / std::sqrt(static_cast<double>(D));
  at::Tensor qk, kk, vk;  // q, k, v in the kernel's layout
  if (q.is_cuda()) {
    const bool half = q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf;
    auto expanded = [&](const at::Tensor& t) {
      return groups > 1 ? t.repeat_interleave(groups, 1) : t;
    };
    if (!documents.defined()) {
      // What Transformer::Attention passes scaled_dot_product_attention, and the kernel it picks.
      qk = q;
      kk = half ? k : expanded(k);
      vk = half ? v : expanded(v);
      const int64_t choice =
          CallByName("aten::_fused_sdp_choice", {{"query", qk},
                                                 {"key", kk},
                                                 {"value", vk},
                                                 {"attn_mask", c10::IValue()},
                                                 {"dropout_p", 0.0},
                                                 {"is_causal", true},
                                                 {"enable_gqa", half && groups > 1}})
              .at(0)
              .toInt();
      // at::_fused_sdp_choice's numbers (sdp::SDPBackend): 1 flash, 2 efficient, 3 cuDNN.
      if (choice == 1) c.kernel = Kernel::kSdpaFlash;
      if (choice == 2) c.kernel = Kernel::kSdpaEfficient;
      if (choice == 3) c.kernel = Kernel::kSdpaCudnn;
    }
    if (c.kernel == Kernel::kMath) {  // documents, or no fused kernel for these inputs
      c.kernel = half ? Kernel::kVarlenFlash : Kernel::kVarlenEfficient;
      if (documents.defined()) {
        c.cu = documents.cu_seqlens;
        c.max_len = documents.max_length;
      } else {
        c.cu = at::arange(0, (B + 1) * S, S, q.options().dtype(at::kInt));
        c.max_len = S;
      }
      // [B, h, S, D] views of [B, S, h, D] tensors back to the tokens' order.
      auto tokens = [&](const at::Tensor& t) {
        return t.transpose(1, 2).reshape({B * S, t.size(1), D});
      };
      qk = half ? tokens(q) : tokens(q).unsqueeze(0);
      kk = half ? tokens(k) : tokens(expanded(k)).unsqueeze(0);
      vk = half ? tokens(v) : tokens(expanded(v)).unsqueeze(0);
    }
  } else {
    at::Tensor causal = at::ones({S, S}, q.options().dtype(at::kBool)).tril();
    if (documents.defined()) {
      const at::Tensor& seg = documents.segments;
      c.blocked = (seg.unsqueeze(2) == seg.unsqueeze(1))
                      .logical_and_(causal)
                      .logical_not_()
                      .unsqueeze(1);  // [B, 1, S, S]
    } else {
      c.blocked = causal.logical_not();
    }
    qk = q;
    kk = groups > 1 ? k.repeat_interleave(groups, 1) : k;
    vk = groups > 1 ? v.repeat_interleave(groups, 1) : v;
  }
  auto as_heads = [&](const at::Tensor& out) {
    const bool varlen = c.kernel == Kernel::kVarlenFlash || c.kernel == Kernel::kVarlenEfficient;
    return varlen ? out.view({B, S, nh, D}).transpose(1, 2) : out;
  };
  auto found = records != nullptr ? records->find(layer) : AttentionRecords::iterator();
  const bool recorded = records != nullptr && found != records->end();
  if (!c10::GradMode::is_enabled()) {
    if (recorded && !write) return as_heads(found->second.out);
    AttentionRecord r = KernelForward(c, qk, kk, vk);
    at::Tensor out = r.out;
    if (records != nullptr && write) (*records)[layer] = std::move(r);
    return as_heads(out);
  }
  AttentionRecord taken;
  if (recorded) {
    taken = std::move(found->second);
    records->erase(found);
  }
  return as_heads(RecordedAttentionFn::apply(qk, kk, vk, &c, recorded ? &taken : nullptr));
}

}  // namespace rp::model
