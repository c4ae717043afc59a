// SPDX-License-Identifier: Apache-2.0
// The two shared-memory segments of a run: header POD and arena layouts.
//
// Segment "rp-<session>-state" (one per run, created 0600 by the coordinator before any worker
// attaches, never resized; see docs/architecture.md, "The shared-memory segments"). Workers map it
// and pin it for DMA, so it holds only what workers read or write:
//
//   [0, 4096)            SegmentHeader (below)
//   layer versions       std::atomic<uint64_t> per pipeline layer: the number of optimizer
//                        updates its owned parameters' compute copies hold. Written only by the
//                        coordinator (release), read by workers (acquire) before a weight fetch.
//   gathered versions    sharded state only (ExecutionPlan): std::atomic<uint64_t> per
//                        pipeline layer, the number of updates every node's shares of the
//                        layer's compute copies hold here. Layer versions then count this node's
//                        own shares; the worker that gathers the layer (GatheringWorker) stores
//                        this (release) once the other nodes' shares are in. What workers wait
//                        for before a fetch (fetch_versions).
//   lookup version       std::atomic<uint64_t>, one word after the layer versions: the number
//                        of updates the embedding's rows of the next step's tokens hold (>= the
//                        embedding layer's version; ahead of it while the optimizer updates those
//                        rows first, lookup_from_host). What a stage that looks up from host memory
//                        waits for instead of the embedding layer's version.
//   gradient table       std::atomic<uint64_t> per gradient slot (a parameter use by a layer):
//                        where in the gradient arena the slot lives this step. Written by the
//                        coordinator before it grants the commit that fills the slot.
//   compute copies       per parameter, in parameter order (so one layer's weights are one
//                        contiguous run), dtype = train.dtype; what workers fetch. In stale1
//                        mode and with optimizer.speculative_update a second such region
//                        follows (double buffer by version parity).
//                        When workers fetch the masters (ExecutionPlan) this region
//                        holds the fp32 masters instead, and there is no compute copy anywhere;
//                        with two buffers (speculative_update) the masters holding
//                        v updates are in buffer v % 2, and the update reads one and writes the
//                        other
//   frozen weights       LoRA only: the base model's compute copies (dtype = train.dtype), one
//                        buffer, written once at start and never updated (no version, no master)
//   gradient arena       fp32 gradient slots, placed by the coordinator when a commit is granted
//                        and released when the parameter's update is done, so only the layers
//                        in flight hold host memory (gradient streaming; see GradArenaBytes)
//   token / label / position slots
//                        int64 [P parities][M microbatches][microbatch_size * seq_len] each;
//                        positions are the tokens' RoPE positions, which also tell the packed
//                        documents apart (io/data.h, model/documents.h)
//   eval slots           int64 tokens, then labels, then positions [train.eval_microbatches]
//                        [microbatch_size * seq_len] when train.eval_every > 0 (RunEval jobs)
//   hidden slots         [P][M][plan.hidden_boundaries][microbatch_size * seq_len * hidden]
//   input-grad slots     [P][M][2][microbatch_size * seq_len * hidden]: boundary index i of
//                        plan.grad_boundaries uses slot i % 2. A microbatch's backward chain is
//                        sequential and writes descending boundaries, so when a stage writes
//                        slot i % 2 the gradient that last used it (boundary i + 2) has been read.
//                        (Hidden and input-grad slots: none here with schedule.activations =
//                        "worker", which keeps them, indexed alike, in the one worker's memory.)
//   router statistics    mixture of experts with the routers' load-balancing loss only: fp64
//                        [P][M][sparse blocks][2][experts], each block's choices per expert and
//                        summed probabilities for the microbatch (model::Transformer::
//                        RouterStats), written by the stage that runs the block's forward (a
//                        forward stage or the fused tail) and read by the microbatch's fused tail
//                        and backward stages, which all run after its last forward.
//   loss scaling         fp16 only (core::ScalesLoss): one LossScaleRecord (below).
//   gradient squares     optimizer.gradients_wait_in = "workers", or sharded gradient slots
//                        (sharded_gradients): fp64 [2 step parities][square chunks]: the
//                        squared sum of each kSquareChunkElems-element chunk of every parameter's
//                        (summed) gradient, parameter order, then chunk order. "workers": written
//                        by the worker holding the gradient before it reports GradsReady, read by
//                        the coordinator once every gradient of the step is reported; step t + 2
//                        writes a parity only after step t's commits were granted, which waited
//                        for the read. Sharded slots: written by the worker before it commits the
//                        gradient's share, read by the optimizer when the parameter's slot is
//                        final (AsyncOptimizer::SlotFinal); step t + 2 writes a parameter's
//                        squares from a job whose layers hold weights that followed that
//                        parameter's update of step t, which follows the read.
//
// Segment "rp-<session>-optim" (written by the coordinator only; workers map it only with
// optimizer.device_update_blocks, read-only, and pin just the covered blocks' arrays, so they
// cannot corrupt it): fp32 masters (unless workers fetch them, above), then the optimizer state
// (AdamW m and v; SGD momentum in m). With sharded state each holds only this node's share of
// each parameter (core::ShardOf), element e of the parameter at (e - share.begin) * 4.
//
// Every array starts on a kArenaAlign boundary. Accumulation call g uses parity g % P, so with
// P = 2 call g+1 can fill its slots while call g drains. P = 1 in exact mode with one call per
// step: there the next call's first stage waits for the embedding's update, which follows the
// last stage of the previous call, so a second set of slots would never be used concurrently. The
// layout is a pure function of the job config; its hash is stored in the header and every attacher
// recomputes and compares it, so a worker built or configured differently refuses to attach instead
// of reading garbage. No interprocess mutexes live here: single-writer fields and control messages
// only.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"
#include "config/job_config.h"
#include "config/model_spec.h"
#include "planning/grad_arena.h"
#include "planning/partitioner.h"
#include "planning/plan.h"

