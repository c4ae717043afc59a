// SPDX-License-Identifier: Apache-2.0
// The planner behind schedule.partition = "auto" and rp-plan.
//
// It searches the fused tail's size (TailCandidates: a block in the tail runs forward and
// backward in one job and is not recomputed, so a longer tail trades device memory, which the
// estimate checks against schedule.gpu_memory_gb when it is set, for less recompute and a wider
// step boundary)
// and the number of forward and backward stages; for each it tries the equal-layer split and the
// exact min-max split (dynamic programming over contiguous cuts, minimizing the slowest stage), or
// every contiguous split when at most six layers precede the tail (the search is then exact),
// simulates the round-robin schedule (planning/simulator.h) with per-layer costs, drops plans
// whose estimated per-worker memory exceeds schedule.gpu_memory_gb, and keeps the one with the
// shortest steady-state step (fewer stages on ties). Forward cuts are split on forward costs,
// backward cuts on recompute + backward costs. Stage counts go up to what keeps the workers busy
// (2W + 2 forward, 3W + 3 backward); only when none of those plans fits the budget does a second
// search add counts up to a layer per stage, the smallest working set a split can have (a deep
// model on a small card).
//
// Costs come from the measured profile named by schedule.profile (planning/profile.h; the launcher
// points it at a copy of <output_dir>/profile.json so every process of a run reads the same
// numbers), else from the FLOP cost model. Deterministic: every process gets the same plan.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "common/status.h"
#include "config/job_config.h"
#include "planning/plan.h"
#include "planning/profile.h"

