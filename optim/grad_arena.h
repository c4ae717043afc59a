// SPDX-License-Identifier: Apache-2.0
// GradArena: places gradient slots in the state segment's gradient arena (shm/layout.h).
//
// Contract:
//  * Offsets only: the arena's bytes live in shared memory that workers write, so the allocator's
//    bookkeeping is kept here, in the coordinator's private heap. Nothing a worker writes can
//    change where the coordinator places or frees a slot.
//  * Place(slots) is all-or-nothing: every slot gets a 256-byte-aligned range of its size
//    (region.grad_slot_bytes) or none does and false is returned (the caller retries once an
//    update has released space). First fit, so the step's first commit (the fused tail, with
//    the largest slot) lands at the arena's start and later holes coalesce behind it.
//  * When the arena can hold every slot at once (!region.grads_streamed: exact clipping or K > 1
//    size it so), each slot has a fixed range instead (the slots' sizes summed in slot order)
//    and Place only fails for a slot already placed (checked). Why: exact mode places the next
//    step's slots while the previous step's second optimizer passes still release theirs, in an
//    order that first fit could fragment into holes too small for a large slot, with nothing left
//    to release.
//  * Release(slot) returns a placed slot's range; releasing an unplaced slot is a bug (checked).
//  * Thread-safe: the coordinator's event loop places, optimizer threads release.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <vector>

#include "shm/layout.h"

namespace rp::coord {

class GradArena {
 public:
  // `region` is the layout's gradient region (it must outlive the arena); `table` is the shared
  // gradient table (region.grad_table in the mapped state segment): a slot's offset is published
  // there (release) before Place returns.
  GradArena(const shm::GradientRegion& region, std::atomic<uint64_t>* table);

  bool Place(const std::vector<int>& slots);
  bool IsPlaced(int slot) const;
  void Release(int slot);
  // Segment offset of a placed slot.
  uint64_t Offset(int slot) const;
  uint64_t PeakBytes() const;

 private:
  bool PlaceOneLocked(int slot);
  void ReleaseLocked(int slot);

  const shm::GradientRegion& region_;
  std::atomic<uint64_t>* table_;
  mutable std::mutex mu_;
  std::map<uint64_t, uint64_t> free_;  // GUARDED_BY(mu_): offset -> bytes, coalesced
  std::vector<uint64_t> placed_;       // GUARDED_BY(mu_): per slot, 0 = not placed
  std::vector<uint64_t> fixed_;        // per slot when every slot fits at once; else empty
  uint64_t used_ = 0, peak_ = 0;       // GUARDED_BY(mu_)
};

}  // namespace rp::coord