namespace rp::shm {

inline constexpr uint64_t kSegmentMagic = 0x3174536550695052ull;  // "RPiPeSt1"
inline constexpr uint32_t kSegmentVersion = 4;
inline constexpr uint64_t kHeaderBytes = 4096;
inline constexpr uint64_t kArenaAlign = 4096;
static_assert(kArenaAlign == core::kGradArenaAlign,
              "the gradient arena is sized in the segment's placement unit");
// The optimizer's chunk of a parameter that is not row-summed (optim/optimizer_step.h
// checks that they agree): the unit of the gradient squares' table.
inline constexpr int64_t kSquareChunkElems = int64_t{1} << 20;

struct SegmentHeader {
  uint64_t magic;
  uint32_t version;
  uint32_t header_bytes;
  uint64_t layout_hash;
  uint64_t total_bytes;
  uint64_t trainable_params;
  int32_t coordinator_pid;
  uint32_t reserved0;
  // Set to 1 by the coordinator (release) after the arenas hold initialized weights.
  std::atomic<uint32_t> ready;
  uint32_t reserved1;
  char session[48];
};
static_assert(sizeof(std::atomic<uint32_t>) == 4 && std::atomic<uint32_t>::is_always_lock_free,
              "the header's flag must be a plain lock-free word to be shared across processes");
static_assert(offsetof(SegmentHeader, magic) == 0);
static_assert(offsetof(SegmentHeader, layout_hash) == 16);
static_assert(offsetof(SegmentHeader, ready) == 48);
static_assert(offsetof(SegmentHeader, session) == 56);
static_assert(sizeof(SegmentHeader) == 104);
static_assert(sizeof(SegmentHeader) <= kHeaderBytes);

// fp16's dynamic loss scale (core::LossScaling) after step `step` (0-based); -1: before the first.
// `scale` holds an fp32 value (torch.amp.GradScaler keeps its scale in fp32).
struct LossScalerState {
  int64_t step;
  double scale;
  int64_t growth_tracker;  // finite steps in a row since the scale last changed
  int64_t skipped;         // steps skipped through `step`: AdamW's step count lags by this many
};
static_assert(sizeof(LossScalerState) == 32);

// fp16's loss scales in the state segment, by step % kLossScaleRing. The coordinator's optimizer
// writes them (optim/async_optimizer.h says when); workers read only step_scale.
//  * step_scale[s % ring]: what step s multiplies its loss by. Written when step s - 1 (exact) or
//    s - 2 (stale1) has its norm, before any weights step s fetches are published (release), so a
//    worker that has fetched them reads it (acquire). A slot is rewritten for step s + ring only
//    after step s's last gradient is final, so no job of step s reads it then.
//  * after[t % ring]: the scaler's state after step t. A checkpoint after step t + 1 keeps the
//    record: a resume reads the entries of steps t and t - 1 back, which nothing writes while the
//    checkpoint copies the record (only step t + 1's entry may change then).
inline constexpr int kLossScaleRing = 4;
struct LossScaleRecord {
  std::atomic<double> step_scale[kLossScaleRing];
  LossScalerState after[kLossScaleRing];
};
static_assert(std::atomic<double>::is_always_lock_free && sizeof(std::atomic<double>) == 8,
              "loss scales must be plain lock-free words to be shared across processes");
static_assert(sizeof(LossScaleRecord) == 8 * kLossScaleRing + 32 * kLossScaleRing);

// The optimizer segment's arrays for node `rank` of `nodes` (sharded state; 1 node: whole
// parameters): per parameter its share and the byte offsets of its master (unless
// `masters_in_state`), first moment and, for AdamW, second moment. A pure function, so a
// checkpoint written on any node count can be read back share by share (coordinator/
// host_state.h).
struct OptimLayout {
  std::vector<core::ElemRange> share;
  std::vector<uint64_t> master, adam_m, adam_v;
  uint64_t total_bytes = 0;
};
OptimLayout ComputeOptimLayout(const core::ModelSpec& spec, bool masters_in_state,
                               core::OptimizerName optimizer, int64_t nodes, int64_t rank);

// The layout by region. Each region is the offsets and sizes one part of the run owns; a
// component that needs one region takes that struct (GradArena takes the GradientRegion).
// ArenaLayout is all of them: a pure function of the run (see above), hashed into the header.

// The segments as a whole and their control words.
struct ControlWords {
  uint64_t total_bytes = 0;        // the state segment
  uint64_t optim_total_bytes = 0;  // the optimizer segment
  uint64_t hash = 0;
  uint64_t layer_versions = 0;     // std::atomic<uint64_t>[num layers]
  uint64_t gathered_versions = 0;  // std::atomic<uint64_t>[num layers]; sharded only
  // What a worker waits for before fetching a layer: gathered_versions when sharded, else
  // layer_versions.
  uint64_t fetch_versions = 0;
  uint64_t lookup_version = 0;    // std::atomic<uint64_t> (see above)
  bool lookup_from_host = false;  // core::LookupInPlaceParam >= 0
  uint64_t loss_scaling = 0;      // the LossScaleRecord; 0 when the loss is not scaled
};

// What workers fetch and the optimizer keeps: written by the coordinator's optimizer only.
struct WeightRegions {
  int compute_elem_bytes = 4;  // train.dtype: activations, frozen weights
  // Workers fetch the fp32 masters (ExecutionPlan::workers_fetch_masters): `compute` and `master`
  // are then the same state-segment offsets, weights_elem_bytes is 4 and the worker rounds to
  // train.dtype.
  bool masters_in_state = false;
  int weights_elem_bytes = 4;     // what `compute` holds per element
  std::vector<uint64_t> compute;  // per parameter, state segment
  // Per parameter, optimizer segment (master: state segment if masters_in_state); adam_v empty
  // for sgd.
  std::vector<uint64_t> master, adam_m, adam_v;
  // Sharded state (ExecutionPlan::sharded_state): per parameter the elements this node updates and
  // keeps the master (when not masters_in_state) and moments of; the whole parameter otherwise.
  bool sharded = false;
  std::vector<core::ElemRange> share;
  uint64_t compute_begin = 0, compute_end = 0;  // the compute-copy region (buffer 0)
  int compute_buffers = 1;  // 2 in stale1 mode or with a speculative update: version v in v % 2
  std::vector<uint64_t> frozen;  // per frozen parameter (LoRA base), state segment
  uint64_t frozen_begin = 0, frozen_end = 0;

