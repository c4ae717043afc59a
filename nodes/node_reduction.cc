// SPDX-License-Identifier: Apache-2.0
#include "nodes/node_reduction.h"

#include <chrono>
#include <cstdlib>
#include <sstream>

#include "rp_config.h"

#if RP_WITH_GLOO
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#endif

namespace rp::nodes {

#if RP_WITH_GLOO
struct NodeReduction::Impl {
  c10::intrusive_ptr<c10d::ProcessGroupGloo> group;
  std::vector<c10::intrusive_ptr<c10d::Work>> pending;
  std::string name;  // for messages
};

bool NodeReduction::Available() { return true; }

StatusOr<std::unique_ptr<NodeReduction>> NodeReduction::Join(const NodeGroup& g, int worker_rank,
                                                            const std::string& purpose) {
  auto impl = std::make_unique<Impl>();
  impl->name = "the " + purpose + " group of worker " + std::to_string(worker_rank) + " across " +
               std::to_string(g.nodes) + " nodes (this is node " + std::to_string(g.node_rank) + ")";
  // Joining waits for the other nodes' workers (they may start later) up to timeout_s + 30 s. A
  // sum may wait much longer for a peer that is alive but busy (an evaluation, a checkpoint on
  // its loop): lost nodes are the launchers' to notice (within timeout_s), so the collectives'
  // own bound is only a last resort, never infinite.
  const auto join_timeout = std::chrono::milliseconds(static_cast<int64_t>((g.timeout_s + 30.0) * 1000.0));
  const auto op_timeout = std::chrono::milliseconds(static_cast<int64_t>((g.timeout_s + 1800.0) * 1000.0));
  try {
    c10d::TCPStoreOptions so;
    so.port = static_cast<uint16_t>(g.store_port);
    so.isServer = false;
    so.waitWorkers = false;
    so.timeout = join_timeout;
    auto store = c10::make_intrusive<c10d::TCPStore>(g.store_host, so);
    auto prefixed = c10::make_intrusive<c10d::PrefixStore>("rp/" + purpose + "/" + std::to_string(worker_rank), store);
    auto opts = c10d::ProcessGroupGloo::Options::create(op_timeout);
    // The interface the other nodes reach this one on: GLOO_SOCKET_IFNAME as torch.distributed
    // reads it, else the address this host's name resolves to.
    if (const char* ifnames = std::getenv("GLOO_SOCKET_IFNAME"); ifnames && *ifnames) {
      std::stringstream list(ifnames);
      for (std::string name; std::getline(list, name, ',');)
        if (!name.empty()) opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(name));
    }
    if (opts->devices.empty()) opts->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
    opts->threads = 1;  // one reduction at a time per worker: its commits are sequential anyway
    impl->group = c10::make_intrusive<c10d::ProcessGroupGloo>(prefixed, g.node_rank, g.nodes, opts);
  } catch (const std::exception& e) {
    return Status::Unavailable("joining " + impl->name + ": " + e.what());
  }
  return std::unique_ptr<NodeReduction>(new NodeReduction(std::move(impl)));
}

Status NodeReduction::Start(at::Tensor flat, at::Tensor loss) {
  if (!impl_->pending.empty())
    return Status::Internal(impl_->name + ": a sum started before the previous one finished");
  try {
    if (flat.defined()) {
      std::vector<at::Tensor> grads = {std::move(flat)};
      impl_->pending.push_back(impl_->group->allreduce(grads));
    }
    if (loss.defined()) {
      std::vector<at::Tensor> sums = {std::move(loss)};
      impl_->pending.push_back(impl_->group->allreduce(sums));
    }
  } catch (const std::exception& e) {
    return Status::Unavailable(impl_->name + ": " + e.what());
  }
  return Status::Ok();
}

StatusOr<bool> NodeReduction::Poll() {
  try {
    for (const auto& work : impl_->pending)
      if (!work->isCompleted()) return false;
    // exception() rather than isSuccess(), which newer LibTorch deprecates.
    for (const auto& work : impl_->pending)
      if (auto failed = work->exception()) std::rethrow_exception(failed);
  } catch (const std::exception& e) {
    impl_->pending.clear();
    return Status::Unavailable(impl_->name + ": " + e.what());
  }
  impl_->pending.clear();
  return true;
}

#else  // LibTorch without c10d's Gloo

struct NodeReduction::Impl {};
bool NodeReduction::Available() { return false; }
StatusOr<std::unique_ptr<NodeReduction>> NodeReduction::Join(const NodeGroup&, int, const std::string&) {
  return Status::InvalidArgument("several nodes need LibTorch's c10d with Gloo, which this build lacks");
}
Status NodeReduction::Start(at::Tensor, at::Tensor) { return Status::Internal("no c10d Gloo"); }
StatusOr<bool> NodeReduction::Poll() { return true; }

#endif

NodeReduction::NodeReduction(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
NodeReduction::~NodeReduction() = default;

}  // namespace rp::nodes
