// SPDX-License-Identifier: Apache-2.0
// MappedFile: a whole regular file mapped read-only, the one owner of the mapping.
//
// Contract:
//  * Open() refuses anything but a regular file (a FIFO or device in a file's place would block
//    or never end), then maps it through Boost.Interprocess (file_mapping + mapped_region); the
//    file descriptor is closed once the mapping exists, which keeps the file's pages.
//  * Errors are InvalidArgument/IoError Statuses that start with `what` and name the path.
//  * An empty file is valid: size() 0, data() null.
//  * Move-only; the destructor unmaps and never throws. The bytes stay valid while the object
//    lives (share it through std::shared_ptr where several readers need it).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include <boost/interprocess/mapped_region.hpp>

#include "common/status.h"

namespace rp {

class MappedFile {
 public:
  static StatusOr<MappedFile> Open(const std::string& path, const std::string& what);

  MappedFile() = default;
  MappedFile(MappedFile&&) noexcept = default;
  MappedFile& operator=(MappedFile&&) noexcept = default;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const uint8_t* data() const { return static_cast<const uint8_t*>(region_.get_address()); }
  uint64_t size() const { return static_cast<uint64_t>(region_.get_size()); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  boost::interprocess::mapped_region region_;
};

}  // namespace rp
