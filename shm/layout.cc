// SPDX-License-Identifier: Apache-2.0
#include "shm/layout.h"

#include "common/rng.h"

namespace rp::shm {
namespace {
uint64_t Align(uint64_t x) { return (x + kArenaAlign - 1) / kArenaAlign * kArenaAlign; }
}  // namespace

uint64_t ArenaLayout::TokenSlot(int parity, int mb) const {
  return tokens + (static_cast<uint64_t>(parity) * microbatches + mb) * Align(tokens_per_mb * 8);
}
uint64_t ArenaLayout::LabelSlot(int parity, int mb) const {
  return labels + (static_cast<uint64_t>(parity) * microbatches + mb) * Align(tokens_per_mb * 8);
}
uint64_t ArenaLayout::HiddenSlot(int parity, int mb, int idx) const {
  return hidden +
         ((static_cast<uint64_t>(parity) * microbatches + mb) * num_hidden + idx) * act_slot_bytes;
}
uint64_t ArenaLayout::InputGradSlot(int parity, int mb, int idx) const {
  return input_grad +
         ((static_cast<uint64_t>(parity) * microbatches + mb) * num_grad + idx) * act_slot_bytes;
}

ArenaLayout ComputeLayout(const core::JobConfig& c, const core::ModelSpec& spec,
                          const core::PipelinePlan& plan) {
  ArenaLayout a;
  a.compute_elem_bytes = c.train.dtype == "bf16" ? 2 : 4;
  uint64_t pos = kHeaderBytes;
  a.layer_versions = pos;
  pos = Align(pos + 8ull * static_cast<uint64_t>(plan.num_layers));
  // Compute copies are packed (256-byte aligned inside the region) so a layer's weights form one
  // run that a worker can fetch with a single copy.
  a.compute_begin = pos;
  for (auto& p : spec.params) {
    a.compute.push_back(pos);
    pos += (static_cast<uint64_t>(p.numel) * a.compute_elem_bytes + 255) / 256 * 256;
  }
  pos = Align(pos);
  a.compute_end = pos;
  a.compute_buffers = c.optimizer.mode == "stale1" ? 2 : 1;
  pos += (a.compute_end - a.compute_begin) * static_cast<uint64_t>(a.compute_buffers - 1);
  // SGD keeps one state buffer (momentum, in adam_m); AdamW two.
  std::vector<std::vector<uint64_t>*> regions = {&a.master, &a.adam_m};
  if (c.optimizer.name == "adamw") regions.push_back(&a.adam_v);
  for (auto* region : regions) {
    for (auto& p : spec.params) {
      region->push_back(pos);
      pos += (static_cast<uint64_t>(p.numel) * 4 + 255) / 256 * 256;
    }
    pos = Align(pos);
  }
  for (auto& g : spec.grad_slots) {
    a.grad.push_back(pos);
    pos += (static_cast<uint64_t>(spec.params[g.param].numel) * 4 + 255) / 256 * 256;
  }
  pos = Align(pos);
  a.microbatches = static_cast<int>(c.train.microbatches);
  a.tokens_per_mb = static_cast<uint64_t>(c.train.microbatch_size * c.data.seq_len);
  const uint64_t slots = 2ull * a.microbatches;
  a.tokens = pos;
  pos += slots * Align(a.tokens_per_mb * 8);
  a.labels = pos;
  pos += slots * Align(a.tokens_per_mb * 8);
  a.act_elems = a.tokens_per_mb * static_cast<uint64_t>(c.model.hidden_size);
  a.act_slot_bytes = Align(a.act_elems * a.compute_elem_bytes);
  a.num_hidden = static_cast<int>(plan.hidden_boundaries.size());
  a.num_grad = static_cast<int>(plan.grad_boundaries.size());
  a.hidden = pos;
  pos += slots * a.num_hidden * a.act_slot_bytes;
  a.input_grad = pos;
  pos += slots * a.num_grad * a.act_slot_bytes;
  a.total_bytes = pos;

  uint64_t h = HashKey({kSegmentMagic, kSegmentVersion, a.total_bytes,
                        static_cast<uint64_t>(a.compute_elem_bytes),
                        static_cast<uint64_t>(a.compute_buffers)});
  for (auto& p : spec.params) {
    for (char ch : p.name) h = SplitMix64(h ^ static_cast<uint8_t>(ch));
    h = HashKey({h, static_cast<uint64_t>(p.numel)});
  }
  for (auto off : a.grad) h = HashKey({h, off});
  // The plan is part of the contract too: RunJob names stages by index.
  for (const auto& st : plan.stages)
    h = HashKey({h, static_cast<uint64_t>(st.kind), static_cast<uint64_t>(st.begin),
                 static_cast<uint64_t>(st.end)});
  for (int b : plan.hidden_boundaries) h = HashKey({h, 0x11u, static_cast<uint64_t>(b)});
  for (int b : plan.grad_boundaries) h = HashKey({h, 0x22u, static_cast<uint64_t>(b)});
  a.hash = h;
  return a;
}

}  // namespace rp::shm
