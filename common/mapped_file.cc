// SPDX-License-Identifier: Apache-2.0
#include "common/mapped_file.h"

#include <sys/stat.h>

#include <cerrno>

#include <boost/interprocess/exceptions.hpp>
#include <boost/interprocess/file_mapping.hpp>

namespace rp {

StatusOr<MappedFile> MappedFile::Open(const std::string& path, const std::string& what) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return Status::FromErrno(what + ": opening " + path, errno);
  if (!S_ISREG(st.st_mode))
    return Status::InvalidArgument(what + ": " + path + " is not a regular file");
  MappedFile f;
  f.path_ = path;
  if (st.st_size == 0) return f;
  namespace bip = boost::interprocess;
  try {
    bip::file_mapping file(path.c_str(), bip::read_only);
    f.region_ = bip::mapped_region(file, bip::read_only);
  } catch (const bip::interprocess_exception& e) {
    return Status::IoError(what + ": mapping " + path + ": " + e.what());
  }
  return f;
}

}  // namespace rp
