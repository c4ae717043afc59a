// SPDX-License-Identifier: Apache-2.0
#include "common/process_state.h"

#include <fstream>
#include <sstream>
#include <string>

namespace rp {

bool ProcessStopped(pid_t pid) {
  if (pid <= 0) return false;
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::stringstream text;
  text << in.rdbuf();
  const std::string stat = text.str();
  // "PID (COMM) S ...": COMM may hold spaces and parentheses; the state follows the last ')'.
  const size_t close = stat.rfind(')');
  if (close == std::string::npos || close + 2 >= stat.size()) return false;
  const char state = stat[close + 2];
  return state == 'T' || state == 't';
}

}  // namespace rp
