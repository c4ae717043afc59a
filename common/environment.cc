// SPDX-License-Identifier: Apache-2.0
#include "common/environment.h"

#include <cstdlib>

extern char** environ;

namespace rp {

std::optional<std::string> EnvironmentValue(const char* name) {
  const char* value = std::getenv(name);
  if (value == nullptr) return std::nullopt;
  return std::string(value);
}

std::vector<std::string> EnvironmentEntries() {
  std::vector<std::string> entries;
  for (char** e = environ; *e != nullptr; ++e) entries.emplace_back(*e);
  return entries;
}

}  // namespace rp