namespace rp::core {

// What the memory estimate is made of, for the job on which it peaks (bytes per worker).
struct MemoryEstimate {
  double total = 0.0;         // the peak: the sum of the parts below less not_at_once
  int stage = -1;             // the stage of that job (-1 only for a plan without stages)
  double weights = 0.0;       // its weights on the device, in the compute dtype
  double next_weights = 0.0;  // its worker's next job's, prefetched meanwhile
  double gradients = 0.0;     // weight gradients and their fp32 sums
  double activations = 0.0;   // kept for the backward, held hidden states, the head's loss chunk
  double attention_scores = 0.0;  // of those, CPU workers' explicit attention scores (none on CUDA)
  double resident = 0.0;          // activation slots on the device (activations = worker, pools)
  double staging = 0.0;           // the chunk fp32 masters are rounded through
  // Gradients waiting in the workers (ExecutionPlan::gradients_wait_in_workers): the fp32 sums of
  // the step's other gradient jobs the busiest worker holds until the norm. In stale1 with
  // clipping: the sums of the gradient jobs this job's worker ran earlier in the step, which may
  // wait for the whole previous update (it starts after the previous step's norm).
  double held_gradients = 0.0;
  // Kept blocks (schedule.kept_blocks): every in-flight microbatch's graph of those blocks, and
  // their weights and fp32 sums, held from their forward to their backward.
  double kept = 0.0;
  // schedule.keep_attention: every in-flight microbatch's attention records of the recomputed
  // blocks, held from their forward to their backward (PeakMemory counts them with `kept`).
  double kept_attention = 0.0;
  // schedule.frozen_on_device: the whole frozen base in the compute dtype, kept on the device
  // (and left out of `weights` and `next_weights`).
  double frozen = 0.0;
  // optimizer.device_update_blocks: the covered blocks' state, gradients and next weights
  // (16 bytes plus the compute dtype's per parameter; 12 plus the dtype's when their gradients
  // are among held_gradients), and of that, the next weights alone.
  double device_update = 0.0;
  double device_update_weights = 0.0;
  // Gradients waiting in the workers: the kept graphs (freed by the first backward stages after
  // the tail) and the gradients held for the norm (complete only at the backward's end) peak at
  // different times. held_with_kept is what this step holds while every kept graph is still
  // there (the tail's sums), covered_waiting the covered blocks' fp32 gradients of the previous
  // step, whose commits come last and may still wait through this forward; not_at_once what the
  // sum of the parts (with the simulated gradients waiting for slots,
  // PlanChoice::held_grad_bytes) counts beyond the larger of the two moments. kept_apart says
  // that order holds (no covered block is kept).
  bool kept_apart = false;
  double held_with_kept = 0.0;
  double covered_waiting = 0.0;
  double not_at_once = 0.0;
};

struct PlanChoice {
  PipelinePlan plan;
  double step_seconds = 0.0;        // predicted steady-state step time (simulated over 3 steps)
  double bubble_ratio = 0.0;        // predicted, steady state
  double first_step_seconds = 0.0;  // predicted, one step from idle
  double fill_ratio = 0.0, drain_ratio = 0.0, imbalance_ratio = 0.0;  // one step from idle
  double peak_memory_bytes = 0.0;  // estimated, per worker: PeakMemory(memory, held_grad_bytes)
  MemoryEstimate memory;           // EstimateMemory's parts
  double held_grad_bytes = 0.0;    // the simulated peak of finished jobs' gradients waiting for
                                   // write-back
  std::string cost_source;         // "measured" (profile file) or "cost-model"
  int candidates = 0;              // plans evaluated
};

// The simulator's predictions for running `plan` with `profile` (fills everything but
// `candidates`).
PlanChoice PredictPlan(const JobConfig& config, const PipelinePlan& plan, const Profile& profile,
                       int workers);
// The profile the planner uses for `config`: schedule.profile if set, else the cost model of
// `device` (CUDA workers).
StatusOr<Profile> PlanningProfile(const JobConfig& config, const DeviceModel& device = H200Model());
// The bytes of shared memory a run of `plan` takes (the shm library's PlanSharedBytes: it lays the
// segments out and builds on this library, so the count is passed in).
using SharedBytesOf = std::function<StatusOr<uint64_t>(const JobConfig&, const PipelinePlan&)>;
// The fastest plan by the simulator among those whose estimate fits schedule.gpu_memory_gb and,
// with schedule.host_memory_gb > 0, whose shared memory (`shared_bytes`, which that limit needs:
// an Internal error without it) fits that. Where a backward stage starts, its block's checkpoint
// lives in a host slot, so the host limit trades backward stages for recompute per stage.
StatusOr<PlanChoice> ChoosePlan(const JobConfig& config, int workers, const Profile& profile,
                                const SharedBytesOf& shared_bytes = {});

// The fused tail sizes ChoosePlan may try for a model of `blocks` decoder blocks, ascending. With a
// memory budget (schedule.gpu_memory_gb > 0): every size up to 8 blocks (so every size of a small
// model), then steps of about a third up to every block (a 28-block model: 0-8, 10, 13, 17, 22,
// 28). Without one, 0-3 blocks: a longer tail's memory would be checked against nothing. On a
// model of more than 8 blocks ChoosePlan stops at the first size beyond 3 whose best plan is no
// faster than the previous size's (or fits nowhere), so the search is exhaustive only for small
// models.
std::vector<int> TailCandidates(int blocks, bool memory_bounded);

// Contiguous split of costs[0..n) into `parts` non-empty ranges minimizing the largest range
// sum; returns the start index of each range (first is 0). Exact.
std::vector<int> MinMaxPartition(const std::vector<double>& costs, int parts);

StatusOr<PlanChoice> ChoosePlan(const JobConfig& config, int workers);

// Estimated peak bytes on one of `workers` workers for a plan: the worst stage's weights, fp32
// gradient accumulators and the activations it keeps for its backward (measured saved bytes per
// layer when the profile has them, else an estimate), plus the weights of the job that worker
// runs next (the job `workers` places later in StepJobOrder, prefetched), unless that job is in
// the next step, waits for this step's update (exact mode with clipping) and the running job is
// no layer-major forward job (which reserves it).
MemoryEstimate EstimateMemory(const JobConfig& config, const PipelinePlan& plan, int workers,
                              const Profile* profile = nullptr);
// The peak of `m` (an EstimateMemory result for `config`) with `simulated_held` bytes of
// gradients waiting for write-back (the simulator's peak); sets m->not_at_once. With gradients
// waiting in the workers, the simulated wait includes the wait for the norm: the two are one
// set of tensors, counted once (the larger). EstimateMemory's total is this with none simulated.
double PeakMemory(const JobConfig& config, MemoryEstimate* m, double simulated_held);
// EstimateMemory(...).total.
double EstimatePeakMemory(const JobConfig& config, const PipelinePlan& plan, int workers,
                          const Profile* profile = nullptr);

// train.mlp_tile_tokens = kMlpTileAuto (-1): the largest tile that lets the job's plan fit
// schedule.gpu_memory_gb per worker, written into `config` (ResolveRun does it once, so every
// process of the run reads the chosen value). The candidates, largest first: untiled, then powers
// of two below the microbatch's tokens down to kSmallestAutoMlpTile; a smaller tile never needs
// more memory, so the first that fits is found by bisection. "Fits" is ChoosePlan finding a plan
// (partition = "auto") or the job's own plan's estimate being within the limit ("equal"), under
// the FLOP cost model (DefaultCostModel) even when the job has a measured profile, so that every
// start of a run (the first, --resume, a re-plan) chooses the same tile. With
// schedule.host_memory_gb > 0 and `shared_bytes` (as ChoosePlan takes it) the plan must fit the
// host too: a larger tile that fits the device may leave no plan within the host limit, where a
// smaller one keeps more checkpoints on the device. With
// schedule.keep_attention = -1 too (one worker), a smaller tile is taken instead when it lets more
// blocks keep their attention records and the cost model, which charges a tiled MLP's second
// forward, predicts a shorter step with them. InvalidArgument naming the key when no tile fits.
// Any other value is left as it is.
inline constexpr int64_t kSmallestAutoMlpTile = 512;
Status ResolveMlpTile(JobConfig* config, int workers, const SharedBytesOf& shared_bytes = {});

// schedule.kept_blocks = kKeptBlocksAuto (-1): the most blocks that let the job's plan fit
// schedule.gpu_memory_gb on its one worker (a plan of partition = "auto" chosen with them), by the
// FLOP cost model like ResolveMlpTile and after it (the tile is chosen without kept blocks, which
// then take what memory is left), written into `config`. None (0) with several workers or nodes,
// with train.layer_recompute or a tiled MLP, or past the first mixture-of-experts block below the
// tail. Any other value is left as it is.
Status ResolveKeptBlocks(JobConfig* config, int workers);

// schedule.keep_attention = kKeepAttentionAuto (-1): the most blocks whose attention records let
// the job's plan fit schedule.gpu_memory_gb on its one worker, by the FLOP cost model, written into
// `config`; after ResolveMlpTile and before ResolveKeptBlocks (kept blocks not yet chosen count as
// none), which then takes what memory is left: a record saves a block's attention forward, most
// of its recompute at length, in the memory of one hidden-sized tensor, where a kept graph saves
// the whole recompute in over ten. With schedule.host_memory_gb > 0 and `shared_bytes` (as
// ChoosePlan takes it) the plans must fit the host too: records take the device memory that a
// plan of fewer backward stages, which the host limit may need, would use. None (0) with several
// workers or nodes. Any other value is left as it is.
Status ResolveKeptAttention(JobConfig* config, int workers, const SharedBytesOf& shared_bytes = {});

// optimizer.update_passes = 0 (auto), resolved into `config` as 1 or 2: in exact mode with a
// gradient arena that holds every slot, `plan` (the job's, as MakePlan made it with auto counting
// as two passes) is simulated with each under `profile`, and one pass is chosen only if predicted
// faster (two move more bytes: a CPU optimizer that bounds the step runs longer with them);
// speculative and device updates keep two. Elsewhere one pass, the only one that applies. Both
// give the same bits and the same memory, so `profile` may be a measured one even though a resumed
// run may then choose differently. An explicit 2 where two passes do not apply is refused, naming
// why; explicit values are otherwise left as they are.
struct UpdatePassesChoice {
  bool chosen = false;  // the job left it to the planner
  int64_t passes = 1;   // what the run does
  // Predicted steady steps (seconds) with each, when both apply and the planner chose; else 0.
  double one_pass_step_s = 0.0, two_pass_step_s = 0.0;
};
StatusOr<UpdatePassesChoice> ResolveUpdatePasses(JobConfig* config, int workers,
                                                 const Profile& profile, const PipelinePlan& plan);

// For a LoRA job whose CUDA workers fetch the frozen base with every job: the prediction with
// schedule.frozen_on_device = true instead (ChoosePlan's plan then, under partition = "auto";
// else the job's own plan), when it fits schedule.gpu_memory_gb (if set) and its step is predicted
// at least 1% shorter than `current_step_seconds`. rp-plan and rp-launch --dry-run print it as a
// suggestion; the job's setting is never changed for it. Nothing for CPU workers (their device
// memory is the host memory the base is already in), full fine-tunes, or a base already kept.
std::optional<PlanChoice> FrozenOnDeviceAlternative(const JobConfig& config, int workers,
                                                    const Profile& profile,
                                                    double current_step_seconds,
                                                    const SharedBytesOf& shared_bytes = {});

// The plan a job runs: BuildPlan's for schedule.partition = "equal"; with "auto" the planner
// chooses tail size and cuts for `workers` workers first (ChoosePlan). Every process computes
// the same plan from the same inputs (`shared_bytes` as for ChoosePlan).
StatusOr<PipelinePlan> MakePlan(const JobConfig& config, int workers = 1,
                                const SharedBytesOf& shared_bytes = {});

}  // namespace rp::core
