// SPDX-License-Identifier: Apache-2.0
// Executor: runs one stage job's microbatches against the shared segment.
//
// Contract:
//  * FetchReady(job) copies a job's weights as the optimizer publishes them, layer by layer: the
//    front job's, then the next one's in the worker's queue while the current job computes, so
//    they are resident when Begin(job) makes the compute stream wait for them.
//  * Begin(job) adopts the weights FetchReady(job) copied (all of them, or for a layer-major job
//    the first layers, see Startable); Microbatch(m) computes microbatch m (its input must be in
//    its slot: the coordinator said InputReady); StartCommit() writes the job's gradients into
//    the shared gradient slots; End() drops the weights.
//  * Forward stages write hidden states (stage output and checkpoints). The fused tail and
//    backward stages write input gradients; their parameter gradients accumulate on the device
//    in fp32 over the job's microbatches (with the device's fused kernels the projections' GEMMs
//    add into the fp32 sums directly; otherwise bf16 weights produce bf16 gradients per
//    microbatch, folded in) and reach shared memory only through StartCommit(), so a job that
//    dies mid-way commits nothing.
//  * Kept blocks (PipelinePlan::kept_start, schedule.kept_blocks): a forward stage runs those
//    layers with autograd, their trainable weights requiring gradients, and keeps each
//    microbatch's graph (and the weights and their fp32 sums) after the job ends, keyed by step,
//    call and layer. A backward stage whose kept layers were all kept for every microbatch at its
//    weights version adopts them: it fetches and recomputes only the layers below them, and
//    backpropagates through the kept graphs into the kept sums, which it then commits as its own.
//    Otherwise (this worker replaced the one that ran the forward) it drops what it finds and
//    recomputes from the checkpoint as without the key: the same operations on the same inputs.
//  * Activations between stages go through the shared-memory slots, or with
//    schedule.activations = "worker" stay in this process's device memory (one worker only), or
//    with activation pools (schedule.activations = "cuda_ipc") are written to this
//    worker's pool and read from the pool of the worker that produced them, which the
//    coordinator names per microbatch (InputSources, from InputReady).
//  * LibTorch and Device errors (exceptions) become Internal at the worker's one exception
//    boundary (gpu_worker/guarded.h), naming the job and microbatch or layer; nothing throws out.
//  * Single-threaded.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <functional>
#include <map>
#include <memory>
#include <tuple>
#include <vector>

#include "common/status.h"
#include "config/job_config.h"
#include "config/model_spec.h"
#include "planning/plan.h"
#include "gpu_worker/activation_store.h"
#include "gpu_worker/device.h"
#include "gpu_worker/device_update.h"
#include "model/transformer.h"
#include "protocol/messages.h"
#include "shm/layout.h"
#include "shm/segment.h"

namespace rp::worker {

struct MicrobatchResult {
  double loss_sum = 0.0;
  // Fused tail with the routers' load-balancing loss: its term in loss_sum's units (the loss
  // divided by RunJob.loss_scale), already in loss_sum and added again when Resolve() reads a
  // pending sum.
  double aux_loss_sum = 0.0;
  int64_t targets = 0;
  std::vector<proto::LayerTime> layer_times;  // jobs with RunJob.profile set: one per layer phase
  // Microbatch(): the microbatch's work is enqueued, not done. It is done (stores in shared
  // memory or the pool, inputs read) once device.Completed(fence); then Resolve() fills
  // loss_sum and targets from `pending_loss` (a fused head's sums, copied to pinned host memory
  // by the same stream), if any, and layer_times from the device marks of a profiled job (read
  // only now, so profiling waits for nothing either). The caller clears the device's marks once
  // no result in flight has any pending.
  uint64_t fence = 0;
  at::Tensor pending_loss;
  struct PendingMarks {
    proto::LayerTime time;  // all but `seconds`
    int mark_a, mark_b;
  };
  std::vector<PendingMarks> pending_marks;
  // A layer-major job's first result: device marks around each batch of layers it enqueued;
  // Resolve() sums them into busy_s (the seconds the device computed the job; -1: not known).
  std::vector<std::pair<int, int>> busy_marks;
  double busy_s = -1.0;
  // Every result of a layer-major job: its microbatches were not computed one after another, so
  // none has an interval of its own (the worker flags its MicrobatchDone).
  bool layer_major = false;
  bool HasPendingMarks() const { return !pending_marks.empty() || !busy_marks.empty(); }
  void Resolve(Device& device);
};

// Where a microbatch's inputs are with activation pools: the ranks whose pools hold its hidden
// state and its incoming gradient (proto::kFromHostSlot where the input is not in a pool).
struct InputSources {
  int hidden_rank = proto::kFromHostSlot;
  int grad_rank = proto::kFromHostSlot;
};

class Executor {
 public:
  Executor(const core::JobConfig& cfg, const core::ExecutionPlan& execution,
           const core::ModelSpec& spec, const core::PipelinePlan& plan,
           const shm::ArenaLayout& layout, const shm::Segment& segment, Device& device);

