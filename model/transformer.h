// SPDX-License-Identifier: Apache-2.0
// Transformer math for one pipeline layer at a time (Llama, Qwen2, Qwen3, Qwen3-MoE and Mistral
// decoders).
//
// Contract:
//  * Stateless with respect to weights: every call receives the layer's weights (LayerWeights,
//    keyed by core::ParamUse::role). The same functions run in rp-worker (per stage job) and in
//    rp-train-ref (whole model), which is what makes the reference an oracle for the pipeline.
//  * Tensors may live on any device; the math follows its inputs. Activations are
//    [batch, seq, hidden] in the compute dtype; normalization and softmax run in fp32.
//  * HeadForwardBackward runs final norm + LM head + cross-entropy in chunks of tokens and, when
//    asked, backpropagates each chunk at once, so full [tokens, vocab] logits never exist.
//  * A projection whose weights include "<role>.bias" adds it (x W^T + b: Qwen2's q/k/v, Llama's
//    attention_bias and mlp_bias).
//  * LoRA: a projection whose weights include "<role>.lora_A" and "<role>.lora_B" computes
//    x W^T (+ b) + scale * drop(x) A^T B^T (PEFT's order of operations). The dropout mask comes
//    from a counter-based hash of (SetDropoutKey's key, layer, module, element), computed with
//    integer tensor ops on the tensor's own device: the forward stage, the recompute and
//    rp-train-ref draw the same mask without sharing a generator.
//  * Expert LoRA: a sparse block whose weights include "experts.gate_up.lora_A"/"_B" (or
//    "experts.down.*") adds scale * (x A_e^T) B_e^T to expert e's product, A_e and B_e cut from
//    the stacked matrices as core::ParamSpec::experts lays them out; PEFT merges s B_e A_e into
//    W_e first, the same function. No dropout there (the job refuses it, as PEFT does).
//  * Not thread-safe (a small RoPE table cache); one instance per thread.
#pragma once

#include <ATen/ATen.h>

#include <map>
#include <optional>
#include <string>

#include "config/job_config.h"
#include "model/documents.h"
#include "model/fused_kernels.h"
#include "model/recorded_attention.h"

namespace rp::model {

using LayerWeights = std::map<std::string, at::Tensor>;

struct HeadResult {
  double loss_sum = 0.0;  // summed token cross-entropy (unscaled)
  int64_t targets = 0;    // labels != -100
  // With a deferred read on the fused path: (loss_sum, targets) as a float64 [2] tensor on the
  // device, not yet read (loss_sum and targets above are then 0); undefined otherwise.
  at::Tensor pending;
};

// One microbatch's router load-balancing loss from its statistics summed over its sparse blocks
// (`choices` and `prob_sums`: Transformer::RouterStats' two rows, `experts` values each), as
// transformers computes it over one forward: experts x sum_e (choices_e / rows) (prob_sums_e /
// rows), rows = sparse blocks x tokens; `weight` multiplies it (core::RouterAuxWeight). `grad`
// is the weighted loss's gradient with respect to each row's probabilities (the choices count
// as constants): weight x experts x choices_e / rows^2.
struct RouterAux {
  double value = 0.0;
  std::vector<float> grad;
};
RouterAux RouterAuxLoss(const double* choices, const double* prob_sums, int64_t experts,
                        int64_t rows, double weight);

class Transformer {
 public:
  explicit Transformer(const core::ModelConfig& config, int64_t loss_chunk_tokens = 4096,
                       const core::LoraConfig& lora = core::LoraConfig{});

