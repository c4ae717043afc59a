// SPDX-License-Identifier: Apache-2.0
#include "planning/grad_arena.h"

#include <algorithm>
#include <string>
#include <utility>

namespace rp::core {

namespace {
std::vector<uint64_t> ByOwner(const JobConfig& c, const ExecutionPlan& x, const ModelSpec& spec,
                              const PipelinePlan& plan, const Stage& st,
                              const std::vector<int>& uses) {
  std::vector<uint64_t> bytes(static_cast<size_t>(plan.num_layers), 0);
  if (st.kind == StageKind::kForward) return bytes;
  for (int l = st.begin; l < st.end; ++l)
    for (const auto& use : spec.layer_uses[l])
      if (uses[use.param] == 1)  // shared ones: GradArenaSizing::shared
        bytes[static_cast<size_t>(spec.params[use.param].owner_layer)] +=
            GradSlotBytes(c, x, spec, use.grad_slot);
  return bytes;
}
}  // namespace

uint64_t GradSlotBytes(const JobConfig& c, const ExecutionPlan& x, const ModelSpec& spec,
                       int slot) {
  const auto& p = spec.params[spec.grad_slots[slot].param];
  const int64_t rows = CompactLookupRows(c, spec, slot);
  int64_t numel = rows > 0 ? rows * p.shape[1] : p.numel;
  if (x.sharded_gradients) numel = ShardOf(p.numel, c.nodes.count, c.nodes.rank).size();
  return (static_cast<uint64_t>(numel) * 4 + 255) / 256 * 256;
}

StatusOr<GradArenaSizing> SizeGradArena(const JobConfig& c, const ExecutionPlan& x,
                                        const ModelSpec& spec, const PipelinePlan& plan,
                                        std::vector<std::vector<uint64_t>>* stage_bytes_by_owner) {
  GradArenaSizing s;
  // How many grad slots each parameter has (more than one: a tied parameter).
  std::vector<int> uses(spec.params.size(), 0);
  for (const auto& g : spec.grad_slots) uses[g.param]++;
  for (size_t g = 0; g < spec.grad_slots.size(); ++g) {
    const uint64_t bytes = GradSlotBytes(c, x, spec, static_cast<int>(g));
    s.all_slots += bytes;
    if (uses[spec.grad_slots[g].param] > 1) s.shared += bytes;
  }
  uint64_t largest_stage = 0;
  if (stage_bytes_by_owner) stage_bytes_by_owner->clear();
  // The slot bytes per parameter, once: the planner sizes the arena for every plan it tries.
  std::vector<uint64_t> param_bytes(spec.params.size(), 0);
  for (size_t g = 0; g < spec.grad_slots.size(); ++g)
    if (uses[spec.grad_slots[g].param] == 1)
      param_bytes[spec.grad_slots[g].param] = GradSlotBytes(c, x, spec, static_cast<int>(g));
  for (const auto& st : plan.stages) {
    uint64_t bytes = 0;
    if (st.kind != StageKind::kForward)
      for (int l = st.begin; l < st.end; ++l)
        for (const auto& use : spec.layer_uses[l]) bytes += param_bytes[use.param];
    largest_stage = std::max(largest_stage, bytes);
    if (stage_bytes_by_owner) stage_bytes_by_owner->push_back(ByOwner(c, x, spec, plan, st, uses));
  }
  // Gradients that wait for the norm on the workers reach the arena after it: streamed.
  s.must_hold_all = (x.updates_wait_for_norm && !x.gradients_wait_in_workers) || Round(c).calls > 1;
  s.minimum = s.must_hold_all ? s.all_slots : std::min(s.all_slots, largest_stage + s.shared);
  const uint64_t requested = static_cast<uint64_t>(c.optimizer.grad_buffer_mb) << 20;
  if (requested == 0) {
    s.chosen = s.must_hold_all ? s.all_slots : std::min(s.all_slots, 2 * largest_stage + s.shared);
  } else if (requested < s.minimum) {
    const std::string why =
        s.must_hold_all
            ? std::string(x.updates_wait_for_norm
                              ? "train.grad_clip > 0 or train.dtype = \"fp16\" (no update may "
                                "start before the "
                                "global gradient norm is known)"
                              : "train.accum_calls > 1 (every slot takes a commit per call)") +
                  ", so every gradient is held at once"
            : std::string("the largest stage's gradients") +
                  (s.shared > 0 ? " plus the tied parameters' (held until their last use)" : "") +
                  " must fit";
    return Status::InvalidArgument(
        "optimizer.grad_buffer_mb: " + std::to_string(c.optimizer.grad_buffer_mb) +
        " MiB is below the " + std::to_string((s.minimum + (1 << 20) - 1) >> 20) +
        " MiB this job needs: " + why);
  } else {
    s.chosen = std::min(requested, s.all_slots);
  }
  s.chosen = (s.chosen + kGradArenaAlign - 1) / kGradArenaAlign * kGradArenaAlign;
  return s;
}

}  // namespace rp::core
