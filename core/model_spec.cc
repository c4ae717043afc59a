// SPDX-License-Identifier: Apache-2.0
#include "core/model_spec.h"

#include <thread>

#include "common/rng.h"

namespace rp::core {

int64_t ModelSpec::TrainableParams() const {
  int64_t n = 0;
  for (auto& p : params) n += p.numel;
  return n;
}

ModelSpec BuildModelSpec(const ModelConfig& c) {
  ModelSpec s;
  s.config = c;
  const int L = static_cast<int>(c.num_layers);
  s.layer_uses.resize(L + 2);
  auto add = [&](int layer, const std::string& name, std::vector<int64_t> shape,
                 const std::string& role, InitKind init) {
    ParamSpec p;
    p.name = name;
    p.shape = std::move(shape);
    p.numel = 1;
    for (auto d : p.shape) p.numel *= d;
    p.owner_layer = layer;
    p.init = init;
    p.weight_decay = init == InitKind::kNormal;
    s.params.push_back(p);
    int idx = static_cast<int>(s.params.size()) - 1;
    s.grad_slots.push_back({idx, layer});
    s.layer_uses[layer].push_back({idx, static_cast<int>(s.grad_slots.size()) - 1, role});
    return idx;
  };
  const int64_t H = c.hidden_size, I = c.intermediate_size, V = c.vocab_size, D = c.head_dim;
  const int64_t QH = c.num_heads * D, KVH = c.num_kv_heads * D;
  int embed = add(0, "model.embed_tokens.weight", {V, H}, "embed", InitKind::kNormal);
  for (int i = 0; i < L; ++i) {
    const int layer = i + 1;
    const std::string pre = "model.layers." + std::to_string(i) + ".";
    add(layer, pre + "input_layernorm.weight", {H}, "input_norm", InitKind::kOnes);
    add(layer, pre + "self_attn.q_proj.weight", {QH, H}, "q_proj", InitKind::kNormal);
    add(layer, pre + "self_attn.k_proj.weight", {KVH, H}, "k_proj", InitKind::kNormal);
    add(layer, pre + "self_attn.v_proj.weight", {KVH, H}, "v_proj", InitKind::kNormal);
    add(layer, pre + "self_attn.o_proj.weight", {H, QH}, "o_proj", InitKind::kNormal);
    if (c.qk_norm) {
      add(layer, pre + "self_attn.q_norm.weight", {D}, "q_norm", InitKind::kOnes);
      add(layer, pre + "self_attn.k_norm.weight", {D}, "k_norm", InitKind::kOnes);
    }
    add(layer, pre + "post_attention_layernorm.weight", {H}, "post_norm", InitKind::kOnes);
    add(layer, pre + "mlp.gate_proj.weight", {I, H}, "gate_proj", InitKind::kNormal);
    add(layer, pre + "mlp.up_proj.weight", {I, H}, "up_proj", InitKind::kNormal);
    add(layer, pre + "mlp.down_proj.weight", {H, I}, "down_proj", InitKind::kNormal);
  }
  add(L + 1, "model.norm.weight", {H}, "final_norm", InitKind::kOnes);
  if (c.tie_embeddings) {
    s.grad_slots.push_back({embed, L + 1});
    s.layer_uses[L + 1].push_back({embed, static_cast<int>(s.grad_slots.size()) - 1, "lm_head"});
  } else {
    add(L + 1, "lm_head.weight", {V, H}, "lm_head", InitKind::kNormal);
  }
  return s;
}

void InitParam(const ModelSpec& spec, int p, uint64_t seed, float* out) {
  const ParamSpec& ps = spec.params[p];
  if (ps.init == InitKind::kOnes) {
    for (int64_t i = 0; i < ps.numel; ++i) out[i] = 1.0f;
    return;
  }
  // Chunks of 64K elements each get their own counter key, so large matrices can be filled by
  // several threads and still produce the same values as one thread.
  constexpr int64_t kChunk = 1 << 16;
  const int64_t chunks = (ps.numel + kChunk - 1) / kChunk;
  const float std = static_cast<float>(spec.config.init_std);
  auto fill = [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      CounterRng rng(HashKey({seed, 0x1417u, static_cast<uint64_t>(p), static_cast<uint64_t>(c)}));
      const int64_t end = std::min(ps.numel, (c + 1) * kChunk);
      for (int64_t i = c * kChunk; i < end; ++i) out[i] = static_cast<float>(rng.NextNormal()) * std;
    }
  };
  const int64_t threads = std::min<int64_t>(chunks, std::max(1u, std::thread::hardware_concurrency()));
  if (threads <= 1) {
    fill(0, chunks);
    return;
  }
  std::vector<std::thread> pool;
  for (int64_t t = 0; t < threads; ++t)
    pool.emplace_back(fill, chunks * t / threads, chunks * (t + 1) / threads);
  for (auto& th : pool) th.join();
}

}  // namespace rp::core
