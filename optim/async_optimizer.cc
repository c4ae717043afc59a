// SPDX-License-Identifier: Apache-2.0
#include "optim/async_optimizer.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "common/logging.h"
#include "common/time_util.h"
#include "config/lr_schedule.h"
#include "optim/loss_scaler.h"

namespace rp::coord {

namespace {
// Adds +0.0 to each element of a row (what folding a zero row of the lookup's gradient does: a
// -0.0 becomes +0.0, as in rp-train-ref's dense sum) and returns its squared sum, exactly as
// AddAndSquaredSum would with a zero row.
double FoldZeroRow(float* row, int64_t cols) {
  thread_local std::vector<float> zeros;
  if (static_cast<int64_t>(zeros.size()) < cols) zeros.assign(static_cast<size_t>(cols), 0.0f);
  return AddAndSquaredSum(row, zeros.data(), cols);
}

}  // namespace

AsyncOptimizer::AsyncOptimizer(const core::JobConfig& cfg, const core::ExecutionPlan& execution,
                               const core::ModelSpec& spec, const shm::ArenaLayout& layout,
                               uint8_t* state, uint8_t* optim, GradArena* grads, int threads,
                               std::function<void()> on_progress)
    : cfg_(cfg),
      exec_(execution),
      spec_(spec),
      layout_(layout),
      state_(state),
      optim_(optim),
      grads_(grads),
      on_progress_(std::move(on_progress)),
      // Two passes hold a parameter's slots until its second pass: only where the arena holds
      // every slot (exact clipping, K > 1). With streamed gradients (no clipping, one call: about
      // two stages' slots) they would keep the next stages' commits waiting for space.
      two_passes_(execution.two_pass_updates && !layout.grads_streamed),
      workers_norm_(execution.gradients_wait_in_workers),
      shard_grads_(layout.sharded_grads),
      norm_first_(execution.updates_wait_for_norm && !workers_norm_),
      // The two passes keep the step's inputs (gradient, master, moments) until every first pass
      // is done, so a clipped step can run its first passes again over the same inputs.
      speculate_(execution.speculative_update && norm_first_ && two_passes_ &&
                 layout.compute_buffers == 2),
      layer_start_us_(spec.NumLayers()) {
  if (layout.loss_scaling != 0)
    scaling_ = reinterpret_cast<shm::LossScaleRecord*>(state + layout.loss_scaling);
  cur_.slots_left.assign(spec.params.size(), 0);
  cur_.param_chunks_left = std::vector<std::atomic<int64_t>>(spec.params.size());
  hold_.held = std::vector<std::atomic<uint8_t>>(spec.params.size());
  cur_.layer_params_left = std::vector<std::atomic<int>>(spec.NumLayers());
  cur_.param_rest_chunks_left = std::vector<std::atomic<int64_t>>(spec.params.size());
  geo_.param_chunks.resize(spec.params.size());
  geo_.param_slots.resize(spec.params.size());
  geo_.layer_param_count.assign(spec.NumLayers(), 0);
  geo_.row_elems.assign(spec.params.size(), 0);
  geo_.lookup_slot.assign(spec.params.size(), -1);
  geo_.row_sq_base.assign(spec.params.size(), 0);
  cur_.early.assign(spec.params.size(), 0);
  int64_t rows = 0;
  for (size_t p = 0; p < spec.params.size(); ++p) {
    geo_.row_elems[p] = spec.TiedRowElems(static_cast<int>(p));
    if (geo_.row_elems[p] > 0) {
      geo_.row_sq_base[p] = rows;
      rows += spec.params[p].numel / geo_.row_elems[p];
    }
    const int64_t chunk = ChunkElems(geo_.row_elems[p]);
    for (int64_t b = 0; b < spec.params[p].numel; b += chunk) {
      geo_.param_chunks[p].push_back(geo_.chunks.size());
      geo_.chunks.push_back({static_cast<int>(p), b, std::min(spec.params[p].numel, b + chunk)});
    }
    geo_.layer_param_count[spec.params[p].owner_layer]++;
  }
  row_sq_.assign(rows, 0.0);
  cur_.chunk_gate = std::vector<std::atomic<int>>(geo_.chunks.size());
  for (size_t s = 0; s < spec.grad_slots.size(); ++s)
    geo_.param_slots[spec.grad_slots[s].param].push_back(static_cast<int>(s));
  for (size_t p = 0; p < spec.params.size(); ++p) {
    auto& slots = geo_.param_slots[p];
    if (geo_.row_elems[p] == 0) continue;  // else exactly two slots
    // The lookup's slot goes second, so the fold adds it into the head's (a + b == b + a: the
    // same bits as the other order).
    for (size_t i = 0; i < 2; ++i)
      if (spec.grad_slots[slots[i]].layer == spec.params[p].owner_layer)
        geo_.lookup_slot[p] = slots[i];
    if (geo_.lookup_slot[p] == slots[0]) std::swap(slots[0], slots[1]);
  }
  cur_.partial.assign(geo_.chunks.size(), 0.0);
  cur_.speculated.assign(geo_.chunks.size(), 0);
  cur_.param_squares.assign(spec.params.size(), 0.0);
  for (size_t p = 0; p < spec.params.size(); ++p)
    RP_CHECK(!shard_grads_ || geo_.param_slots[p].size() == 1)
        << "sharded gradient slots with parameter " << spec.params[p].name
        << " used by several layers";
  std::vector<int> last_use(spec.params.size(), -1);
  for (int l = 0; l < spec.NumLayers(); ++l)
    for (const auto& use : spec.layer_uses[l]) {
      const int p = spec.grad_slots[use.grad_slot].param;
      last_use[p] = std::max(last_use[p], l);
    }
  // Blocks 1..N (pipeline layers) are updated on the worker's device too (device_update_blocks).
  geo_.device_param.assign(spec.params.size(), 0);
  for (size_t p = 0; p < spec.params.size(); ++p) {
    geo_.device_param[p] = execution.DeviceUpdatesLayer(spec.params[p].owner_layer) ? 1 : 0;
    if (!geo_.device_param[p]) {
      geo_.rest_order.push_back(static_cast<int>(p));
      geo_.two_pass_params++;
    }
  }
  std::stable_sort(geo_.rest_order.begin(), geo_.rest_order.end(),
                   [&](int a, int b) { return last_use[a] > last_use[b]; });
  if (layout.lookup_from_host) {
    geo_.lookup_param = core::LookupInPlaceParam(execution, spec);
    geo_.lookup_cols = spec.params[geo_.lookup_param].shape[1];
  }
  const int pool = std::max(1, threads);
  const int rest_threads =
      cfg.bench.optimizer_rest_threads > 0
          ? static_cast<int>(std::min<int64_t>(pool, cfg.bench.optimizer_rest_threads))
          : std::max(1, pool / 4);
  pool_ = std::make_unique<TaskPool>(pool, rest_threads);
}

// The pool (declared last) finishes every queued task before the state it uses goes.
AsyncOptimizer::~AsyncOptimizer() = default;

void AsyncOptimizer::Submit(std::function<void()> task) { pool_->Submit(std::move(task)); }

void AsyncOptimizer::SubmitRest(int64_t step, const std::vector<int>& params) {
  std::vector<std::function<void()>> tasks;
  for (int param : params) {
    cur_.param_rest_chunks_left[param].store(static_cast<int64_t>(geo_.param_chunks[param].size()));
    for (size_t c : geo_.param_chunks[param])
      tasks.push_back([this, step, c] { UpdateChunk(step, c, UpdateWrites::kRest); });
  }
  pool_->SubmitRest(std::move(tasks));
}

double AsyncOptimizer::LearningRate(int64_t step) const {
  return core::LearningRate(cfg_.optimizer, step, cfg_.train.steps);
}

Status AsyncOptimizer::StartAfter(int64_t steps_done) {
  cur_.step = steps_done - 1;
  published_through_.store(steps_done - 1);
  updated_through_.store(steps_done - 1);
  if (!scaling_) return Status::Ok();
  const int ring = shm::kLossScaleRing;
  // The state after step `t` (-1: before the first): the record's entry, checked, or the initial
  // one.
  auto after = [&](int64_t t) -> StatusOr<shm::LossScalerState> {
    if (t < 0) return InitialLossScaler(cfg_.train.loss_scaling);
    const shm::LossScalerState e = scaling_->after[t % ring];
    if (e.step != t || !(e.scale > 0.0) || e.skipped < 0 || e.skipped > t + 1)
      return Status::InvalidArgument("the loss scaler's state after step " + std::to_string(t + 1) +
                                     " is missing from the checkpoint (its entry is for step " +
                                     std::to_string(e.step + 1) + ", scale " +
                                     std::to_string(e.scale) + ")");
    return e;
  };
  RP_ASSIGN_OR_RETURN(scaler_, after(steps_done - 1));
  for (int64_t s = steps_done; s <= steps_done + LossScaleLag(exec_); ++s) {
    RP_ASSIGN_OR_RETURN(const shm::LossScalerState used, after(s - 1 - LossScaleLag(exec_)));
    scaling_->step_scale[s % ring].store(used.scale, std::memory_order_release);
  }
  return Status::Ok();
}

void AsyncOptimizer::SetTouchedRows(int64_t step, std::vector<int64_t> rows) {
  auto shared = std::make_shared<const std::vector<int64_t>>(std::move(rows));
  std::lock_guard<std::mutex> l(reported_.mu);
  reported_.touched[step] = std::move(shared);
}

void AsyncOptimizer::SlotFinal(int64_t step, int slot) {
  if (step != cur_.step) {
    RP_CHECK(step == cur_.step + 1 && published_through_.load() == cur_.step)
        << "optimizer step " << step << " began before step " << cur_.step << " was published";
    RP_CHECK(cur_.chunks_norm_left.load() == 0)
        << "optimizer step " << step << " began before step " << cur_.step
        << "'s norm was complete";
    cur_.step = step;
    for (size_t p = 0; p < spec_.params.size(); ++p) {
      cur_.slots_left[p] = static_cast<int>(geo_.param_slots[p].size());
      cur_.param_chunks_left[p].store(static_cast<int64_t>(geo_.param_chunks[p].size()));
    }
    for (int l = 0; l < spec_.NumLayers(); ++l) {
      cur_.layer_params_left[l].store(geo_.layer_param_count[l]);
      layer_start_us_[l].store(0);
    }
    cur_.chunks_norm_left.store(static_cast<int64_t>(geo_.chunks.size()));
    cur_.params_left.store(static_cast<int>(spec_.params.size()));
    cur_.fetched_left.store(geo_.two_pass_params);
    // Step - 1's second passes may still run, on the other parity's counter; step - 2's are all
    // counted (their slots came back before this step's were final).
    RP_CHECK(cur_.params_rest_left[step & 1].load() == 0)
        << "optimizer step " << step << " began before step " << step - 2 << " was fully updated";
    cur_.params_rest_left[step & 1].store(static_cast<int>(spec_.params.size()));
    std::fill(cur_.early.begin(), cur_.early.end(), 0);
    std::fill(cur_.speculated.begin(), cur_.speculated.end(), 0);
    for (auto& g : cur_.chunk_gate) g.store(2);
    double given = 0.0;
    {
      std::lock_guard<std::mutex> l(reported_.mu);
      reported_.touched.erase(reported_.touched.begin(), reported_.touched.lower_bound(step));
      if (workers_norm_) {
        auto it = reported_.given_squares.find(step);
        RP_CHECK(it != reported_.given_squares.end())
            << "optimizer step " << step << "'s first gradient came before the workers' squares";
        given = it->second;
        reported_.given_squares.erase(it);
      }
    }
    // Before any update of the step is queued: they read what this sets.
    if (workers_norm_) TakeNorm(step, given);
  }
  const int p = spec_.grad_slots[slot].param;
  RP_CHECK(cur_.slots_left[p] > 0)
      << "gradient slot " << slot << " finalized twice in step " << step;
  const bool update_now = !norm_first_;
  if (--cur_.slots_left[p] > 0) {
    // The head's slot of a row-summed parameter is final and the lookup's is not: square the
    // head's rows now, while the backward runs.
    if (geo_.lookup_slot[p] >= 0 && slot != geo_.lookup_slot[p]) {
      cur_.early[p] = 1;
      for (size_t c : geo_.param_chunks[p])
        Submit([this, step, c, update_now] { RowSquares(step, c, update_now); });
    }
    return;
  }
  if (shard_grads_) {
    // Read as the slot becomes final: this parity's next write of p is step + 2's, by a job whose
    // layers hold step + 1's weights or later, which follow p's update for this step, queued
    // below.
    const double* sq = layout_.GradSquares(state_, step) + layout_.square_chunk_base[p];
    const int64_t chunks =
        (spec_.params[p].numel + shm::kSquareChunkElems - 1) / shm::kSquareChunkElems;
    double total = 0.0;
    for (int64_t i = 0; i < chunks; ++i) total += sq[i];
    cur_.param_squares[p] = total;
  }
  for (size_t c : geo_.param_chunks[p]) {
    if (cur_.early[p] && cur_.chunk_gate[c].fetch_sub(1, std::memory_order_acq_rel) != 1) continue;
    Submit([this, step, c, update_now] { NormChunk(step, c, update_now); });
  }
}

void AsyncOptimizer::RowSquares(int64_t step, size_t chunk, bool then_update) {
  const Chunk& c = geo_.chunks[chunk];
  const int64_t cols = geo_.row_elems[c.param];
  float* g = reinterpret_cast<float*>(state_ + grads_->Offset(geo_.param_slots[c.param][0]));
  double* sq = row_sq_.data() + geo_.row_sq_base[c.param];
  for (int64_t r = c.begin / cols; r < c.end / cols; ++r) sq[r] = FoldZeroRow(g + r * cols, cols);
  if (cur_.chunk_gate[chunk].fetch_sub(1, std::memory_order_acq_rel) == 1)
    NormChunk(step, chunk, then_update);
}

double AsyncOptimizer::RowSummedChunk(int64_t step, const Chunk& c) {
  const auto& slots = geo_.param_slots[c.param];
  const int64_t cols = geo_.row_elems[c.param];
  const int64_t r0 = c.begin / cols, r1 = c.end / cols;
  float* g = reinterpret_cast<float*>(state_ + grads_->Offset(slots[0]));
  auto other = [&](size_t s) {
    return reinterpret_cast<const float*>(state_ + grads_->Offset(slots[s]));
  };
  double* sq = row_sq_.data() + geo_.row_sq_base[c.param];
  // A compact lookup slot (core::CompactLookupRows) holds the touched rows only, packed in order.
  const bool compact =
      geo_.lookup_slot[c.param] >= 0 && geo_.lookup_slot[c.param] == layout_.compact_lookup_slot;
  std::shared_ptr<const std::vector<int64_t>> touched;
  if (cur_.early[c.param] || compact) {
    std::lock_guard<std::mutex> l(reported_.mu);
    auto it = reported_.touched.find(step);
    if (it != reported_.touched.end()) touched = it->second;
  }
  RP_CHECK(touched || !compact)
      << "step " << step << ": the compact lookup slot came without its rows (SetTouchedRows)";
  if (touched) {
    // The other rows of the lookup's slot are zero (or absent): their fold adds +0.0, done
    // early (FoldZeroRow) with their squares.
    if (!cur_.early[c.param])
      for (int64_t r = r0; r < r1; ++r) sq[r] = FoldZeroRow(g + r * cols, cols);
    const float* o = other(1);
    for (auto it = std::lower_bound(touched->begin(), touched->end(), r0);
         it != touched->end() && *it < r1; ++it) {
      const int64_t from = compact ? (it - touched->begin()) : *it;
      sq[*it] = AddAndSquaredSum(g + *it * cols, o + from * cols, cols);
    }
  } else {
    for (int64_t r = r0; r < r1; ++r)
      sq[r] = AddAndSquaredSum(g + r * cols, other(1) + r * cols, cols);
  }
  double total = 0.0;
  for (int64_t r = r0; r < r1; ++r) total += sq[r];  // RowwiseSquaredSum's order
  return total;
}

void AsyncOptimizer::SetNormSquares(int64_t step, double squares) {
  {
    std::lock_guard<std::mutex> l(reported_.mu);
    reported_.given_squares[step] = squares;
  }
  Progress();
}

void AsyncOptimizer::NormChunk(int64_t step, size_t chunk, bool then_update) {
  const Chunk& c = geo_.chunks[chunk];
  if (workers_norm_ || shard_grads_) {
    // The norm came from the workers (SetNormSquares, or their squares table): nothing to square.
  } else if (geo_.row_elems[c.param] > 0) {
    cur_.partial[chunk] = RowSummedChunk(step, c);
  } else {
    const auto& slots = geo_.param_slots[c.param];
    float* g = reinterpret_cast<float*>(state_ + grads_->Offset(slots[0])) + c.begin;
    // Several uses: fold the others into the first slot, in slot order; the last fold and the
    // squared sum share one pass.
    const int64_t n = c.end - c.begin;
    auto other = [&](size_t s) {
      return reinterpret_cast<const float*>(state_ + grads_->Offset(slots[s])) + c.begin;
    };
    for (size_t s = 1; s + 1 < slots.size(); ++s) {
      const float* o = other(s);
      for (int64_t i = 0; i < n; ++i) g[i] += o[i];
    }
    cur_.partial[chunk] =
        slots.size() > 1 ? AddAndSquaredSum(g, other(slots.size() - 1), n) : SquaredSum(g, n);
    if (Speculates(c.param)) {
      // Before the count below: OnNormsDone, on whichever thread counts last, reads the flag.
      WaitIfHeld(step, c.param);
      UpdateElems(step, c.param, c.begin, c.end, UpdateWrites::kFetched, Unclipped(step));
      cur_.speculated[chunk] = 1;
    }
  }
  // Counted before the update: without clipping the update may publish the step's last layer,
  // after which the next step may begin and reset the counter.
  if (cur_.chunks_norm_left.fetch_sub(1, std::memory_order_acq_rel) == 1) OnNormsDone(step);
  if (!then_update) return;
  // Gradients waiting in the workers: the covered blocks' commits come last already
  // (StepDispatch), so their one pass runs as they land, on any thread.
  if (geo_.device_param[c.param] && !workers_norm_) {
    SubmitDeviceChunk(step, chunk);
  } else {
    UpdateChunk(step, chunk, OnePass(c.param) ? UpdateWrites::kAll : UpdateWrites::kFetched);
  }
}

void AsyncOptimizer::SubmitDeviceChunk(int64_t step, size_t chunk) {
  pool_->SubmitRest({[this, step, chunk] { UpdateChunk(step, chunk, UpdateWrites::kAll); }});
}

void AsyncOptimizer::OnNormsDone(int64_t step) {
  if (workers_norm_) return;  // taken with the step's first slot; updated chunk by chunk
  double total = 0.0;
  if (shard_grads_) {
    for (double s : cur_.param_squares) total += s;  // parameter order
  } else {
    for (double s : cur_.partial) total += s;  // fixed order: parameter-major, chunk-minor
  }
  TakeNorm(step, total);
  Progress();
  if (!norm_first_) return;  // already updated chunk by chunk
  // A speculated chunk's first pass is this update's when the step turned out unclipped: the
  // same operations on the same inputs with the same constants. Otherwise it runs again below.
  bool any = false;
  for (char s : cur_.speculated) any = any || s;
  const StepUpdate& u = cur_.update[step & 1];
  const StepUpdate unclipped = Unclipped(step);
  const bool confirmed =
      any && !u.skip && u.grad_scale == unclipped.grad_scale && u.adam_step == unclipped.adam_step;
  if (any) (confirmed ? spec_confirmed_ : spec_redone_).fetch_add(1);
  if (!confirmed) std::fill(cur_.speculated.begin(), cur_.speculated.end(), 0);
  // Published before anything is queued: the next step's forward may start on those layers now.
  int64_t now_us = WallMicros();
  for (size_t c = 0; c < geo_.chunks.size(); ++c) {
    if (!cur_.speculated[c]) continue;
    const int param = geo_.chunks[c].param;
    int64_t unset = 0;
    layer_start_us_[spec_.params[param].owner_layer].compare_exchange_strong(unset, now_us);
    if (cur_.param_chunks_left[param].fetch_sub(1, std::memory_order_acq_rel) == 1)
      OnParamPublished(step, param);
  }
  // Ascending parameter order = ascending layers: the next step's first stages get theirs first.
  const UpdateWrites writes = two_passes_ ? UpdateWrites::kFetched : UpdateWrites::kAll;
  if (!SubmitRowsFirst(step, writes))
    for (size_t c = 0; c < geo_.chunks.size(); ++c)
      if (!cur_.speculated[c] && !geo_.device_param[geo_.chunks[c].param])
        Submit([this, step, c, writes] { UpdateChunk(step, c, writes); });
  for (size_t c = 0; c < geo_.chunks.size(); ++c)
    if (geo_.device_param[geo_.chunks[c].param]) SubmitDeviceChunk(step, c);
}

bool AsyncOptimizer::Speculates(int param) const {
  // Not the row-summed (tied) parameters, whose squares and first pass come in row order (rows
  // first), nor the layers below spec_from_layer_, whose gradients land last: speculating on them
  // would hold up the norm by as much as it saves.
  return speculate_ && !last_clipped_.load(std::memory_order_relaxed) &&
         geo_.row_elems[param] == 0 && param != geo_.lookup_param &&
         spec_.params[param].owner_layer >= spec_from_layer_.load();
}

AsyncOptimizer::StepUpdate AsyncOptimizer::Unclipped(int64_t step) const {
  // What TakeNorm sets for a step whose norm is at or under train.grad_clip (no loss scaling
  // here: validated).
  StepUpdate u;
  u.grad_scale = 1.0f;  // ClipScale 1 over a loss scale of 1
  u.skip = false;
  u.adam_step = step + 1;
  return u;
}

void AsyncOptimizer::TakeNorm(int64_t step, double total) {
  double norm = std::sqrt(total);
  StepScaling scaling;
  if (scaling_) {
    const int ring = shm::kLossScaleRing;
    scaling.scale = scaling_->step_scale[step % ring].load(std::memory_order_acquire);
    scaling.skipped = !std::isfinite(total);
    scaler_ = NextLossScaler(scaler_, scaling.skipped, cfg_.train.loss_scaling);
    scaling.scale_after = scaler_.scale;
    scaling_->after[step % ring] = scaler_;
    // Before any version this update publishes: the first step that fetches one reads it.
    scaling_->step_scale[(step + 1 + LossScaleLag(exec_)) % ring].store(scaler_.scale,
                                                                        std::memory_order_release);
    norm /= scaling.scale;
  }
  {
    std::lock_guard<std::mutex> l(reported_.mu);
    reported_.norms[step] = norm;
    reported_.scaling[step] = scaling;
  }
  // Without a norm first the step's updates are already running and read none of this.
  if (!norm_first_ && !workers_norm_) return;
  // By parity: step - 1's second passes may still read theirs (with gradients waiting in the
  // workers this runs at the step's first slot, not after its last).
  StepUpdate& u = cur_.update[step & 1];
  u.skip = scaling.skipped;
  u.adam_step = step + 1 - (scaling_ ? scaler_.skipped : 0);
  const double clip_scale =
      cfg_.train.grad_clip > 0.0 && !u.skip ? ClipScale(norm, cfg_.train.grad_clip) : 1.0;
  u.grad_scale = static_cast<float>(clip_scale / scaling.scale);
  // The next step speculates only after an unclipped one: a run that clips keeps clipping for a
  // while, and each refuted guess costs a first pass.
  last_clipped_.store(clip_scale != 1.0, std::memory_order_relaxed);
  if (exec_.device_update_blocks > 0) {
    // The caller wakes the coordinator's loop (Progress), which sends them to the workers.
    std::lock_guard<std::mutex> l(reported_.mu);
    reported_.constants.push_back({step, u.adam_step, LearningRate(step), u.grad_scale});
  }
}

std::vector<AsyncOptimizer::StepConstants> AsyncOptimizer::TakeStepConstants() {
  std::lock_guard<std::mutex> l(reported_.mu);
  return std::exchange(reported_.constants, {});
}

bool AsyncOptimizer::SubmitRowsFirst(int64_t step, UpdateWrites writes) {
  // Two passes only: in one pass the moments would be written too, and nothing is gained (stale1
  // fetches the previous version; streamed gradients have no clipping).
  if (geo_.lookup_param < 0 || !two_passes_) return false;
  std::shared_ptr<const std::vector<int64_t>> next;
  {
    std::lock_guard<std::mutex> l(reported_.mu);
    auto it = reported_.touched.find(step + 1);
    if (it != reported_.touched.end()) next = it->second;
  }
  if (!next) return false;
  // Runs of consecutive rows as element ranges, the next step's rows and the others, grouped
  // into tasks of about one chunk's elements each.
  const int64_t cols = geo_.lookup_cols, rows = spec_.params[geo_.lookup_param].numel / cols;
  const int64_t task_elems = ChunkElems(cols);
  std::vector<Ranges> first, rest;
  auto add = [&](std::vector<Ranges>& tasks, int64_t& filled, int64_t r0, int64_t r1) {
    while (r0 < r1) {
      if (tasks.empty() || filled >= task_elems) {
        tasks.emplace_back();
        filled = 0;
      }
      const int64_t take = std::min(r1 - r0, std::max<int64_t>(1, (task_elems - filled) / cols));
      tasks.back().push_back({r0 * cols, (r0 + take) * cols});
      filled += take * cols;
      r0 += take;
    }
  };
  int64_t first_filled = 0, rest_filled = 0, r = 0;
  for (size_t i = 0; i < next->size();) {
    const int64_t begin = (*next)[i];
    int64_t end = begin + 1;
    while (++i < next->size() && (*next)[i] == end) ++end;
    add(rest, rest_filled, r, begin);
    add(first, first_filled, begin, end);
    r = end;
  }
  add(rest, rest_filled, r, rows);
  // No task of this parameter has started (the norm was the last thing before the updates).
  cur_.param_chunks_left[geo_.lookup_param].store(static_cast<int64_t>(first.size() + rest.size()));
  lookup_rows_left_.store(static_cast<int64_t>(first.size()));
  if (first.empty()) StoreLookupVersion(step);
  for (auto& t : first)
    Submit([this, step, t = std::move(t), writes] { UpdateLookupRanges(step, t, true, writes); });
  for (size_t c = 0; c < geo_.chunks.size(); ++c)
    if (geo_.chunks[c].param != geo_.lookup_param && !cur_.speculated[c] &&
        !geo_.device_param[geo_.chunks[c].param])
      Submit([this, step, c, writes] { UpdateChunk(step, c, writes); });
  for (auto& t : rest)
    Submit([this, step, t = std::move(t), writes] { UpdateLookupRanges(step, t, false, writes); });
  return true;
}

void AsyncOptimizer::UpdateLookupRanges(int64_t step, const Ranges& ranges, bool next_rows,
                                        UpdateWrites writes) {
  WaitIfHeld(step, geo_.lookup_param);
  for (const auto& [begin, end] : ranges) UpdateElems(step, geo_.lookup_param, begin, end, writes);
  if (next_rows && lookup_rows_left_.fetch_sub(1, std::memory_order_acq_rel) == 1)
    StoreLookupVersion(step);
  if (cur_.param_chunks_left[geo_.lookup_param].fetch_sub(1, std::memory_order_acq_rel) == 1)
    OnParamPublished(step, geo_.lookup_param);
}

void AsyncOptimizer::StoreLookupVersion(int64_t step) {
  // Release: the rows' writes by every pool thread that counted down before this one.
  auto* version = reinterpret_cast<std::atomic<uint64_t>*>(state_ + layout_.lookup_version);
  version->store(static_cast<uint64_t>(step + 1), std::memory_order_release);
}

void AsyncOptimizer::HoldUpdatesFrom(int64_t step) {
  std::lock_guard<std::mutex> l(hold_.mu);
  hold_.every_param.store(true, std::memory_order_release);
  hold_.from.store(step, std::memory_order_release);
}

void AsyncOptimizer::HoldOnly(const std::vector<uint8_t>& params) {
  {
    // The flags first, then the narrowing: a thread that sees every_param false reads them set.
    std::lock_guard<std::mutex> l(hold_.mu);
    for (size_t p = 0; p < hold_.held.size(); ++p)
      hold_.held[p].store(p < params.size() && params[p] ? 1 : 0, std::memory_order_relaxed);
    hold_.every_param.store(false, std::memory_order_release);
  }
  hold_.cv.notify_all();
}

void AsyncOptimizer::ReleaseParam(int param) {
  {
    std::lock_guard<std::mutex> l(hold_.mu);
    hold_.held[param].store(0, std::memory_order_release);
  }
  hold_.cv.notify_all();
}

void AsyncOptimizer::ReleaseUpdates() {
  {
    std::lock_guard<std::mutex> l(hold_.mu);
    hold_.from.store(std::numeric_limits<int64_t>::max(), std::memory_order_release);
    hold_.every_param.store(true, std::memory_order_release);
  }
  hold_.cv.notify_all();
}

bool AsyncOptimizer::Held(int64_t step, int param) const {
  if (step < hold_.from.load(std::memory_order_acquire)) return false;
  return hold_.every_param.load(std::memory_order_acquire) ||
         hold_.held[param].load(std::memory_order_acquire) != 0;
}

void AsyncOptimizer::WaitIfHeld(int64_t step, int param) {
  if (!Held(step, param)) return;
  std::unique_lock<std::mutex> l(hold_.mu);
  hold_.cv.wait(l, [&] { return !Held(step, param); });
}

std::vector<int> AsyncOptimizer::UpdateOrder() const {
  std::vector<int> order(spec_.params.size());
  for (size_t p = 0; p < order.size(); ++p) order[p] = static_cast<int>(p);
  if (!norm_first_)
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
      return spec_.params[a].owner_layer > spec_.params[b].owner_layer;
    });
  return order;
}