  // Starts copying the job's stage weights, layer by layer as the optimizer finishes each layer
  // at the version the job needs (exact mode: step t reads weights holding t updates), so the
  // copies of a stage's first layers overlap the updates of its later ones instead of waiting
  // for the last. Call again until *complete; Begin(job) then adopts the weights. One job's
  // fetch is kept at a time (a call for another job drops a partial one). Never blocks.
  Status FetchReady(const proto::RunJob& job, bool* complete);
  // RunEval: true once every layer holds `job.weights_version` updates. Evaluate() runs the eval
  // microbatch in its slot through every layer (fetching one layer's weights at a time, no
  // autograd, no dropout) and returns its summed loss; it leaves a prefetched job alone.
  bool WeightsReady(const proto::RunEval& job) const;
  // `between_layers` runs after each layer (the worker's heartbeat: an eval of a large model on
  // a slow device can take longer than the hang timeout).
  StatusOr<MicrobatchResult> Evaluate(const proto::RunEval& job,
                                      const std::function<void()>& between_layers);
  // Runs after each layer phase of a training microbatch: the worker's heartbeat. On a device
  // that computes as it is called (the CPU), one long stage (a long sequence) would otherwise
  // send nothing for longer than job.worker_timeout_s and be taken for a hung worker.
  void SetBetweenLayers(std::function<void()> f) { between_layers_ = std::move(f); }
  // Whether Begin(job, all_inputs_ready) may adopt the weights FetchReady(job) has copied so
  // far: all of them, or for a job that may run layer-major (LayerMajorEligible) with every
  // microbatch's input ready, at least its first layer. With RP_LAYER_MAJOR_FORWARD=always an
  // eligible job also needs every input, complete weights or not.
  bool Startable(const proto::RunJob& job, bool all_inputs_ready) const;
  // Begins `job`; layer-major (LayerMajorBegun) when it is eligible, every input is ready and
  // its weights are still incomplete (RP_LAYER_MAJOR_FORWARD=auto), or always
  // ("always").
  Status Begin(const proto::RunJob& job, bool all_inputs_ready);
  // Layer-major jobs (bench.layer_major_forward): forward stages with several
  // layers and microbatches. In exact mode the optimizer publishes the next step's layers one
  // by one at the step boundary, slower than a bandwidth-bound first pass over a large model lets
  // the forward compute them. Run microbatch by microbatch, a stage could only start once its
  // last layer was published; run layer by layer over every microbatch (ForwardLayers), each
  // layer computes as soon as it is copied, while the optimizer updates the next, and the
  // forward ends one layer after the optimizer's last instead of one stage after. The same
  // operations on the same inputs: the microbatch order's results bit for bit. Costs device
  // memory for every microbatch's hidden state at once (M x microbatch_size x seq_len x hidden
  // in train.dtype), and waits for every microbatch's input (with several workers a stage may
  // then start later than its first microbatch could: auto runs layer-major only while weights
  // are still being published, when the stage could not start anyway). Profiled jobs run
  // layer-major too, each layer of each microbatch timed on its own: kept in the microbatch
  // order, a profiled step made such a stage wait for its last layer, so every profile (and
  // every re-profile after drift) cost the plans that rely on it a slower step.
  bool LayerMajorEligible(const proto::RunJob& job) const;
  // Makes `job`'s weight destinations now (Device::EmptyWeights), for FetchReady(job) to copy
  // into later. Called for the next job when a layer-major job begins: made later, while that
  // job's layers are queued, their copies would wait for all of its compute (on the Qwen3-1.7B
  // job that cost the gain of running layer-major). It holds them longer than the prefetch
  // would, but only in the forward, where the device holds the least.
  Status Reserve(const proto::RunJob& job);
  bool LayerMajorBegun() const { return lm_.job; }
  // Bytes of frozen weights kept on the device (ExecutionPlan::frozen_on_device); 0 otherwise.
  int64_t FrozenKeptBytes() const {
    int64_t n = 0;
    for (const auto& [param, t] : frozen_kept_) n += static_cast<int64_t>(t.nbytes());
    return n;
  }
  // A begun layer-major job with layers still to copy: the next job's prefetch waits, so that a
  // layer published now goes first on the weights stream (its copy is what the job waits for).
  bool LayerMajorCopying() const {
    return lm_.job && stage_.begin + static_cast<int>(current_.layers.size()) < stage_.end;
  }
  // A begun layer-major job: copies the layers published since the last call, enqueues each
  // copied layer for every microbatch (the first layer's inputs: token slots, or each
  // microbatch's hidden state from `inputs`), and once the stage's last layer is enqueued sets
  // *done and returns one result per microbatch, all with the same fence. Never blocks.
  // The first result's busy_marks bracket the device's work for the job (its busy_s once
  // resolved): the worker reports the job's microbatches as one interval of that length ending
  // when they complete, so the bubble ratio counts the waits for unpublished layers as idle and
  // the computing between them as busy. Without the marks' figure the interval starts at
  // StallEndUs(): WallMicros() when the job last found its next layer published after waiting
  // for it (else when it began), which counts earlier layers' computing as idle too.
  StatusOr<std::vector<MicrobatchResult>> ForwardLayers(const std::map<int, InputSources>& inputs,
                                                        bool* done);
  int64_t StallEndUs() const { return lm_.stall_end_us; }
  // Device marks the begun layer-major job has made and not yet handed to a result: the
  // device's marks must not be cleared meanwhile.
  bool HoldsMarks() const {
    return !lm_.busy_marks.empty() || std::any_of(lm_.layer_marks.begin(), lm_.layer_marks.end(),
                                                  [](const auto& m) { return !m.empty(); });
  }
  // Enqueues microbatch `mb` and returns without waiting for the device (see MicrobatchResult);
  // the next microbatch, or the next job's, may be enqueued at once.
  StatusOr<MicrobatchResult> Microbatch(int mb, InputSources from = {});
  // Starts writing (accumulate = false) or adding the job's gradients into the shared slots and
  // releases the job's weights; the next job may Begin at once. Done when
  // device.CommitDone(ticket) is true.
  // Ends a finished tail/backward job but keeps its gradients (on the device) for a later
  // StartCommit(job_index, ...): the commit grant may arrive while the next job computes.
  // Fails only where the device update cannot hold the job's gradients (UseDeviceUpdate).
  Status Detach();
  StatusOr<uint64_t> StartCommit(int64_t job_index, bool accumulate);
  // optimizer.device_update_blocks: `update` (owned by the worker, outliving this) prefetches
  // the covered layers' state when a gradient job's weights are all copied, holds their
  // gradients when the job is detached (before its commit), and its weights serve forward stages
  // and evals of the next version (backward stages and the tail fetch the host's, whose version
  // also says the state is there).
  void UseDeviceUpdate(DeviceUpdate* update) { device_update_ = update; }
  // The dtype of the weights a job computes with (what the device update writes).
  at::ScalarType weights_dtype() const { return act_dtype_; }
  // StepUpdate: the covered layers' next weights from the step's held gradients.
  Status ApplyStepUpdate(const proto::StepUpdate& u);
  // Several nodes: the held gradients of `job_index` gathered into one fp32 tensor, which they
  // then view (a parameter the job did not reach holds zeros), so summing it across the nodes
  // in place sums what StartCommit writes. On the worker's device (CPU, or its GPU).
  StatusOr<at::Tensor> GatherHeld(int64_t job_index);
  // optimizer.gradients_wait_in = "workers" and share-sized slots: starts the squared sums of
  // the optimizer chunks of every gradient `job_index` holds, into their places in `table`
  // (ArenaLayout::GradSquares of the job's step); a parameter the job did not reach gets zeros.
  // Call it once the job's microbatches are complete. The sums are written once
  // Device::SquaresDone(returned ticket) is true.
  StatusOr<uint64_t> StartChunkSquares(int64_t job_index, double* table);
  void End();
  bool HasGrads() const;

