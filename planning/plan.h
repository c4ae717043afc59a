// SPDX-License-Identifier: Apache-2.0
// PipelinePlan: layers -> stages, which activations cross stage boundaries, and the round-robin
// dispatch rule.
//
// Layers are numbered 0 = embedding, 1..L = decoder blocks, L+1 = head; "boundary b" is the
// hidden state entering layer b. Stages of one accumulation call run as a chain:
//   F_0 .. F_{f-1}   forward stages, ascending layer ranges covering [0, tail_start)
//   T                the fused tail: forward of [tail_start, L+2), loss, backward (no recompute)
//   B_1 .. B_b       backward stages, descending ranges covering [0, tail_start), each
//                    recomputing its layers from a checkpoint then backpropagating
// Microbatch m of chain position k starts after microbatch m of position k-1, so the chain order
// is the only dependency inside a call.
//
// Dispatch: the k-th stage job launched since the run began (counting across calls and steps)
// runs on worker (cursor0 + k) mod N. One rule, one place: WorkerForJob().
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"
#include "config/job_config.h"

namespace rp::core {

enum class StageKind : uint8_t { kForward = 0, kFusedTail = 1, kBackward = 2 };
const char* StageKindName(StageKind k);

struct Stage {
  StageKind kind;
  int begin;                     // first layer
  int end;                       // one past the last layer
  std::string Describe() const;  // "F[0,7)", "T[28,30)", "B[0,4)"
};

struct PipelinePlan {
  int num_layers = 0;  // pipeline layers (L + 2)
  int tail_start = 0;
  // Layers [kept_start, tail_start) keep their forward graphs until their backward
  // (schedule.kept_blocks): their forward stage runs them with autograd and the backward stages
  // backpropagate through those graphs instead of recomputing. tail_start (or above) when none.
  int kept_start = 1 << 30;
  std::vector<Stage> stages;           // chain order: forward, tail, backward
  std::vector<int> hidden_boundaries;  // boundaries stored in activation slots, ascending
  std::vector<int> grad_boundaries;    // boundaries whose input-gradient crosses stages

  int NumForward() const;
  // Activation slots one microbatch needs (shm/layout.h): every hidden boundary, plus input-
  // gradient slots used alternately (boundary index i in slot i % 2; a chain writes descending
  // boundaries, so two suffice).
  int InputGradSlotsPerMicrobatch() const {
    return grad_boundaries.size() < 2 ? static_cast<int>(grad_boundaries.size()) : 2;
  }
  int ActivationSlotsPerMicrobatch() const {
    return static_cast<int>(hidden_boundaries.size()) + InputGradSlotsPerMicrobatch();
  }
  // Slot index of boundary b in hidden_boundaries / grad_boundaries, or -1.
  int HiddenSlot(int b) const;
  int GradSlot(int b) const;
  // True if a forward stage must save the hidden state entering layer b (a checkpoint for a
  // backward stage that starts there).
  bool IsCheckpoint(int b) const;
  bool KeepsGraph(int layer) const { return layer >= kept_start && layer < tail_start; }
  std::string Describe() const;
};

// PipelinePlan::kept_start for a tail starting at layer `tail_start`: schedule.kept_blocks layers
// below it, never the embedding nor a mixture-of-experts block (the planner's probes move the tail,
// and with it the range, onto blocks the job's own check did not see).
int KeptStart(const JobConfig& config, int tail_start);

// schedule.keep_attention: the first block whose forward keeps its attention for its backward
// stage. Those blocks are the keep_attention blocks just below the kept blocks (or the tail), so
// their records wait the least: [KeptAttentionStart, min(kept_start, tail_start)). 0, or
// kKeepAttentionAuto not yet resolved: none (min(kept_start, tail_start)).
int KeptAttentionStart(const JobConfig& config, const PipelinePlan& plan);
inline bool KeepsAttention(const JobConfig& config, const PipelinePlan& plan, int layer) {
  return layer >= KeptAttentionStart(config, plan) &&
         layer < std::min(plan.kept_start, plan.tail_start);
}

// The plan for the config's explicit cuts or equal stage counts (what "auto" evaluates; the
// plan of a job is planning/partitioner.h's MakePlan). Never drops or duplicates a layer: each of
// forward and backward covers [0, tail_start) exactly once.
StatusOr<PipelinePlan> BuildPlan(const JobConfig& config);

// Splits [0, n) into `parts` contiguous ranges whose sizes differ by at most one (larger first).
std::vector<int> EqualCuts(int n, int parts);

// One step's stage jobs in dispatch order (so in each worker's queue order): (call, stage).
// Sequential: call by call, each call's chain in order. Interleaved (K >= 2): calls in pairs
// (2i, 2i+1); the pair's forward stages alternate stage by stage (F_0 of 2i, F_0 of 2i+1, F_1 of
// 2i, ...), then call 2i's tail and backward stages, then call 2i+1's. In exact mode the
// optimizer publishes a step's weights layer by layer after the last gradient (with clipping),
// and the forward of one call over a stage is shorter than the stage's update: with two calls'
// forward work queued per stage (on one worker: back to back) the workers keep up with the
// optimizer instead of waiting for it.
// Every job still follows the jobs it depends on (its call's previous stage, the same stage of
// the previous call for accumulation, the call two earlier for its activation slots), so no
// order of workers can deadlock; only two calls are in flight, as with two slot parities.
struct JobSlot {
  int call;
  int stage;
};
std::vector<JobSlot> StepJobOrder(const PipelinePlan& plan, int calls, bool interleave);

// Whether a job of `stage` over `microbatches` may run layer-major (bench.layer_major_forward,
// worker::Executor::ForwardLayers): a forward stage of several layers and microbatches. The
// worker decides per job from what is ready; the planner's memory estimate counts it wherever
// it may.
inline bool MayRunLayerMajor(const JobConfig& c, const Stage& stage, int64_t microbatches) {
  return c.bench.layer_major_forward != core::Tristate::kNever &&
         stage.kind == StageKind::kForward && stage.end - stage.begin > 1 && microbatches > 1;
}

inline int WorkerForJob(int64_t job_index, int cursor0, int num_workers) {
  return static_cast<int>((cursor0 + job_index) % num_workers);
}

}  // namespace rp::core
