// SPDX-License-Identifier: Apache-2.0
#include "nodes/node_reduction.h"
#include "common/environment.h"

#include <chrono>
#include <cstdlib>
#include <sstream>

#include "rp_config.h"

#if RP_WITH_C10D
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "nodes/node_group.h"
#include "nodes/sealed_store.h"
#endif
#if RP_WITH_GLOO
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#endif

namespace rp::nodes {

#if RP_WITH_C10D
struct NodeReduction::Impl {
  c10::intrusive_ptr<CollectiveGroup> group;
  std::vector<c10::intrusive_ptr<c10d::Work>> pending;
  std::string name;  // for messages
};

std::string GroupName(const NodeGroup& g, int worker_rank, const std::string& purpose) {
  return "the " + purpose + " group of worker " + std::to_string(worker_rank) + " across " +
         std::to_string(g.nodes) +
         (g.nodes == 1 ? " node" : " nodes (this is node " + std::to_string(g.node_rank) + ")");
}

StatusOr<c10::intrusive_ptr<c10d::Store>> GroupStore(const NodeGroup& g, int worker_rank,
                                                     const std::string& purpose) {
  // Joining waits for the other nodes' workers (they may start later) up to timeout_s + 30 s.
  const auto join_timeout =
      std::chrono::milliseconds(static_cast<int64_t>((g.timeout_s + 30.0) * 1000.0));
  try {
    c10::intrusive_ptr<c10d::Store> store;
    if (g.nodes == 1) {
      store = c10::make_intrusive<c10d::HashStore>();
    } else {
      if (g.secret.empty())
        return Status::InvalidArgument("joining " + GroupName(g, worker_rank, purpose) +
                                       ": no run secret (" + kRunSecretVariable +
                                       ", which rp-launch passes to its processes)");
      c10d::TCPStoreOptions so;
      so.port = static_cast<uint16_t>(g.store_port);
      so.isServer = false;
      so.waitWorkers = false;
      so.timeout = join_timeout;
      store = c10::make_intrusive<SealedStore>(
          c10::make_intrusive<c10d::TCPStore>(g.store_host, so), StoreSeal(g.secret));
    }
    store->setTimeout(join_timeout);
    return c10::intrusive_ptr<c10d::Store>(c10::make_intrusive<c10d::PrefixStore>(
        "rp/" + purpose + "/" + std::to_string(worker_rank), store));
  } catch (const std::exception& e) {
    return Status::Unavailable("joining " + GroupName(g, worker_rank, purpose) + ": " + e.what());
  }
}

std::unique_ptr<NodeReduction> WrapGroup(c10::intrusive_ptr<CollectiveGroup> group,
                                         std::string name) {
  auto impl = std::make_unique<NodeReduction::Impl>();
  impl->group = std::move(group);
  impl->name = std::move(name);
  return NodeReduction::FromImpl(std::move(impl));
}

std::unique_ptr<NodeReduction> NodeReduction::FromImpl(std::unique_ptr<Impl> impl) {
  return std::unique_ptr<NodeReduction>(new NodeReduction(std::move(impl)));
}
#endif

#if RP_WITH_GLOO
bool NodeReduction::Available() { return true; }

StatusOr<std::unique_ptr<NodeReduction>> NodeReduction::Join(const NodeGroup& g, int worker_rank,
                                                             const std::string& purpose) {
  const std::string name = GroupName(g, worker_rank, purpose);
  // A sum may wait much longer for a peer that is alive but busy (an evaluation, a checkpoint on
  // its loop): lost nodes are the launchers' to notice (within timeout_s), so the collectives'
  // own bound is only a last resort, never infinite.
  const auto op_timeout =
      std::chrono::milliseconds(static_cast<int64_t>((g.timeout_s + 1800.0) * 1000.0));
  RP_ASSIGN_OR_RETURN(auto prefixed, GroupStore(g, worker_rank, purpose));
  try {
    auto opts = c10d::ProcessGroupGloo::Options::create(op_timeout);
    // The interface the other nodes reach this one on: GLOO_SOCKET_IFNAME as torch.distributed
    // reads it, else the address this host's name resolves to.
    if (const auto ifnames = EnvironmentValue("GLOO_SOCKET_IFNAME"); ifnames && !ifnames->empty()) {
      std::stringstream list(*ifnames);
      for (std::string ifname; std::getline(list, ifname, ',');)
        if (!ifname.empty())
          opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(ifname));
    }
    if (opts->devices.empty())
      opts->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
    opts->threads = 1;  // one reduction at a time per worker: its commits are sequential anyway
    return WrapGroup(
        c10::make_intrusive<c10d::ProcessGroupGloo>(prefixed, g.node_rank, g.nodes, opts), name);
  } catch (const std::exception& e) {
    return Status::Unavailable("joining " + name + ": " + e.what());
  }
}
#else
bool NodeReduction::Available() { return false; }
StatusOr<std::unique_ptr<NodeReduction>> NodeReduction::Join(const NodeGroup&, int,
                                                             const std::string&) {
  return Status::InvalidArgument(
      "several nodes with CPU workers need LibTorch's c10d with Gloo, which this build lacks");
}
#endif

#if RP_WITH_C10D

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

Status NodeReduction::StartGather(at::Tensor mine, std::vector<at::Tensor> all) {
  if (!impl_->pending.empty())
    return Status::Internal(impl_->name + ": a gather started before the previous one finished");
  try {
    std::vector<std::vector<at::Tensor>> outputs = {std::move(all)};
    std::vector<at::Tensor> inputs = {std::move(mine)};
    impl_->pending.push_back(impl_->group->allgather(outputs, inputs));
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

void NodeReduction::Abandon() {
  if (impl_->pending.empty()) return;
  (void)impl_.release();  // deliberately never destroyed (see the header)
}

#else  // LibTorch without c10d

struct NodeReduction::Impl {};
Status NodeReduction::Start(at::Tensor, at::Tensor) { return Status::Internal("no c10d Gloo"); }
Status NodeReduction::StartGather(at::Tensor, std::vector<at::Tensor>) {
  return Status::Internal("no c10d");
}
void NodeReduction::Abandon() {}
StatusOr<bool> NodeReduction::Poll() { return true; }

#endif

NodeReduction::NodeReduction(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
NodeReduction::~NodeReduction() = default;

}  // namespace rp::nodes