 private:
  at::Tensor Tokens(int mb, bool labels);
  // [microbatch_size, seq_len, hidden]: every hidden-state and input-gradient slot.
  std::vector<int64_t> ActivationShape() const {
    return {cfg_.train.microbatch_size, cfg_.data.seq_len, cfg_.model.hidden_size};
  }
  at::Tensor Hidden(int mb, int boundary);
  // The stage's input for microbatch `mb`: its token slot (a stage from the embedding) or the
  // hidden state at the stage's first layer (from from_'s producer).
  at::Tensor StageInput(int mb);
  // What the layer math needs to know of microbatch `mb` of the current job: its LoRA dropout
  // masks' key (model::DropoutKey) and its documents (model/documents.h, built once per
  // microbatch and kept while its step may still run here).
  void SetMicrobatchFor(int mb);
  // The documents of the microbatch whose positions are at `positions` in the state segment.
  model::Documents DocumentsAt(uint64_t positions);
  at::Tensor InputGrad(int mb, int boundary);
  void StoreHidden(int mb, int boundary, const at::Tensor& t);
  // The routers' load-balancing loss (shm::ArenaLayout router statistics): a forward of sparse
  // block `l` leaves its statistics in the microbatch's slot; the microbatch's tail and backward
  // stages read every block's back as the loss and its gradient (model::RouterAuxLoss).
  void StoreRouterStats(int mb, int l);
  model::RouterAux ReadRouterAux(int mb) const;
  // The gradient of ReadRouterAux on `like`'s device, set on the math for this microbatch's
  // backward (undefined without the loss).
  // fp16: what this job's step multiplies its loss by (shm::LossScaleRecord); 1 otherwise.
  double StepLossScale() const;
  at::Tensor RouterAuxGrad(const model::RouterAux& aux, const at::Tensor& like);
  void StoreInputGrad(int mb, int boundary, const at::Tensor& t);
  MicrobatchResult RunForward(int mb);
  MicrobatchResult RunTail(int mb);
  MicrobatchResult RunBackward(int mb);
  struct Segments {
    std::vector<at::Tensor> inputs, outputs;  // per layer of the stage, in layer order
    // train.layer_recompute: `inputs` without graphs, `outputs` only the last layer's.
    bool layerwise = false;
  };
  void SegmentedForward(const at::Tensor& x, int end, Segments* seg);
  at::Tensor SegmentedBackward(Segments* seg, at::Tensor grad);
  // Profiling (RunJob.profile): device marks around each layer phase, read once the
  // microbatch's completion fence has passed (MicrobatchResult::Resolve).
  int MarkIfProfiling();
  MicrobatchResult::PendingMarks LayerMarks(int layer, proto::LayerPhase phase, int mark_a,
                                            int mark_b, int64_t saved_bytes, int mb) const;
  // Adds the marks to pending_marks_ (the microbatch is filled in by Microbatch()).
  void Timed(int layer, proto::LayerPhase phase, int mark_a, int mark_b, int64_t saved_bytes);
  std::vector<MicrobatchResult::PendingMarks> pending_marks_;  // this microbatch's, so far
  std::function<void()> between_layers_;
  Status Validate(const proto::RunJob& job) const;
  struct GradUse {
    at::Tensor weight;
    int grad_slot;
    int layer;
    at::Tensor accum;  // fp32 sum over the job's microbatches
    // Summed by the GEMM itself (model::Transformer::SetWeightGradSinks): accum is made at Begin
    // and weight.grad stays undefined.
    bool sink = false;
  };
  struct StageWeights {
    int64_t job_index = -1;
    bool complete = false;  // every layer's copy is enqueued and `fence` follows them
    uint64_t fence = 0;
    std::vector<model::LayerWeights> layers;  // per layer of the stage, copied so far
    // Destinations (EmptyLayer) of the stage's layers, made together at its first ready layer;
    // an entry is moved out when its layer is copied.
    std::vector<std::vector<at::Tensor>> empty;
    std::vector<GradUse> grads;
    // A backward job: the first layer it adopts from kept_ (the stage's end when none), decided
    // at its first fetch; the layers below it are fetched. The adopted layers' segments, in
    // layer order (their gradients are in `grads`).
    bool kept_decided = false;
    int fetch_end = -1;
    std::vector<std::vector<std::pair<at::Tensor, at::Tensor>>>
        kept_segments;  // [layer][mb]: (input, output)
  };
  // One kept layer's forward (see the contract above): its trainable weights' gradient uses and
  // each microbatch's (input, output), filled as the forward stage computes them.
  struct KeptLayer {
    int64_t weights_version = -1;
    std::vector<GradUse> grads;
    std::vector<std::pair<at::Tensor, at::Tensor>> segments;  // by microbatch
  };
  using KeptKey = std::tuple<int64_t, int, int>;  // step, call, layer
  std::map<KeptKey, KeptLayer> kept_;
  // The first layer of `st` that keeps its graph (its end when none does).
  int KeptFrom(const core::Stage& st) const {
    return std::clamp(plan_.kept_start, st.begin, st.end);
  }
  // The end of the layers a job of `st` fetches: below its adopted kept layers.
  static int FetchEnd(const core::Stage& st, const StageWeights& w) {
    return w.fetch_end >= 0 ? w.fetch_end : st.end;
  }
  // Runs kept layer `l` of the current forward job for microbatch `mb` with autograd and keeps
  // the graph; returns the output, detached.
  at::Tensor KeptLayerForward(int l, int mb, const at::Tensor& x);
  // A backward job's first fetch: adopts its kept layers into `w` when every one of them holds
  // every microbatch at the job's weights version, else drops them (the job recomputes).
  void AdoptKept(const proto::RunJob& job, StageWeights* w);
  // The current job's trainable weights that have a sink but no sum yet: zeroed fp32 sums,
  // registered with the math (a layer-major job copies its layers after it began).
  void StartSinks();
  // Forgets next_ (another job's fetch, partial or unused) safely for the device allocator.
  void DropNext();
  // ExecutionPlan::frozen_on_device: copies the whole frozen base into frozen_kept_ once, at the
  // worker's first fetch or eval; Unavailable naming the option when the device cannot hold it.
  Status KeepFrozenBase();
  // Whether every weight layer `l` reads holds `version` updates (with `device_weights`, weights
  // the device update kept at that version count).
  bool LayerReady(int l, int64_t version, bool device_weights = false) const;
  // Layer `layer`'s weights at `weights_version`, copied into `dst` (EmptyLayer's tensors; made
  // here if empty); with `grads`, trainable ones require gradients and are recorded in `into`
  // (which may be null without `grads`). With `map_lookup` (a stage job's fetch) the embedding
  // layer is mapped (MapsLookup), not copied.
  // With `device_weights`, a weight the device update kept at `weights_version` is copied from
  // there instead of the segment.
  model::LayerWeights FetchLayer(int layer, int64_t weights_version, bool grads, StageWeights* into,
                                 std::vector<at::Tensor> dst = {}, bool map_lookup = false,
                                 bool device_weights = false);
  // Whether a stage job reads layer `l`'s weights in place instead of copying them: the
  // embedding's table under ExecutionPlan::lookup_from_host (Device::MapWeights). Its readiness is
  // then the lookup version (shm/layout.h), and it has no destination.
  bool MapsLookup(int l) const { return l == 0 && layout_.lookup_from_host; }
  // Uninitialized device tensors for layer `layer`'s weights, in FetchLayer's order.
  std::vector<at::Tensor> EmptyLayer(int layer);
  // w->empty for stage `st`: EmptyLayer of each layer from `from` to the stage's end.
  void MakeDestinations(const core::Stage& st, int from, StageWeights* w);
  // Copies stage `st`'s layers after those in `w` while they are published at `weights_version`
  // (the stage's destinations all made at the first); whether it copied any.
  bool CopyReadyLayers(const core::Stage& st, int64_t weights_version, bool grads, StageWeights* w);
  void AccumulateGrads();

