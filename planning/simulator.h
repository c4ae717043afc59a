// SPDX-License-Identifier: Apache-2.0
// Event-driven simulator of the round-robin schedule: predicts step time, bubble ratio (split
// into fill, drain and imbalance) for a plan from per-stage costs.
//
// Model (the runtime's rules, in pure form):
//  * A step is K calls of the stage chain, dispatched in `order` (core::StepJobOrder); job k
//    (counted over steps in that order) runs on worker k mod N; each job processes
//    microbatches 0..M-1 in order.
//  * Microbatch m of chain position k starts when (a) microbatch m of the previous position in
//    its call is done (its output is in host memory), (b) the job's own microbatch m-1 is done,
//    and (c) for m = 0, the worker's previous job is done and the job's weights are resident.
//    A microbatch costs its input's H2D copy + compute + its outputs' D2H copy, in series (the
//    CUDA backend's activation copies wait for compute and compute waits for them).
//  * Weights: per worker one copy stream; a job's fetch starts when the weights it reads hold
//    the version it needs and the worker's previous job has begun (two jobs' weights at most).
//  * Gradients: after a job's last microbatch they are written back on the worker's gradient
//    stream, overlapping the next job (calls after the first of a step also read the slot's
//    current value first, to add on the device), once the slot is free: step t - 1's update of
//    the layer has read it. Until then the gradients wait on the device. A layer's gradient is
//    final when the last job of the step that writes it has finished that copy. With gradients
//    waiting in the workers for the norm (SimInput::commits_wait_for_norm) the copies start
//    after the step's last gradient job, last stage first.
//  * Optimizer: one server (the coordinator's pool) updating one owner layer at a time: without
//    clipping each layer as soon as final, with clipping (the global norm is needed) all layers
//    after the step's last final gradient, ascending. Step t reads weights updated through step
//    t - lag (lag 1 = exact, 2 = stale1). Exact mode's second passes (SimInput::second_pass_s)
//    follow the step's first passes on the same server and publish nothing.
//  * Layer-major forward stages: see SimInput::layer_major.
//  * Several nodes: each simulates its own share of the step (the same on every node), with the
//    cross-node sum of each job's gradients before their write-back (SimInput::nodes).
//  * A streamed gradient arena (SimInput::arena_bytes, with commits waiting for the norm): a
//    commit is granted once the earlier commits' slots the host has not yet released leave room
//    for its own; the host releases each layer's slots when it has updated that layer.
//  * Not modelled: activation slot reuse across calls, a streamed arena's capacity without
//    commits waiting for the norm (slots wait only for the previous step's update, as when the
//    arena holds every gradient), second passes sharing the host's memory bandwidth with first
//    passes or running on fewer threads (and, with device updates, that the host's passes over
//    the covered layers delay them), several workers sharing one GPU's link or compute, message
//    latency (folded into a measured overhead).
// Pure and deterministic.
#pragma once

#include <cstdint>
#include <vector>

#include "config/execution_plan.h"
#include "config/job_config.h"
#include "config/model_spec.h"
#include "planning/plan.h"
#include "planning/profile.h"

