// SPDX-License-Identifier: Apache-2.0
#include "gpu_worker/executor.h"

#include <c10/core/GradMode.h>

#include <cmath>
#include <cstring>
#include <limits>

#include <atomic>
#include <stdexcept>
#include <string>
#include <c10/util/Exception.h>

#include "common/test_hooks.h"
#include "common/time_util.h"
#include "gpu_worker/guarded.h"
#include "io/data.h"

namespace rp::worker {

namespace {
at::ScalarType StoredDtype(core::TrainDtype d) {
  switch (d) {
    case core::TrainDtype::kBf16:
    case core::TrainDtype::kFp8: return at::kBFloat16;
    case core::TrainDtype::kFp16: return at::kHalf;
    case core::TrainDtype::kFp32: break;
  }
  return at::kFloat;
}
}  // namespace

Executor::Executor(const core::JobConfig& cfg, const core::ExecutionPlan& execution,
                   const core::ModelSpec& spec, const core::PipelinePlan& plan,
                   const shm::ArenaLayout& layout, const shm::Segment& segment, Device& device)
    : cfg_(cfg),
      execution_(execution),
      round_(core::Round(cfg)),
      spec_(spec),
      plan_(plan),
      layout_(layout),
      segment_(segment),
      device_(device),
      math_(cfg.model, cfg.train.loss_chunk_tokens, cfg.lora),
      store_dtype_(StoredDtype(cfg.train.dtype)),
      act_dtype_(store_dtype_ != at::kFloat && device.torch_device().is_cpu() ? at::kFloat
                                                                              : store_dtype_),
      weights_dtype_(layout.weights_elem_bytes == 4 ? at::kFloat : store_dtype_),
      emulate_half_(store_dtype_ != at::kFloat && act_dtype_ == at::kFloat),
      frozen_on_device_(execution.frozen_on_device),
      activations_(MakeActivationStore(layout, segment, device, ActivationShape(), store_dtype_)) {
  if (core::FusedKernelsApply(cfg)) {
    math_.UseFusedKernels(device.fused_kernels());
    math_.UseFusedNorms(cfg.bench.fused_norms);
    weight_grad_sinks_ = device.fused_kernels() != nullptr;
    math_.UseE4m3Projections(core::Fp8Matmuls(cfg));  // the worker checked the device takes them
  }
  math_.SetEmbedDtype(act_dtype_);
  // Rows looked up in place from the fp32 masters (ExecutionPlan::lookup_from_host) are what fp16
  // would hold.
  if (emulate_half_) math_.SetEmbedRounding(store_dtype_);
  math_.SetMlpTileTokens(cfg.train.mlp_tile_tokens);
  math_.UseGroupedExperts(cfg.bench.grouped_experts);
  math_.UseRecordedAttention(cfg.schedule.keep_attention != 0);
}

bool Executor::HasGrads() const { return stage_.kind != core::StageKind::kForward; }

Status Executor::Validate(const proto::RunJob& job) const {
  if (job.stage < 0 || job.stage >= static_cast<int>(plan_.stages.size()) || job.parity < 0 ||
      job.parity >= layout_.parities || job.num_microbatches != round_.microbatches)
    return Status::ProtocolError("RunJob " + std::to_string(job.job_index) +
                                 " has out-of-range stage, parity or microbatch count");
  return Status::Ok();
}

bool Executor::LayerReady(int l, int64_t version, bool device_weights) const {
  if (device_weights && device_update_ && device_update_->CoversLayer(l)) {
    bool all = true;
    for (const auto& use : spec_.layer_uses[l])
      all = all && device_update_->Weights(use.param, version) != nullptr;
    if (all && spec_.layer_frozen[l].empty()) return true;
  }
  if (MapsLookup(l))
    return segment_.At<std::atomic<uint64_t>>(layout_.lookup_version)
               ->load(std::memory_order_acquire) >= static_cast<uint64_t>(version);
  // Sharded state: the version every node's shares hold here (ShareGatherer).
  const auto* versions = segment_.At<std::atomic<uint64_t>>(layout_.fetch_versions);
  for (const auto& use : spec_.layer_uses[l]) {
    const int owner = spec_.params[use.param].owner_layer;
    if (versions[owner].load(std::memory_order_acquire) < static_cast<uint64_t>(version))
      return false;
  }
  return true;
}

void Executor::DropNext() {
  // Its tensors come from the compute stream's pool but copies on the weights stream may still
  // write them: the compute stream waits for those before the allocator may reuse the memory.
  if (!next_.layers.empty() || !next_.empty.empty()) device_.WaitWeights(device_.WeightsFence());
  next_ = StageWeights();
}

Status Executor::KeepFrozenBase() {
  if (!frozen_on_device_ || !frozen_kept_.empty() || spec_.frozen.empty()) return Status::Ok();
  int64_t bytes = 0;
  for (const auto& p : spec_.frozen)
    bytes += p.numel * static_cast<int64_t>(c10::elementSize(act_dtype_));
  try {
    // All of it at the first fetch, before any compute is queued: the destinations then wait for
    // nothing (Device::EmptyWeights) and the base is allocated before any passing tensor; the
    // first job's fence covers these copies, being taken after them on the weights stream.
    for (size_t p = 0; p < spec_.frozen.size(); ++p) {
      at::Tensor t = device_.EmptyWeights(spec_.frozen[p].shape, act_dtype_);
      device_.CopyWeights(t, segment_.data() + layout_.frozen[p], store_dtype_);
      frozen_kept_.emplace(static_cast<int>(p), std::move(t));
    }
  } catch (const std::exception& e) {
    frozen_kept_.clear();
    return Status::Unavailable("schedule.frozen_on_device: keeping the frozen base (" +
                               std::to_string(static_cast<double>(bytes) / 1e9) + " GB) on " +
                               device_.Describe() + " failed (" + e.what() +
                               "); leave the option off, or give each worker a device of its own");
  }
  return Status::Ok();
}

Status Executor::FetchReady(const proto::RunJob& job, bool* complete) {
  *complete = false;
  RP_RETURN_IF_ERROR(Validate(job));
  RP_RETURN_IF_ERROR(KeepFrozenBase());
  if (next_.job_index != job.job_index) {
    DropNext();
    next_.job_index = job.job_index;
  }
  if (!next_.kept_decided) AdoptKept(job, &next_);
  if (!next_.complete) {
    const core::Stage& st = plan_.stages[job.stage];
    bool all = false;
    Status s = Guarded(
        [] { return std::string("fetching weights"); },
        [&] {
          CopyReadyLayers(st, job.weights_version, st.kind != core::StageKind::kForward, &next_);
          all = st.begin + static_cast<int>(next_.layers.size()) == FetchEnd(st, next_);
          if (all) next_.fence = device_.WeightsFence();
          return Status::Ok();
        });
    if (!s.ok()) {
      DropNext();
      return s;
    }
    if (!all) return Status::Ok();
    next_.complete = true;
    // A gradient job has checked its layers' host versions: their state is there to prefetch.
    if (device_update_ && st.kind != core::StageKind::kForward) {
      s = Guarded([] { return std::string("prefetching the device update's state"); },
                  [&] {
                    for (int l = st.begin; l < FetchEnd(st, next_); ++l)
                      device_update_->Prefetch(job.weights_version, l);
                    return Status::Ok();
                  });
      if (!s.ok()) return s;
    }
  }
  *complete = true;
  return Status::Ok();
}

Status Executor::Reserve(const proto::RunJob& job) {
  RP_RETURN_IF_ERROR(Validate(job));
  if (next_.job_index == job.job_index && !next_.empty.empty()) return Status::Ok();
  DropNext();
  next_.job_index = job.job_index;
  Status s = Guarded(
      [&] {
        return "job " + std::to_string(job.job_index) + ": making its weights' device memory";
      },
      [&] {
        MakeDestinations(plan_.stages[job.stage], plan_.stages[job.stage].begin, &next_);
        return Status::Ok();
      });
  if (!s.ok()) DropNext();
  return s;
}

bool Executor::CopyReadyLayers(const core::Stage& st, int64_t weights_version, bool grads,
                               StageWeights* w) {
  bool copied = false;
  // Forward stages may take the device update's weights (UseDeviceUpdate).
  const bool device_weights = !grads;
  for (int l = st.begin + static_cast<int>(w->layers.size()); l < FetchEnd(st, *w); ++l) {
    if (!LayerReady(l, weights_version, device_weights)) break;
    // Every destination of the stage at once, while the compute stream has queued only what
    // comes before this stage (Device::EmptyWeights): made layer by layer, each copy of a
    // layer-major stage would wait for the stage's previous layer over every microbatch.
    if (w->empty.empty()) MakeDestinations(st, l, w);
    // A forward stage's kept layers train through the graphs they keep.
    const bool layer_grads = grads || (st.kind == core::StageKind::kForward && plan_.KeepsGraph(l));
    w->layers.push_back(FetchLayer(l, weights_version, layer_grads, w,
                                   std::move(w->empty[l - st.begin]),
                                   /*map_lookup=*/true, device_weights));
    copied = true;
  }
  return copied;
}

void Executor::MakeDestinations(const core::Stage& st, int from, StageWeights* w) {
  w->empty.resize(st.end - st.begin);
  for (int l = from; l < FetchEnd(st, *w); ++l)
    if (!MapsLookup(l)) w->empty[l - st.begin] = EmptyLayer(l);
}

std::vector<at::Tensor> Executor::EmptyLayer(int l) {
  std::vector<at::Tensor> out;
  for (const auto& use : spec_.layer_uses[l])
    out.push_back(device_.EmptyWeights(spec_.params[use.param].shape, act_dtype_));
  if (!frozen_on_device_)
    for (const auto& use : spec_.layer_frozen[l])
      out.push_back(device_.EmptyWeights(spec_.frozen[use.param].shape, act_dtype_));
  return out;
}

model::LayerWeights Executor::FetchLayer(int l, int64_t weights_version, bool grads,
                                         StageWeights* into, std::vector<at::Tensor> dst,
                                         bool map_lookup, bool device_weights) {
  const bool mapped = map_lookup && MapsLookup(l);
  if (dst.empty() && !mapped) dst = EmptyLayer(l);
  size_t next_dst = 0;
  model::LayerWeights lw;
  const int buffer = static_cast<int>(weights_version % layout_.compute_buffers);
  for (const auto& use : spec_.layer_uses[l]) {
    const uint8_t* src = segment_.data() + layout_.ComputeCopy(use.param, buffer);
    const at::Tensor* computed = device_weights && device_update_
                                     ? device_update_->Weights(use.param, weights_version)
                                     : nullptr;
    at::Tensor t;
    if (computed) {
      // On the compute stream, behind the update that wrote them.
      t = dst.at(next_dst++);
      t.copy_(*computed);
    } else if (mapped) {
      // The lookup reads its rows from the masters in place (ExecutionPlan::lookup_from_host).
      t = device_.MapWeights(src, spec_.params[use.param].shape, weights_dtype_);
    } else {
      t = dst.at(next_dst++);
      device_.CopyWeights(t, src, weights_dtype_);
      // Emulated fp16 or bf16 from fp32 masters: the values a 16-bit copy would hold.
      if (emulate_half_ && weights_dtype_ == at::kFloat) t.copy_(t.to(store_dtype_));
    }
    if (grads) {
      t.requires_grad_(true);
      into->grads.push_back({t, use.grad_slot, l, at::Tensor(),
                             weight_grad_sinks_ && model::Transformer::SinkableRole(use.role)});
    }
    lw.emplace(use.role, t);
  }
  for (const auto& use : spec_.layer_frozen[l]) {  // LoRA's base: one buffer, never a gradient
    at::Tensor t;
    if (frozen_on_device_) {
      t = frozen_kept_.at(use.param);  // KeepFrozenBase ran before any fetch
    } else {
      t = dst.at(next_dst++);
      device_.CopyWeights(t, segment_.data() + layout_.frozen[use.param], store_dtype_);
    }
    lw.emplace(use.role, t);
  }
  return lw;
}

bool Executor::WeightsReady(const proto::RunEval& job) const {
  const auto* versions = segment_.At<std::atomic<uint64_t>>(layout_.fetch_versions);
  for (const auto& p : spec_.params)
    if (versions[p.owner_layer].load(std::memory_order_acquire) <
        static_cast<uint64_t>(job.weights_version))
      return false;
  return true;
}

StatusOr<MicrobatchResult> Executor::Evaluate(const proto::RunEval& job,
                                              const std::function<void()>& between_layers) {
  if (job.slot < 0 || job.slot >= layout_.eval_slots)
    return Status::ProtocolError("RunEval " + std::to_string(job.job_index) + " has slot " +
                                 std::to_string(job.slot) + " (this job has " +
                                 std::to_string(layout_.eval_slots) + " eval slots)");
  if (job.weights_version < 0)
    return Status::ProtocolError("RunEval " + std::to_string(job.job_index) +
                                 " asks for weights version " +
                                 std::to_string(job.weights_version));
  RP_RETURN_IF_ERROR(KeepFrozenBase());
  const auto* versions = segment_.At<std::atomic<uint64_t>>(layout_.layer_versions);
  MicrobatchResult r;
  Status s = Guarded(
      [&] { return "eval job " + std::to_string(job.job_index); },
      [&] {
        c10::NoGradGuard no_grad;
        math_.SetTraining(false);
        math_.SetDocuments(DocumentsAt(layout_.EvalPositionSlot(job.slot)));
        math_.SetAttentionRecords(nullptr, false);  // an eval neither keeps nor reads any
        const std::vector<int64_t> shape = {cfg_.train.microbatch_size, cfg_.data.seq_len};
        at::Tensor x = device_.FetchActivation(segment_.data() + layout_.EvalTokenSlot(job.slot),
                                               shape, at::kLong);
        at::Tensor labels = device_.FetchActivation(
            segment_.data() + layout_.EvalLabelSlot(job.slot), shape, at::kLong);
        for (int l = 0; l < plan_.num_layers; ++l) {
          // One layer resident at a time: evaluation needs no more device memory than a stage.
          // The coordinator holds back the update that would overwrite this buffer until the eval
          // is done; a newer version here means that contract broke, and the loss would be wrong.
          for (const auto& use : spec_.layer_uses[l]) {
            const uint64_t v =
                versions[spec_.params[use.param].owner_layer].load(std::memory_order_acquire);
            if (v >= static_cast<uint64_t>(job.weights_version + layout_.compute_buffers))
              return Status::Internal("eval job " + std::to_string(job.job_index) + ": layer " +
                                      std::to_string(l) + " is at weights version " +
                                      std::to_string(v) + ", past the version " +
                                      std::to_string(job.weights_version) + " it evaluates");
          }
          model::LayerWeights lw = FetchLayer(l, job.weights_version, /*grads=*/false, nullptr);
          device_.WaitWeights(device_.WeightsFence());
          if (l + 1 < plan_.num_layers) {
            x = math_.Layer(l, lw, x);
          } else {
            auto h = math_.HeadForwardBackward(lw, x, labels, 1.0, /*backward=*/false);
            r.loss_sum = h.loss_sum;
            r.targets = h.targets;
          }
          if (between_layers) between_layers();
        }
        device_.Synchronize();
        return Status::Ok();
      });
  math_.SetTraining(true);
  if (!s.ok()) return s;
  return r;
}

bool Executor::LayerMajorEligible(const proto::RunJob& job) const {
  if (job.stage < 0 || job.stage >= static_cast<int>(plan_.stages.size())) return false;
  return core::MayRunLayerMajor(cfg_, plan_.stages[job.stage], job.num_microbatches);
}

bool Executor::Startable(const proto::RunJob& job, bool all_inputs_ready) const {
  if (next_.job_index != job.job_index) return false;
  const bool eligible = LayerMajorEligible(job);
  // "always" (tests): every eligible job runs layer-major, so it waits for all its inputs.
  if (eligible && cfg_.bench.layer_major_forward == core::Tristate::kAlways)
    return all_inputs_ready && !next_.layers.empty();
  return next_.complete || (eligible && all_inputs_ready && !next_.layers.empty());
}

Status Executor::Begin(const proto::RunJob& job, bool all_inputs_ready) {
  RP_RETURN_IF_ERROR(Validate(job));
  // FetchReady copies a stage's weights (and ForwardLayers, for a layer-major job, the layers
  // published after it began); Begin only adopts them.
  if (!Startable(job, all_inputs_ready))
    return Status::Internal("job " + std::to_string(job.job_index) +
                            " began before FetchReady had copied its weights");
  job_ = job;
  stage_ = plan_.stages[job.stage];
  current_ = std::move(next_);
  math_.SetAttentionRecords(nullptr, false);
  if (stage_.kind == core::StageKind::kForward) {
    // Records of earlier steps nobody took (their backward ran elsewhere) and this stage's own
    // from an earlier attempt.
    for (auto it = attention_.begin(); it != attention_.end();) {
      const auto& [step, call, mb] = it->first;
      auto& layers = it->second.layers;
      if (step == job.step && call == job.call)
        layers.erase(layers.lower_bound(stage_.begin), layers.lower_bound(stage_.end));
      it = step < job.step || layers.empty() ? attention_.erase(it) : std::next(it);
    }
  }
  if (stage_.kind == core::StageKind::kForward && KeptFrom(stage_) < stage_.end) {
    // Defensive: graphs of earlier steps nobody adopted and this job's own from an earlier attempt.
    // Neither happens while the one worker runs every job in step order (a failed job ends the
    // process, and its graphs with it), but a leftover must not hold device memory for good.
    for (auto it = kept_.begin(); it != kept_.end();) {
      const auto& [step, call, layer] = it->first;
      const bool own =
          step == job.step && call == job.call && layer >= stage_.begin && layer < stage_.end;
      it = step < job.step || own ? kept_.erase(it) : std::next(it);
    }
  }
  next_ = StageWeights();
  lm_.job = LayerMajorEligible(job) && all_inputs_ready &&
            (!current_.complete || cfg_.bench.layer_major_forward == core::Tristate::kAlways);
  lm_.next_layer = stage_.begin;
  lm_.hidden.assign(lm_.job ? job.num_microbatches : 0, at::Tensor());
  lm_.stalled = false;
  lm_.stall_end_us = WallMicros();
  lm_.busy_marks.clear();
  lm_.layer_marks.assign(lm_.job && job.profile ? job.num_microbatches : 0, {});
  RP_RETURN_IF_ERROR(Guarded([] { return std::string("waiting for weights"); },
                             [&] {
                               // (A layer-major job's later layers: ForwardLayers makes the compute
                               // stream wait for each.)
                               device_.WaitWeights(current_.complete ? current_.fence
                                                                     : device_.WeightsFence());
                               return Status::Ok();
                             }));
  // The projections' fp32 sums start at zero and their GEMMs add into them (sinks); made here,
  // not at the fetch, so a prefetched job holds no gradient memory while the current one runs.
  int64_t sink_bytes = 0;
  return Guarded(
      [&] {
        return "job " + std::to_string(job.job_index) +
               ": allocating its fp32 weight-gradient sums (" + std::to_string(sink_bytes) +
               " bytes so far)";
      },
      [&] {
        math_.SetWeightGradSinks({});
        for (const auto& g : current_.grads)
          if (g.sink && !g.accum.defined())
            sink_bytes += g.weight.numel() * static_cast<int64_t>(sizeof(float));
        StartSinks();
        return Status::Ok();
      });
}

void Executor::StartSinks() {
  for (auto& g : current_.grads)
    if (g.sink && !g.accum.defined()) {
      g.accum = at::zeros(g.weight.sizes(), g.weight.options().dtype(at::kFloat));
      math_.AddWeightGradSink(g.weight, g.accum);
    }
}

void Executor::AdoptKept(const proto::RunJob& job, StageWeights* w) {
  w->kept_decided = true;
  const core::Stage& st = plan_.stages[job.stage];
  w->fetch_end = st.end;
  const int from = KeptFrom(st);
  if (st.kind != core::StageKind::kBackward || from == st.end) return;
  bool whole = true;
  for (int l = from; l < st.end && whole; ++l) {
    auto it = kept_.find({job.step, job.call, l});
    whole =
        it != kept_.end() && it->second.weights_version == job.weights_version &&
        it->second.grads.size() == spec_.layer_uses[l].size() &&
        static_cast<int>(it->second.segments.size()) == job.num_microbatches &&
        std::all_of(it->second.segments.begin(), it->second.segments.end(),
                    [](const auto& seg) { return seg.first.defined() && seg.second.defined(); });
  }
  for (int l = from; l < st.end; ++l) {
    auto it = kept_.find({job.step, job.call, l});
    if (it == kept_.end()) continue;
    if (whole) {
      for (auto& g : it->second.grads) w->grads.push_back(std::move(g));
      w->kept_segments.push_back(std::move(it->second.segments));
    }
    kept_.erase(it);
  }
  if (whole) w->fetch_end = from;
}

at::Tensor Executor::KeptLayerForward(int l, int mb, const at::Tensor& x) {
  c10::AutoGradMode grad_mode(true);
  KeptLayer& k = kept_[{job_.step, job_.call, l}];
  if (k.segments.empty()) {
    k.weights_version = job_.weights_version;
    k.segments.resize(static_cast<size_t>(job_.num_microbatches));
  }
  // A leaf of its own: the backward stage runs this layer's backward alone and reads the input's
  // gradient from it, as SegmentedForward's segments do.
  at::Tensor in = x.detach().requires_grad_(true);
  at::Tensor y = math_.Layer(l, current_.layers[l - stage_.begin], in);
  k.segments.at(static_cast<size_t>(mb)) = {in, y};
  return y.detach();
}

StatusOr<std::vector<MicrobatchResult>> Executor::ForwardLayers(
    const std::map<int, InputSources>& inputs, bool* done) {
  *done = false;
  const int M = job_.num_microbatches;
  if (!lm_.job || static_cast<int>(lm_.hidden.size()) != M)
    return Status::Internal("job " + std::to_string(job_.job_index) +
                            " is not a begun layer-major job");
  std::vector<MicrobatchResult> results;
  Status s = Guarded(
      [&] {
        return "job " + std::to_string(job_.job_index) + " layer " + std::to_string(lm_.next_layer);
      },
      [&]() -> Status {
        c10::NoGradGuard no_grad;
        if (CopyReadyLayers(stage_, job_.weights_version, /*grads=*/false, &current_)) {
          StartSinks();
          device_.WaitWeights(device_.WeightsFence());
          if (lm_.stalled) lm_.stall_end_us = WallMicros();
        }
        const int copied_end = stage_.begin + static_cast<int>(current_.layers.size());
        lm_.stalled = copied_end < stage_.end;
        // Device marks around each batch of layers: the device's busy time, without the waits for
        // unpublished layers between batches (MicrobatchResult::busy_s).
        const int mark_a = lm_.next_layer < copied_end ? device_.Mark() : -1;
        for (; lm_.next_layer < copied_end; ++lm_.next_layer) {
          const int l = lm_.next_layer;
          for (int mb = 0; mb < M; ++mb) {
            SetMicrobatchFor(mb);
            at::Tensor x;
            if (l > stage_.begin) {
              x = lm_.hidden[mb];
            } else {
              auto in = inputs.find(mb);
              if (in == inputs.end())
                return Status::Internal("job " + std::to_string(job_.job_index) + ": microbatch " +
                                        std::to_string(mb) +
                                        "'s input is not ready for a layer-major stage");
              from_ = in->second;
              x = StageInput(mb);
            }
            const int a = MarkIfProfiling();
            x = plan_.KeepsGraph(l) ? KeptLayerForward(l, mb, x)
                                    : math_.Layer(l, current_.layers[l - stage_.begin], x);
            StoreRouterStats(mb, l);
            if (a >= 0)
              lm_.layer_marks[mb].push_back(
                  LayerMarks(l, proto::LayerPhase::kForward, a, device_.Mark(), -1, mb));
            if (plan_.HiddenSlot(l + 1) >= 0) StoreHidden(mb, l + 1, x);
            lm_.hidden[mb] = l + 1 < stage_.end ? x : at::Tensor();
          }
        }
        if (mark_a >= 0) lm_.busy_marks.push_back({mark_a, device_.Mark()});
        if (lm_.next_layer < stage_.end) return Status::Ok();
        *done = true;
        results.resize(M);
        const uint64_t fence = device_.CompletionFence();
        for (int mb = 0; mb < M; ++mb) {
          results[mb].fence = fence;
          results[mb].layer_major = true;
          if (!lm_.layer_marks.empty()) results[mb].pending_marks = std::move(lm_.layer_marks[mb]);
        }
        results[0].busy_marks = std::move(lm_.busy_marks);
        lm_.busy_marks.clear();
        lm_.layer_marks.clear();
        lm_.hidden.clear();
        lm_.job = false;
        return Status::Ok();
      });
  if (!s.ok()) return s;
  return results;
}

void Executor::AccumulateGrads() {
  for (auto& g : current_.grads) {
    const at::Tensor& grad = g.weight.grad();
    if (!grad.defined()) continue;
    if (g.accum.defined()) g.accum.add_(grad);
    // The leaf's .grad is its own tensor (autograd clones what it cannot steal): an fp32 one
    // (a mapped fp32 embedding's) becomes the sum as it is, without a second copy of it.
    else g.accum = grad.scalar_type() == at::kFloat ? grad : grad.to(at::kFloat);
    g.weight.mutable_grad().reset();
  }
}

at::Tensor Executor::Tokens(int mb, bool labels) {
  const uint64_t off =
      labels ? layout_.LabelSlot(job_.parity, mb) : layout_.TokenSlot(job_.parity, mb);
  return device_.FetchActivation(segment_.data() + off,
                                 {cfg_.train.microbatch_size, cfg_.data.seq_len}, at::kLong);
}

at::Tensor Executor::Hidden(int mb, int boundary) {
  return activations_
      ->Read(ActivationStore::Kind::kHidden, job_.parity, mb, plan_.HiddenSlot(boundary),
             from_.hidden_rank, job_.job_index)
      .to(act_dtype_);
}

at::Tensor Executor::StageInput(int mb) {
  return stage_.begin == 0 ? Tokens(mb, false) : Hidden(mb, stage_.begin);
}

void Executor::SetMicrobatchFor(int mb) {
  math_.SetDropoutKey(
      model::DropoutKey(cfg_.train.seed, job_.step, core::StepMicrobatch(cfg_, job_.call, mb)));
  const auto key = std::make_tuple(job_.step, job_.call, mb);
  auto it = documents_.find(key);
  if (it == documents_.end()) {
    for (auto old = documents_.begin(); old != documents_.end();)
      old = std::get<0>(old->first) + 1 < job_.step ? documents_.erase(old) : std::next(old);
    it = documents_.emplace(key, DocumentsAt(layout_.PositionSlot(job_.parity, mb))).first;
  }
  math_.SetDocuments(it->second);
  UseAttentionRecords(mb);
}

void Executor::UseAttentionRecords(int mb) {
  math_.SetAttentionRecords(nullptr, false);
  if (cfg_.schedule.keep_attention == 0) return;
  const auto key = std::make_tuple(job_.step, static_cast<int64_t>(job_.call), mb);
  if (stage_.kind == core::StageKind::kForward) {
    KeptAttention& k = attention_[key];
    if (k.weights_version != job_.weights_version) {
      k.layers.clear();
      k.weights_version = job_.weights_version;
    }
    math_.SetAttentionRecords(&k.layers, /*write=*/true, core::KeptAttentionStart(cfg_, plan_));
  } else if (stage_.kind == core::StageKind::kBackward) {
    auto it = attention_.find(key);
    // Records of other weights are another forward's: recompute instead.
    if (it != attention_.end() && it->second.weights_version == job_.weights_version)
      math_.SetAttentionRecords(&it->second.layers, /*write=*/false);
  }
}

void Executor::DropAttentionRecords(int mb) {
  math_.SetAttentionRecords(nullptr, false);
  auto it = attention_.find(std::make_tuple(job_.step, static_cast<int64_t>(job_.call), mb));
  if (it == attention_.end()) return;
  auto& layers = it->second.layers;
  layers.erase(layers.lower_bound(stage_.begin), layers.lower_bound(stage_.end));
  if (layers.empty()) attention_.erase(it);
}

model::Documents Executor::DocumentsAt(uint64_t positions) {
  return model::MakeDocuments(segment_.At<int64_t>(positions), cfg_.train.microbatch_size,
                              cfg_.data.seq_len, [this](const int64_t* host, int64_t n) {
                                return device_.FetchActivation(host, {n}, at::kLong);
                              });
}

at::Tensor Executor::InputGrad(int mb, int boundary) {
  return activations_
      ->Read(ActivationStore::Kind::kInputGrad, job_.parity, mb, plan_.GradSlot(boundary),
             from_.grad_rank, job_.job_index)
      .to(act_dtype_);
}

void Executor::StoreHidden(int mb, int boundary, const at::Tensor& t) {
  activations_->Write(ActivationStore::Kind::kHidden, job_.parity, mb, plan_.HiddenSlot(boundary),
                      t);
}

void Executor::StoreInputGrad(int mb, int boundary, const at::Tensor& t) {
  activations_->Write(ActivationStore::Kind::kInputGrad, job_.parity, mb, plan_.GradSlot(boundary),
                      t);
}

void Executor::StoreRouterStats(int mb, int l) {
  if (layout_.router_blocks == 0 || l < 1 || l > cfg_.model.num_layers ||
      !core::SparseBlock(cfg_.model, l - 1))
    return;
  const at::Tensor stats = math_.RouterStats(l).contiguous();
  const int block = static_cast<int>(core::SparseBlocksBefore(cfg_.model, l - 1));
  std::memcpy(segment_.data() + layout_.RouterStatsSlot(job_.parity, mb, block),
              stats.data_ptr<double>(),
              static_cast<size_t>(2 * layout_.router_experts) * sizeof(double));
}

model::RouterAux Executor::ReadRouterAux(int mb) const {
  const int E = layout_.router_experts;
  std::vector<double> choices(static_cast<size_t>(E)), probs(static_cast<size_t>(E));
  for (int b = 0; b < layout_.router_blocks; ++b) {
    const auto* slot = reinterpret_cast<const double*>(segment_.data() +
                                                       layout_.RouterStatsSlot(job_.parity, mb, b));
    for (int e = 0; e < E; ++e) {
      choices[static_cast<size_t>(e)] += slot[e];
      probs[static_cast<size_t>(e)] += slot[E + e];
    }
  }
  const int64_t rows =
      static_cast<int64_t>(layout_.router_blocks) * cfg_.train.microbatch_size * cfg_.data.seq_len;
  return model::RouterAuxLoss(choices.data(), probs.data(), E, rows, core::RouterAuxWeight(cfg_));
}

at::Tensor Executor::RouterAuxGrad(const model::RouterAux& aux, const at::Tensor& like) {
  at::Tensor g = at::tensor(aux.grad, at::TensorOptions().dtype(at::kFloat)).to(like.device());
  return layout_.loss_scaling != 0 ? g * StepLossScale() : g;
}

double Executor::StepLossScale() const {
  if (layout_.loss_scaling == 0) return 1.0;
  // Stored before any weights this job fetched were published (shm::LossScaleRecord).
  const auto* record = segment_.At<shm::LossScaleRecord>(layout_.loss_scaling);
  return record->step_scale[job_.step % shm::kLossScaleRing].load(std::memory_order_acquire);
}

int Executor::MarkIfProfiling() { return job_.profile ? device_.Mark() : -1; }

MicrobatchResult::PendingMarks Executor::LayerMarks(int layer, proto::LayerPhase phase, int a,
                                                    int b, int64_t saved_bytes, int mb) const {
  proto::LayerTime lt{};
  lt.job_index = job_.job_index;
  lt.microbatch = mb;
  lt.layer = layer;
  lt.phase = static_cast<int32_t>(phase);
  lt.saved_bytes = saved_bytes;
  return {lt, a, b};
}

void Executor::Timed(int layer, proto::LayerPhase phase, int a, int b, int64_t saved_bytes) {
  if (job_.profile) pending_marks_.push_back(LayerMarks(layer, phase, a, b, saved_bytes, -1));
  if (between_layers_) between_layers_();
}

MicrobatchResult Executor::RunForward(int mb) {
  c10::NoGradGuard no_grad;
  at::Tensor x = StageInput(mb);
  for (int l = stage_.begin; l < stage_.end; ++l) {
    const int a = MarkIfProfiling();
    x = plan_.KeepsGraph(l) ? KeptLayerForward(l, mb, x)
                            : math_.Layer(l, current_.layers[l - stage_.begin], x);
    StoreRouterStats(mb, l);
    Timed(l, proto::LayerPhase::kForward, a, MarkIfProfiling(), -1);
    // The stage output and every checkpoint a backward stage will recompute from.
    if (plan_.HiddenSlot(l + 1) >= 0) StoreHidden(mb, l + 1, x);
  }
  return {};
}

// Autograd forward of layers [stage begin, end) from `x`, one graph segment per layer: each
// layer's input is a fresh leaf, so the backward can run (and be timed) layer by layer. The
// gradients are the same as through one graph: each segment computes the same operations.
//
// train.layer_recompute: no graph here. The layers run without autograd and only each layer's
// input is kept (and the last output, the head's input in a tail); SegmentedBackward rebuilds
// one layer's graph at a time from its input. The same operations on the same inputs: the same
// gradients, with one layer's intermediates on the device instead of the stage's.
void Executor::SegmentedForward(const at::Tensor& x, int end, Segments* seg) {
  if (cfg_.train.layer_recompute) {
    seg->layerwise = true;
    c10::NoGradGuard no_grad;
    at::Tensor h = x;
    for (int l = stage_.begin; l < end; ++l) {
      const int a = MarkIfProfiling();
      at::Tensor y = math_.Layer(l, current_.layers[l - stage_.begin], h);
      Timed(l, proto::LayerPhase::kForward, a, MarkIfProfiling(), -1);
      seg->inputs.push_back(h);
      h = y;
    }
    if (end > stage_.begin) seg->outputs.push_back(h);
    return;
  }
  for (int l = stage_.begin; l < end; ++l) {
    at::Tensor in = l == stage_.begin ? x : seg->outputs.back().detach().requires_grad_(true);
    const int64_t before = job_.profile ? device_.AllocatedBytes() : -1;
    // A layer whose attention comes from its forward's record is timed apart: the profile's
    // recompute is the whole autograd forward.
    const auto phase =
        math_.HasAttentionRecord(l) ? proto::LayerPhase::kReplay : proto::LayerPhase::kRecompute;
    const int a = MarkIfProfiling();
    at::Tensor y = math_.Layer(l, current_.layers[l - stage_.begin], in);
    const int b = MarkIfProfiling();
    const int64_t after = job_.profile ? device_.AllocatedBytes() : -1;
    Timed(l, phase, a, b, before >= 0 && after >= 0 ? after - before : -1);
    seg->inputs.push_back(in);
    seg->outputs.push_back(y);
  }
}

// Backpropagates `grad` (the gradient of the last segment's output) down to the first segment;
// returns the gradient of the first input (undefined for token ids).
at::Tensor Executor::SegmentedBackward(Segments* seg, at::Tensor grad) {
  if (seg->layerwise) {
    seg->outputs.clear();
    for (size_t i = seg->inputs.size(); i-- > 0;) {
      const int l = stage_.begin + static_cast<int>(i);
      // The stage's own input keeps what the caller made of it (a leaf needing grad, or tokens).
      at::Tensor in = i == 0 ? seg->inputs[0] : seg->inputs[i].requires_grad_(true);
      const int64_t before = job_.profile ? device_.AllocatedBytes() : -1;
      const int a = MarkIfProfiling();
      at::Tensor y = math_.Layer(l, current_.layers[i], in);
      const int b = MarkIfProfiling();
      const int64_t after = job_.profile ? device_.AllocatedBytes() : -1;
      Timed(l, proto::LayerPhase::kRecompute, a, b,
            before >= 0 && after >= 0 ? after - before : -1);
      if (y.requires_grad()) y.backward(grad);
      Timed(l, proto::LayerPhase::kBackward, b, MarkIfProfiling(), -1);
      grad = in.requires_grad() ? in.grad() : at::Tensor();
      seg->inputs[i] = at::Tensor();
    }
    return grad;
  }
  for (size_t i = seg->outputs.size(); i-- > 0;) {
    const int a = MarkIfProfiling();
    // A frozen embedding (LoRA) from token ids has no graph: nothing to propagate.
    if (seg->outputs[i].requires_grad()) seg->outputs[i].backward(grad);
    Timed(stage_.begin + static_cast<int>(i), proto::LayerPhase::kBackward, a, MarkIfProfiling(),
          -1);
    seg->outputs[i] = at::Tensor();
    grad = seg->inputs[i].requires_grad() ? seg->inputs[i].grad() : at::Tensor();
  }
  return grad;
}

MicrobatchResult Executor::RunTail(int mb) {
  at::Tensor x = Hidden(mb, stage_.begin).requires_grad_(true);
  const int head = plan_.num_layers - 1;
  Segments seg;
  // The load-balancing loss's gradient needs this tail's own blocks' choices too: set now,
  // filled in place once they have routed, read by the backward inside the head below.
  at::Tensor aux_grad;
  if (layout_.router_blocks > 0) {
    aux_grad =
        at::zeros({layout_.router_experts}, x.options().dtype(at::kFloat).requires_grad(false));
    math_.SetRouterAuxGrad(aux_grad);
  }
  SegmentedForward(x, head, &seg);
  double aux_loss_sum = 0.0;
  if (aux_grad.defined()) {
    for (int l = stage_.begin; l < head; ++l) StoreRouterStats(mb, l);
    const model::RouterAux aux = ReadRouterAux(mb);
    aux_grad.copy_(RouterAuxGrad(aux, aux_grad));
    aux_loss_sum = aux.value / job_.loss_scale;
  }
  at::Tensor head_in = seg.outputs.empty() ? x : seg.outputs.back().detach().requires_grad_(true);
  at::Tensor labels = Tokens(mb, true);
  const int a = MarkIfProfiling();
  double loss_scale = job_.step == TestNanStep() ? std::nan("") : job_.loss_scale * StepLossScale();
  if (TestOverflowAt(job_.step)) loss_scale = std::numeric_limits<double>::infinity();
  auto r = math_.HeadForwardBackward(current_.layers.back(), head_in, labels, loss_scale,
                                     /*backward=*/true, /*defer_read=*/true);
  Timed(head, proto::LayerPhase::kRecompute, a, MarkIfProfiling(), -1);
  at::Tensor g = seg.inputs.empty() ? head_in.grad() : SegmentedBackward(&seg, head_in.grad());
  StoreInputGrad(mb, stage_.begin, g);
  math_.SetRouterAuxGrad({});
  MicrobatchResult out;
  out.loss_sum = r.loss_sum + aux_loss_sum;
  out.aux_loss_sum = aux_loss_sum;
  out.targets = r.targets;
  if (r.pending.defined()) {
    // Reading the sums now would wait for this microbatch; the copy lands when it is done.
    out.pending_loss = at::empty({2}, at::TensorOptions().dtype(at::kDouble).pinned_memory(true));
    out.pending_loss.copy_(r.pending, /*non_blocking=*/true);
  }
  return out;
}

MicrobatchResult Executor::RunBackward(int mb) {
  // Adopted kept layers first (the top of the stage), through the graphs their forward kept.
  const int kept_from = FetchEnd(stage_, current_);
  at::Tensor g = InputGrad(mb, stage_.end);
  for (int l = stage_.end; l-- > kept_from;) {
    auto& [in, out] =
        current_.kept_segments.at(static_cast<size_t>(l - kept_from)).at(static_cast<size_t>(mb));
    const int a = MarkIfProfiling();
    out.backward(g);
    Timed(l, proto::LayerPhase::kBackward, a, MarkIfProfiling(), -1);
    g = in.grad();
    in = out = at::Tensor();
  }
  if (kept_from > stage_.begin) {
    at::Tensor x = StageInput(mb);
    if (stage_.begin > 0) x.requires_grad_(true);
    if (layout_.router_blocks > 0) math_.SetRouterAuxGrad(RouterAuxGrad(ReadRouterAux(mb), x));
    Segments seg;
    SegmentedForward(x, kept_from, &seg);
    g = SegmentedBackward(&seg, g);
  }
  if (stage_.begin > 0) StoreInputGrad(mb, stage_.begin, g);
  math_.SetRouterAuxGrad({});
  DropAttentionRecords(mb);
  return {};
}

StatusOr<MicrobatchResult> Executor::Microbatch(int mb, InputSources from) {
  if (mb < 0 || mb >= round_.microbatches)
    return Status::ProtocolError("microbatch " + std::to_string(mb) + " out of range");
  from_ = from;
  MicrobatchResult r;
  Status s = Guarded(
      [&] { return "job " + std::to_string(job_.job_index) + " microbatch " + std::to_string(mb); },
      [&] {
        pending_marks_.clear();
        SetMicrobatchFor(mb);
        math_.SetRouterAuxGrad({});  // one that an exception left set belongs to another microbatch
        switch (stage_.kind) {
          case core::StageKind::kForward: r = RunForward(mb); break;
          case core::StageKind::kFusedTail: r = RunTail(mb); break;
          case core::StageKind::kBackward: r = RunBackward(mb); break;
        }
        if (HasGrads()) AccumulateGrads();
        // Nothing here waits for the device, profiled or not: the marks are read once the fence
        // has passed (MicrobatchResult::Resolve).
        r.fence = device_.CompletionFence();
        for (auto& p : pending_marks_) p.time.microbatch = mb;
        r.pending_marks = std::move(pending_marks_);
        pending_marks_.clear();
        return Status::Ok();
      });
  if (!s.ok()) return s;
  return r;
}

void MicrobatchResult::Resolve(Device& device) {
  if (!busy_marks.empty()) {
    busy_s = 0.0;
    for (const auto& [a, b] : busy_marks) busy_s += device.MarkSeconds(a, b);
    busy_marks.clear();
  }
  for (auto& p : pending_marks) {
    p.time.seconds = device.MarkSeconds(p.mark_a, p.mark_b);
    layer_times.push_back(p.time);
  }
  pending_marks.clear();
  if (!pending_loss.defined()) return;
  const double* sums = pending_loss.data_ptr<double>();
  loss_sum = sums[0] + aux_loss_sum;
  targets = static_cast<int64_t>(sums[1]);
  pending_loss = at::Tensor();
}

Status Executor::Detach() {
  std::vector<HeldGrad> held;
  for (auto& g : current_.grads) {
    if (g.grad_slot == layout_.compact_lookup_slot) {
      // The job's input-token rows only, ascending (core::CompactLookupRows): the lookup's
      // gradient is zero elsewhere. The token slots hold this step's tokens until the step is
      // done, which needs this job's commit.
      std::vector<const int64_t*> slots;
      for (int mb = 0; mb < job_.num_microbatches; ++mb)
        slots.push_back(segment_.At<int64_t>(layout_.TokenSlot(job_.parity, mb)));
      std::vector<int64_t> rows =
          core::SortedTokenRows(slots, cfg_.TokensPerMicrobatch(), cfg_.model.vocab_size);
      const int64_t n = static_cast<int64_t>(rows.size()), cols = g.weight.size(1);
      const auto options = g.weight.options().dtype(at::kFloat);
      at::Tensor compact;
      if (!g.accum.defined() || n == 0) {
        compact = at::zeros({n, cols}, options);
      } else {
        // Pinned and asynchronous to a device: a copy from pageable memory would first wait for
        // the compute stream (this job's microbatches).
        at::Tensor index = at::from_blob(rows.data(), {n}, at::kLong);
        index = g.accum.is_cpu() ? index.clone()
                                 : index.pin_memory().to(g.accum.device(), /*non_blocking=*/true);
        compact = g.accum.index_select(0, index);
      }
      held.push_back({compact, g.grad_slot, {n, cols}, options});
      continue;
    }
    held.push_back(
        {g.accum, g.grad_slot, g.weight.sizes().vec(), g.weight.options().dtype(at::kFloat)});
  }
  // The device update holds its blocks' gradients now: complete (their work is queued), and
  // before any commit, which a step's update may no longer wait for (gradients waiting in the
  // worker are committed covered blocks last).
  Status s = Status::Ok();
  if (device_update_)
    s = Guarded([] { return std::string("holding gradients for the device update"); },
                [&] {
                  for (const auto& g : held)
                    if (g.accum.defined())
                      device_update_->Hold(spec_.grad_slots[g.grad_slot].param, g.accum);
                  return Status::Ok();
                });
  held_[job_.job_index] = std::move(held);
  End();
  return s;
}

StatusOr<uint64_t> Executor::StartCommit(int64_t job_index, bool accumulate) {
  auto it = held_.find(job_index);
  if (it == held_.end())
    return Status::ProtocolError("commit grant for job " + std::to_string(job_index) +
                                 ", which holds no gradients here");
  uint64_t ticket = 0;
  Status s = Guarded(
      [] { return std::string("committing gradients"); },
      [&]() -> Status {
        std::vector<Device::CommitItem> items;
        for (auto& g : it->second) {
          if (!g.accum.defined()) {
            // A parameter this stage did not reach: its slot must still read zero, not last step.
            if (accumulate) continue;
            g.accum = at::zeros(g.shape, g.options);
          }
          // Where the coordinator placed the slot for this step (written before it granted this
          // commit). Checked, so a bad table entry fails the job instead of writing elsewhere.
          const uint64_t off =
              segment_.At<std::atomic<uint64_t>>(layout_.grad_table)[g.grad_slot].load(
                  std::memory_order_acquire);
          if (!layout_.GradSlotInArena(off, layout_.grad_slot_bytes[g.grad_slot]))
            return Status::ProtocolError("gradient slot " + std::to_string(g.grad_slot) +
                                         " of job " + std::to_string(job_index) +
                                         " is placed at offset " + std::to_string(off) +
                                         ", outside the gradient arena");
          if (layout_.sharded_grads) {
            // The slot holds this node's share only (the other nodes commit theirs of the same
            // sum).
            const core::ElemRange share = layout_.share[spec_.grad_slots[g.grad_slot].param];
            items.push_back({g.accum.reshape({-1}).narrow(0, share.begin, share.size()),
                             segment_.At<float>(off)});
          } else {
            items.push_back({g.accum, segment_.At<float>(off)});
          }
        }
        held_.erase(it);
        ticket = device_.StartCommit(std::move(items), accumulate);
        return Status::Ok();
      });
  if (!s.ok()) return s;
  return ticket;
}

Status Executor::ApplyStepUpdate(const proto::StepUpdate& u) {
  if (!device_update_)
    return Status::ProtocolError("StepUpdate for step " + std::to_string(u.step) +
                                 ", but this worker updates no blocks on its device");
  return Guarded(
      [&] {
        return "updating blocks 1.." + std::to_string(execution_.device_update_blocks) +
               " on the device for step " + std::to_string(u.step);
      },
      [&] {
        device_update_->Apply(u);
        return Status::Ok();
      });
}

StatusOr<at::Tensor> Executor::GatherHeld(int64_t job_index) {
  auto it = held_.find(job_index);
  if (it == held_.end())
    return Status::ProtocolError("commit grant for job " + std::to_string(job_index) +
                                 ", which holds no gradients here");
  at::Tensor flat;
  Status s =
      Guarded([] { return std::string("gathering gradients for the cross-node sum"); },
              [&]() -> Status {
                int64_t total = 0;
                for (const auto& g : it->second) total += c10::multiply_integers(g.shape);
                // On the worker's device: CUDA workers sum over NCCL, on the compute stream's
                // order.
                flat = at::zeros(
                    {total}, at::TensorOptions().dtype(at::kFloat).device(device_.torch_device()));
                int64_t off = 0;
                for (auto& g : it->second) {
                  const int64_t n = c10::multiply_integers(g.shape);
                  at::Tensor view = flat.narrow(0, off, n).view(g.shape);
                  if (g.accum.defined()) {
                    if (g.accum.device() != flat.device())
                      return Status::Internal("a held gradient is on " + g.accum.device().str() +
                                              ", the worker's device is " + flat.device().str());
                    view.copy_(g.accum);
                  }
                  g.accum = view;
                  off += n;
                }
                return Status::Ok();
              });
  if (!s.ok()) return s;
  return flat;
}

StatusOr<uint64_t> Executor::StartChunkSquares(int64_t job_index, double* table) {
  auto it = held_.find(job_index);
  if (it == held_.end())
    return Status::ProtocolError("gradient squares of job " + std::to_string(job_index) +
                                 ", which holds no gradients here");
  uint64_t ticket = 0;
  Status s = Guarded(
      [] { return std::string("summing the squares of held gradients"); },
      [&]() -> Status {
        std::vector<Device::SquaresItem> items;
        for (const auto& g : it->second) {
          // The compact lookup rows are gathered after the job's last microbatch (Detach), on the
          // compute stream: Device::StartChunkSquares would not wait for them. The modes that sum
          // squares in the workers never have that slot (tied lookups are refused there).
          if (g.grad_slot == layout_.compact_lookup_slot)
            return Status::Internal(
                "gradient squares of job " + std::to_string(job_index) +
                ": its compact lookup gradient is not complete when the job is");
          const int param = spec_.grad_slots[g.grad_slot].param;
          double* out = table + layout_.square_chunk_base[param];
          if (g.accum.defined()) {
            items.push_back({g.accum, out});
          } else {
            const int64_t numel = c10::multiply_integers(g.shape);
            std::fill(out, out + (numel + shm::kSquareChunkElems - 1) / shm::kSquareChunkElems,
                      0.0);
          }
        }
        ticket = device_.StartChunkSquares(std::move(items), shm::kSquareChunkElems);
        return Status::Ok();
      });
  if (!s.ok()) return s;
  return ticket;
}

void Executor::End() {
  math_.SetWeightGradSinks({});
  math_.SetAttentionRecords(nullptr, false);
  // A forward job's kept layers: their weights and sums wait with their graphs (KeptLayer).
  if (stage_.kind == core::StageKind::kForward)
    for (auto& g : current_.grads)
      kept_[{job_.step, job_.call, g.layer}].grads.push_back(std::move(g));
  current_ = StageWeights();
  lm_.hidden.clear();
  lm_.layer_marks.clear();
  lm_.job = false;
}

}  // namespace rp::worker
