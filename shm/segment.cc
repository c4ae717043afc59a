// SPDX-License-Identifier: Apache-2.0
#include "shm/segment.h"

#include <boost/interprocess/mapped_region.hpp>
#include <boost/interprocess/shared_memory_object.hpp>

#include <sys/statvfs.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>

#include "common/logging.h"

namespace rp::shm {

namespace bip = boost::interprocess;

namespace {
constexpr const char* kShmDir = "/dev/shm";
std::string GiB(uint64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.1f GiB", static_cast<double>(bytes) / (1ull << 30));
  return buf;
}

// The first unsigned number in `path`, or 0 (missing file, "max").
uint64_t ReadNumber(const std::string& path) {
  std::ifstream in(path);
  unsigned long long v = 0;
  return (in >> v) ? static_cast<uint64_t>(v) : 0;
}

// Room left under this process's memory cgroup limit (shared-memory pages are charged to it, so
// in a container with -m the OOM killer strikes before MemAvailable runs out), or 0 when there is
// no limit or it cannot be read. cgroup v2 ("0::<path>") and v1 ("<n>:...memory...:<path>").
uint64_t CgroupMemoryRoom() {
  std::ifstream in("/proc/self/cgroup");
  std::string line;
  while (std::getline(in, line)) {
    const size_t a = line.find(':'), b = line.find(':', a + 1);
    if (a == std::string::npos || b == std::string::npos) continue;
    const std::string controllers = line.substr(a + 1, b - a - 1), path = line.substr(b + 1);
    std::string limit, usage;
    if (line.compare(0, a, "0") == 0 && controllers.empty()) {
      limit = "/sys/fs/cgroup" + path + "/memory.max";
      usage = "/sys/fs/cgroup" + path + "/memory.current";
    } else if (("," + controllers + ",").find(",memory,") != std::string::npos) {
      limit = "/sys/fs/cgroup/memory" + path + "/memory.limit_in_bytes";
      usage = "/sys/fs/cgroup/memory" + path + "/memory.usage_in_bytes";
    } else {
      continue;
    }
    const uint64_t max = ReadNumber(limit), used = ReadNumber(usage);
    // v1 reports "no limit" as a huge page-rounded number.
    if (max == 0 || max >= (1ull << 60)) return 0;
    return max > used ? max - used : 1;
  }
  return 0;
}
}  // namespace

Status CheckSharedMemoryRoom(uint64_t bytes, const std::string& what) {
  struct statvfs fs {};
  if (::statvfs(kShmDir, &fs) != 0) {  // cannot tell: let creation decide, as before this check
    RP_LOG(WARNING) << "statvfs " << kShmDir << ": " << std::strerror(errno)
                    << "; not checking its free space";
    return Status::Ok();
  }
  if (fs.f_blocks == 0) return Status::Ok();  // tmpfs mounted with size=0: no limit
  const uint64_t free_bytes = static_cast<uint64_t>(fs.f_bavail) * fs.f_frsize;
  if (bytes <= free_bytes) return Status::Ok();
  return Status::InvalidArgument(what + " needs " + GiB(bytes) + " of shared memory, but " +
                                 kShmDir + " has " + GiB(free_bytes) +
                                 " free: free space there, enlarge it (Docker: --shm-size; "
                                 "otherwise mount -o remount,size=... " +
                                 kShmDir + "), or shrink the job");
}

uint64_t AvailableHostMemory() {
  std::ifstream in("/proc/meminfo");
  std::string line;
  unsigned long long kib = 0;
  uint64_t avail = 0;
  while (std::getline(in, line))
    if (std::sscanf(line.c_str(), "MemAvailable: %llu kB", &kib) == 1) {
      avail = static_cast<uint64_t>(kib) * 1024;
      break;
    }
  const uint64_t room = CgroupMemoryRoom();
  if (room > 0 && (avail == 0 || room < avail)) return room;
  return avail;
}

struct Segment::Impl {
  bip::shared_memory_object object;
  bip::mapped_region region;
};

Segment::Segment(std::unique_ptr<Impl> impl, std::string name)
    : impl_(std::move(impl)), name_(std::move(name)) {}
Segment::Segment(Segment&&) noexcept = default;
Segment& Segment::operator=(Segment&&) noexcept = default;
Segment::~Segment() = default;  // mapped_region unmaps; nothing here can throw

uint8_t* Segment::data() const { return static_cast<uint8_t*>(impl_->region.get_address()); }
uint64_t Segment::size() const { return impl_->region.get_size(); }

StatusOr<Segment> Segment::Create(const std::string& name, uint64_t bytes) {
  try {
    bip::permissions perm;
    perm.set_permissions(0600);  // only this user's processes may map the run's state
    auto impl = std::make_unique<Impl>();
    impl->object = bip::shared_memory_object(bip::create_only, name.c_str(), bip::read_write, perm);
    impl->object.truncate(static_cast<bip::offset_t>(bytes));
    impl->region = bip::mapped_region(impl->object, bip::read_write);
    return Segment(std::move(impl), name);
  } catch (const bip::interprocess_exception& e) {
    return Status::IoError("creating shared memory /dev/shm/" + name + " (" +
                           std::to_string(bytes) + " bytes): " + e.what());
  }
}

StatusOr<Segment> Segment::CreateStamped(const std::string& name, uint64_t bytes,
                                         uint64_t layout_hash) {
  if (bytes < kHeaderBytes)
    return Status::InvalidArgument("segment " + name + ": " + std::to_string(bytes) +
                                   " bytes cannot hold its header");
  RP_ASSIGN_OR_RETURN(auto seg, Create(name, bytes));
  seg.StampHeader(layout_hash);
  seg.header()->ready.store(1, std::memory_order_release);
  return seg;
}

void Segment::StampHeader(uint64_t layout_hash) const {
  SegmentHeader* h = header();
  h->magic = kSegmentMagic;
  h->version = kSegmentVersion;
  h->header_bytes = kHeaderBytes;
  h->layout_hash = layout_hash;
  h->total_bytes = size();
}

StatusOr<Segment> Segment::Open(const std::string& name, uint64_t expected_layout_hash) {
  std::unique_ptr<Impl> impl;
  try {
    impl = std::make_unique<Impl>();
    impl->object = bip::shared_memory_object(bip::open_only, name.c_str(), bip::read_write);
    impl->region = bip::mapped_region(impl->object, bip::read_write);
  } catch (const bip::interprocess_exception& e) {
    return Status::IoError("opening shared memory /dev/shm/" + name + ": " + e.what());
  }
  Segment seg(std::move(impl), name);
  if (seg.size() < kHeaderBytes)
    return Status::ProtocolError("segment " + name + " is smaller than its header");
  const SegmentHeader* h = seg.header();
  if (h->magic != kSegmentMagic)
    return Status::ProtocolError("segment " + name + ": bad magic (not a RoundPipe state segment)");
  if (h->version != kSegmentVersion)
    return Status::ProtocolError("segment " + name + ": version " + std::to_string(h->version) +
                                 ", this build reads " + std::to_string(kSegmentVersion));
  if (h->layout_hash != expected_layout_hash)
    return Status::ProtocolError("segment " + name +
                                 ": layout hash differs from this process's job config (was the "
                                 "worker started with a different job file or build?)");
  if (h->total_bytes != seg.size())
    return Status::ProtocolError("segment " + name + ": header says " +
                                 std::to_string(h->total_bytes) + " bytes, mapping has " +
                                 std::to_string(seg.size()));
  return seg;
}

StatusOr<Segment> Segment::OpenReadOnly(const std::string& name, uint64_t expected_bytes) {
  std::unique_ptr<Impl> impl;
  try {
    impl = std::make_unique<Impl>();
    impl->object = bip::shared_memory_object(bip::open_only, name.c_str(), bip::read_only);
    impl->region = bip::mapped_region(impl->object, bip::read_only);
  } catch (const bip::interprocess_exception& e) {
    return Status::IoError("opening shared memory /dev/shm/" + name + " read-only: " + e.what());
  }
  Segment seg(std::move(impl), name);
  if (seg.size() != expected_bytes)
    return Status::ProtocolError("segment " + name + " has " + std::to_string(seg.size()) +
                                 " bytes, this job's layout " + std::to_string(expected_bytes));
  return seg;
}

bool RemoveSharedMemory(const std::string& name) {
  try {
    return bip::shared_memory_object::remove(name.c_str());
  } catch (...) {
    return false;
  }
}

Unlinker::~Unlinker() { Remove(); }

bool Unlinker::Remove() {
  if (name_.empty()) return false;
  bool removed = RemoveSharedMemory(name_);
  name_.clear();
  return removed;
}

}  // namespace rp::shm
