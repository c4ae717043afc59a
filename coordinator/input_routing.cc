// SPDX-License-Identifier: Apache-2.0
#include "coordinator/input_routing.h"

namespace rp::coord {

InputRouting::InputRouting(const core::PipelinePlan& plan, const shm::ArenaLayout& layout,
                           int microbatches)
    : plan_(plan), layout_(layout), microbatches_(microbatches) {
  if (layout_.activations != core::Activations::kCudaIpc) return;
  const size_t per_parity = static_cast<size_t>(layout_.parities) * microbatches_;
  hidden_owner_.assign(per_parity * layout_.num_hidden, -1);
  grad_owner_.assign(per_parity * layout_.grad_slots_per_mb, -1);
}

size_t InputRouting::Base(const proto::RunJob& run, int mb) const {
  return static_cast<size_t>(run.parity) * microbatches_ + mb;
}

void InputRouting::Recorded(const proto::RunJob& run, int mb, int rank) {
  if (layout_.activations != core::Activations::kCudaIpc) return;
  const core::Stage& st = plan_.stages[run.stage];
  const size_t base = Base(run, mb);
  if (st.kind == core::StageKind::kForward) {
    for (int l = st.begin; l < st.end; ++l)
      if (const int slot = plan_.HiddenSlot(l + 1); slot >= 0)
        hidden_owner_[base * layout_.num_hidden + slot] = rank;
  } else if (st.begin > 0) {  // the tail and backward stages above the embedding
    grad_owner_[base * layout_.grad_slots_per_mb +
                plan_.GradSlot(st.begin) % layout_.grad_slots_per_mb] = rank;
  }
}

proto::InputReady InputRouting::For(const proto::RunJob& run, int mb) const {
  proto::InputReady r{run.job_index, mb, proto::kFromHostSlot, proto::kFromHostSlot, 0};
  if (layout_.activations != core::Activations::kCudaIpc) return r;
  const core::Stage& st = plan_.stages[run.stage];
  const size_t base = Base(run, mb);
  if (st.begin > 0)
    r.hidden_rank = hidden_owner_[base * layout_.num_hidden + plan_.HiddenSlot(st.begin)];
  if (st.kind == core::StageKind::kBackward)
    r.grad_rank = grad_owner_[base * layout_.grad_slots_per_mb +
                              plan_.GradSlot(st.end) % layout_.grad_slots_per_mb];
  return r;
}

}  // namespace rp::coord
