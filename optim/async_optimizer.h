// SPDX-License-Identifier: Apache-2.0
// AsyncOptimizer: the coordinator's per-layer optimizer, running on its own thread pool while
// the workers keep computing.
//
// Contract:
//  * SlotFinal(step, slot) says that gradient slot `slot` holds its final value for `step` (its
//    last commit of the step is in shared memory). When every slot of a parameter is final, the
//    parameter's extra slots (tied embeddings) are folded into its first slot and its squared norm
//    is taken, in chunks of kOptimizerChunk (whole rows for a row-summed parameter, see
//    optimizer_step.h). A tied embedding's head slot is usually final long before its lookup slot:
//    its rows are squared then, and once the lookup slot is final only the rows of the step's
//    tokens (SetTouchedRows) are folded and squared again.
//  * Without clipping (train.grad_clip = 0) each parameter is updated right after that. With
//    clipping the update needs the global norm, so updates start when the last parameter is final,
//    in ascending parameter order (embedding first: what the next step's first forward stage needs
//    first). Either way the result is exactly the synchronous step's (the norm is summed in a fixed
//    order, see optimizer_step.h).
//  * In exact mode an update runs as two passes (adamw.h: UpdateWrites). The first writes only what
//    workers fetch; when every parameter a layer owns has had it, the layer's version in shared
//    memory becomes step + 1 (release store). Workers fetch a layer for step t only at version >=
//    t, so no fetch reads a half-written array. The second pass writes the moments (and the master
//    when workers fetch a separate copy) on the first rest_threads pool threads. With clipping the
//    second passes start once every first pass is done, in the order the next step's commits need
//    the slots back (parameters by the last layer that uses them, descending); without clipping
//    each parameter's second pass is queued right after its first. Why: the next step's forward
//    waits for the first pass only, which moves 20-28% fewer bytes than a whole update, and the
//    second runs while the workers compute. stale1 mode runs one whole pass (nothing waits for it),
//    and so does exact mode when gradients are streamed through an arena smaller than every slot
//    (holding slots longer would stall commits there), or when the job's resolution chose one pass
//    (ExecutionPlan::two_pass_updates false: the passes' extra bytes would cost more than the
//    earlier start saves).
//  * Rows first (shm::ArenaLayout::lookup_from_host, with clipping and two passes): when the rows
//    of the next step's tokens are known (SetTouchedRows for step + 1 before this step's norm is
//    complete), the embedding's first pass runs over those rows before anything else, then the
//    other parameters, then the embedding's other rows. The lookup version in shared memory becomes
//    step + 1 when those rows are done; the embedding layer's version when every row is. Why: the
//    next step's first stage looks up only those rows (from host memory), so it starts after about
//    a third of the embedding's pass, tens of milliseconds earlier for a 1.7B model. Each row's
//    update is the same computation either way: the same bits. Without the rows (or without
//    clipping) the lookup version follows the layer's.
//  * A parameter's gradient slots go back to the arena when its update is complete (gradient
//    streaming: the next stage's commit may reuse the space at once). The next step's commit of a
//    slot must wait until then; the coordinator checks GradArena::IsPlaced for that.
//  * Steps are sequential: SlotFinal for step t + 1 only once every parameter of step t has had its
//    first pass (Published). In exact mode the versions guarantee it (the next step's forward went
//    through every layer); in stale1 the coordinator holds the next step's first commit until
//    Updated. Step t's second passes may still run then. A parameter's first pass of step t + 1
//    needs its slots final for t + 1, so placed again, so released by its second pass of step t
//    (with clipping every parameter's, since the norm needs every slot).
//  * fp16 (core::ScalesLoss): updates wait for the norm as with clipping
//    (ExecutionPlan::updates_wait_for_norm). The norm of the scaled gradients, divided by the
//    step's scale, is the step's norm. A norm that is not finite skips the step: no master or
//    moment changes, and the version it publishes holds the same weights (the compute copy is
//    rewritten from the masters). Either way the scaler's state advances (loss_scaler.h) and the
//    scale of a later step is stored in the state segment's LossScaleRecord before any of the
//    update's versions are published (shm/layout.h says which step). AdamW's step count is the
//    number of updates applied, as torch's when GradScaler skips optimizer.step(). The gradients
//    are multiplied by clip scale / loss scale in the update: for a power-of-two scale (the
//    defaults keep it one) the bits of unscaling, then clipping.
//  * Speculative updates (ExecutionPlan::speculative_update: clipping, two passes, two buffers of
//    what workers fetch): as a parameter's chunk is squared, its first pass also runs with the
//    constants of an unclipped step (Unclipped), writing the next version's buffer, which no job of
//    this step reads. When the norm leaves the step unclipped (grad_scale exactly 1, as those
//    constants have it) the chunk counts as updated without running again: its layers publish at
//    once. Otherwise every first pass runs as without speculation and overwrites them. Not the
//    row-summed parameters and not the layers below SpeculateFromLayer; paused after a clipped
//    step. With the masters as what workers fetch, the update reads the masters of buffer step % 2
//    and writes those of (step + 1) % 2; its second pass writes only the moments.
//  * Device updates (ExecutionPlan::device_update_blocks = N): the parameters of blocks 1..N are
//    updated in one pass (masters, moments and what workers fetch together), queued behind every
//    other parameter's first pass (on the rest threads, ahead of the second passes; with gradients
//    waiting in the workers their commits come last instead, and each runs as it lands): the worker
//    holding their gradients computes the same weights on its device (TakeStepConstants gives it
//    each step's constants), and the next step's forward uses those, so the host's copy is wanted
//    only by the next backward. Their layer versions are published after that one pass; a version
//    >= t + 1 then means masters and moments hold step t too (what the worker reads for t + 1).
//  * Gradients waiting in the workers (ExecutionPlan::gradients_wait_in_workers): the norm comes
//    from SetNormSquares (fp16: a sum that is not finite skips the step as above), and each
//    parameter is updated, clipped, as soon as its slots are final, as without clipping; no squares
//    are taken here.
//  * Sharded gradient slots (ExecutionPlan::sharded_gradients: no clipping, no loss scaling): a
//    slot holds this node's share of its parameter, and the norm is the sum of the squares the
//    workers wrote of the whole summed gradient (shm::ArenaLayout::grad_squares), read when the
//    parameter's slot is final; it is reported only (nothing it scales).
//  * Thread-safety: SlotFinal, GradNorm, Published and Updated may be called from one thread (the
//    coordinator's event loop) while the pool runs; the destructor waits for queued work.
//  * `on_progress` (may be empty) is called from a pool thread after each change the coordinator
//    may be waiting for: a parameter's slots given back, a step's norm known, a step updated. It
//    must be cheap and thread-safe (the coordinator wakes its loop with it).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "common/status.h"
#include "optim/grad_arena.h"
#include "optim/optimizer_step.h"
#include "optim/task_pool.h"
#include "config/job_config.h"
#include "config/model_spec.h"
#include "shm/layout.h"

