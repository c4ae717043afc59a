// SPDX-License-Identifier: Apache-2.0
// CheckpointWriter: training checkpoints written off the coordinator's loop, one part of the
// coordinator.
//
// A checkpoint after step t must hold exactly t + 1 updates. The live state holds them from the
// moment the optimizer finishes step t (Updated) until it sees step t + 1's first final gradient
// slot, which is roughly one step of compute later. In that window a copy of the state is taken
// in the background (Snapshot), and the file is written from the copy by a thread of its own while
// training goes on. The copy needs host memory the size of the checkpoint: when that is not
// available (the host's MemAvailable, with a quarter to spare) the checkpoint is written from the
// live state on the loop, as before, with the loop's deafness excused (liveness.h) and the
// launcher's beacon kept beating.
//
// Contract:
//  * Snapshot(steps_done) may be called once the live state holds `steps_done` updates; it starts
//    the copy and returns at once (no-op when a copy for that step is under way, or when writing
//    in the background is off).
//  * Write(steps_done) must be called while the live state still holds them (before the optimizer
//    sees the next step's gradients). It waits for the copy (started here if Snapshot was not
//    called), hands it to the file thread and returns; without a copy it writes synchronously.
//    A write still running from the previous checkpoint is waited for first, and its failure is
//    returned then.
//  * Finish() waits for the file thread; its Status is the last write's. written() is the steps
//    of the newest checkpoint known to be complete on disk.
//  * Owned by the coordinator's loop; the destructor joins every thread and never throws.
#pragma once

#include <cstdint>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "common/status.h"
#include "coordinator/training_state.h"

namespace rp::coord {

class CheckpointWriter {
 public:
  struct Setup {
    std::string dir;
    uint64_t state_hash = 0;
    bool masters_in_state = false;
    int keep = 0;
    int copy_threads = 4;      // the snapshot's memcpy
    int checksum_threads = 2;  // a background write's CRCs: cores the optimizer keeps
  };
  // `live`: the sections of the running state (HostState::Sections()).
  CheckpointWriter(Setup setup, std::vector<StateSection> live, int64_t written);
  ~CheckpointWriter();
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;

  void Snapshot(int64_t steps_done);
  Status Write(int64_t steps_done);
  Status Finish();
  int64_t written() const { return written_; }
  bool background() const { return background_; }

 private:
  void CopyIn();  // the snapshot threads' work: live -> copy_
  Status WaitForFile();

  Setup setup_;
  std::vector<StateSection> live_;
  uint64_t bytes_ = 0;
  bool background_ = false;
  std::unique_ptr<uint8_t[]> copy_;  // the snapshot, bytes_ long, sections back to back
  int64_t copying_ = -1;             // the step the copy under way (or done) holds
  std::vector<std::thread> copy_threads_;
  std::future<Status> file_;         // the file thread's result
  int64_t file_steps_ = -1;          // what it writes
  int64_t written_ = -1;
};

}  // namespace rp::coord