  const core::JobConfig& cfg_;
  const core::ExecutionPlan execution_;
  const core::RoundShape round_;  // core::Round(cfg_), decided once
  const core::ModelSpec& spec_;
  const core::PipelinePlan& plan_;
  const shm::ArenaLayout& layout_;
  const shm::Segment& segment_;
  Device& device_;
  model::Transformer math_;
  // What shared memory and activation pools hold (train.dtype), and what the math runs in: the
  // same, except fp16 and bf16 on a CPU worker, which emulates them (LibTorch's CPU kernels lack
  // fp16 math and run bf16 slowly): fp32 arithmetic on weights rounded to the 16-bit type and on
  // stage inputs and gradients stored in it.
  at::ScalarType store_dtype_;
  at::ScalarType act_dtype_;
  at::ScalarType
      weights_dtype_;  // what the segment holds for trainable weights (fp32 masters or train.dtype)
  bool emulate_half_ = false;       // fp16 or bf16 on a CPU worker (above)
  bool weight_grad_sinks_ = false;  // the device's fused kernels sum projection gradients
  // ExecutionPlan::frozen_on_device: every frozen tensor, by frozen parameter index
  // (KeepFrozenBase); EmptyLayer then makes no destination for them. Read-only for the math, so
  // every job and eval shares the one copy.
  const bool frozen_on_device_;
  std::map<int, at::Tensor> frozen_kept_;
  // Where the tensors between stages live (schedule.activations), chosen once.
  std::unique_ptr<ActivationStore> activations_;