  // The key of the next microbatch's LoRA dropout masks (see DropoutKey); unused without dropout.
  void SetDropoutKey(uint64_t key) { dropout_key_ = key; }
  uint64_t dropout_key() const { return dropout_key_; }
  // The documents of the next microbatch (model/documents.h): each block's attention stays
  // inside a document and its RoPE positions come from Documents::positions. Undefined (the
  // default): one causal sequence per row at positions 0..seq-1. On a CUDA bf16/fp16 tensor the
  // attention is the variable-length flash kernel over the documents (no seq x seq mask); fp32
  // and the CPU mask the scores.
  void SetDocuments(Documents documents) { documents_ = std::move(documents); }
  // Off for evaluation: no dropout (as a model in eval mode).
  void SetTraining(bool training) { training_ = training; }
  // Dense blocks' post-attention norm and MLP over the microbatch's tokens (flattened, in order)
  // `tokens` at a time; 0: all at once. With autograd each tile is checkpointed: its forward
  // keeps only its input (the residual after attention), and the backward recomputes the tile
  // (same weights, same LoRA dropout masks: a tile's mask is its slice of the untiled one) and
  // backpropagates through it, its weight gradients going where the untiled block's go. So a
  // tiled block keeps neither the MLP's intermediates nor the normed sequence. The same values up
  // to the rounding of the weight gradients' sums (and, with the fused kernels, of the residual
  // sum, which the untiled block's fused add-and-norm keeps in fp32 for its norm).
  void SetMlpTileTokens(int64_t tokens) { mlp_tile_tokens_ = tokens; }
  // schedule.keep_attention: every block's attention runs through RecordedAttention
  // (model/recorded_attention.h), whose backward needs no forward. Off: the kernels above.
  void UseRecordedAttention(bool on) { recorded_attention_ = on; }
  // Where that attention keeps its records by layer (without autograd and `write`: stores those
  // of layers from `first_written` on; otherwise reads them); null: nowhere. Not owned; must
  // outlive its use.
  void SetAttentionRecords(AttentionRecords* records, bool write, int first_written = 0) {
    attention_records_ = records;
    write_attention_ = write;
    first_written_ = first_written;
  }
  bool HasAttentionRecord(int layer) const {
    return attention_records_ != nullptr && attention_records_->count(layer) > 0;
  }
  // A dense block's MLP on h (any leading shape, tokens in flattened order starting at token
  // `first_token` of the microbatch, which keys the LoRA dropout masks).
  at::Tensor Mlp(const LayerWeights& w, const at::Tensor& h, int layer, int64_t first_token);
  // Mlp of the post-attention norm of x1 (the residual stream after attention): one tile's work.
  at::Tensor NormMlp(const LayerWeights& w, const at::Tensor& x1, int layer, int64_t first_token);
  // When set, each sparse block stores the experts every token chose ([tokens, k] int64 on the
  // CPU, in order of probability) under its pipeline layer index; for tests. Not owned.
  void RecordRouting(std::map<int, at::Tensor>* routing) { routing_ = routing; }
  // The routers' load-balancing loss (core::MoeConfig::aux_loss_weight > 0). Its gradient with
  // respect to a token's router probabilities is one vector over the experts for every token
  // of every sparse block of the microbatch, and that vector needs the whole forward's choices
  // (RouterAuxLoss), so the pipeline splits the work:
  //  * every sparse block run keeps its microbatch's statistics: fp64 [2, experts] on the CPU,
  //    how many (token, slot) choices went to each expert and the summed probabilities
  //    (RouterStats(layer), the last run of that pipeline layer);
  //  * while an aux gradient is set ([experts] fp32 on the activations' device), each sparse
  //    block run with autograd adds it to its probabilities' gradient in the backward. The values
  //    are read when the backward runs, so the caller may fill the tensor in place after the
  //    forward (a fused tail does: its own blocks' choices are part of the sum).
  at::Tensor RouterStats(int layer) const;
  void SetRouterAuxGrad(at::Tensor grad) { router_aux_grad_ = std::move(grad); }
  // RouterAuxLoss over every sparse block's last run, for a caller that ran the whole model on
  // one microbatch of `tokens` tokens (rp-train-ref, tests).
  RouterAux WholeModelRouterAux(int64_t tokens, double weight) const;
  // Fast paths for tensors on the kernels' device (model/fused_kernels.h); null = composites
  // only. Not owned; must outlive this object's use.
  void UseFusedKernels(const FusedKernels* kernels) { fused_ = kernels; }
  // With fused kernels: whether the RMSNorms (and the residual add before the post-attention
  // norm) use them (FusedKernels::AddRmsNorm) or LibTorch's fused rms_norm; for A/B runs
  // (bench.fused_norms).
  void UseFusedNorms(bool on) { fused_norms_ = on; }
  // Experts of bf16 CUDA tensors (LibTorch >= 2.8), frozen or trained: one grouped GEMM per
  // projection over every expert's tokens (at::_grouped_mm) instead of a loop over the experts
  // with tokens, with no read of the token counts on the host; a trained expert without tokens
  // gets exactly zero gradient; expert adapters join it when the rank is a multiple of 8 (two
  // more grouped GEMMs per projection); for A/B runs (bench.grouped_experts).
  void UseGroupedExperts(bool on) { grouped_experts_ = on; }
  // train.dtype = "fp8": blocks' projections of bf16 CUDA tensors (k and n multiples of 16)
  // multiply in e4m3 through the fused kernels (model/fp8.h; the caller has checked
  // FusedKernels::E4m3MatmulSupported): x W^T and the input gradient dy W from row-scaled e4m3
  // operands, the weight gradient dy^T x in bf16 with fp32 sums (into its sink when it has one).
  // The head, router, experts, attention and LoRA adapters stay bf16.
  void UseE4m3Projections(bool on) { e4m3_projections_ = on; }
  // The last e4m3 quantization of a projection's input (FusedKernels::QuantizeRowsE4m3), so that
  // q, k and v quantize their shared input once, as gate and up do. Keyed by the input tensor and
  // its version; the entry holds the input, so its address cannot be reused while the entry
  // lives.
  struct E4m3Input {
    at::Tensor x, values, scales;
    int64_t version = -1;
  };
  // Embed's output dtype when its table is stored wider (an fp32 master read in place,
  // ExecutionPlan::lookup_from_host): the looked-up rows are rounded, the same values as rounding
  // the table first. Unset: the table's dtype.
  void SetEmbedDtype(at::ScalarType dtype) { embed_dtype_ = dtype; }
  // Embed's rows rounded through `dtype` first (an fp32 table for emulated fp16 arithmetic: the
  // values an fp16 table would hold). Unset: no rounding.
  void SetEmbedRounding(at::ScalarType dtype) { embed_rounding_ = dtype; }
  // Weight-gradient sinks, for the fused path only (FusedKernels::AddWeightGrad): a projection or
  // LM head whose weight has a sink here adds its weight gradient, summed over the tokens in
  // fp32, straight into the sink (fp32, the weight's shape) during the backward, and leaves
  // weight.grad alone. Keyed by the weight tensor's TensorImpl; only weights whose role is
  // SinkableRole may have one (every use of them goes through Proj or the head). Why: the worker
  // sums a job's gradients over its microbatches in fp32 anyway; adding in the GEMM itself skips
  // writing, rounding to bf16 and re-reading each microbatch's gradient (a few percent of a
  // block's time in rp-block-bench), and the sum is no longer rounded to bf16 per microbatch.
  using WeightGradSinks = std::map<const c10::TensorImpl*, at::Tensor>;
  void SetWeightGradSinks(WeightGradSinks sinks) { sinks_ = std::move(sinks); }
  void AddWeightGradSink(const at::Tensor& weight, at::Tensor sum) {
    sinks_[weight.unsafeGetTensorImpl()] = std::move(sum);
  }
  static bool SinkableRole(const std::string& role);