namespace rp::coord {

class AsyncOptimizer {
 public:
  // `state` is the mapped state segment (compute copies, or the masters when workers fetch
  // them; layer versions, gradient arena), `optim` the optimizer segment (moments, and the
  // masters otherwise: layout.masters_in_state says which); `grads` places and releases slots.
  AsyncOptimizer(const core::JobConfig& cfg, const core::ExecutionPlan& execution,
                 const core::ModelSpec& spec, const shm::ArenaLayout& layout, uint8_t* state,
                 uint8_t* optim, GradArena* grads, int threads,
                 std::function<void()> on_progress = {});
  ~AsyncOptimizer();
  AsyncOptimizer(const AsyncOptimizer&) = delete;
  AsyncOptimizer& operator=(const AsyncOptimizer&) = delete;

  // Whether updates run as two passes (the first publishes; the profile's rate is that pass's).
  bool TwoPasses() const { return two_passes_; }

  // Resume: the state already holds `steps_done` updates, so the first step seen is steps_done.
  // Call before the first SlotFinal. fp16: the scaler starts from the record's states after steps
  // steps_done - 1 and - 2 where they exist (a resume: HostState read them back), else from
  // train.loss_scale_init, and the scales of the first steps are stored; an entry of another step
  // is an error naming both.
  Status StartAfter(int64_t steps_done);
  // The rows of `step`'s input tokens, ascending, without repeats. Rows first (above): given
  // for step t + 1 before step t's norm is complete, they are updated first. And outside them
  // the tied embedding's lookup gradient slot is zero (the embedding's backward scatters into
  // those rows only). With them, and the head's slot final before the lookup's, the head's rows
  // are squared while the backward runs and the step boundary folds and squares only these
  // rows; without them it does every row (the same bits either way). Call before the step's
  // lookup slot is final; any thread.
  void SetTouchedRows(int64_t step, std::vector<int64_t> rows);
  void SlotFinal(int64_t step, int slot);
  // ExecutionPlan::gradients_wait_in_workers: the sum of the squares of step `step`'s gradients,
  // which the workers took (shm::ArenaLayout::grad_squares) and the coordinator added up in this
  // class's chunk order; given before the step's first SlotFinal. Its root is the step's norm,
  // which clips each parameter's update as soon as its gradient lands (nothing waits for a host
  // norm).
  void SetNormSquares(int64_t step, double squares);
  std::optional<double> GradNorm(int64_t step) const;
  // Device updates: the constants of each step's update whose norm became known since the last
  // call (ascending steps), each returned once. Any thread.
  struct StepConstants {
    int64_t step = 0;
    int64_t adam_step = 0;
    double lr = 0.0;
    float grad_scale = 1.0f;
  };
  std::vector<StepConstants> TakeStepConstants();
  // fp16: the scale step `step`'s loss was multiplied by, whether the step was skipped, and the
  // scale after it; known with the norm. Without loss scaling: scale 1, never skipped.
  struct StepScaling {
    double scale = 1.0;
    bool skipped = false;
    double scale_after = 1.0;
  };
  std::optional<StepScaling> Scaling(int64_t step) const;
  // True once every parameter is updated for `step`: both passes, so masters and moments hold
  // the step (what a checkpoint reads).
  bool Updated(int64_t step) const;
  // True once every layer version is >= step + 1 (the first pass; equal to Updated in stale1).
  bool Published(int64_t step) const;
  double LearningRate(int64_t step) const;
  // When each layer's update ran: from the first update chunk of a parameter it owns starting
  // to its version being published (wall-clock microseconds, for the trace).
  struct LayerSpan {
    int64_t step;
    int layer;
    int64_t start_us, end_us;
  };
  std::vector<LayerSpan> TakeLayerSpans();
  // A copy of the spans recorded for `step` so far (for the profile's optimizer rate).
  std::vector<LayerSpan> SpansOfStep(int64_t step) const;
  // Checkpoints (coordinator/checkpoint_writer.h): from HoldUpdatesFrom(step) until
  // ReleaseUpdates(), no update of a step >= `step` writes masters, moments or compute copies;
  // pool threads that reach one wait (norms and folds, which read only gradients, go on).
  // HoldOnly(params) narrows a hold to those parameters (a 0/1 flag per parameter), which
  // ReleaseParam then lets go one at a time; the hold ends with ReleaseUpdates(). Any thread.
  void HoldUpdatesFrom(int64_t step);
  void HoldOnly(const std::vector<uint8_t>& params);
  void ReleaseParam(int param);
  void ReleaseUpdates();
  // The parameters in the order this job's updates reach them: with a norm first (clipping, loss
  // scaling) parameter order, as the chunks are queued once the norm is known; otherwise as their
  // gradients become final, the last layer's first (the backward's order).
  std::vector<int> UpdateOrder() const;
  // optimizer.speculative_update: parameters of layers below `layer` are not speculated on (the
  // coordinator passes the end of the last backward stage: their gradients land last, and their
  // first passes would hold up the norm). Call before the first SlotFinal.
  void SpeculateFromLayer(int layer) { spec_from_layer_.store(layer); }
  // Steps whose speculative first passes were the update's (confirmed) and steps that ran them
  // again with the clip scale (redone).
  struct SpeculationCounts {
    int64_t confirmed = 0, redone = 0;
  };
  SpeculationCounts Speculation() const { return {spec_confirmed_.load(), spec_redone_.load()}; }