  // Byte offset of element `e` (inside this node's share) of parameter p's master, first or
  // second moment: `base` is master, adam_m or adam_v.
  uint64_t ShareElem(const std::vector<uint64_t>& base, int p, int64_t e) const {
    return base[p] + static_cast<uint64_t>(e - share[p].begin) * 4;
  }
  // Compute copy of parameter p in buffer b (version % compute_buffers).
  uint64_t ComputeCopy(int p, int buffer) const {
    return compute[p] + static_cast<uint64_t>(buffer) * (compute_end - compute_begin);
  }
};

// The gradient table, the arena its slots are placed in, and the squares of the gradients that
// wait for the norm: placed by the coordinator, filled by workers' commits.
struct GradientRegion {
  uint64_t grad_table = 0;                // std::atomic<uint64_t>[gradient slots]
  std::vector<uint64_t> grad_slot_bytes;  // per gradient slot: fp32 bytes, 256-aligned
  // ExecutionPlan::sharded_gradients: each slot holds its parameter's `share` only (element
  // share[p].begin first), and the gradient squares table holds the squares of the whole summed
  // gradients.
  bool sharded_grads = false;
  // The tied embedding's input-lookup slot when it is compact (CompactLookupRows), else -1: it
  // holds the rows of the step's input tokens only, ascending (core::SortedTokenRows), packed.
  int compact_lookup_slot = -1;
  uint64_t grad_arena = 0, grad_arena_bytes = 0;  // [grad_arena, grad_arena + grad_arena_bytes)
  bool grads_streamed = false;                    // arena smaller than every slot at once
  // Gradient squares (above): the table's offset (0: none), and per parameter its first chunk.
  uint64_t grad_squares = 0;
  std::vector<int64_t> square_chunk_base;
  int64_t square_chunks = 0;

