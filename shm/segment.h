// SPDX-License-Identifier: Apache-2.0
// RAII owners for POSIX shared memory (Boost.Interprocess underneath).
//
// Contract:
//  * Segment owns one mapping of one named object. Create() makes a new object (fails if the name
//    exists), sizes it and maps it; Open() maps an existing one and validates its SegmentHeader
//    against the layout hash the caller computed. Move-only. The destructor unmaps; it never
//    unlinks the name and never throws.
//  * Unlinker owns the *name*: its destructor removes it from /dev/shm. The creator holds one, so
//    the name disappears on every exit path of the creating process; the launcher holds a second
//    one for the case where the coordinator is killed.
//  * Neither type is thread-safe to mutate; the mapped bytes follow the arena rules in layout.h.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "common/status.h"
#include "shm/layout.h"

namespace rp::shm {

// Refuses a request for `bytes` of new shared memory that /dev/shm (the tmpfs behind POSIX shared
// memory) has no room for. tmpfs accepts any size at creation and fails only when a page is first
// touched, with SIGBUS in whichever process touches it, possibly hours into a run; this turns
// that into an error up front. `what` names the request in the message.
Status CheckSharedMemoryRoom(uint64_t bytes, const std::string& what);
// Bytes of host memory the kernel reports available (MemAvailable), or less when this process's
// memory cgroup (a container's -m) leaves less room; 0 where unknown.
uint64_t AvailableHostMemory();

class Segment {
 public:
  static StatusOr<Segment> Create(const std::string& name, uint64_t bytes);
  // Create() plus a header (magic, version, `layout_hash`, size, ready) that Open() accepts: for
  // segments a worker makes for its peers (a CPU worker's activation pool).
  static StatusOr<Segment> CreateStamped(const std::string& name, uint64_t bytes,
                                         uint64_t layout_hash);
  // Opens and checks magic, version, size and layout hash.
  static StatusOr<Segment> Open(const std::string& name, uint64_t expected_layout_hash);
  // Maps an existing object that has no header (the optimizer segment) for reading only: the
  // mapping is PROT_READ, so this process cannot write it. Fails unless it holds exactly
  // `expected_bytes`.
  static StatusOr<Segment> OpenReadOnly(const std::string& name, uint64_t expected_bytes);

  Segment(Segment&&) noexcept;
  Segment& operator=(Segment&&) noexcept;
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;
  ~Segment();

  uint8_t* data() const;
  uint64_t size() const;
  const std::string& name() const { return name_; }
  SegmentHeader* header() const { return reinterpret_cast<SegmentHeader*>(data()); }
  // Writes what Open() checks (magic, version, header size, `layout_hash`, total size); leaves
  // `ready` and the other fields alone.
  void StampHeader(uint64_t layout_hash) const;
  template <typename T>
  T* At(uint64_t offset) const {
    return reinterpret_cast<T*>(data() + offset);
  }

 private:
  struct Impl;
  explicit Segment(std::unique_ptr<Impl> impl, std::string name);
  std::unique_ptr<Impl> impl_;
  std::string name_;
};

class Unlinker {
 public:
  explicit Unlinker(std::string name) : name_(std::move(name)) {}
  Unlinker(Unlinker&& o) noexcept : name_(std::move(o.name_)) { o.name_.clear(); }
  Unlinker(const Unlinker&) = delete;
  Unlinker& operator=(const Unlinker&) = delete;
  ~Unlinker();
  // Removes the name now (idempotent). Returns true if something was removed.
  bool Remove();

 private:
  std::string name_;
};

// Removes a shared-memory name if present; never throws. Returns true if something was removed.
bool RemoveSharedMemory(const std::string& name);

}  // namespace rp::shm
