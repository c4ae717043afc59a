// SPDX-License-Identifier: Apache-2.0
// run-spec.json, what every worker and the coordinator read: any text is parsed into a spec or
// refused with a Status, never a crash, an exception or an out-of-bounds access.
#include <cstdint>
#include <string>

#include "planning/run_spec.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto spec = rp::core::ParseRunSpec(std::string(reinterpret_cast<const char*>(data), size),
                                     "run-spec.json");
  if (spec.ok()) (void)rp::core::RunSpecJson(*spec);
  return 0;
}