void AsyncOptimizer::UpdateElems(int64_t step, int param, int64_t begin, int64_t end,
                                 UpdateWrites writes) {
  int64_t unset = 0;
  if (writes != UpdateWrites::kRest)
    layer_start_us_[spec_.params[param].owner_layer].compare_exchange_strong(unset, WallMicros());
  UpdateElems(step, param, begin, end, writes, cur_.update[step & 1]);
}

void AsyncOptimizer::UpdateElems(int64_t step, int param, int64_t begin, int64_t end,
                                 UpdateWrites writes, const StepUpdate& u) {
  // Sharded state: only this node's share; the other nodes update theirs with the same
  // gradient (summed across the nodes), and the workers gather the shares.
  begin = std::max(begin, layout_.share[param].begin);
  end = std::min(end, layout_.share[param].end);
  if (begin >= end) return;
  const auto& ps = spec_.params[param];
  const ComputeDtype dtype = ComputeDtypeOf(cfg_.train.dtype);
  const float scale = norm_first_ || workers_norm_ ? u.grad_scale : 1.0f;
  const int into = static_cast<int>((step + 1) % layout_.compute_buffers);
  // Masters the workers fetch are whole parameters in the state segment; the optimizer
  // segment's arrays hold the share.
  const int from = static_cast<int>(step % layout_.compute_buffers);
  float* master =
      layout_.masters_in_state
          ? reinterpret_cast<float*>(state_ + layout_.ComputeCopy(param, from)) + begin
          : reinterpret_cast<float*>(optim_ + layout_.ShareElem(layout_.master, param, begin));
  // Workers that fetch the masters need no compute copy: passing the master as its own fp32
  // copy makes the update skip the write. With two buffers the next master goes to the other
  // one as an fp32 copy; the second pass then writes only the moments (the master passed as its
  // own copy), so the buffer the step read is never written.
  void* compute = master;
  ComputeDtype compute_dtype = ComputeDtype::kFloat32;
  if (layout_.masters_in_state && layout_.compute_buffers == 2 && writes != UpdateWrites::kRest)
    compute = reinterpret_cast<float*>(state_ + layout_.ComputeCopy(param, into)) + begin;
  if (!layout_.masters_in_state) {
    compute = state_ + layout_.ComputeCopy(param, into) + begin * layout_.weights_elem_bytes;
    compute_dtype = dtype;
  }
  if (u.skip) {
    // A skipped step changes nothing, and the version it publishes holds the same weights: a
    // separate compute copy (the other buffer in stale1) gets the masters again.
    if (writes != UpdateWrites::kRest && compute != master)
      ToComputeCopy(master, compute, end - begin, compute_dtype);
    return;
  }
  // A sharded slot starts at the share's first element.
  const float* grad =
      reinterpret_cast<const float*>(state_ + grads_->Offset(geo_.param_slots[param][0])) + begin -
      (shard_grads_ ? layout_.share[param].begin : 0);
  float* m = reinterpret_cast<float*>(optim_ + layout_.ShareElem(layout_.adam_m, param, begin));
  float* v =
      layout_.adam_v.empty()
          ? nullptr
          : reinterpret_cast<float*>(optim_ + layout_.ShareElem(layout_.adam_v, param, begin));
  // Without a norm first (no clipping, no loss scaling) nothing is skipped: the step's own count.
  const int64_t adam_step = norm_first_ || workers_norm_ ? u.adam_step : step + 1;
  UpdateRange(cfg_.optimizer, LearningRate(step), adam_step, ps.weight_decay, scale, grad, master,
              m, v, end - begin, compute, compute_dtype, writes);
}

