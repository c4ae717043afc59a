// SPDX-License-Identifier: Apache-2.0
// What the fuzz targets share: a private scratch directory per process and the input written
// into files there, since every reader under test takes a path.
#pragma once

#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <string>
#include <string_view>
#include <vector>

namespace rp::fuzz {

// A directory of this process's own, made once, emptied by the caller's writes.
inline const std::string& ScratchDir() {
  static const std::string dir = [] {
    std::string tmpl = "/tmp/rp-fuzz-XXXXXX";
    if (::mkdtemp(tmpl.data()) == nullptr) std::abort();
    return tmpl;
  }();
  return dir;
}

inline void WriteFile(const std::string& path, std::string_view bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc)
      .write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// The input cut at each "\n--\n" into at most `n` parts (the last takes the rest; missing parts
// are empty): one input feeds a file and its sidecars.
inline std::vector<std::string_view> Parts(const uint8_t* data, size_t size, size_t n) {
  std::string_view rest(reinterpret_cast<const char*>(data), size);
  std::vector<std::string_view> parts;
  while (parts.size() + 1 < n) {
    const size_t cut = rest.find("\n--\n");
    if (cut == std::string_view::npos) break;
    parts.push_back(rest.substr(0, cut));
    rest.remove_prefix(cut + 4);
  }
  parts.push_back(rest);
  parts.resize(n);
  return parts;
}

}  // namespace rp::fuzz
