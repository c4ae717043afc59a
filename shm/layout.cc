// SPDX-License-Identifier: Apache-2.0
#include "shm/layout.h"

#include <algorithm>

#include "common/rng.h"

namespace rp::shm {

namespace {
uint64_t Align(uint64_t x) { return (x + kArenaAlign - 1) / kArenaAlign * kArenaAlign; }
// Packs one region of weight copies from `pos` (256-byte aligned inside, so a layer's weights
// form one run a worker can fetch with a single copy); returns the 4 KiB-aligned end.
uint64_t PackWeights(const std::vector<core::ParamSpec>& params, int elem_bytes, uint64_t pos,
                     std::vector<uint64_t>* offsets) {
  for (const auto& p : params) {
    offsets->push_back(pos);
    pos += (static_cast<uint64_t>(p.numel) * static_cast<uint64_t>(elem_bytes) + 255) / 256 * 256;
  }
  return Align(pos);
}
// Folds names and sizes into the layout hash; `salt` tells the parameter lists apart.
uint64_t HashParams(uint64_t h, const std::vector<core::ParamSpec>& params, uint64_t salt) {
  for (const auto& p : params) {
    for (char ch : p.name) h = SplitMix64(h ^ static_cast<uint8_t>(ch));
    h = salt == 0 ? HashKey({h, static_cast<uint64_t>(p.numel)})
                  : HashKey({h, salt, static_cast<uint64_t>(p.numel)});
  }
  return h;
}
}  // namespace

OptimLayout ComputeOptimLayout(const core::ModelSpec& spec, bool masters_in_state,
                               core::OptimizerName optimizer, int64_t nodes, int64_t rank) {
  // SGD keeps one state buffer (momentum, in adam_m); AdamW two.
  OptimLayout o;
  for (const auto& p : spec.params) o.share.push_back(core::ShardOf(p.numel, nodes, rank));
  uint64_t pos = 0;
  std::vector<std::vector<uint64_t>*> regions = {&o.adam_m};
  if (!masters_in_state) regions.insert(regions.begin(), &o.master);
  if (optimizer == core::OptimizerName::kAdamW) regions.push_back(&o.adam_v);
  for (auto* region : regions) {
    for (const auto& r : o.share) {
      region->push_back(pos);
      pos += (static_cast<uint64_t>(r.size()) * 4 + 255) / 256 * 256;
    }
    pos = Align(pos);
  }
  o.total_bytes = pos;
  return o;
}

uint64_t ArenaLayout::TokenSlot(int parity, int mb) const {
  return tokens + (static_cast<uint64_t>(parity) * microbatches + mb) * Align(tokens_per_mb * 8);
}
uint64_t ArenaLayout::LabelSlot(int parity, int mb) const {
  return labels + (static_cast<uint64_t>(parity) * microbatches + mb) * Align(tokens_per_mb * 8);
}
uint64_t ArenaLayout::PositionSlot(int parity, int mb) const {
  return positions + (static_cast<uint64_t>(parity) * microbatches + mb) * Align(tokens_per_mb * 8);
}
uint64_t ArenaLayout::EvalTokenSlot(int slot) const {
  return eval_tokens + static_cast<uint64_t>(slot) * Align(tokens_per_mb * 8);
}
uint64_t ArenaLayout::EvalLabelSlot(int slot) const {
  return eval_labels + static_cast<uint64_t>(slot) * Align(tokens_per_mb * 8);
}
uint64_t ArenaLayout::EvalPositionSlot(int slot) const {
  return eval_positions + static_cast<uint64_t>(slot) * Align(tokens_per_mb * 8);
}
// Offset of input-gradient slot (parity, mb, idx) from the start of the input-gradient region.
static uint64_t GradInRegion(const ArenaLayout& a, int parity, int mb, int idx) {
  return ((static_cast<uint64_t>(parity) * a.microbatches + mb) * a.grad_slots_per_mb +
          idx % a.grad_slots_per_mb) *
         a.act_slot_bytes;
}
// A pool holds the hidden slots, then the input-gradient slots, at the offsets the segment's
// regions use.
uint64_t ArenaLayout::PoolHiddenSlot(int parity, int mb, int idx) const {
  return ((static_cast<uint64_t>(parity) * microbatches + mb) * num_hidden + idx) * act_slot_bytes;
}
uint64_t ArenaLayout::PoolInputGradSlot(int parity, int mb, int idx) const {
  const uint64_t hidden_bytes =
      static_cast<uint64_t>(parities) * microbatches * num_hidden * act_slot_bytes;
  return hidden_bytes + GradInRegion(*this, parity, mb, idx);
}
uint64_t ArenaLayout::HiddenSlot(int parity, int mb, int idx) const {
  return hidden + PoolHiddenSlot(parity, mb, idx);
}
uint64_t ArenaLayout::RouterStatsSlot(int parity, int mb, int block) const {
  return router_stats + (static_cast<uint64_t>(parity) * microbatches + mb) * router_slot_bytes +
         static_cast<uint64_t>(block) * 2 * router_experts * 8;
}
uint64_t ArenaLayout::InputGradSlot(int parity, int mb, int idx) const {
  return input_grad + GradInRegion(*this, parity, mb, idx);
}

StatusOr<ArenaLayout> ComputeLayout(const core::JobConfig& c, const core::ExecutionPlan& x,
                                    const core::ModelSpec& spec, const core::PipelinePlan& plan) {
  RP_ASSIGN_OR_RETURN(core::GradArenaSizing sizing, core::SizeGradArena(c, x, spec, plan));
  ArenaLayout a;
  a.compute_elem_bytes = core::ComputeElemBytes(c);
  uint64_t pos = kHeaderBytes;
  a.sharded = x.sharded_state;
  a.layer_versions = pos;
  a.lookup_version = pos + 8ull * static_cast<uint64_t>(plan.num_layers);
  pos = Align(a.lookup_version + 8);
  a.fetch_versions = a.layer_versions;
  if (a.sharded) {
    a.gathered_versions = a.fetch_versions = pos;
    pos = Align(pos + 8ull * static_cast<uint64_t>(plan.num_layers));
  }
  a.lookup_from_host = core::LookupInPlaceParam(x, spec) >= 0;
  a.grad_table = pos;
  pos = Align(pos + 8ull * spec.grad_slots.size());
  a.masters_in_state = x.workers_fetch_masters;
  a.weights_elem_bytes = a.masters_in_state ? 4 : a.compute_elem_bytes;
  a.compute_begin = pos;
  pos = PackWeights(spec.params, a.weights_elem_bytes, pos, &a.compute);
  a.compute_end = pos;
  if (a.masters_in_state) a.master = a.compute;
  // A lagging step reads an older version while the optimizer writes the next one; a speculative
  // update writes the next while the step still reads the current one.
  a.compute_buffers = std::max(1 + x.weight_version_lag, x.speculative_update ? 2 : 1);
  pos += (a.compute_end - a.compute_begin) * static_cast<uint64_t>(a.compute_buffers - 1);
  // After the compute buffers, so a training-state checkpoint (which saves those) leaves the
  // frozen base out: it is reloaded from its source on resume.
  a.frozen_begin = pos;
  pos = a.frozen_end = PackWeights(spec.frozen, a.compute_elem_bytes, pos, &a.frozen);
  for (size_t g = 0; g < spec.grad_slots.size(); ++g) {
    a.grad_slot_bytes.push_back(core::GradSlotBytes(c, x, spec, static_cast<int>(g)));
    if (core::CompactLookupRows(c, spec, static_cast<int>(g)) > 0)
      a.compact_lookup_slot = static_cast<int>(g);
  }
  a.sharded_grads = x.sharded_gradients;
  a.grad_arena = pos;
  a.grad_arena_bytes = sizing.chosen;
  a.grads_streamed = sizing.chosen < sizing.all_slots;
  pos += a.grad_arena_bytes;
  a.microbatches = static_cast<int>(core::Round(c).microbatches);
  a.tokens_per_mb = static_cast<uint64_t>(c.train.microbatch_size * c.data.seq_len);
  a.parities = x.activation_parities;
  const uint64_t slots = static_cast<uint64_t>(a.parities) * a.microbatches;
  a.tokens = pos;
  pos += slots * Align(a.tokens_per_mb * 8);
  a.labels = pos;
  pos += slots * Align(a.tokens_per_mb * 8);
  a.positions = pos;
  pos += slots * Align(a.tokens_per_mb * 8);
  a.eval_slots = c.train.eval_every > 0 ? static_cast<int>(c.train.eval_microbatches) : 0;
  a.eval_tokens = pos;
  pos += static_cast<uint64_t>(a.eval_slots) * Align(a.tokens_per_mb * 8);
  a.eval_labels = pos;
  pos += static_cast<uint64_t>(a.eval_slots) * Align(a.tokens_per_mb * 8);
  a.eval_positions = pos;
  pos += static_cast<uint64_t>(a.eval_slots) * Align(a.tokens_per_mb * 8);
  a.act_elems = a.tokens_per_mb * static_cast<uint64_t>(c.model.hidden_size);
  a.act_slot_bytes = Align(a.act_elems * a.compute_elem_bytes);
  a.num_hidden = static_cast<int>(plan.hidden_boundaries.size());
  a.num_grad = static_cast<int>(plan.grad_boundaries.size());
  a.grad_slots_per_mb = plan.InputGradSlotsPerMicrobatch();
  a.activations = x.activations;
  const bool in_segment = a.activations == core::Activations::kHost;
  a.hidden = pos;
  if (in_segment) pos += slots * a.num_hidden * a.act_slot_bytes;
  a.input_grad = pos;
  if (in_segment) pos += slots * a.grad_slots_per_mb * a.act_slot_bytes;
  if (a.activations == core::Activations::kCudaIpc)
    a.pool_bytes = slots * (a.num_hidden + a.grad_slots_per_mb) * a.act_slot_bytes;
  if (c.model.moe.aux_loss_weight > 0.0) {
    a.router_blocks = static_cast<int>(core::SparseBlocks(c.model));
    a.router_experts = static_cast<int>(c.model.moe.num_experts);
    a.router_slot_bytes = Align(static_cast<uint64_t>(a.router_blocks) * 2 * a.router_experts * 8);
  }
  a.router_stats = pos;
  pos += slots * a.router_slot_bytes;
  if (core::ScalesLoss(c)) {
    a.loss_scaling = pos;
    pos = Align(pos + sizeof(LossScaleRecord));
  }
  if (x.gradients_wait_in_workers || a.sharded_grads) {
    for (const auto& p : spec.params) {
      a.square_chunk_base.push_back(a.square_chunks);
      a.square_chunks += (p.numel + kSquareChunkElems - 1) / kSquareChunkElems;
    }
    a.grad_squares = pos;
    pos = Align(pos + 2 * 8 * static_cast<uint64_t>(a.square_chunks));
  }
  a.total_bytes = pos;

  // The optimizer segment.
  OptimLayout o = ComputeOptimLayout(spec, a.masters_in_state, c.optimizer.name,
                                     a.sharded ? c.nodes.count : 1, a.sharded ? c.nodes.rank : 0);
  a.share = std::move(o.share);
  if (!a.masters_in_state) a.master = std::move(o.master);
  a.adam_m = std::move(o.adam_m);
  a.adam_v = std::move(o.adam_v);
  a.optim_total_bytes = o.total_bytes;

  uint64_t h = HashKey(
      {kSegmentMagic, kSegmentVersion, a.total_bytes, static_cast<uint64_t>(a.compute_elem_bytes),
       static_cast<uint64_t>(a.compute_buffers), static_cast<uint64_t>(a.parities),
       static_cast<uint64_t>(a.masters_in_state), static_cast<uint64_t>(a.lookup_from_host)});
  h = HashParams(h, spec.params, 0);
  h = HashParams(h, spec.frozen, 0xF0u);
  h = HashKey({h, a.grad_table, a.grad_arena, a.grad_arena_bytes, a.compute_begin,
               static_cast<uint64_t>(a.eval_slots),
               static_cast<uint64_t>(a.activations == core::Activations::kWorker)});
  if (a.activations == core::Activations::kCudaIpc) h = HashKey({h, 0x900Lu, a.pool_bytes});
  if (a.sharded) h = HashKey({h, 0x5Au, a.gathered_versions, static_cast<uint64_t>(c.nodes.count)});
  if (a.router_blocks > 0)
    h = HashKey({h, 0x70u, a.router_stats, static_cast<uint64_t>(a.router_blocks),
                 static_cast<uint64_t>(a.router_experts)});
  if (a.loss_scaling != 0) h = HashKey({h, 0x1055u, a.loss_scaling});
  if (a.grad_squares != 0)
    h = HashKey({h, 0x5Du, a.grad_squares, static_cast<uint64_t>(a.square_chunks)});
  if (a.sharded_grads) h = HashKey({h, 0x5Eu, a.grad_arena_bytes});
  // The plan is part of the contract too: RunJob names stages by index.
  for (const auto& st : plan.stages)
    h = HashKey({h, static_cast<uint64_t>(st.kind), static_cast<uint64_t>(st.begin),
                 static_cast<uint64_t>(st.end)});
  for (int b : plan.hidden_boundaries) h = HashKey({h, 0x11u, static_cast<uint64_t>(b)});
  for (int b : plan.grad_boundaries) h = HashKey({h, 0x22u, static_cast<uint64_t>(b)});
  a.hash = h;
  return a;
}

StatusOr<uint64_t> PlanSharedBytes(const core::JobConfig& c, const core::PipelinePlan& plan,
                                   int workers) {
  RP_ASSIGN_OR_RETURN(
      const ArenaLayout layout,
      ComputeLayout(c, core::ResolveExecution(c), core::BuildModelSpec(c.model, c.lora), plan));
  return SharedMemoryBytes(layout, c, workers);
}

core::SharedBytesOf SharedBytesFor(int workers) {
  return [workers](const core::JobConfig& c, const core::PipelinePlan& plan) {
    return PlanSharedBytes(c, plan, workers);
  };
}

}  // namespace rp::shm