  double* GradSquares(uint8_t* state, int64_t step) const {
    return reinterpret_cast<double*>(state + grad_squares) + (step & 1) * square_chunks;
  }
  // True if a gradient slot of `bytes` at `offset` lies inside the arena (what a reader of the
  // gradient table checks before trusting an entry).
  bool GradSlotInArena(uint64_t offset, uint64_t bytes) const {
    return offset >= grad_arena && bytes <= grad_arena_bytes &&
           offset - grad_arena <= grad_arena_bytes - bytes;
  }
};

// The inputs of each microbatch and evaluation: written by the coordinator before it sends the
// jobs that read them, rewritten only when every such job is done.
struct InputSlots {
  int microbatches = 0;
  int parities = 2;            // slot sets (see above)
  uint64_t tokens_per_mb = 0;  // elements per token slot
  uint64_t tokens = 0, labels = 0, positions = 0;
  uint64_t eval_tokens = 0, eval_labels = 0, eval_positions = 0;
  int eval_slots = 0;
};

// What passes between stages: hidden states and input gradients (here, in one worker, or in each
// worker's pool) and the routers' statistics.
struct ActivationSlots {
  uint64_t act_elems = 0;       // elements per hidden / input-grad slot
  uint64_t act_slot_bytes = 0;  // bytes per slot, aligned
  int num_hidden = 0, num_grad = 0;
  int grad_slots_per_mb = 0;  // input-gradient slots per microbatch: min(num_grad, 2)
  uint64_t hidden = 0, input_grad = 0;
  // Where the hidden and input-gradient slots live (schedule.activations). kHost: in this
  // segment. kWorker: only in the one worker's memory (same indexing). kCudaIpc
  // (ExecutionPlan::ActivationsInPools): in each worker's activation pool, `pool_bytes` per
  // worker, indexed by PoolHiddenSlot and PoolInputGradSlot (offsets from the pool's base). The
  // segment has no bytes for them unless kHost.
  core::Activations activations = core::Activations::kHost;
  uint64_t pool_bytes = 0;
  // Router statistics (above): none when router_blocks is 0.
  uint64_t router_stats = 0, router_slot_bytes = 0;
  int router_blocks = 0, router_experts = 0;
};

struct ArenaLayout : ControlWords, WeightRegions, GradientRegion, InputSlots, ActivationSlots {
  // Slots by parity (call % parities), microbatch and index: the activation regions are indexed
  // by the input slots' shape.
  uint64_t TokenSlot(int parity, int mb) const;
  uint64_t LabelSlot(int parity, int mb) const;
  uint64_t PositionSlot(int parity, int mb) const;
  uint64_t HiddenSlot(int parity, int mb, int idx) const;
  uint64_t InputGradSlot(int parity, int mb, int idx) const;
  uint64_t PoolHiddenSlot(int parity, int mb, int idx) const;
  uint64_t PoolInputGradSlot(int parity, int mb, int idx) const;
  // Sparse block `block` (its index among the sparse blocks) of microbatch mb: 2 x
  // router_experts doubles.
  uint64_t RouterStatsSlot(int parity, int mb, int block) const;
  uint64_t EvalTokenSlot(int slot) const;
  uint64_t EvalLabelSlot(int slot) const;
  uint64_t EvalPositionSlot(int slot) const;
};

// Fails only where core::SizeGradArena does (an explicit optimizer.grad_buffer_mb below the
// minimum).
StatusOr<ArenaLayout> ComputeLayout(const core::JobConfig& config,
                                    const core::ExecutionPlan& execution,
                                    const core::ModelSpec& spec, const core::PipelinePlan& plan);

static_assert(sizeof(std::atomic<uint64_t>) == 8 && std::atomic<uint64_t>::is_always_lock_free,
              "layer versions must be plain lock-free words to be shared across processes");

// Sharded state: the worker of `workers` that gathers layer `layer`'s shares across the nodes
// (the same rank on every node, so each rank's gathers pair up across the nodes in one order).
inline int GatheringWorker(int layer, int workers) { return layer % workers; }

inline std::string StateSegmentName(const std::string& session) {
  return "rp-" + session + "-state";
}
inline std::string OptimSegmentName(const std::string& session) {
  return "rp-" + session + "-optim";
}
// The optimizer segment of the run whose state segment is `state_name` (StateSegmentName); empty
// for a name of another form.
inline std::string OptimSegmentOf(const std::string& state_name) {
  const std::string suffix = "-state";
  if (state_name.size() <= suffix.size() ||
      state_name.compare(state_name.size() - suffix.size(), suffix.size(), suffix) != 0)
    return "";
  return state_name.substr(0, state_name.size() - suffix.size()) + "-optim";
}
// A CPU worker's activation pool (ArenaLayout::activations is kCudaIpc): created by worker `rank`,
// mapped by its peers; a kHeaderBytes header (the run's layout hash) precedes the slots.
inline std::string PoolSegmentName(const std::string& session, int rank) {
  return "rp-" + session + "-pool" + std::to_string(rank);
}
// Bytes of /dev/shm a run takes: both segments, plus every CPU worker's activation pool (CUDA
// workers' pools are device memory).
inline uint64_t SharedMemoryBytes(const ArenaLayout& a, const core::JobConfig& c, int workers) {
  const bool cpu_pools =
      a.activations == core::Activations::kCudaIpc && c.job.device == core::DeviceKind::kCpu;
  return a.total_bytes + a.optim_total_bytes +
         (cpu_pools ? static_cast<uint64_t>(workers) * (kHeaderBytes + a.pool_bytes) : 0);
}
// SharedMemoryBytes of the layout a run of `plan` with `workers` workers would have: what the
// planner counts against schedule.host_memory_gb (core::ChoosePlan's `shared_bytes`).
StatusOr<uint64_t> PlanSharedBytes(const core::JobConfig& config, const core::PipelinePlan& plan,
                                   int workers);
core::SharedBytesOf SharedBytesFor(int workers);

}  // namespace rp::shm