void AsyncOptimizer::UpdateChunk(int64_t step, size_t chunk, UpdateWrites writes) {
  const Chunk& c = geo_.chunks[chunk];
  WaitIfHeld(step, c.param);
  UpdateElems(step, c.param, c.begin, c.end, writes);
  if (writes == UpdateWrites::kRest) {
    if (cur_.param_rest_chunks_left[c.param].fetch_sub(1, std::memory_order_acq_rel) == 1)
      OnParamUpdated(step, c.param);
  } else if (cur_.param_chunks_left[c.param].fetch_sub(1, std::memory_order_acq_rel) == 1) {
    OnParamPublished(step, c.param);
  }
}

void AsyncOptimizer::OnParamPublished(int64_t step, int param) {
  // One pass: the update is complete. Its slots go back before the version is published, so the
  // next step's first commit finds them free.
  const bool one_pass = OnePass(param);
  if (one_pass)
    for (int slot : geo_.param_slots[param]) grads_->Release(slot);
  // Counted before the layer's version is stored: a worker that sees the version may bring the
  // next step's first SlotFinal, which checks this.
  const bool last = cur_.params_left.fetch_sub(1, std::memory_order_acq_rel) == 1;
  if (last) StoreMax(published_through_, step);
  const int layer = spec_.params[param].owner_layer;
  if (cur_.layer_params_left[layer].fetch_sub(1, std::memory_order_acq_rel) == 1) {
    auto* versions = reinterpret_cast<std::atomic<uint64_t>*>(state_ + layout_.layer_versions);
    versions[layer].store(static_cast<uint64_t>(step + 1), std::memory_order_release);
    if (layer == 0) StoreLookupVersion(step);  // no earlier when the rows did not go first
    std::lock_guard<std::mutex> l(reported_.mu);
    reported_.spans.push_back({step, layer, layer_start_us_[layer].load(), WallMicros()});
  }
  if (one_pass) {
    CountUpdated(step);
    Progress();
  } else if (!norm_first_) {
    // Without clipping parameters are updated as their gradients become final (backward order,
    // already the order the next step needs them back).
    SubmitRest(step, {param});
  }
  // With clipping every first pass comes before any second pass, and those go in geo_.rest_order
  // (the device-updated parameters' one passes, queued at the norm, run before them).
  if (!one_pass && norm_first_ && cur_.fetched_left.fetch_sub(1, std::memory_order_acq_rel) == 1)
    SubmitRest(step, geo_.rest_order);
}

