// SPDX-License-Identifier: Apache-2.0
#include "optim/grad_arena.h"

#include <algorithm>
#include <iterator>

#include "common/logging.h"

namespace rp::coord {

GradArena::GradArena(const shm::GradientRegion& region, std::atomic<uint64_t>* table)
    : region_(region), table_(table), placed_(region.grad_slot_bytes.size(), 0) {
  // Offset 0 is the segment header, never a slot, so it can mean "not placed".
  if (region.grad_arena_bytes > 0) free_[region.grad_arena] = region.grad_arena_bytes;
  if (!region.grads_streamed) {
    uint64_t off = region.grad_arena;
    for (uint64_t b : region.grad_slot_bytes) {
      fixed_.push_back(off);
      off += b;
    }
  }
}

bool GradArena::PlaceOneLocked(int slot) {
  const uint64_t need = region_.grad_slot_bytes[slot];
  if (!fixed_.empty()) {
    placed_[slot] = fixed_[slot];
    used_ += need;
    peak_ = std::max(peak_, used_);
    table_[slot].store(fixed_[slot], std::memory_order_release);
    return true;
  }
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second < need) continue;
    const uint64_t off = it->first, left = it->second - need;
    free_.erase(it);
    if (left > 0) free_[off + need] = left;
    placed_[slot] = off;
    used_ += need;
    peak_ = std::max(peak_, used_);
    table_[slot].store(off, std::memory_order_release);
    return true;
  }
  return false;
}

void GradArena::ReleaseLocked(int slot) {
  const uint64_t off = placed_[slot], bytes = region_.grad_slot_bytes[slot];
  RP_CHECK(off != 0) << "gradient slot " << slot << " released but not placed";
  placed_[slot] = 0;
  used_ -= bytes;
  if (!fixed_.empty()) return;
  auto next = free_.lower_bound(off);
  uint64_t begin = off, size = bytes;
  if (next != free_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == off) {
      begin = prev->first;
      size += prev->second;
      free_.erase(prev);
    }
  }
  if (next != free_.end() && off + bytes == next->first) {
    size += next->second;
    free_.erase(next);
  }
  free_[begin] = size;
}

bool GradArena::Place(const std::vector<int>& slots) {
  std::lock_guard<std::mutex> l(mu_);
  for (size_t i = 0; i < slots.size(); ++i) {
    RP_CHECK(placed_[slots[i]] == 0) << "gradient slot " << slots[i] << " placed twice";
    if (!PlaceOneLocked(slots[i])) {
      for (size_t k = 0; k < i; ++k) ReleaseLocked(slots[k]);
      return false;
    }
  }
  return true;
}

bool GradArena::IsPlaced(int slot) const {
  std::lock_guard<std::mutex> l(mu_);
  return placed_[slot] != 0;
}

void GradArena::Release(int slot) {
  std::lock_guard<std::mutex> l(mu_);
  ReleaseLocked(slot);
}

uint64_t GradArena::Offset(int slot) const {
  std::lock_guard<std::mutex> l(mu_);
  return placed_[slot];
}

uint64_t GradArena::PeakBytes() const {
  std::lock_guard<std::mutex> l(mu_);
  return peak_;
}

}  // namespace rp::coord
