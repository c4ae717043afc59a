// SPDX-License-Identifier: Apache-2.0
// ActivationStore: where the tensors between stages live (schedule.activations), behind one
// interface, so the executor reads and writes a microbatch's hidden state or input gradient at a
// boundary slot without asking where it is.
//
// Contract:
//  * Slots are keyed as the shared-memory slots are (parity, microbatch, slot index), so the
//    coordinator's slot-reuse rules apply to every store unchanged.
//  * MakeActivationStore() picks, once, from the layout: the shared segment's slots ("host"),
//    this worker's device memory ("worker": one worker only; a stored tensor aliases the computed
//    one, which is already in the store's dtype, so neither may be modified in place), or the
//    workers' activation pools ("cuda_ipc": written to this worker's pool, read from the pool of
//    the worker the coordinator names, `from_rank`).
//  * Read() returns the tensor in the store's dtype on the device; a slot never written in this
//    worker (worker memory) or a pool read that names no worker is a runtime_error naming the
//    slot, the microbatch and `job` (the executor's exception boundary reports it).
//  * Single-threaded, like the executor.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "gpu_worker/device.h"
#include "shm/layout.h"
#include "shm/segment.h"

namespace rp::worker {

class ActivationStore {
 public:
  enum class Kind { kHidden, kInputGrad };
  virtual ~ActivationStore() = default;
  virtual at::Tensor Read(Kind kind, int parity, int mb, int slot, int from_rank, int64_t job) = 0;
  virtual void Write(Kind kind, int parity, int mb, int slot, const at::Tensor& t) = 0;
};

// `shape`: an activation's ([microbatch_size, seq_len, hidden]); `dtype`: what the slots hold.
std::unique_ptr<ActivationStore> MakeActivationStore(const shm::ArenaLayout& layout,
                                                     const shm::Segment& segment, Device& device,
                                                     std::vector<int64_t> shape,
                                                     at::ScalarType dtype);

}  // namespace rp::worker
