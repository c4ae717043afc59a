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

std::unique_ptr<ShareGatherer> ShareGatherer::Start(const core::JobConfig& config,
                                                    const core::ModelSpec& spec,
                                                    const shm::ArenaLayout& layout, uint8_t* state,
                                                    int worker_rank, int workers, Joiner join,
                                                    at::Device buffers) {
  return std::unique_ptr<ShareGatherer>(new ShareGatherer(config, spec, layout, state, worker_rank,
                                                          workers, std::move(join), buffers));
}

ShareGatherer::ShareGatherer(const core::JobConfig& config, const core::ModelSpec& spec,
                             const shm::ArenaLayout& layout, uint8_t* state, int worker_rank,
                             int workers, Joiner join, at::Device buffers)
    : cfg_(config),
      spec_(spec),
      layout_(layout),
      state_(state),
      rank_(worker_rank),
      join_(std::move(join)),
      device_(buffers) {
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
        shares.pieces[n].emplace_back(
            layout.ComputeCopy(static_cast<int>(p), 0) + static_cast<uint64_t>(r.begin) * elem,
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
      mine_dev_ = device_.is_cpu() ? mine_ : mine_.to(device_);
      for (const at::Tensor& t : all_)
        all_dev_.push_back(device_.is_cpu() ? t : at::empty_like(t, opts.device(device_)));
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
  RP_ASSIGN_OR_RETURN(auto gathers, join_());
  RP_LOG(INFO) << "joined the cross-node gather group of worker " << rank_ << " (" << layers_.size()
               << " layers, " << cfg_.nodes.count << " nodes)";
  const auto* gathered =
      reinterpret_cast<const std::atomic<uint64_t>*>(state_ + layout_.gathered_versions);
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
  std::vector<at::Tensor> all, all_dev;
  for (const auto& t : all_) all.push_back(t.narrow(0, 0, most));
  for (const auto& t : all_dev_) all_dev.push_back(t.narrow(0, 0, most));
  uint64_t at = 0;
  for (const auto& [offset, n] : shares.pieces[me]) {
    std::memcpy(mine.data_ptr<uint8_t>() + at, state_ + offset + shift, n);
    at += n;
  }
  at::Tensor mine_dev = mine_dev_.narrow(0, 0, most);
  // On the thread's current stream, which the collective waits for before it reads `mine_dev`.
  if (!device_.is_cpu()) mine_dev.copy_(mine);
  RP_RETURN_IF_ERROR(group.StartGather(mine_dev, all_dev));
  for (;;) {
    RP_ASSIGN_OR_RETURN(const bool complete, group.Poll());
    if (complete) break;
    if (stop_.load()) return false;
    std::this_thread::sleep_for(kPoll);
  }
  if (nodes == 1) {
    // A group of this node alone (the test hook): nothing comes from elsewhere, so check instead
    // that the collective and its staging gave this node's shares back unchanged.
    if (!device_.is_cpu()) all[me].copy_(all_dev[me]);
    if (std::memcmp(all[me].data_ptr<uint8_t>(), mine.data_ptr<uint8_t>(),
                    static_cast<size_t>(most)) != 0)
      return Status::Internal("gathering layer " + std::to_string(layer) + " version " +
                              std::to_string(version) +
                              " in a group of one node did not give its shares back unchanged");
  }
  for (int n = 0; n < nodes; ++n) {
    if (n == me) continue;
    // The collective is complete (its kernels and copies have run), so a copy after it reads
    // its results; a copy to pageable memory has landed when it returns.
    if (!device_.is_cpu()) all[n].copy_(all_dev[n]);
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