void AsyncOptimizer::OnParamUpdated(int64_t step, int param) {
  // Counted before the slots go back: once they are free the next step may place them, and two
  // steps on reset this parity's counter (checked in SlotFinal).
  CountUpdated(step);
  for (int slot : geo_.param_slots[param]) grads_->Release(slot);
  Progress();
}

void AsyncOptimizer::CountUpdated(int64_t step) {
  if (cur_.params_rest_left[step & 1].fetch_sub(1, std::memory_order_acq_rel) == 1)
    StoreMax(updated_through_, step);
}

void AsyncOptimizer::StoreMax(std::atomic<int64_t>& through, int64_t step) {
  int64_t seen = through.load();
  while (seen < step && !through.compare_exchange_weak(seen, step)) {
  }
}

std::optional<double> AsyncOptimizer::GradNorm(int64_t step) const {
  std::lock_guard<std::mutex> l(reported_.mu);
  auto it = reported_.norms.find(step);
  if (it == reported_.norms.end()) return std::nullopt;
  return it->second;
}

std::optional<AsyncOptimizer::StepScaling> AsyncOptimizer::Scaling(int64_t step) const {
  std::lock_guard<std::mutex> l(reported_.mu);
  auto it = reported_.scaling.find(step);
  if (it == reported_.scaling.end()) return std::nullopt;
  return it->second;
}

std::vector<AsyncOptimizer::LayerSpan> AsyncOptimizer::TakeLayerSpans() {
  std::lock_guard<std::mutex> l(reported_.mu);
  std::vector<LayerSpan> out;
  out.swap(reported_.spans);
  return out;
}

std::vector<AsyncOptimizer::LayerSpan> AsyncOptimizer::SpansOfStep(int64_t step) const {
  std::lock_guard<std::mutex> l(reported_.mu);
  std::vector<LayerSpan> out;
  for (const auto& s : reported_.spans)
    if (s.step == step) out.push_back(s);
  return out;
}

bool AsyncOptimizer::Updated(int64_t step) const {
  // Both: without clipping a step's last second pass can end before its last first pass counts.
  return updated_through_.load() >= step && published_through_.load() >= step;
}

bool AsyncOptimizer::Published(int64_t step) const { return published_through_.load() >= step; }

}  // namespace rp::coord
