// SPDX-License-Identifier: Apache-2.0
// ModelSpec: the parameter list of a decoder-only transformer (Llama / Qwen3 family), metadata
// only. Names follow Hugging Face (`model.layers.3.self_attn.q_proj.weight`) so checkpoints map
// one to one.
//
// A sparse block (SparseBlock: Qwen3-MoE) has roles "router" [E, H], "experts.gate_up"
// [E, 2 x I, H] and "experts.down" [E, H, I] in place of gate/up/down_proj.
//
// Pipeline layers: 0 = embedding, 1..L = decoder blocks, L+1 = head (final norm + LM head + loss).
// A parameter is *owned* by one layer (its storage, optimizer state); it is *used* by one or more
// layers. With tied embeddings the head uses the embedding matrix owned by layer 0, and each use
// has its own gradient slot so two jobs never add into one buffer concurrently; the optimizer sums
// the slots in a fixed order.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "config/execution_plan.h"
#include "config/job_config.h"

namespace rp::core {

// kUniformFanIn: uniform in +-1/sqrt(shape[1]) (a LoRA A matrix, as PEFT's kaiming init);
// kZeros: a LoRA B matrix, so a fresh adapter leaves the model unchanged.
enum class InitKind : uint8_t { kNormal, kOnes, kUniformFanIn, kZeros };

struct ParamSpec {
  std::string name;
  std::vector<int64_t> shape;
  int64_t numel = 0;
  int owner_layer = 0;
  InitKind init = InitKind::kNormal;
  bool weight_decay = true;  // norms are not decayed
  // Key of the parameter's init stream: its index in the full model's parameter list, so a
  // frozen base under LoRA starts exactly as the full model with the same seed would.
  uint64_t init_key = 0;
  // A LoRA matrix (A or B): the index in ModelSpec::frozen of the base weight it adapts, else -1.
  int adapts = -1;
  // An adapter on stacked expert tensors [experts, out, in] (PEFT's layout): A is [r x experts,
  // in] with expert e's rows at e x r .. e x r + r - 1, B is [out, r x experts] with expert e's
  // rank-k column at k x experts + e; 0 for an adapter on one matrix.
  int64_t experts = 0;
};

// A frozen parameter's use by a layer (LoRA's base weights): fetched, never updated, no gradient.
struct FrozenUse {
  int param = 0;  // index into ModelSpec::frozen
  std::string role;
};

// One use of a parameter by a layer, with the gradient slot it accumulates into.
struct ParamUse {
  int param = 0;      // index into ModelSpec::params
  int grad_slot = 0;  // index into ModelSpec::grad_slots
  std::string role;   // "embed", "q_proj", ... : what the layer code looks it up by
};

struct GradSlot {
  int param = 0;
  int layer = 0;
};

// `params` are the trainable parameters (masters, moments, gradient slots); everything the
// optimizer, the gradient arena and training-state checkpoints touch is indexed by them. Under
// LoRA they are the adapters (role "<module>.lora_A" / ".lora_B", names as the base weight's with
// ".lora_A.weight"; each lora_B directly follows its lora_A), and the base model is `frozen`:
// compute copies only. Expert adapters (lora.target_parameters) have roles
// "experts.gate_up.lora_A" ... "experts.down.lora_B" and PEFT's names: its wrappers nest in the
// order transformers registers the tensors (gate_up_proj, then down_proj), the first innermost,
// so with both targeted gate_up's are "mlp.experts.base_layer.lora_A.weight" and down's
// "mlp.experts.lora_A.weight".
struct ModelSpec {
  ModelConfig config;
  LoraConfig lora;
  std::vector<ParamSpec> params;
  std::vector<GradSlot> grad_slots;
  std::vector<std::vector<ParamUse>> layer_uses;     // per pipeline layer, in a fixed order
  std::vector<ParamSpec> frozen;                     // empty unless LoRA
  std::vector<std::vector<FrozenUse>> layer_frozen;  // per pipeline layer

  int NumLayers() const { return static_cast<int>(layer_uses.size()); }
  int64_t TrainableParams() const;
  int64_t FrozenParams() const;
  // Elements of every weight layer `l` reads (trainable and frozen): what a stage fetches.
  int64_t LayerWeightElems(int l) const;
  // Bytes a worker copies for layer `l`: trainable weights at `trainable_elem_bytes` (4 when it
  // fetches the fp32 masters), frozen ones at `frozen_elem_bytes` (the compute dtype).
  int64_t LayerWeightBytes(int l, int trainable_elem_bytes, int frozen_elem_bytes) const;
  // Row length of trainable parameter `p` when it is a tied matrix (exactly two gradient slots:
  // the tied embedding's input lookup and head), else 0. The optimizer sums its norm by rows and
  // the layout may keep its lookup slot compact (optim/optimizer_step.h,
  // core::CompactLookupRows).
  int64_t TiedRowElems(int p) const;
};

ModelSpec BuildModelSpec(const ModelConfig& config, const LoraConfig& lora = LoraConfig{});

// The trainable table the embedding layer looks up in place (ExecutionPlan::lookup_from_host,
// with layer 0 one trainable 2-D parameter and nothing frozen), else -1. The one place that
// decides it: the layout's flag, the optimizer's rows first, the worker's mapping and the planner
// all follow it.
int LookupInPlaceParam(const ExecutionPlan& x, const ModelSpec& spec);

// Rows the gradient slot `slot` holds when it is the tied embedding's input-lookup slot with
// one call per step (after bench.merge_calls): at most one row per input token of the step,
// min(vocab, tokens per step), instead of the whole matrix. Why: the lookup's gradient is zero
// outside the step's token rows, so the worker commits those rows only (less host memory and
// device-to-host copy at the end of the step's last backward stage) and the optimizer folds
// them into the head's slot by row (AsyncOptimizer). With several calls each call's rows would
// differ, so the slot stays whole; 0 for every other slot.
int64_t CompactLookupRows(const JobConfig& c, const ModelSpec& spec, int slot);

// Whether a use with this role may sum its weight gradient straight into an fp32 sink
// (model::Transformer::SetWeightGradSinks; CUDA workers with bench.fused_kernels): the
// projections and the LM head, every use of which goes through a GEMM the fused path owns. The
// planner's memory estimate follows it (no per-microbatch gradient in the compute dtype).
bool SinkableRole(const std::string& role);

// Initial value of element `i` of parameter `ps`: a pure function of (seed, ps.init_key, i),
// shared by the coordinator and rp-train-ref so both start bit-identical.
void InitParam(const ParamSpec& ps, const ModelConfig& config, uint64_t seed, float* out);
inline void InitParam(const ModelSpec& spec, int p, uint64_t seed, float* out) {
  InitParam(spec.params[p], spec.config, seed, out);
}

}  // namespace rp::core
