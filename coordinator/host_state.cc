// SPDX-License-Identifier: Apache-2.0
#include "coordinator/host_state.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <functional>
#include <memory>
#include <cstring>

#include "common/cores.h"
#include "common/logging.h"
#include "optim/adamw.h"
#include "optim/optimizer_step.h"
#include "io/hf_model.h"
#include "io/peft.h"
#include "protocol/codec.h"

namespace rp::coord {

HostState::HostState(const core::JobConfig& cfg, const core::ModelSpec& spec,
                     const core::PipelinePlan& plan, const shm::ArenaLayout& layout,
                     const std::string& run_id)
    : cfg_(cfg),
      spec_(spec),
      plan_(plan),
      layout_(layout),
      state_unlinker_(shm::StateSegmentName(run_id)),
      optim_unlinker_(shm::OptimSegmentName(run_id)) {}

StatusOr<std::unique_ptr<HostState>> HostState::Create(const core::JobConfig& cfg,
                                                       const core::ModelSpec& spec,
                                                       const core::PipelinePlan& plan,
                                                       const shm::ArenaLayout& layout,
                                                       const std::string& run_id, int workers) {
  RP_RETURN_IF_ERROR(shm::CheckSharedMemoryRoom(shm::SharedMemoryBytes(layout, cfg, workers),
                                                "this job (state and optimizer segments)"));
  std::unique_ptr<HostState> h(new HostState(cfg, spec, plan, layout, run_id));
  RP_ASSIGN_OR_RETURN(auto state,
                      shm::Segment::Create(shm::StateSegmentName(run_id), layout.total_bytes));
  h->state_.emplace(std::move(state));
  RP_ASSIGN_OR_RETURN(
      auto optim, shm::Segment::Create(shm::OptimSegmentName(run_id), layout.optim_total_bytes));
  h->optim_.emplace(std::move(optim));
  h->grad_arena_ =
      std::make_unique<GradArena>(layout, h->state_->At<std::atomic<uint64_t>>(layout.grad_table));
  auto* header = h->state_->header();
  std::memset(static_cast<void*>(header), 0, sizeof(*header));
  h->state_->StampHeader(layout.hash);
  header->trainable_params = static_cast<uint64_t>(spec.TrainableParams());
  header->coordinator_pid = ::getpid();
  proto::CopyText(header->session, run_id);
  return h;
}

const float* HostState::Weights(int p, int64_t version) const {
  if (layout_
          .masters_in_state)  // the masters holding `version` updates (one buffer, or version % 2)
    return state_->At<const float>(
        layout_.ComputeCopy(p, static_cast<int>(version % layout_.compute_buffers)));
  if (!layout_.sharded) return optim_->At<const float>(layout_.master[p]);
  return state_->At<const float>(
      layout_.ComputeCopy(p, static_cast<int>(version % layout_.compute_buffers)));
}

void HostState::ReadFrozen(int f, float* out) const {
  FromComputeCopy(state_->At<const uint8_t>(layout_.frozen[f]), out, spec_.frozen[f].numel,
                  ComputeDtypeOf(cfg_.train.dtype));
}

namespace {

// Where each tensor's bytes lie in one checkpoint section, and a describer naming the ones in a
// byte range (the tensors a damaged chunk belongs to).
struct Extent {
  uint64_t begin, end;
  std::string what;
};

std::function<std::string(uint64_t, uint64_t)> Describer(std::vector<Extent> extents) {
  std::sort(extents.begin(), extents.end(),
            [](const Extent& a, const Extent& b) { return a.begin < b.begin; });
  auto shared = std::make_shared<const std::vector<Extent>>(std::move(extents));
  return [shared](uint64_t begin, uint64_t end) {
    std::vector<std::string> hit;
    for (const auto& e : *shared)
      if (e.begin < end && begin < e.end) hit.push_back(e.what);
    if (hit.empty()) return std::string();
    std::string out = hit[0];
    if (hit.size() > 1) out += ", " + hit[1];
    if (hit.size() > 2) out += " and " + std::to_string(hit.size() - 2) + " more";
    return out;
  };
}

}  // namespace

std::vector<StateSection> HostState::Sections() {
  // The optimizer segment: masters (unless workers fetch them from the state segment) and moments.
  std::vector<Extent> optim;
  const bool has_v = !layout_.adam_v.empty();
  for (size_t p = 0; p < spec_.params.size(); ++p) {
    const uint64_t n = static_cast<uint64_t>(layout_.share[p].size()) * 4;
    const std::string& name = spec_.params[p].name;
    if (!layout_.masters_in_state)
      optim.push_back({layout_.master[p], layout_.master[p] + n, "master of " + name});
    if (!layout_.adam_m.empty())
      optim.push_back({layout_.adam_m[p], layout_.adam_m[p] + n, "first moment of " + name});
    if (has_v)
      optim.push_back({layout_.adam_v[p], layout_.adam_v[p] + n, "second moment of " + name});
  }
  // The compute-copy region, once per buffer (stale1 keeps two); with sharded state this node's
  // shares of it, packed.
  std::vector<Extent> compute;
  const uint64_t region = layout_.compute_end - layout_.compute_begin;
  uint64_t packed = 0;
  for (int b = 0; b < layout_.compute_buffers; ++b)
    for (size_t p = 0; p < spec_.params.size(); ++p) {
      const uint64_t whole =
          static_cast<uint64_t>(spec_.params[p].numel) * layout_.weights_elem_bytes;
      const uint64_t share =
          static_cast<uint64_t>(layout_.share[p].size()) * layout_.weights_elem_bytes;
      const uint64_t at = layout_.sharded ? packed
                                          : layout_.compute[p] - layout_.compute_begin +
                                                static_cast<uint64_t>(b) * region;
      packed += share;
      compute.push_back(
          {at, at + (layout_.sharded ? share : whole),
           (layout_.masters_in_state ? "master of "
                                     : "weights (buffer " + std::to_string(b) + ") of ") +
               spec_.params[p].name});
    }
  std::vector<StateSection> sections = CheckpointSections(layout_, optim_->data(), state_->data());
  sections[0].describe = Describer(std::move(optim));
  sections[1].describe = Describer(std::move(compute));
  return sections;
}

std::vector<std::vector<CheckpointWriter::Placement>> HostState::Placements() const {
  if (layout_.sharded) return {};
  std::vector<std::vector<CheckpointWriter::Placement>> out(spec_.params.size());
  const uint64_t region = layout_.compute_end - layout_.compute_begin;
  for (size_t p = 0; p < spec_.params.size(); ++p) {
    const uint64_t n = static_cast<uint64_t>(spec_.params[p].numel) * 4;
    if (!layout_.masters_in_state) out[p].push_back({0, layout_.master[p], n});
    if (!layout_.adam_m.empty()) out[p].push_back({0, layout_.adam_m[p], n});
    if (!layout_.adam_v.empty()) out[p].push_back({0, layout_.adam_v[p], n});
    const uint64_t weights =
        static_cast<uint64_t>(spec_.params[p].numel) * layout_.weights_elem_bytes;
    for (int b = 0; b < layout_.compute_buffers; ++b)
      out[p].push_back(
          {1, layout_.compute[p] - layout_.compute_begin + static_cast<uint64_t>(b) * region,
           weights});
  }
  return out;
}

namespace {

// ToComputeCopy over every core: at start-up a large model's compute copy is the first write to
// its shared-memory pages, and one thread page-faulting through tens of GB was most of the
// time before the first step (each element converts on its own, so the bits are the same).
void ToComputeCopyOnAllCores(const float* in, uint8_t* out, int64_t n, ComputeDtype dtype) {
  constexpr int64_t kChunk = int64_t{1} << 22;
  const size_t width = dtype == ComputeDtype::kFloat32 ? 4 : 2;
  ParallelFor((n + kChunk - 1) / kChunk, UsableCores(), [&](int64_t c) {
    const int64_t begin = c * kChunk;
    ToComputeCopy(in + begin, out + begin * width, std::min(kChunk, n - begin), dtype);
  });
}

}  // namespace

Status HostState::Fill(const std::optional<StateFile>& resume_from, uint64_t state_hash,
                       int64_t first_step, core::Dataset* eval_data) {
  const ComputeDtype dtype = ComputeDtypeOf(cfg_.train.dtype);
  // LoRA's frozen base, on resume too (checkpoints leave it out): the checkpoint (model.path)
  // or the seeded init, straight into its compute copy.
  if (!spec_.frozen.empty()) {
    std::optional<core::HfWeights> hf;
    if (!cfg_.model.path.empty()) {
      RP_ASSIGN_OR_RETURN(auto w, core::HfWeights::Open(cfg_.model.path));
      hf.emplace(std::move(w));
    }
    std::vector<float> staging;
    for (size_t f = 0; f < spec_.frozen.size(); ++f) {
      const auto& ps = spec_.frozen[f];
      const bool narrow = dtype != ComputeDtype::kFloat32;
      float* dst = narrow ? (staging.resize(static_cast<size_t>(ps.numel)), staging.data())
                          : state_->At<float>(layout_.frozen[f]);
      if (hf) RP_RETURN_IF_ERROR(hf->Load(ps, dst));
      else core::InitParam(ps, spec_.config, static_cast<uint64_t>(cfg_.train.seed), dst);
      if (narrow)
        ToComputeCopyOnAllCores(dst, state_->At<uint8_t>(layout_.frozen[f]), ps.numel, dtype);
    }
  }
  if (resume_from) {
    // Masters, moments and every compute-copy buffer as they were after first_step updates: a
    // whole file straight into a replicated run's segments, else share by share.
    if (resume_from->paths.size() <= 1 && !layout_.sharded)
      RP_RETURN_IF_ERROR(
          ReadTrainingState(*resume_from, state_hash, layout_.masters_in_state, Sections()));
    else
      RP_RETURN_IF_ERROR(ReadTrainingStateShares(*resume_from, cfg_, spec_, layout_, state_hash,
                                                 optim_->data(), state_->data()));
    auto* versions = state_->At<std::atomic<uint64_t>>(layout_.layer_versions);
    for (int l = 0; l < plan_.num_layers; ++l)
      versions[l].store(static_cast<uint64_t>(first_step), std::memory_order_relaxed);
    state_->At<std::atomic<uint64_t>>(layout_.lookup_version)
        ->store(static_cast<uint64_t>(first_step), std::memory_order_relaxed);
    if (layout_.sharded) {
      auto* gathered = state_->At<std::atomic<uint64_t>>(layout_.gathered_versions);
      for (int l = 0; l < plan_.num_layers; ++l)
        gathered[l].store(static_cast<uint64_t>(first_step), std::memory_order_relaxed);
    }
    RP_LOG(INFO) << "resumed from " << resume_from->path << " after step " << first_step;
  } else {
    RP_RETURN_IF_ERROR(FillFresh());
  }
  // The eval set: the same microbatches at every evaluation, written once.
  int64_t eval_targets = 0;
  for (int k = 0; k < layout_.eval_slots; ++k) {
    int64_t* labels = state_->At<int64_t>(layout_.EvalLabelSlot(k));
    eval_data->FillEval(k, state_->At<int64_t>(layout_.EvalTokenSlot(k)), labels,
                        state_->At<int64_t>(layout_.EvalPositionSlot(k)));
    for (uint64_t i = 0; i < layout_.tokens_per_mb; ++i)
      eval_targets += labels[i] != core::kIgnoreIndex;
  }
  if (layout_.eval_slots > 0 && eval_targets == 0)
    return Status::InvalidArgument(
        std::string(cfg_.data.eval_path.empty() ? "data.eval_fraction" : "data.eval_path") +
        ": the eval set (" + std::to_string(layout_.eval_slots) +
        " microbatches) has no target tokens");
  state_->header()->ready.store(1, std::memory_order_release);
  return Status::Ok();
}

Status HostState::FillFresh() {
  // Masters from the Hugging Face checkpoint (model.path; under LoRA the adapter directory
  // lora.init_from) or the seeded init; compute copies from the masters. m and v are zero
  // because a fresh tmpfs object reads as zeros; gradient slots are written before they are read.
  std::optional<core::HfWeights> hf;
  std::optional<core::PeftAdapter> adapter;
  if (spec_.lora.enabled()) {
    // The checkpoint holds the base, not the adapters.
    if (!cfg_.lora.init_from.empty()) {
      RP_ASSIGN_OR_RETURN(auto a, core::PeftAdapter::Open(cfg_.lora.init_from, spec_));
      adapter.emplace(std::move(a));
    }
  } else if (!cfg_.model.path.empty()) {
    RP_ASSIGN_OR_RETURN(auto w, core::HfWeights::Open(cfg_.model.path));
    hf.emplace(std::move(w));
  }
  std::vector<float> staging;
  for (size_t p = 0; p < spec_.params.size(); ++p) {
    const int64_t n = spec_.params[p].numel;
    // The whole parameter in fp32: straight into the masters workers fetch, or into the masters
    // of a replicated optimizer segment; with sharded state that segment holds only this node's
    // share, and the whole goes through a staging buffer into the compute copy.
    float* whole = nullptr;
    if (layout_.masters_in_state) {
      whole = state_->At<float>(layout_.master[p]);
    } else if (!layout_.sharded) {
      whole = optim_->At<float>(layout_.master[p]);
    } else {
      staging.resize(static_cast<size_t>(n));
      whole = staging.data();
    }
    if (adapter) RP_RETURN_IF_ERROR(adapter->Load(spec_.params[p], whole));
    else if (hf) RP_RETURN_IF_ERROR(hf->Load(spec_.params[p], whole));
    else core::InitParam(spec_, static_cast<int>(p), static_cast<uint64_t>(cfg_.train.seed), whole);
    if (layout_.masters_in_state) continue;  // workers fetch the master itself: no compute copy
    if (layout_.sharded) {
      const core::ElemRange r = layout_.share[p];
      std::memcpy(
          optim_->At<float>(layout_.ShareElem(layout_.master, static_cast<int>(p), r.begin)),
          whole + r.begin, static_cast<size_t>(r.size()) * sizeof(float));
    }
    ToComputeCopyOnAllCores(whole, state_->At<uint8_t>(layout_.compute[p]), n,
                            ComputeDtypeOf(cfg_.train.dtype));
  }
  return Status::Ok();
}

}  // namespace rp::coord
