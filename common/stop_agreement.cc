// SPDX-License-Identifier: Apache-2.0
#include "common/stop_agreement.h"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

namespace rp {

Status WriteStepFile(const std::string& path, int64_t step) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << step << "\n";
    out.flush();
    if (!out) return Status::Internal("writing " + tmp + ": " + std::strerror(errno));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0)
    return Status::Internal("renaming " + tmp + " to " + path + ": " + std::strerror(errno));
  return Status::Ok();
}

StatusOr<std::optional<int64_t>> ReadStepFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return std::optional<int64_t>();
  std::stringstream text;
  text << in.rdbuf();
  long long step = -1;
  char rest = 0;
  if (std::sscanf(text.str().c_str(), "%lld %c", &step, &rest) != 1 || step < 0)
    return Status::ProtocolError(path + " holds \"" + text.str() + "\", not a step count");
  return std::optional<int64_t>(step);
}

}  // namespace rp
