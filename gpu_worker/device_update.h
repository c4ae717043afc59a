// SPDX-License-Identifier: Apache-2.0
// DeviceUpdate: the worker's half of optimizer.device_update_blocks
// (ExecutionPlan::device_update_blocks).
//
// At an exact-mode step boundary with clipping nothing can be updated before the global norm,
// and the host's optimizer then publishes layer after layer more slowly than the next forward
// consumes them. For blocks 1..N the worker that holds their gradients computes the next weights
// on its own device (a few milliseconds there), and the next step's forward stages use those at
// once, while the host updates the other blocks first. The host still updates blocks 1..N itself
// (optim/async_optimizer.h): it stays the only owner of masters and moments, and the
// device's weights are a cache that a replacement worker simply lacks.
//
// Contract:
//  * Covers the trainable parameters owned by pipeline layers 1..N. Create() maps the run's
//    optimizer segment read-only and pins the covered parameters' arrays in it for DMA.
//  * Prefetch(step, layer): queues copies to the device of `layer`'s fp32 masters and moments as
//    they are before step `step`'s update. The caller has seen the layer's host version reach
//    `step` (the host publishes a covered layer's version only once its masters and moments are
//    written), and the host writes them again only after this step's gradient commit of the
//    layer (its update needs the slot final). Once per parameter and step; a no-op otherwise.
//  * Hold(param, grad): keeps `grad` (the parameter's complete fp32 gradient of the prefetched
//    step) for the update, and makes the compute stream wait for the prefetch. Call it before
//    the gradient's commit is started: the commit waits for the compute stream, so the host
//    sees the slot final only after the prefetch has read the state. Ignored for a parameter
//    without a prefetch of that step.
//  * Apply(u): queues each held parameter's update of step u.step on the compute stream
//    (Device::AdamWComputeCopy) into new weights in the workers' dtype, kept as version
//    u.step + 1 until the next Apply replaces them, and drops that step's state and gradients.
//    A parameter without a held gradient keeps nothing for the version. Bits: the host's.
//  * Weights(param, version): the kept weights of `param` at `version`, or null. Each use must
//    copy them (the next Apply drops them); the copy is ordered after the update on the compute
//    stream.
//  * Device errors throw (the caller's Guarded boundary reports them). Single-threaded.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>

#include "common/status.h"
#include "config/job_config.h"
#include "config/model_spec.h"
#include "gpu_worker/device.h"
#include "protocol/messages.h"
#include "shm/layout.h"
#include "shm/segment.h"

namespace rp::worker {

class DeviceUpdate {
 public:
  // `state` is the mapped state segment (whose name gives the optimizer segment's), `weights_dtype`
  // the dtype of the weights the executor makes (what Apply writes).
  static StatusOr<std::unique_ptr<DeviceUpdate>> Create(const core::JobConfig& cfg,
                                                        const core::ExecutionPlan& execution,
                                                        const core::ModelSpec& spec,
                                                        const shm::ArenaLayout& layout,
                                                        const shm::Segment& state, Device& device,
                                                        at::ScalarType weights_dtype);

  bool CoversLayer(int layer) const { return layer >= 1 && layer <= blocks_; }
  void Prefetch(int64_t step, int layer);
  void Hold(int param, const at::Tensor& grad);
  void Apply(const proto::StepUpdate& u);
  const at::Tensor* Weights(int param, int64_t version) const;

 private:
  DeviceUpdate(const core::JobConfig& cfg, int blocks, const core::ModelSpec& spec,
               const shm::ArenaLayout& layout, const shm::Segment& state, shm::Segment optim,
               Device& device, at::ScalarType weights_dtype);
  const float* MasterOf(int param, int64_t step) const;
  const float* MomentOf(const std::vector<uint64_t>& array, int param) const;

  const core::JobConfig& cfg_;
  const int blocks_;  // ExecutionPlan::device_update_blocks: blocks 1..blocks_ are covered
  const core::ModelSpec& spec_;
  const shm::ArenaLayout& layout_;
  const shm::Segment& state_;
  const shm::Segment optim_;  // read-only mapping
  Device& device_;
  const at::ScalarType weights_dtype_;
  const bool nudge_;  // RP_TEST_DEVICE_UPDATE_NUDGE (common/test_hooks.h)
  struct Pending {
    int64_t step = -1;
    at::Tensor master, m, v, grad;
    uint64_t fence = 0;  // the weights stream's, after the state's copies
  };
  std::map<int, Pending> pending_;  // by parameter
  struct Kept {
    int64_t version = -1;
    at::Tensor weights;
  };
  std::map<int, Kept> kept_;  // by parameter
};

}  // namespace rp::worker
