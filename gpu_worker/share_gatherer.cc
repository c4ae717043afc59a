// SPDX-License-Identifier: Apache-2.0
#include "gpu_worker/share_gatherer.h"

#include <chrono>
#include <cstring>

#include "common/logging.h"

namespace rp::worker {

namespace {
// How long the thread sleeps between looks at a version or a pending gather.
constexpr auto kPoll = std::chrono::microseconds(200);
}  // namespace

std::unique_ptr<ShareGatherer> ShareGatherer::Start(const core::JobConfig& config, const core::ModelSpec& spec,
                                                    const shm::ArenaLayout& layout, uint8_t* state, int worker_rank,
                                                    int workers) {
  return std::unique_ptr<ShareGatherer>(new ShareGatherer(config, spec, layout, state, worker_rank, workers));
}

ShareGatherer::ShareGatherer(const core::JobConfig& config, const core::ModelSpec& spec,
                             const shm::ArenaLayout& layout, uint8_t* state, int worker_rank, int workers)
    : cfg_(config), spec_(spec), layout_(layout), state_(state), rank_(worker_rank) {
  std::vector<bool> owns(spec.NumLayers(), false);
  for (const auto& p : spec.params) owns[p.owner_layer] = true;
  for (int l = 0; l < spec.NumLayers(); ++l)
    if (owns[l] && shm::GatheringWorker(l, workers) == worker_rank) layers_.push_back(l);
  thread_ = std::thread([this] {
    Status s = Status::Ok();
    try {
      s = Run();
    } catch (const std::exception& e) {  // LibTorch's allocations and checks throw
      s = Status::Internal(std::string("gathering the other nodes' shares: ") + e.what());
    }
    if (!s.ok()) {
      std::lock_guard<std::mutex> l(mu_);
      failed_ = s;
    }
  });
}

ShareGatherer::~ShareGatherer() {
  stop_.store(true);
  if (thread_.joinable()) thread_.join();
}

std::optional<Status> ShareGatherer::Failed() const {
  std::lock_guard<std::mutex> l(mu_);
  return failed_;
}

Status ShareGatherer::Run() {
  if (layers_.empty()) return Status::Ok();
  const nodes::NodeGroup group{static_cast<int>(cfg_.nodes.count), static_cast<int>(cfg_.nodes.rank),
                               cfg_.nodes.store_host, static_cast<int>(cfg_.nodes.store_port), cfg_.job.node_timeout_s};
  RP_ASSIGN_OR_RETURN(auto gathers, nodes::NodeReduction::Join(group, rank_, "gather"));
  RP_LOG(INFO) << "joined the cross-node gather group of worker " << rank_ << " (" << layers_.size() << " layers, "
               << cfg_.nodes.count << " nodes)";
  const auto* gathered = reinterpret_cast<const std::atomic<uint64_t>*>(state_ + layout_.gathered_versions);
  // Every layer holds the same version at the start (a fresh state, or a checkpoint's).
  uint64_t version = gathered[layers_.front()].load(std::memory_order_acquire) + 1;
  while (!stop_.load()) {
    for (int l : layers_) {
      auto done = GatherLayer(*gathers, l, version);
      if (!done.ok() || !*done) {
        gathers->Abandon();  // a gather still pending is left to the process's exit
        return done.ok() ? Status::Ok() : done.status();
      }
    }
    ++version;
  }
  return Status::Ok();
}

StatusOr<bool> ShareGatherer::GatherLayer(nodes::NodeReduction& group, int layer, uint64_t version) {
  const auto* own = reinterpret_cast<const std::atomic<uint64_t>*>(state_ + layout_.layer_versions);
  while (own[layer].load(std::memory_order_acquire) < version) {
    if (stop_.load()) return false;
    std::this_thread::sleep_for(kPoll);
  }
  const int nodes = static_cast<int>(cfg_.nodes.count);
  const int buffer = static_cast<int>(version % static_cast<uint64_t>(layout_.compute_buffers));
  const uint64_t elem = static_cast<uint64_t>(layout_.weights_elem_bytes);
  // Node n's shares of the layer's parameters in this buffer: (offset in the segment, bytes).
  std::vector<std::vector<std::pair<uint64_t, uint64_t>>> pieces(nodes);
  std::vector<uint64_t> bytes(nodes, 0);
  for (size_t p = 0; p < spec_.params.size(); ++p) {
    if (spec_.params[p].owner_layer != layer) continue;
    for (int n = 0; n < nodes; ++n) {
      const core::ElemRange r = core::ShardOf(spec_.params[p].numel, nodes, n);
      if (r.size() == 0) continue;
      pieces[n].emplace_back(layout_.ComputeCopy(static_cast<int>(p), buffer) + static_cast<uint64_t>(r.begin) * elem,
                             static_cast<uint64_t>(r.size()) * elem);
      bytes[n] += static_cast<uint64_t>(r.size()) * elem;
    }
  }
  // Every node sends as many bytes as the largest share (the gather's sizes must agree).
  uint64_t most = 0;
  for (uint64_t b : bytes) most = std::max(most, b);
  const auto opts = at::TensorOptions().dtype(at::kByte);
  at::Tensor mine = at::zeros({static_cast<int64_t>(most)}, opts);
  const int me = static_cast<int>(cfg_.nodes.rank);
  uint64_t at = 0;
  for (const auto& [offset, n] : pieces[me]) {
    std::memcpy(mine.data_ptr<uint8_t>() + at, state_ + offset, n);
    at += n;
  }
  std::vector<at::Tensor> all;
  for (int n = 0; n < nodes; ++n) all.push_back(at::empty({static_cast<int64_t>(most)}, opts));
  RP_RETURN_IF_ERROR(group.StartGather(mine, all));
  for (;;) {
    RP_ASSIGN_OR_RETURN(const bool complete, group.Poll());
    if (complete) break;
    if (stop_.load()) return false;
    std::this_thread::sleep_for(kPoll);
  }
  for (int n = 0; n < nodes; ++n) {
    if (n == me) continue;
    at = 0;
    for (const auto& [offset, b] : pieces[n]) {
      std::memcpy(state_ + offset, all[n].data_ptr<uint8_t>() + at, b);
      at += b;
    }
  }
  auto* gathered = reinterpret_cast<std::atomic<uint64_t>*>(state_ + layout_.gathered_versions);
  gathered[layer].store(version, std::memory_order_release);
  return true;
}

}  // namespace rp::worker
