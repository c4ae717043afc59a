// SPDX-License-Identifier: Apache-2.0
// ExecutionPlan: how a run executes, resolved once from the job's mode keys.
//
// Contract:
//  * ResolveExecution() is the one place that reads the mode keys (ModeKey in job_config.h:
//    optimizer.mode, .state, .gradients_wait_in, .speculative_update, .device_update_blocks,
//    .update_passes, schedule.activations, .weights_source, .embedding_lookup, .frozen_on_device,
//    .partition) and derives what the processes act on. Pure given the job (and the test hook
//    RP_TEST_NODE_SUMS_ALONE, read once per process).
//  * rp-launch resolves it with the run spec (planning/run_spec.h), which stores it; the
//    layout, the dispatch, the optimizer and the executor take it from there. The planner
//    resolves each job it tries (a trial of another mode key is another plan).
//  * A plain value: copy it freely.
#pragma once

#include <cstdint>

#include "config/job_config.h"

namespace rp::core {

struct ExecutionPlan {
  // How many updates a step's weights lag its own count: step t computes with the weights that
  // hold t - weight_version_lag updates (none before step 0's). 0 in exact mode (synchronous
  // training); 1 in stale1, so step t - 1's update overlaps all of step t. The dispatch's weight
  // versions, the loss scale's delay, the compute buffers and the simulator's dependencies all
  // derive from it.
  int weight_version_lag = 0;
  // Whether no parameter may be updated before the step's global gradient norm is known: with
  // clipping (the norm scales every update) and with fp16's loss scaling (a step whose gradients
  // are not all finite updates nothing). Otherwise each parameter is updated as soon as its
  // gradient is final.
  bool updates_wait_for_norm = false;
  // optimizer.gradients_wait_in = "workers": where updates wait for the norm, each step's
  // gradients wait for it on the workers that computed them (device memory) instead of in the
  // host's gradient arena. Each worker writes the squared sums of its gradients' optimizer chunks
  // into the state segment; the coordinator adds them up in the optimizer's order, and only then
  // grants the step's commits, which stream through an arena sized as without clipping; the
  // activation slots get a second parity. Validated to need a norm to wait for, one commit per
  // gradient slot and step, and no parameter shared between layers.
  bool gradients_wait_in_workers = false;
  // optimizer.speculative_update: in exact mode with clipping, the optimizer writes each
  // parameter's next weights as if the step were not clipped while the backward still runs, into a
  // second buffer of what workers fetch (shm::ArenaLayout compute buffers = 2). If the norm then
  // leaves the step unclipped, those weights are the update's exactly and the next step starts at
  // once; otherwise the update runs again with the clip scale. Validated to need AdamW, exact
  // mode, clipping, gradients waiting on the host and no loss scaling.
  bool speculative_update = false;
  // optimizer.device_update_blocks = N: blocks 1..N (pipeline layers) are updated twice per step
  // with the same bits: on the worker's device, into the weights the next step's stages use there
  // (gpu_worker/device_update.h), and on the host, which stays the state's only owner. The host
  // does those blocks after every other parameter's first pass, so the next step's forward runs
  // its first N blocks while the host updates the rest. Validated to need AdamW, exact mode,
  // clipping, bf16 or fp32 compute, one accumulation round, one worker, one node, no speculation
  // and no LoRA.
  int device_update_blocks = 0;
  // optimizer.update_passes resolved: in exact mode, where the gradient arena holds every slot
  // (shm::ArenaLayout::grads_streamed false), each parameter's update runs as two passes over the
  // same inputs (optim/adamw.h, UpdateWrites): the first writes what workers fetch, the second the
  // rest, while the next step computes. Fewer bytes stand between a step's norm and the next
  // forward, more move in all. Auto (0) counts as two until core::ResolveUpdatePasses chooses.
  bool two_pass_updates = false;
  // optimizer.update_passes = 0: the planner chooses (core::ResolveUpdatePasses, in ResolveRun).
  bool planner_chooses_update_passes = false;
  // schedule.weights_source resolved: workers fetch the fp32 masters (the shared state segment
  // holds them and there is no compute copy). Exact mode can: a layer's masters change only after
  // every job of the step that reads them has run. stale1 cannot: the next step reads version t
  // while the optimizer writes version t + 1.
  bool workers_fetch_masters = false;
  // schedule.embedding_lookup resolved: the embedding's lookup reads the rows it needs straight
  // from the fp32 masters instead of copying the whole table to the device first, and the
  // exact-mode optimizer updates the next step's token rows first. Needs workers_fetch_masters
  // (a row the next step reads keeps its value until that step's own update). Not for LoRA (a
  // frozen embedding) and not with sharded state (other nodes' rows are current only once the
  // whole layer is gathered).
  bool lookup_from_host = false;
  // optimizer.state resolved: each of several nodes keeps the fp32 masters (where workers do not
  // fetch them) and the moments of its own share of every parameter (ShardOf), updates only that
  // share, and the workers gather every node's updated shares before a layer is fetched (ZeRO-1
  // across nodes). One node's share is everything, except under the test hook
  // RP_TEST_NODE_SUMS_ALONE (common/test_hooks.h), where one node shards and gathers across a
  // group of itself, so the whole path runs on one machine and must change no bit.
  bool sharded_state = false;
  // Sharded state whose gradient slots hold only this node's share of each parameter (the arena
  // is 1/N too): when nothing waits for the norm (the slots stream layer by layer), one call per
  // step, and no trainable parameter used by two layers (a tied embedding's two slots are summed
  // on the host). Workers commit their node's share of each summed gradient and write the
  // squares of the whole into the gradient squares table, from which the coordinator takes the
  // norm.
  bool sharded_gradients = false;
  // schedule.frozen_on_device with LoRA: a worker copies the whole frozen base to its device at
  // its first fetch and keeps it; a stage's fetch is then its trainable weights only.
  bool frozen_on_device = false;
  // schedule.activations: where the hidden states and input gradients between stages live.
  // kCudaIpc: each worker's own activation pool (device memory for CUDA workers, exported once
  // through CUDA IPC; a named shared-memory object for CPU workers), copied from by consumers.
  Activations activations = Activations::kHost;
  // Activation slot sets (shm/layout.h): 2 so call g + 1 fills its slots while call g drains.
  // Exact mode with one call per step has one: the next step's first forward needs this step's
  // update, which comes after this step's last job. Not with gradients waiting in the workers:
  // there a job is done only after its commit, the commits follow the norm, and with one set the
  // next step's tokens could not go in before the last (the tail's) commit. A slot is reused
  // only when every job that read it is done, so a replacement worker can re-run any of them.
  int activation_parities = 2;
  // bench.interleave_calls, in exact mode only (stale1 has no step-boundary wait to hide).
  bool interleave_calls = false;
  // schedule.partition = "auto": the planner chooses the cuts (and re-plans from fresh profiles).
  bool planner_chooses_partition = false;

  // Whether the next step's weights need this step's update (no lag: exact mode). Where it
  // holds, the step boundary waits for the optimizer.
  bool NextStepWaitsForUpdate() const { return weight_version_lag == 0; }
  // Whether pipeline layer `layer` is one of the blocks device_update_blocks covers (1..N).
  bool DeviceUpdatesLayer(int layer) const { return layer >= 1 && layer <= device_update_blocks; }
  bool ActivationsInPools() const { return activations == Activations::kCudaIpc; }
  // Whether the activations between stages stay in workers (one worker's memory or the pools)
  // rather than in the state segment's host slots.
  bool ActivationsInWorkers() const { return activations != Activations::kHost; }

  bool operator==(const ExecutionPlan& o) const;
  bool operator!=(const ExecutionPlan& o) const { return !(*this == o); }
};

ExecutionPlan ResolveExecution(const JobConfig& config);

}  // namespace rp::core
