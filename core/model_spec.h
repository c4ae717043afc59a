// SPDX-License-Identifier: Apache-2.0
// ModelSpec: the parameter list of a decoder-only transformer (Llama / Qwen3 family), metadata
// only. Names follow Hugging Face (`model.layers.3.self_attn.q_proj.weight`) so checkpoints map
// one to one.
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

#include "core/job_config.h"

namespace rp::core {

enum class InitKind : uint8_t { kNormal, kOnes };

struct ParamSpec {
  std::string name;
  std::vector<int64_t> shape;
  int64_t numel = 0;
  int owner_layer = 0;
  InitKind init = InitKind::kNormal;
  bool weight_decay = true;  // norms are not decayed
};

// One use of a parameter by a layer, with the gradient slot it accumulates into.
struct ParamUse {
  int param = 0;       // index into ModelSpec::params
  int grad_slot = 0;   // index into ModelSpec::grad_slots
  std::string role;    // "embed", "q_proj", ... : what the layer code looks it up by
};

struct GradSlot {
  int param = 0;
  int layer = 0;
};

struct ModelSpec {
  ModelConfig config;
  std::vector<ParamSpec> params;
  std::vector<GradSlot> grad_slots;
  std::vector<std::vector<ParamUse>> layer_uses;  // per pipeline layer, in a fixed order

  int NumLayers() const { return static_cast<int>(layer_uses.size()); }
  int64_t TrainableParams() const;
};

ModelSpec BuildModelSpec(const ModelConfig& config);

// Initial value of element `i` of parameter `p`: a pure function of (seed, parameter index, i),
// shared by the coordinator and rp-train-ref so both start bit-identical.
void InitParam(const ModelSpec& spec, int p, uint64_t seed, float* out);

}  // namespace rp::core
