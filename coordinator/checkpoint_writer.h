// SPDX-License-Identifier: Apache-2.0
// CheckpointWriter: training checkpoints written off the coordinator's loop, one part of the
// coordinator.
//
// A checkpoint after step t must hold exactly t + 1 updates. The live state holds them from the
// moment the optimizer finishes step t (Updated) until it updates anything for step t + 1, which
// comes after step t + 1's gradients: about a step of compute later. Snapshot() copies the state
// in that window, on threads of its own, and holds step t + 1's updates (not its norms) until the
// copy is done (AsyncOptimizer::HoldUpdatesFrom), so the copy is exact however the threads race.
// The file is then written from the copy, with its checksums, by a thread of its own while
// training goes on. Two copies are kept where the budget allows (checkpoint.memory_gb; by
// default MemAvailable with a quarter to spare), so a slow disk still writing one checkpoint does
// not hold up the next; one where only one fits. Where none fits, one partial copy: the
// parameters updated first (AsyncOptimizer::UpdateOrder) are copied while they fit the budget
// (default: half of MemAvailable), and the rest are written from the live state, in update order,
// each one's updates held until its bytes are in the file (AsyncOptimizer::HoldOnly), so the
// write overlaps the next step's compute as far as the disk allows. Without a per-parameter map
// of the sections (sharded state), or when checkpoints are not periodic, they are written on the
// loop instead (the launcher's beacon keeps beating, liveness.h excuses the deafness). The copies
// are allocated and touched once, at the start, so taking one costs no page faults.
//
// Contract:
//  * Snapshot(steps_done) may be called once the live state holds `steps_done` updates and before
//    the optimizer may update step steps_done. It returns at once, the copy and the file under
//    way; it does nothing when a copy of that step is under way, when no copy is free (Write then
//    waits for one), or on the loop.
//  * Write(steps_done) is called at the latest before the optimizer sees step steps_done's first
//    final gradient slot. It hands the copy to a file thread, or waits for the oldest file and
//    takes a copy first if none was taken; on the loop it writes synchronously.
//  * Poll() collects finished files (their failure is returned then); Finish() waits for all of
//    them. written() is the steps of the newest checkpoint complete on disk.
//  * Owned by the coordinator's loop; the destructor releases any hold, joins every thread and
//    never throws.
#pragma once

#include <atomic>
#include <cstdint>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/status.h"
#include "optim/async_optimizer.h"
#include "optim/training_state.h"
#include "io/run_output.h"

namespace rp::coord {

class CheckpointWriter {
 public:
  struct Placement {
    int section;
    uint64_t offset, bytes;
  };
  struct Setup {
    std::string dir;
    uint64_t state_hash = 0;
    bool masters_in_state = false;
    core::RunRecord run;  // the job's run-defining values, recorded in every file
    int keep = 0;
    int copy_threads = 8;      // the snapshot's memcpy
    int checksum_threads = 2;  // a background write's CRCs: cores the optimizer keeps
    bool background = true;    // false: every checkpoint on the loop, no copies (none periodic)
    ShardId shard;             // sharded state: this node's file of each checkpoint
    // Bytes the copies may take (checkpoint.memory_gb); < 0: decided from MemAvailable.
    int64_t memory_bytes = -1;
    // Where each parameter's bytes lie in the sections (masters, moments, compute copies); empty
    // where the sections are not laid out by parameter (no partial copies then), and the order
    // the optimizer's updates reach the parameters.
    std::vector<std::vector<Placement>> params;
    std::vector<int> update_order;
  };
  // `live`: the sections of the running state (HostState::Sections()); `written`: the steps of
  // the newest checkpoint already on disk (resume), else -1.
  CheckpointWriter(Setup setup, std::vector<StateSection> live, AsyncOptimizer& optimizer,
                   int64_t written);
  ~CheckpointWriter();
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;

  void Snapshot(int64_t steps_done);
  Status Write(int64_t steps_done);
  Status Poll();
  Status Finish();
  int64_t written() const { return written_; }
  // The writes completed since the last call (for metrics.jsonl), and all of them (summary.json).
  std::vector<core::StepMetrics::Checkpoint> TakeCompleted();
  const std::vector<core::StepMetrics::Checkpoint>& all_completed() const { return all_; }
  int copies() const { return static_cast<int>(copies_.size()); }
  // A partial copy's bytes, and the state's bytes written from the live state (0: whole copies).
  uint64_t partial_copy_bytes() const { return partial_.copy_bytes; }
  uint64_t in_place_bytes() const { return partial_.in_place_bytes; }

 private:
  struct Copy {
    std::unique_ptr<uint8_t[]> bytes;
    int64_t steps = -1;                     // what it holds (or is being filled with); -1: free
    std::vector<std::thread> copy_threads;  // filling it
    std::future<std::pair<Status, WriteStats>> file;  // writing it
  };
  // A partial copy: what is copied (live offset in the concatenated sections, offset in the copy,
  // bytes), which parameters are written in place, and the file's extents in writing order
  // (sources relative to the copy's buffer or the live sections; see Launch).
  struct Partial {
    struct Run {
      int section;
      uint64_t offset, at, bytes;
    };
    std::vector<Run> copied;
    std::vector<uint8_t> in_place;       // per parameter
    std::vector<SourcedExtent> extents;  // src: null here, filled per copy
    std::vector<int64_t> copy_at;        // per extent: offset in the copy, or -1 (live)
    uint64_t copy_bytes = 0, in_place_bytes = 0;
  };
  void PlanPartialCopy(uint64_t budget);
  Copy* FreeCopy();
  Copy* CopyOf(int64_t steps_done);
  void StartCopy(Copy& c, int64_t steps_done);
  void Launch(Copy& c, int64_t steps_done);  // hands the copy to a file thread
  Status Collect(Copy& c);                   // waits for its file; frees it

  Setup setup_;
  std::vector<StateSection> live_;
  AsyncOptimizer& optimizer_;
  uint64_t bytes_ = 0;
  std::vector<Copy> copies_;   // empty: written on the loop
  bool partial_copy_ = false;  // copies_ holds one partial copy (partial_)
  Partial partial_;
  std::atomic<int> copy_threads_left_{
      0};  // the one copy under way; its last thread releases the hold
  std::shared_ptr<std::mutex> disk_ =
      std::make_shared<std::mutex>();  // held by the file thread writing
  int64_t written_ = -1;
  std::vector<core::StepMetrics::Checkpoint> completed_, all_;
};

}  // namespace rp::coord
