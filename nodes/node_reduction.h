// SPDX-License-Identifier: Apache-2.0
// NodeReduction: sums a worker's gradients with those of the same-rank worker of every other
// node (c10d's ProcessGroupGloo over the node store).
//
// Why in the workers: the round-robin plan is the same on every node, so the same stage job of
// the same step runs on the same-rank worker everywhere, holding that stage's fp32 sums over its
// node's microbatches. Summing them there, between GradsReady and the commit, gives every node
// the whole step's gradient with no pass over host memory and no change to the coordinator's
// optimizer, which then updates identical replicas.
//
// Contract:
//  * Join() forms the group of worker `worker_rank` of every node over Gloo (a store prefix per
//    purpose and worker rank), waiting up to `timeout_s` + 30 s for the others; CUDA workers
//    form theirs over NCCL behind the CUDA seam (worker::JoinNcclGroup), on the same stores. A
//    group of one node (`nodes` 1) meets on an in-process store: what the path's tests run. Every
//    collective is bounded too, by `timeout_s` + 30 min: a peer that is alive may be busy for long
//    (an evaluation), and a lost node is for the launchers to notice, within `timeout_s`, and stop
//    the run.
//  * Start() begins summing `flat` (fp32, contiguous; CPU for Gloo, the group's GPU for NCCL) in
//  place across the nodes when
//    defined, and `loss` (fp64: a loss sum and target count) when defined; the callers of every
//    node must start the same sizes in the same order. Poll() is true once the sums are in the
//    tensors, or the error (naming the group) if one failed.
//  * StartGather() begins gathering `mine` (bytes, contiguous, CPU) from every node into `all`
//    (one tensor of the same size per node, in node order); Poll() as for a sum.
//  * Abandon() gives up a collective still pending (the process is stopping): the group is left
//    to the process's exit, because destroying it would wait for the peers of that collective.
//    Nothing but the destructor may be called after it.
//  * Available() is false in a build without c10d's Gloo: Join() fails saying so.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "common/status.h"

namespace rp::nodes {

struct NodeGroup {
  int nodes = 1;
  int node_rank = 0;
  std::string store_host;
  int store_port = 0;
  double timeout_s = 60.0;
  // The run's secret (several nodes): the group's store traffic is sealed with it
  // (nodes/store_seal.h).
  std::string secret;
};

class NodeReduction {
 public:
  // True when this build can Join (c10d with Gloo: CPU tensors).
  static bool Available();
  // `purpose` names the group (one store prefix per purpose and worker rank): a worker's
  // gradient sums and its eval sums are separate groups, each with its own order.
  static StatusOr<std::unique_ptr<NodeReduction>> Join(const NodeGroup& group, int worker_rank,
                                                       const std::string& purpose = "reduce");
  ~NodeReduction();
  NodeReduction(const NodeReduction&) = delete;
  NodeReduction& operator=(const NodeReduction&) = delete;

  Status Start(at::Tensor flat, at::Tensor loss);
  Status StartGather(at::Tensor mine, std::vector<at::Tensor> all);
  void Abandon();
  // True when the sum started last is complete (no reduction pending is true too).
  StatusOr<bool> Poll();

  struct Impl;
  static std::unique_ptr<NodeReduction> FromImpl(std::unique_ptr<Impl> impl);  // nodes/node_group.h

 private:
  explicit NodeReduction(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace rp::nodes