 private:
  struct Chunk {
    int param;
    int64_t begin, end;
  };
  void Submit(std::function<void()> task);
  void Progress() {
    if (on_progress_) on_progress_();
  }
  // Second passes of `params` go to their own queue, which only the first rest_threads_ pool
  // threads take from, and only when the main queue is empty.
  void SubmitRest(int64_t step, const std::vector<int>& params);
  void NormChunk(int64_t step, size_t chunk, bool then_update);
  // Row-summed parameters: squares each row of chunk `chunk` of the first (dense) slot, then
  // opens the chunk's gate (chunk_gate_).
  void RowSquares(int64_t step, size_t chunk, bool then_update);
  // The chunk's folded squared sum by rows (optimizer_step.h: RowwiseSquaredSum).
  double RowSummedChunk(int64_t step, const Chunk& c);
  void UpdateChunk(int64_t step, size_t chunk, UpdateWrites writes);
  // The update of elements [begin, end) of `param` (no counting), with the step's constants.
  void UpdateElems(int64_t step, int param, int64_t begin, int64_t end, UpdateWrites writes);
  // Rows first: submits the first passes in that order when the next step's rows are known;
  // false (nothing submitted) otherwise.
  bool SubmitRowsFirst(int64_t step, UpdateWrites writes);
  // Element ranges of one rows-first task of the looked-up parameter.
  using Ranges = std::vector<std::pair<int64_t, int64_t>>;
  void UpdateLookupRanges(int64_t step, const Ranges& ranges, bool next_rows, UpdateWrites writes);
  void StoreLookupVersion(int64_t step);
  void OnNormsDone(int64_t step);
  // The step's norm from the squared sum of its gradients (scaled, in fp16): the loss scaler
  // advanced (its record written), the norm and scaling reported, and where updates wait for the
  // norm the clip scale, skip and AdamW count they use. Before any update of the step runs.
  void TakeNorm(int64_t step, double total);
  // Device updates: queues `chunk`'s one pass on the rest threads (behind the first passes).
  void SubmitDeviceChunk(int64_t step, size_t chunk);
  bool OnePass(int param) const { return !two_passes_ || geo_.device_param[param]; }
  void OnParamPublished(int64_t step, int param);
  void OnParamUpdated(int64_t step, int param);  // second pass done: counted, slots back
  void CountUpdated(int64_t step);
  static void StoreMax(std::atomic<int64_t>& through, int64_t step);

