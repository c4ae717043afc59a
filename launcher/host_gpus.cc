// SPDX-License-Identifier: Apache-2.0
#include "launcher/host_gpus.h"

#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <vector>

namespace rp::launch {

double SmallestGpuMemoryGib(const std::string& nvidia_smi_csv,
                            const std::optional<std::string>& visible) {
  std::vector<double> mib;  // by GPU index; < 0 where a line does not parse
  std::istringstream lines(nvidia_smi_csv);
  for (std::string line; std::getline(lines, line);) {
    char* end = nullptr;
    const double v = std::strtod(line.c_str(), &end);
    mib.push_back(end != line.c_str() && v > 0 ? v : -1.0);
  }
  std::vector<size_t> chosen;
  if (visible && !visible->empty()) {
    std::istringstream ids(*visible);
    for (std::string id; std::getline(ids, id, ',');) {
      char* end = nullptr;
      const long index = std::strtol(id.c_str(), &end, 10);
      if (id.empty() || *end != '\0' || index < 0) {  // a UUID or a MIG instance: not mapped here
        chosen.clear();
        break;
      }
      if (static_cast<size_t>(index) < mib.size()) chosen.push_back(static_cast<size_t>(index));
    }
  }
  if (chosen.empty())
    for (size_t i = 0; i < mib.size(); ++i) chosen.push_back(i);
  double smallest = 0.0;
  for (size_t i : chosen)
    if (mib[i] > 0 && (smallest == 0.0 || mib[i] < smallest)) smallest = mib[i];
  return smallest / 1024.0;
}

double QueryGpuMemoryGib(const EnvLookup& env) {
  // Bounded: a driver in trouble can keep nvidia-smi waiting, and the launch must not wait with it.
  FILE* pipe = ::popen(
      "timeout 10 nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null",
      "r");
  if (pipe == nullptr) return 0.0;
  std::string out;
  char buf[256];
  size_t n = 0;
  while ((n = std::fread(buf, 1, sizeof(buf), pipe)) > 0) out.append(buf, n);
  if (::pclose(pipe) != 0) return 0.0;
  return SmallestGpuMemoryGib(out, env("CUDA_VISIBLE_DEVICES"));
}

}  // namespace rp::launch
