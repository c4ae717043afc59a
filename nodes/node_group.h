// SPDX-License-Identifier: Apache-2.0
// What NodeReduction runs its collectives on, for the code that forms the groups: Gloo in
// node_reduction.cc, NCCL behind the CUDA seam (gpu_worker/cuda). Includes c10d; only those two
// include this header.
#pragma once

#include <memory>
#include <string>

#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/version.h>
#if TORCH_VERSION_MAJOR >= 2
#include <torch/csrc/distributed/c10d/Backend.hpp>
#else
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#endif

#include "common/status.h"
#include "nodes/node_reduction.h"

namespace rp::nodes {

// The base class c10d's process groups share: Backend since LibTorch 2, ProcessGroup before.
#if TORCH_VERSION_MAJOR >= 2
using CollectiveGroup = c10d::Backend;
#else
using CollectiveGroup = c10d::ProcessGroup;
#endif

// Where the group of `purpose` and worker `worker_rank` meets: node 0's store under a prefix of
// its own, reached within timeout_s + 30 s; with one node (tests of the path on one machine), an
// in-process store.
StatusOr<c10::intrusive_ptr<c10d::Store>> GroupStore(const NodeGroup& g, int worker_rank,
                                                     const std::string& purpose);
// The group's name in messages.
std::string GroupName(const NodeGroup& g, int worker_rank, const std::string& purpose);
// A NodeReduction running on `group`.
std::unique_ptr<NodeReduction> WrapGroup(c10::intrusive_ptr<CollectiveGroup> group,
                                         std::string name);

}  // namespace rp::nodes