  const core::JobConfig cfg_;
  const core::ExecutionPlan exec_;
  const core::ModelSpec& spec_;
  const shm::ArenaLayout& layout_;
  uint8_t* state_;
  uint8_t* optim_;
  GradArena* grads_;
  std::function<void()> on_progress_;
  // What each parameter's update consists of: decided once, in the constructor.
  struct Geometry {
    std::vector<Chunk> chunks;  // all chunks, parameter-major
    std::vector<std::vector<size_t>> param_chunks;
    std::vector<std::vector<int>> param_slots;  // slots of each parameter, first = primary
    // Row-summed parameters (optimizer_step.h: RowElems; the tied embedding): row length, the
    // slot of the owner layer's use (the input lookup, zero outside the step's token rows; -1
    // when none), where its rows' squared sums start in row_sq_. Their first slot is the other
    // use's.
    std::vector<int64_t> row_elems;
    std::vector<int> lookup_slot;
    std::vector<int64_t> row_sq_base;
    std::vector<int> layer_param_count;
    // The parameter the embedding layer looks up, when it reads it from host memory
    // (ArenaLayout::lookup_from_host), else -1; its row length.
    int lookup_param = -1;
    int64_t lookup_cols = 0;
    std::vector<int> rest_order;     // second passes: last using layer, descending
    std::vector<char> device_param;  // per parameter: owned by a block the worker updates too
    int two_pass_params = 0;         // parameters outside device_param
  };
  Geometry geo_;
  const bool two_passes_;                  // exact mode, arena holds every slot
  const bool workers_norm_;                // ExecutionPlan::gradients_wait_in_workers
  const bool shard_grads_;                 // ExecutionPlan::sharded_gradients: slots hold the share
  const bool norm_first_;                  // updates wait for a norm taken here
  const bool speculate_;                   // ExecutionPlan::speculative_update
  std::atomic<bool> last_clipped_{false};  // the last step whose norm is known was clipped
  std::atomic<int> spec_from_layer_{0};
  std::atomic<int64_t> spec_confirmed_{0}, spec_redone_{0};
  // fp16: the state segment's record (null without loss scaling), and the scaler's state after
  // the last step whose norm is known (written by TakeNorm only, which steps reach in order).
  shm::LossScaleRecord* scaling_ = nullptr;
  shm::LossScalerState scaler_{};
  std::vector<double> row_sq_;                // per row of the row-summed parameters
  std::atomic<int64_t> lookup_rows_left_{0};  // rows-first tasks of the next step's rows left