  // Layer 0: tokens [B, S] int64 -> hidden [B, S, H].
  at::Tensor Embed(const LayerWeights& w, const at::Tensor& tokens) const;
  // Layers 1..L (`layer` keys the LoRA dropout masks).
  at::Tensor Block(const LayerWeights& w, const at::Tensor& x, int layer);
  // Layer 0 (Embed) or 1..L (Block), by pipeline layer index.
  at::Tensor Layer(int layer, const LayerWeights& w, const at::Tensor& x) {
    return layer == 0 ? Embed(w, x) : Block(w, x, layer);
  }
  // Layer L+1. With `backward`, each chunk's loss * loss_scale is backpropagated into the
  // weights' .grad and, through the final norm, into x's graph (x.grad if x is a leaf).
  // `defer_read`: on the fused path, leave the sums on the device (HeadResult::pending) instead
  // of waiting for the device to read them; the caller then reads them once the work is done.
  HeadResult HeadForwardBackward(const LayerWeights& w, const at::Tensor& x,
                                 const at::Tensor& labels, double loss_scale, bool backward,
                                 bool defer_read = false);

  const core::ModelConfig& config() const { return config_; }

 private:
  at::Tensor RmsNorm(const at::Tensor& x, const at::Tensor& weight) const;
  // {x + res, RmsNorm(x + res)}: one kernel each way where the fused norm applies.
  std::pair<at::Tensor, at::Tensor> AddRmsNorm(const at::Tensor& x, const at::Tensor& res,
                                               const at::Tensor& weight) const;
  bool FusedNorm(const at::Tensor& x) const {
    return fused_norms_ && Fused(x) && fused_->RmsNormSupports(x.size(-1)) && x.is_contiguous();
  }
  at::Tensor Rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) const;
  at::Tensor Attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) const;
  // Attention inside each of documents_'s documents (same shapes as Attention).
  at::Tensor DocumentAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) const;
  // A sparse block's MLP (Qwen3-MoE): h [B, S, H] -> the routed experts' weighted sum. Reads the
  // per-expert token counts back to the host (one synchronization per block on a GPU).
  at::Tensor Experts(const LayerWeights& w, const at::Tensor& h, int layer);
  void RopeTables(int64_t seq, const at::Tensor& like, at::Tensor* cos, at::Tensor* sin);
  // at::linear(h, W) plus the LoRA adapter of `role` when the weights have one. `first_token`:
  // where h's first token is in the microbatch (tiles), which offsets its dropout mask.
  at::Tensor Proj(const LayerWeights& w, const std::string& role, const at::Tensor& h, int layer,
                  int module, int64_t first_token = 0) const;
  // The 0/1 keep mask of h's shape and dtype for (dropout key, layer, module): element i of h is
  // element first_token x h.size(-1) + i of the microbatch's mask.
  at::Tensor LoraDropout(const at::Tensor& h, int layer, int module, int64_t first_token = 0) const;

  bool Fused(const at::Tensor& t) const { return fused_ != nullptr && t.is_cuda(); }
  // at::linear(x, weight, bias), the weight's gradient through its sink when it has one
  // (SetWeightGradSinks); the bias (undefined: none) keeps autograd's gradient.
  at::Tensor Linear(const at::Tensor& x, const at::Tensor& weight,
                    const at::Tensor& bias = {}) const;
  // The weight's gradient sink (SetWeightGradSinks), or null.
  const at::Tensor* SinkOf(const at::Tensor& weight) const;
  // Linear in e4m3 (UseE4m3Projections) where it applies to these operands, else Linear.
  at::Tensor ProjLinear(const at::Tensor& x, const at::Tensor& weight,
                        const at::Tensor& bias) const;
  HeadResult FusedHead(const at::Tensor& flat, const at::Tensor& flat_labels,
                       const at::Tensor& lm_head, double loss_scale, bool backward,
                       bool defer_read) const;

  core::ModelConfig config_;
  const FusedKernels* fused_ = nullptr;
  WeightGradSinks sinks_;
  bool fused_norms_ = true;
  bool grouped_experts_ = true;
  bool e4m3_projections_ = false;
  // Emptied after each group of projections that share an input.
  mutable E4m3Input e4m3_input_;
  std::optional<at::ScalarType> embed_dtype_;
  std::optional<at::ScalarType> embed_rounding_;
  double lora_scale_ = 0.0, lora_dropout_ = 0.0;
  uint64_t dropout_key_ = 0;
  bool training_ = true;
  std::map<int, at::Tensor>* routing_ = nullptr;
  std::map<int, at::Tensor> router_stats_;
  at::Tensor router_aux_grad_;
  int64_t loss_chunk_tokens_;
  int64_t mlp_tile_tokens_ = 0;
  bool recorded_attention_ = false;
  AttentionRecords* attention_records_ = nullptr;
  bool write_attention_ = false;
  int first_written_ = 0;
  at::Tensor cos_, sin_;  // cache for the last (seq, device, dtype); sin_ as Rope() takes it
  Documents documents_;
};

const at::Tensor& Get(const LayerWeights& w, const std::string& role);

// Key of one microbatch's LoRA dropout masks: a pure function of where it is in training.
// `step_microbatch` counts the step's microbatches across its calls (call x M + microbatch), so
// a step's calls merged into one round (bench.merge_calls) draw the same masks as the calls
// run one after another.
uint64_t DropoutKey(int64_t seed, int64_t step, int64_t step_microbatch);

}  // namespace rp::model