namespace rp::core {

// One layer's weight copy: it may start once every owner layer's update is published.
struct SimFetch {
  std::vector<int> owners;
  double bytes = 0.0;
};

struct SimStage {
  double compute_s = 0.0;     // per microbatch
  double in_bytes = 0.0;      // per microbatch, host -> device before compute
  double out_bytes = 0.0;     // per microbatch, device -> host after compute
  double weight_bytes = 0.0;  // per job
  double grad_bytes = 0.0;    // per job, written back after the last microbatch (0: none)
  double arena_bytes = 0.0;  // per job, what its commit places in the arena (SimInput::arena_bytes)
  std::vector<double>
      owner_arena_bytes;    // of those, per entry of `owners` (released with its update)
  std::vector<int> owners;  // owner layers whose weights it reads (and gradients it writes)
  // Device updates (SimInput::device_blocks): every owner it writes is one of those blocks; with
  // commits waiting for the norm such stages commit after all others.
  bool device_updated = false;
  // Per layer in copy order (the worker's Executor::FetchReady); empty: weight_bytes in one copy
  // after every owner's update.
  std::vector<SimFetch> fetches;
  // A forward stage that may run layer-major (SimInput::layer_major): per layer (fetches[i]'s),
  // its compute per microbatch; compute_s minus their sum is a per-microbatch overhead. Empty:
  // never layer-major.
  std::vector<double> layer_compute_s;
};

struct SimInput {
  std::vector<SimStage> stages;  // chain order
  int workers = 1, microbatches = 1, calls = 1, steps = 1;
  double h2d_bytes_per_s = 0.0;  // 0: transfers are free
  double d2h_bytes_per_s = 0.0;
  std::vector<double> update_s;  // per owner layer; empty: updates are free and instant
  // Exact mode's two passes (ExecutionPlan::two_pass_updates, arena holding every slot): per
  // owner layer, its second pass, run after every update_s (first pass) of the step. Empty: each
  // update is one pass.
  std::vector<double> second_pass_s;
  // Rows first (ExecutionPlan::lookup_from_host, coordinator::AsyncOptimizer): fetches that name
  // `lookup_owner` (a pseudo owner past the layers; -1: none) wait for the part of owner 0's
  // update over the next step's rows, `lookup_fraction` of its cost, which runs before every other
  // update; the rest of owner 0's update runs after them. Needs updates_wait_for_norm; without
  // it the pseudo owner is published with owner 0.
  int lookup_owner = -1;
  double lookup_fraction = 1.0;
  // Per owner layer: the coordinator's norm work once its gradients are final (folding a tied
  // parameter's slots, squaring), on the optimizer's threads before its update; with clipping
  // every update waits for every norm. Empty: free.
  std::vector<double> norm_s;
  // Device updates (ExecutionPlan::device_update_blocks): owner layers 1..device_blocks are also
  // updated on the worker's device. A forward stage's fetch of one of them names pseudo owner
  // device_owner_base + layer - 1, published once the step's norm is known (the device's update
  // takes milliseconds: left out; so is the first step's copy of them from the host); the host
  // updates those layers after every other owner.
  // Backward stages fetch the host's copy. Left out: the state the worker copies in during the
  // backward (12 bytes per covered parameter), which waits for nothing and nothing waits for
  // until the boundary, beside the weight copies on the link.
  int device_blocks = 0;
  int device_owner_base = -1;
  int version_lag = 1;
  bool updates_wait_for_norm = false;
  // Gradients waiting in the workers (ExecutionPlan::gradients_wait_in_workers): no job's commit
  // starts before the step's last gradient job has ended (the norm, from the workers' squares);
  // then the step's commits go last stage first, and each layer is updated once final, as without
  // clipping (updates_wait_for_norm false, no norm work on the host).
  bool commits_wait_for_norm = false;
  // With commits_wait_for_norm: the arena's bytes for stage commits (core::SizeGradArena's chosen
  // less its shared slots), each commit placing its stage's arena_bytes; 0: room for every one.
  double arena_bytes = 0.0;
  // CUDA workers: activation copies run on their own streams and the worker does not wait
  // between microbatches, so a microbatch's input copy overlaps the previous one's compute
  // (only the first of a job is exposed) and its output copy the next one's (a consumer waits
  // for it). Otherwise input copy, compute and output copy run in series (CPU workers).
  bool copies_overlap = false;
  std::vector<JobSlot> order;  // one step's jobs in dispatch order; empty: call by call
  // bench.layer_major_forward (worker::Executor::ForwardLayers): a stage with
  // layer_compute_s, several layers and microbatches runs layer by layer over all its
  // microbatches, each layer once copied, when it could begin (the worker free, its first layer
  // copied, every microbatch's input there) before its last layer is copied (kAuto), or always
  // (kAlways). Its outputs are all there when its last layer ends.
  enum class LayerMajor { kNever, kAuto, kAlways };
  LayerMajor layer_major = LayerMajor::kNever;
  // Several nodes (core::NodesConfig): before its write-back a job's gradients are summed with
  // the other nodes' (a ring: 2 (N - 1) / N of the bytes each way, 2 (N - 1) hops of
  // node_hop_s), one sum at a time per worker, on its gradient stream.
  int nodes = 1;
  double node_link_bytes_per_s = 0.0;  // 0: the sum costs only its hops
  double node_hop_s = 0.0;
  // Sharded optimizer state (ExecutionPlan::sharded_state): per owner layer, the all-gather of its
  // updated shares across the nodes, which a fetch of the layer waits for; layer o's gather runs on
  // worker o mod `workers`, each worker's gathers one at a time in ascending layer order after
  // their updates, beside the optimizer (update_s then holds one node's share of each update).
  // Empty: none.
  std::vector<double> gather_s;
};

// Seconds of one cross-node sum of `bytes` (SimInput::nodes).
double NodeSumSeconds(const SimInput& in, double bytes);
// Seconds of one cross-node all-gather of `bytes` in all (a ring: (N - 1) / N of them in, N - 1
// hops).
double NodeGatherSeconds(const SimInput& in, double bytes);

struct SimResult {
  double makespan = 0.0;      // until the last job, commit and update
  std::vector<double> busy;   // per worker: microbatch time (compute, plus transfers in series)
  double bubble_ratio = 0.0;  // idle / (N x makespan) = fill + drain + imbalance
  double fill_ratio = 0.0;    // idle before a worker's first microbatch
  double drain_ratio = 0.0;   // idle after a worker's last microbatch
  double imbalance_ratio = 0.0;
  std::vector<double> step_done;  // per step: its last microbatch or gradient copy finished
  double steady_step_s = 0.0;  // (step_done[last] - step_done[0]) / (steps - 1); 1 step: makespan
  double steady_bubble_ratio = 0.0;  // 1 - busy per step / (N x steady_step_s)
  // Per worker: the most fp32 gradient bytes of finished jobs waiting on the device for their
  // write-back at one time (device memory on top of the running job's).
  std::vector<double> peak_held_grad_bytes;
};

SimResult Simulate(const SimInput& in);

// The compute-only special case: stage_time[s] seconds per microbatch, one step, no transfers,
// no optimizer.
SimResult SimulateRoundRobin(const std::vector<double>& stage_time, int workers, int microbatches,
                             int calls);

// Bytes of host memory one parameter's AdamW update moves, per kind of pass (optim/adamw.h,
// UpdateWrites): the rate a profile measures (Profile::optimizer_params_per_s) times the bytes
// of the pass it timed is the host's bandwidth for updates, from which the others are priced.
struct UpdatePassBytes {
  double whole = 0.0;   // one pass writing everything
  double first = 0.0;   // the first of two: writes what workers fetch
  double second = 0.0;  // the second: writes the rest
  double Publishing(bool two_passes) const { return two_passes ? first : whole; }
};
UpdatePassBytes UpdateBytesPerParam(const JobConfig& config, const ExecutionPlan& execution);

// The simulator's input for running `plan` on `workers` workers with the costs in `profile`.
SimInput BuildSimInput(const JobConfig& cfg, const ModelSpec& spec, const PipelinePlan& plan,
                       const Profile& profile, int workers, int steps);

// Seconds of modelled activation transfer for one microbatch of `stage`.
double TransferSeconds(const SimStage& stage, double h2d_bytes_per_s, double d2h_bytes_per_s);

}  // namespace rp::core
