// SPDX-License-Identifier: Apache-2.0
#include "config/execution_plan.h"

#include <tuple>

#include "common/test_hooks.h"
#include "config/mode_key_access.h"

namespace rp::core {

bool ExecutionPlan::operator==(const ExecutionPlan& o) const {
  auto tie = [](const ExecutionPlan& x) {
    return std::tie(x.weight_version_lag, x.updates_wait_for_norm, x.gradients_wait_in_workers,
                    x.speculative_update, x.device_update_blocks, x.two_pass_updates,
                    x.planner_chooses_update_passes, x.workers_fetch_masters, x.lookup_from_host,
                    x.sharded_state, x.sharded_gradients, x.frozen_on_device, x.activations,
                    x.activation_parities, x.interleave_calls, x.planner_chooses_partition);
  };
  return tie(*this) == tie(o);
}

ExecutionPlan ResolveExecution(const JobConfig& c) {
  const ModeKeyAccess key = ModeKeyGrant::Access();
  const OptimizerConfig& o = c.optimizer;
  const ScheduleConfig& s = c.schedule;
  ExecutionPlan x;
  x.weight_version_lag = o.mode.Read(key) == OptimizerMode::kStale1 ? 1 : 0;
  x.updates_wait_for_norm = c.train.grad_clip > 0.0 || ScalesLoss(c);
  x.gradients_wait_in_workers = o.gradients_wait_in.Read(key) == GradientsWait::kWorkers;
  x.speculative_update = o.speculative_update.Read(key);
  x.device_update_blocks = static_cast<int>(o.device_update_blocks.Read(key));
  const int64_t passes = o.update_passes.Read(key);
  x.two_pass_updates = x.NextStepWaitsForUpdate() && passes != 1;
  x.planner_chooses_update_passes = passes == kUpdatePassesAuto;
  x.workers_fetch_masters =
      s.weights_source.Read(key) == WeightsSource::kAuto && x.NextStepWaitsForUpdate();
  x.sharded_state = o.state.Read(key) == OptimizerState::kSharded &&
                    (c.nodes.count > 1 || (c.nodes.count == 1 && TestNodeSumsAlone()));
  x.lookup_from_host = s.embedding_lookup.Read(key) == EmbeddingLookup::kAuto &&
                       x.workers_fetch_masters && !c.lora.enabled() && !x.sharded_state;
  x.sharded_gradients = x.sharded_state && !x.updates_wait_for_norm && Round(c).calls == 1 &&
                        !(c.model.tie_embeddings && !c.lora.enabled());
  x.frozen_on_device = s.frozen_on_device.Read(key) && c.lora.enabled();
  x.activations = s.activations.Read(key);
  x.activation_parities =
      !x.NextStepWaitsForUpdate() || Round(c).calls > 1 || x.gradients_wait_in_workers ? 2 : 1;
  x.interleave_calls = c.bench.interleave_calls && x.NextStepWaitsForUpdate();
  x.planner_chooses_partition = s.partition.Read(key) == Partition::kAuto;
  return x;
}

}  // namespace rp::core
