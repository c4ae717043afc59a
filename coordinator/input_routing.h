// SPDX-License-Identifier: Apache-2.0
// InputRouting: where a stage job finds each microbatch's inputs, one part of the coordinator.
// With host slots (schedule.activations = "host") every input is in shared memory and the
// answer is always kFromHostSlot. With activation pools (schedule.activations = "cuda_ipc") a
// hidden state or an incoming gradient stays in the pool of the worker that produced it, and
// InputReady names that worker so the consumer copies from its pool.
//
// Contract:
//  * Recorded() is told of every microbatch a job finished (its worker wrote the job's outputs);
//    For() builds the InputReady for microbatch `mb` of job `run` from what was recorded last for
//    the slots it reads. A slot never written reads as -1 (none).
//  * Not thread-safe: owned by the coordinator's loop.
#pragma once

#include <vector>

#include "planning/plan.h"
#include "protocol/messages.h"
#include "shm/layout.h"

namespace rp::coord {

class InputRouting {
 public:
  InputRouting(const core::PipelinePlan& plan, const shm::ArenaLayout& layout, int microbatches);

  void Recorded(const proto::RunJob& run, int mb, int rank);
  proto::InputReady For(const proto::RunJob& run, int mb) const;

 private:
  size_t Base(const proto::RunJob& run, int mb) const;

  const core::PipelinePlan& plan_;
  const shm::ArenaLayout& layout_;
  int microbatches_;
  // Indexed like the pools' slots: which worker's pool holds each one's current contents.
  std::vector<int> hidden_owner_, grad_owner_;
};

}  // namespace rp::coord
