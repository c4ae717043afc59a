// SPDX-License-Identifier: Apache-2.0
// Several nodes with CUDA workers: each worker rank's groups over NCCL (c10d's ProcessGroupNCCL),
// so gradient sums stay on the GPU. Compiled into CUDA builds; without NCCL's headers (RP_WITH_NCCL
// off) joining fails saying so.
#include <chrono>

#include "gpu_worker/device.h"
#include "rp_config.h"

#if RP_WITH_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

#include "nodes/node_group.h"
#endif

namespace rp::worker {

#if RP_WITH_NCCL
bool NcclAvailable() { return true; }

StatusOr<std::unique_ptr<nodes::NodeReduction>> JoinNcclGroup(const nodes::NodeGroup& g,
                                                              int worker_rank,
                                                              const std::string& purpose,
                                                              int device_index) {
  const std::string name = nodes::GroupName(g, worker_rank, purpose) + " (NCCL, GPU " +
                           std::to_string(device_index) + ")";
  RP_ASSIGN_OR_RETURN(auto store, nodes::GroupStore(g, worker_rank, purpose));
  try {
    auto opts = c10d::ProcessGroupNCCL::Options::create();
    // As for Gloo's groups: a live peer may be busy for long; lost nodes are the launchers' to
    // notice, so this bound is a last resort, never infinite.
    opts->timeout =
        std::chrono::milliseconds(static_cast<int64_t>((g.timeout_s + 1800.0) * 1000.0));
    // The communicator is created at the first collective, on the device of its tensors.
    return nodes::WrapGroup(
        c10::make_intrusive<c10d::ProcessGroupNCCL>(store, g.node_rank, g.nodes, opts), name);
  } catch (const std::exception& e) {
    return Status::Unavailable("joining " + name + ": " + e.what());
  }
}
#else
bool NcclAvailable() { return false; }

StatusOr<std::unique_ptr<nodes::NodeReduction>> JoinNcclGroup(const nodes::NodeGroup&, int,
                                                              const std::string&, int) {
  return Status::InvalidArgument(
      "several nodes with CUDA workers need LibTorch's c10d with NCCL; this build found no "
      "nccl.h (the torch wheel's nvidia/nccl/include, or the system's)");
}
#endif

}  // namespace rp::worker
