// SPDX-License-Identifier: Apache-2.0
// ShareGatherer: with sharded optimizer state (ExecutionPlan::sharded_state), the worker thread
// that brings every node's updated shares of its layers into this node's compute copies.
//
// Each node's coordinator updates only its own share of each parameter (core::ShardOf) and
// publishes it as the layer's version in shared memory. Layer l is gathered by worker
// shm::GatheringWorker(l, workers) of every node, so the gathers of one worker rank pair up across
// the nodes in one order: versions ascending, and within a version the rank's layers ascending.
// For each, it waits for this node's own share (the layer's version), gathers the layer's shares
// from the other nodes over c10d (a group of its own per worker rank, "gather", beside the
// gradient sums'), writes them into the compute-copy buffer of that version, and then stores the
// layer's gathered version (release), which is what workers wait for before fetching the layer
// (shm::ArenaLayout::fetch_versions).
//
// Why a thread of its own: a gather waits for the other nodes' optimizers, which wait for this
// node's gradient sums; the worker's loop must go on committing them meanwhile.
//
// Why this cannot deadlock: gathering version v of a layer waits only for the layer's update to v
// on each node, which needs only gradients of step v - 1, computed from versions < v, which were
// gathered before (the order above).
//
// Where the gathers run: `join` forms the group (Gloo between CPU workers, NCCL between CUDA
// workers, as for the gradient sums); `buffers` is where its collectives read and write (the CPU,
// or the worker's GPU for NCCL: this node's shares are copied there from the segment, and the
// other nodes' back, so the segment stays the one place workers fetch from).
//
// Contract:
//  * Start() returns at once; the thread joins the group through `join` (which waits up to
//    job.node_timeout_s + 30 s for the other nodes) and gathers until the destructor. A failure
//    stops it; Failed() then returns the reason (the worker ends the run with it).
//  * The destructor stops the thread, abandoning a gather in progress (NodeReduction::Abandon),
//    and never throws. A thread still joining the group is waited for (the join's own bound,
//    job.node_timeout_s + 30 s).
//  * The gathers' buffers hold the largest layer's shares of every node (its largest share times
//    the node count), allocated once, in host memory and, for a GPU group, again on the GPU.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "common/status.h"
#include "config/job_config.h"
#include "config/model_spec.h"
#include "nodes/node_reduction.h"
#include "shm/layout.h"

namespace rp::worker {

class ShareGatherer {
 public:
  using Joiner = std::function<StatusOr<std::unique_ptr<nodes::NodeReduction>>()>;
  // `state` is the mapped state segment; `layout`, `spec` and `config` must outlive the gatherer.
  static std::unique_ptr<ShareGatherer> Start(const core::JobConfig& config,
                                              const core::ModelSpec& spec,
                                              const shm::ArenaLayout& layout, uint8_t* state,
                                              int worker_rank, int workers, Joiner join,
                                              at::Device buffers);
  ~ShareGatherer();
  ShareGatherer(const ShareGatherer&) = delete;
  ShareGatherer& operator=(const ShareGatherer&) = delete;

  std::optional<Status> Failed() const;

 private:
  ShareGatherer(const core::JobConfig& config, const core::ModelSpec& spec,
                const shm::ArenaLayout& layout, uint8_t* state, int worker_rank, int workers,
                Joiner join, at::Device buffers);
  Status Run();

  const core::JobConfig& cfg_;
  const core::ModelSpec& spec_;
  const shm::ArenaLayout& layout_;
  uint8_t* state_;
  const int rank_;
  const Joiner join_;
  const at::Device device_;  // where the collectives' buffers live
  // This rank's layers that own trainable parameters, ascending, each with every node's shares of
  // its parameters in compute buffer 0 (offset in the segment, bytes; buffer b adds b regions),
  // decided once.
  struct LayerShares {
    int layer;
    std::vector<std::vector<std::pair<uint64_t, uint64_t>>> pieces;  // per node
    uint64_t most = 0;  // the largest node's bytes: what every node sends
  };
  std::vector<LayerShares> layers_;
  // Gathers `layer`'s shares of `version` through `group`; false when stopped first.
  StatusOr<bool> GatherLayer(nodes::NodeReduction& group, const LayerShares& layer,
                             uint64_t version);
  // The gather's buffers, sized once for the largest layer: this node's shares, every node's; in
  // host memory, and on device_ too when that is a GPU (else the same tensors).
  at::Tensor mine_, mine_dev_;
  std::vector<at::Tensor> all_, all_dev_;
  std::atomic<bool> stop_{false};
  mutable std::mutex mu_;
  std::optional<Status> failed_;  // GUARDED_BY(mu_)
  std::thread thread_;            // last: joined before the members above go
};

}  // namespace rp::worker