  proto::RunJob job_{};
  // SetMicrobatchFor's documents by (step, call, microbatch); entries of steps before the
  // previous one are dropped.
  std::map<std::tuple<int64_t, int64_t, int>, model::Documents> documents_;
  // schedule.keep_attention: what forward stages recorded of each block's attention, by (step,
  // call, microbatch), for the backward stage of the same microbatch (which takes the records out
  // as its recompute uses them and drops the rest of its layers'). A forward job drops those of
  // earlier steps: a backward stage that ran on another worker recomputed them.
  struct KeptAttention {
    int64_t weights_version = -1;
    model::AttentionRecords layers;
  };
  std::map<std::tuple<int64_t, int64_t, int>, KeptAttention> attention_;
  // The current microbatch's records (SetMicrobatchFor) and, in a backward stage, dropping what is
  // left of its layers' once its microbatch is done.
  void UseAttentionRecords(int mb);
  void DropAttentionRecords(int mb);
  core::Stage stage_{};
  InputSources from_{};  // the microbatch being computed's
  StageWeights current_, next_;
  struct HeldGrad {
    at::Tensor
        accum;  // undefined if the stage never produced this gradient (a sink is always defined)
    int grad_slot;
    std::vector<int64_t> shape;
    at::TensorOptions options;
  };
  std::map<int64_t, std::vector<HeldGrad>> held_;  // by job index
  DeviceUpdate* device_update_ = nullptr;          // UseDeviceUpdate
  // The begun layer-major job's state (ForwardLayers): the next layer to enqueue, every
  // microbatch's hidden state after the layers enqueued so far, whether the last call found a
  // layer unpublished, and when waiting last ended.
  struct LayerMajor {
    bool job = false;
    int next_layer = 0;
    std::vector<at::Tensor> hidden;
    bool stalled = false;
    int64_t stall_end_us = 0;
    std::vector<std::pair<int, int>> busy_marks;
    std::vector<std::vector<MicrobatchResult::PendingMarks>>
        layer_marks;  // profiled: per microbatch
  };
  LayerMajor lm_;
};

}  // namespace rp::worker
