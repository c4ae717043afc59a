// SPDX-License-Identifier: Apache-2.0
#include "config/model_spec.h"

#include <algorithm>
#include <cmath>

#include "common/cores.h"
#include "common/parallel.h"
#include "common/rng.h"

namespace rp::core {

int64_t ModelSpec::TrainableParams() const {
  int64_t n = 0;
  for (auto& p : params) n += p.numel;
  return n;
}

int64_t ModelSpec::FrozenParams() const {
  int64_t n = 0;
  for (auto& p : frozen) n += p.numel;
  return n;
}

int64_t ModelSpec::LayerWeightElems(int l) const {
  int64_t n = 0;
  for (const auto& use : layer_uses[l]) n += params[use.param].numel;
  for (const auto& use : layer_frozen[l]) n += frozen[use.param].numel;
  return n;
}

int64_t ModelSpec::LayerWeightBytes(int l, int trainable_elem_bytes, int frozen_elem_bytes) const {
  int64_t n = 0;
  for (const auto& use : layer_uses[l]) n += params[use.param].numel * trainable_elem_bytes;
  for (const auto& use : layer_frozen[l]) n += frozen[use.param].numel * frozen_elem_bytes;
  return n;
}

int64_t ModelSpec::TiedRowElems(int p) const {
  int uses = 0;
  for (const auto& slot : grad_slots) uses += slot.param == p ? 1 : 0;
  return uses == 2 && params[p].shape.size() == 2 ? params[p].shape[1] : 0;
}

int64_t CompactLookupRows(const JobConfig& c, const ModelSpec& spec, int slot) {
  const GradSlot& g = spec.grad_slots[slot];
  const ParamSpec& p = spec.params[g.param];
  // Several nodes sum the slot across them: its rows must mean the same everywhere, so it holds
  // every row there, not this node's tokens' rows.
  if (c.nodes.count > 1) return 0;
  // TiedRowElems scans every slot: asked last, for the embedding's lookup slot only.
  if (g.layer != 0 || g.layer != p.owner_layer || core::Round(c).calls != 1 ||
      spec.TiedRowElems(g.param) == 0)
    return 0;
  const int64_t tokens = core::Round(c).microbatches * c.train.microbatch_size * c.data.seq_len;
  return std::min(p.shape[0], tokens);
}

bool SinkableRole(const std::string& role) {
  static const char* const kRoles[] = {"q_proj",    "k_proj",  "v_proj",    "o_proj",
                                       "gate_proj", "up_proj", "down_proj", "lm_head"};
  for (const char* r : kRoles)
    if (role == r) return true;
  return false;
}

int LookupInPlaceParam(const ExecutionPlan& x, const ModelSpec& spec) {
  if (!x.lookup_from_host || spec.layer_uses.empty() || spec.layer_uses[0].size() != 1 ||
      (!spec.layer_frozen.empty() && !spec.layer_frozen[0].empty()))
    return -1;
  const int p = spec.layer_uses[0][0].param;
  return spec.params[p].shape.size() == 2 ? p : -1;
}

ModelSpec BuildModelSpec(const ModelConfig& c, const LoraConfig& lora) {
  ModelSpec s;
  s.config = c;
  s.lora = lora;
  const bool adapters = lora.enabled();
  const int L = static_cast<int>(c.num_layers);
  s.layer_uses.resize(L + 2);
  s.layer_frozen.resize(L + 2);
  uint64_t next_key = 0;  // the full model's parameter index
  auto make = [&](int layer, const std::string& name, std::vector<int64_t> shape, InitKind init,
                  uint64_t key) {
    ParamSpec p;
    p.name = name;
    p.shape = std::move(shape);
    p.numel = 1;
    for (auto d : p.shape) p.numel *= d;
    p.owner_layer = layer;
    p.init = init;
    p.weight_decay = init != InitKind::kOnes;
    p.init_key = key;
    return p;
  };
  auto add_trainable = [&](ParamSpec p, const std::string& role) {
    const int layer = p.owner_layer;
    s.params.push_back(std::move(p));
    int idx = static_cast<int>(s.params.size()) - 1;
    s.grad_slots.push_back({idx, layer});
    s.layer_uses[layer].push_back({idx, static_cast<int>(s.grad_slots.size()) - 1, role});
    return idx;
  };
  // A base weight: trainable in a full fine-tune, frozen under LoRA (adapters added separately).
  auto add = [&](int layer, const std::string& name, std::vector<int64_t> shape,
                 const std::string& role, InitKind init) {
    ParamSpec p = make(layer, name, std::move(shape), init, next_key++);
    if (!adapters) return add_trainable(std::move(p), role);
    s.frozen.push_back(std::move(p));
    int idx = static_cast<int>(s.frozen.size()) - 1;
    s.layer_frozen[layer].push_back({idx, role});
    return idx;
  };
  // Adapter init keys live above every base key, one pair per (layer, module).
  constexpr uint64_t kAdapterKeyBase = uint64_t{1} << 40;
  // A projection's weight, its adapters under LoRA, then its bias (frozen under LoRA, as PEFT's
  // default bias = "none"; starts at zero and is not decayed, like torch's Linear bias in the
  // usual "matrices only" parameter groups).
  auto add_projection = [&](int layer, const std::string& name, int64_t out, int64_t in,
                            const std::string& role, bool bias) {
    add(layer, name + ".weight", {out, in}, role, InitKind::kNormal);
    const uint64_t adapter_key = kAdapterKeyBase + 2 * (next_key - 1);
    if (bias) {
      ParamSpec b = make(layer, name + ".bias", {out}, InitKind::kZeros, next_key++);
      b.weight_decay = false;
      if (!adapters) {
        add_trainable(std::move(b), role + ".bias");
      } else {
        s.frozen.push_back(std::move(b));
        s.layer_frozen[layer].push_back({static_cast<int>(s.frozen.size()) - 1, role + ".bias"});
      }
    }
    if (!adapters) return;
    const auto& t = lora.target_modules;
    if (std::find(t.begin(), t.end(), role) == t.end()) return;
    const int base = static_cast<int>(s.frozen.size()) - (bias ? 2 : 1);
    ParamSpec a =
        make(layer, name + ".lora_A.weight", {lora.rank, in}, InitKind::kUniformFanIn, adapter_key);
    ParamSpec b =
        make(layer, name + ".lora_B.weight", {out, lora.rank}, InitKind::kZeros, adapter_key + 1);
    a.adapts = b.adapts = base;
    add_trainable(std::move(a), role + ".lora_A");
    add_trainable(std::move(b), role + ".lora_B");
  };
  const int64_t H = c.hidden_size, I = c.intermediate_size, V = c.vocab_size, D = c.head_dim;
  const int64_t QH = c.num_heads * D, KVH = c.num_kv_heads * D;
  int embed = add(0, "model.embed_tokens.weight", {V, H}, "embed", InitKind::kNormal);
  for (int i = 0; i < L; ++i) {
    const int layer = i + 1;
    const std::string pre = "model.layers." + std::to_string(i) + ".";
    add(layer, pre + "input_layernorm.weight", {H}, "input_norm", InitKind::kOnes);
    add_projection(layer, pre + "self_attn.q_proj", QH, H, "q_proj", c.qkv_bias);
    add_projection(layer, pre + "self_attn.k_proj", KVH, H, "k_proj", c.qkv_bias);
    add_projection(layer, pre + "self_attn.v_proj", KVH, H, "v_proj", c.qkv_bias);
    add_projection(layer, pre + "self_attn.o_proj", H, QH, "o_proj", c.o_bias);
    if (c.qk_norm) {
      add(layer, pre + "self_attn.q_norm.weight", {D}, "q_norm", InitKind::kOnes);
      add(layer, pre + "self_attn.k_norm.weight", {D}, "k_norm", InitKind::kOnes);
    }
    add(layer, pre + "post_attention_layernorm.weight", {H}, "post_norm", InitKind::kOnes);
    if (SparseBlock(c, i)) {
      // transformers 5's fused layout: every expert's gate and up rows stacked ([E, 2 x I, H],
      // gate first) and its down matrix ([E, H, I]); io/hf_model.h maps per-expert files to it.
      const int64_t E = c.moe.num_experts, EI = c.moe.expert_intermediate_size;
      add(layer, pre + "mlp.gate.weight", {E, H}, "router", InitKind::kNormal);
      const int gate_up = add(layer, pre + "mlp.experts.gate_up_proj", {E, 2 * EI, H},
                              "experts.gate_up", InitKind::kNormal);
      const int down =
          add(layer, pre + "mlp.experts.down_proj", {E, H, EI}, "experts.down", InitKind::kNormal);
      if (!adapters) continue;
      struct Target {
        const char* tensor;
        const char* role;
        int base;
        int64_t out, in;
      };
      std::vector<Target> targets;
      for (const Target& t :
           {Target{"mlp.experts.gate_up_proj", "experts.gate_up", gate_up, 2 * EI, H},
            Target{"mlp.experts.down_proj", "experts.down", down, H, EI}}) {
        const auto& tp = lora.target_parameters;
        if (std::any_of(tp.begin(), tp.end(), [&](const std::string& n) {
              return CanonicalLoraParameter(n) == t.tensor;
            }))
          targets.push_back(t);
      }
      for (size_t n = 0; n < targets.size(); ++n) {
        const Target& t = targets[n];
        std::string name = pre + "mlp.experts.";
        for (size_t outer = n + 1; outer < targets.size(); ++outer) name += "base_layer.";
        const uint64_t key = kAdapterKeyBase + 2 * s.frozen[t.base].init_key;
        ParamSpec a = make(layer, name + "lora_A.weight", {lora.rank * E, t.in},
                           InitKind::kUniformFanIn, key);
        ParamSpec b =
            make(layer, name + "lora_B.weight", {t.out, lora.rank * E}, InitKind::kZeros, key + 1);
        for (ParamSpec* m : {&a, &b}) {
          m->adapts = t.base;
          m->experts = E;
        }
        add_trainable(std::move(a), std::string(t.role) + ".lora_A");
        add_trainable(std::move(b), std::string(t.role) + ".lora_B");
      }
      continue;
    }
    add_projection(layer, pre + "mlp.gate_proj", I, H, "gate_proj", c.mlp_bias);
    add_projection(layer, pre + "mlp.up_proj", I, H, "up_proj", c.mlp_bias);
    add_projection(layer, pre + "mlp.down_proj", H, I, "down_proj", c.mlp_bias);
  }
  add(L + 1, "model.norm.weight", {H}, "final_norm", InitKind::kOnes);
  if (c.tie_embeddings) {
    if (adapters) {
      s.layer_frozen[L + 1].push_back({embed, "lm_head"});
    } else {
      s.grad_slots.push_back({embed, L + 1});
      s.layer_uses[L + 1].push_back({embed, static_cast<int>(s.grad_slots.size()) - 1, "lm_head"});
    }
  } else {
    add(L + 1, "lm_head.weight", {V, H}, "lm_head", InitKind::kNormal);
  }
  return s;
}

void InitParam(const ParamSpec& ps, const ModelConfig& config, uint64_t seed, float* out) {
  if (ps.init == InitKind::kOnes || ps.init == InitKind::kZeros) {
    const float v = ps.init == InitKind::kOnes ? 1.0f : 0.0f;
    for (int64_t i = 0; i < ps.numel; ++i) out[i] = v;
    return;
  }
  // Chunks of 64K elements each get their own counter key, so large matrices can be filled by
  // several threads and still produce the same values as one thread.
  constexpr int64_t kChunk = 1 << 16;
  const int64_t chunks = (ps.numel + kChunk - 1) / kChunk;
  const bool uniform = ps.init == InitKind::kUniformFanIn;
  const double bound = uniform ? 1.0 / std::sqrt(static_cast<double>(ps.shape.at(1))) : 0.0;
  const float std = static_cast<float>(config.init_std);
  ParallelFor(chunks, UsableCores(), [&](int64_t c) {
    CounterRng rng(HashKey({seed, 0x1417u, ps.init_key, static_cast<uint64_t>(c)}));
    const int64_t end = std::min(ps.numel, (c + 1) * kChunk);
    if (uniform) {
      for (int64_t i = c * kChunk; i < end; ++i)
        out[i] = static_cast<float>((2.0 * rng.NextUniform() - 1.0) * bound);
      return;
    }
    for (int64_t i = c * kChunk; i < end; ++i) out[i] = static_cast<float>(rng.NextNormal()) * std;
  });
}

}  // namespace rp::core