  struct StepUpdate {
    float grad_scale = 1.0f;  // what the update multiplies gradients by: clip scale / loss scale
    bool skip = false;        // fp16: gradients not all finite, nothing updated
    int64_t adam_step = 0;    // 1-based count of updates applied, this one included
  };
  // The same with explicit constants (a speculative first pass: Unclipped).
  void UpdateElems(int64_t step, int param, int64_t begin, int64_t end, UpdateWrites writes,
                   const StepUpdate& u);
  // Whether `param`'s chunks get a speculative first pass as their norms are taken (NormChunk).
  bool Speculates(int param) const;
  // What TakeNorm sets for `step` when its norm does not clip it.
  StepUpdate Unclipped(int64_t step) const;
  // The current step's counters (and the previous step's second passes, by parity).
  struct StepCounters {
    int64_t step = -1;
    std::vector<int> slots_left;  // per parameter
    std::vector<double> partial;  // per chunk
    // Per chunk: its first pass ran speculatively, unclipped (read by OnNormsDone, written
    // before the chunk's norm is counted).
    std::vector<char> speculated;
    std::vector<double> param_squares;  // per parameter: the workers' squares (sharded slots)
    // Row-summed parameters whose dense slot was final first this step: their row squares run
    // early; a chunk's norm task starts when both its rows are squared and the last slot is
    // final (the gate counts those two down from 2).
    std::vector<char> early;                   // per parameter
    std::vector<std::atomic<int>> chunk_gate;  // per chunk
    std::atomic<int64_t> chunks_norm_left{0};
    std::vector<std::atomic<int64_t>> param_chunks_left;
    std::vector<std::atomic<int>> layer_params_left;
    std::atomic<int> params_left{0};   // first passes left (the only pass in stale1)
    std::atomic<int> fetched_left{0};  // first passes of the two-pass parameters left
    std::vector<std::atomic<int64_t>> param_rest_chunks_left;
    // Second passes left, by step parity: step t's may still run once step t + 1 has begun.
    std::atomic<int> params_rest_left[2] = {0, 0};
    // What a step's updates apply (TakeNorm), by step parity: step t + 1's is set while step t's
    // second passes may still run; step t + 2 begins only after they are all done.
    StepUpdate update[2];
  };
  StepCounters cur_;

  // What the coordinator's loop reads while the pool writes it.
  struct Reported {
    mutable std::mutex mu;
    std::map<int64_t, double> norms;                                         // GUARDED_BY(mu)
    std::map<int64_t, StepScaling> scaling;                                  // GUARDED_BY(mu)
    std::map<int64_t, double> given_squares;                                 // GUARDED_BY(mu)
    std::map<int64_t, std::shared_ptr<const std::vector<int64_t>>> touched;  // GUARDED_BY(mu)
    std::vector<LayerSpan> spans;                                            // GUARDED_BY(mu)
    std::vector<StepConstants> constants;                                    // GUARDED_BY(mu)
  };
  Reported reported_;
  std::atomic<int64_t> published_through_{-1};
  std::atomic<int64_t> updated_through_{-1};
  std::vector<std::atomic<int64_t>> layer_start_us_;  // first update chunk of the current step

  // The checkpoint copy's hold (HoldUpdatesFrom): updates of steps >= `from` wait.
  struct Hold {
    std::atomic<int64_t> from{std::numeric_limits<int64_t>::max()};
    std::atomic<bool> every_param{true};     // false after HoldOnly: `held` says which
    std::vector<std::atomic<uint8_t>> held;  // per parameter
    std::mutex mu;
    std::condition_variable cv;
  };
  Hold hold_;
  bool Held(int64_t step, int param) const;
  void WaitIfHeld(int64_t step, int param);

  std::unique_ptr<TaskPool> pool_;  // last: drained and stopped before the state above
};

}  // namespace rp::coord
