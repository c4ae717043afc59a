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
  const int nodes = static_cast<int>(config.nodes.count);
  const uint64_t elem = static_cast<uint64_t>(layout.weights_elem_bytes);
  uint64_t most = 0;
  for (int l = 0; l < spec.NumLayers(); ++l) {
    if (shm::GatheringWorker(l, workers) != worker_rank) continue;
    LayerShares shares{l, std::vector<std::vector<std::pair<uint64_t, uint64_t>>>(nodes), 0};
    std::vector<uint64_t> bytes(nodes, 0);
    for (size_t p = 0; p < spec.params.size(); ++p) {
      if (spec.params[p].owner_layer != l) continue;
      for (int n = 0; n < nodes; ++n) {
        const core::ElemRange r = core::ShardOf(spec.params[p].numel, nodes, n);
        if (r.size() == 0) continue;
        shares.pieces[n].emplace_back(layout.ComputeCopy(static_cast<int>(p), 0) + static_cast<uint64_t>(r.begin) * elem,
                                      static_cast<uint64_t>(r.size()) * elem);
        bytes[n] += static_cast<uint64_t>(r.size()) * elem;
      }
    }
    for (uint64_t b : bytes) shares.most = std::max(shares.most, b);
    if (shares.most == 0) continue;  // no trainable parameters: never updated, never gathered
    most = std::max(most, shares.most);
    layers_.push_back(std::move(shares));
  }
  thread_ = std::thread([this, nodes, most] {
    Status s = Status::Ok();
    try {
      const auto opts = at::TensorOptions().dtype(at::kByte);
      mine_ = at::zeros({static_cast<int64_t>(most)}, opts);
      for (int n = 0; n < nodes; ++n) all_.push_back(at::empty({static_cast<int64_t>(most)}, opts));
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
  uint64_t version = gathered[layers_.front().layer].load(std::memory_order_acquire) + 1;
  while (!stop_.load()) {
    for (const LayerShares& l : layers_) {
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

StatusOr<bool> ShareGatherer::GatherLayer(nodes::NodeReduction& group, const LayerShares& shares,
                                          uint64_t version) {
  const int layer = shares.layer;
  const auto* own = reinterpret_cast<const std::atomic<uint64_t>*>(state_ + layout_.layer_versions);
  while (own[layer].load(std::memory_order_acquire) < version) {
    if (stop_.load()) return false;
    std::this_thread::sleep_for(kPoll);
  }
  // That version's buffer (stale1 keeps two).
  const uint64_t shift = (version % static_cast<uint64_t>(layout_.compute_buffers)) *
                         (layout_.compute_end - layout_.compute_begin);
  const int nodes = static_cast<int>(cfg_.nodes.count), me = static_cast<int>(cfg_.nodes.rank);
  const int64_t most = static_cast<int64_t>(shares.most);
  at::Tensor mine = mine_.narrow(0, 0, most);
  std::vector<at::Tensor> all;
  for (const auto& t : all_) all.push_back(t.narrow(0, 0, most));
  uint64_t at = 0;
  for (const auto& [offset, n] : shares.pieces[me]) {
    std::memcpy(mine.data_ptr<uint8_t>() + at, state_ + offset + shift, n);
    at += n;
  }
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
    for (const auto& [offset, b] : shares.pieces[n]) {
      std::memcpy(state_ + offset + shift, all[n].data_ptr<uint8_t>() + at, b);
      at += b;
    }
  }
  auto* gathered = reinterpret_cast<std::atomic<uint64_t>*>(state_ + layout_.gathered_versions);
  gathered[layer].store(version, std::memory_order_release);
  return true;
}

}  // namespace rp::worker
