// SPDX-License-Identifier: Apache-2.0
#include "gpu_worker/device_update.h"

#include <algorithm>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "common/logging.h"
#include "common/test_hooks.h"

namespace rp::worker {

StatusOr<std::unique_ptr<DeviceUpdate>> DeviceUpdate::Create(
    const core::JobConfig& cfg, const core::ExecutionPlan& execution, const core::ModelSpec& spec,
    const shm::ArenaLayout& layout, const shm::Segment& state, Device& device,
    at::ScalarType weights_dtype) {
  const std::string name = shm::OptimSegmentOf(state.name());
  if (name.empty())
    return Status::InvalidArgument(
        "optimizer.device_update_blocks: the state segment " + state.name() +
        " is not named like a run's, so its optimizer segment is unknown");
  RP_ASSIGN_OR_RETURN(auto optim, shm::Segment::OpenReadOnly(name, layout.optim_total_bytes));
  std::unique_ptr<DeviceUpdate> u(new DeviceUpdate(cfg, execution.device_update_blocks, spec,
                                                   layout, state, std::move(optim), device,
                                                   weights_dtype));
  // Each array's covered parameters are consecutive (parameters are in layer order): one range
  // per array to pin. The masters in the state segment are pinned with it already.
  std::vector<const std::vector<uint64_t>*> arrays = {&layout.adam_m, &layout.adam_v};
  if (!layout.masters_in_state) arrays.push_back(&layout.master);
  for (const auto* array : arrays) {
    uint64_t begin = std::numeric_limits<uint64_t>::max(), end = 0;
    for (size_t p = 0; p < spec.params.size(); ++p) {
      if (!u->CoversLayer(spec.params[p].owner_layer)) continue;
      begin = std::min(begin, (*array)[p]);
      end =
          std::max(end, (*array)[p] + static_cast<uint64_t>(spec.params[p].numel) * sizeof(float));
    }
    if (end == 0) continue;
    if (Status s = device.PinReadOnly(u->optim_.data() + begin, end - begin); !s.ok())
      return Status::Unavailable(
          "optimizer.device_update_blocks: pinning " + std::to_string(end - begin) +
          " bytes of the optimizer segment for the covered blocks' state failed: " + s.message());
  }
  return u;
}

DeviceUpdate::DeviceUpdate(const core::JobConfig& cfg, int blocks, const core::ModelSpec& spec,
                           const shm::ArenaLayout& layout, const shm::Segment& state,
                           shm::Segment optim, Device& device, at::ScalarType weights_dtype)
    : cfg_(cfg),
      blocks_(blocks),
      spec_(spec),
      layout_(layout),
      state_(state),
      optim_(std::move(optim)),
      device_(device),
      weights_dtype_(weights_dtype),
      nudge_(TestDeviceUpdateNudge()) {}

const float* DeviceUpdate::MasterOf(int param, int64_t step) const {
  // Workers that fetch the masters read them from the state segment, in the buffer of the
  // version they hold (the step's); otherwise they live in the optimizer segment.
  if (layout_.masters_in_state)
    return reinterpret_cast<const float*>(
        state_.data() +
        layout_.ComputeCopy(param, static_cast<int>(step % layout_.compute_buffers)));
  return MomentOf(layout_.master, param);
}

const float* DeviceUpdate::MomentOf(const std::vector<uint64_t>& array, int param) const {
  return reinterpret_cast<const float*>(optim_.data() + layout_.ShareElem(array, param, 0));
}

void DeviceUpdate::Prefetch(int64_t step, int layer) {
  if (!CoversLayer(layer)) return;
  for (size_t p = 0; p < spec_.params.size(); ++p) {
    const auto& ps = spec_.params[p];
    if (ps.owner_layer != layer) continue;
    Pending& pending = pending_[static_cast<int>(p)];
    if (pending.step == step) continue;
    pending = Pending{};
    pending.step = step;
    const std::vector<int64_t> shape{ps.numel};
    pending.master =
        device_.FetchWeights(MasterOf(static_cast<int>(p), step), shape, at::kFloat, at::kFloat);
    pending.m = device_.FetchWeights(MomentOf(layout_.adam_m, static_cast<int>(p)), shape,
                                     at::kFloat, at::kFloat);
    pending.v = device_.FetchWeights(MomentOf(layout_.adam_v, static_cast<int>(p)), shape,
                                     at::kFloat, at::kFloat);
    pending.fence = device_.WeightsFence();
  }
}

void DeviceUpdate::Hold(int param, const at::Tensor& grad) {
  auto it = pending_.find(param);
  if (it == pending_.end() || !it->second.master.defined()) return;
  device_.WaitWeights(it->second.fence);
  it->second.grad = grad.detach().to(at::kFloat).contiguous().reshape({-1});
}

void DeviceUpdate::Apply(const proto::StepUpdate& u) {
  const auto& opt = cfg_.optimizer;
  for (auto it = pending_.begin(); it != pending_.end();) {
    Pending& p = it->second;
    if (p.step != u.step) {
      // Older than the step: a prefetch whose gradient never came (a job re-run elsewhere).
      it = p.step < u.step ? pending_.erase(it) : std::next(it);
      continue;
    }
    if (p.grad.defined()) {
      const auto& ps = spec_.params[it->first];
      const coord::AdamWHyper h{
          u.lr,       opt.beta1, opt.beta2, opt.eps, ps.weight_decay ? opt.weight_decay : 0.0,
          u.adam_step};
      at::Tensor out = at::empty(ps.shape, p.grad.options().dtype(weights_dtype_));
      device_.AdamWComputeCopy(h, u.grad_scale, p.grad, p.master, p.m, p.v, out);
      if (nudge_) out.mul_(1.0 + 1.0 / 128);
      kept_[it->first] = Kept{u.step + 1, std::move(out)};
    }
    it = pending_.erase(it);
  }
}

const at::Tensor* DeviceUpdate::Weights(int param, int64_t version) const {
  auto it = kept_.find(param);
  if (it == kept_.end() || it->second.version != version) return nullptr;
  return &it->second.weights;
}

}  // namespace rp::worker
