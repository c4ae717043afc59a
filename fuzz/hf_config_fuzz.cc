// SPDX-License-Identifier: Apache-2.0
// A checkpoint's config.json (model.path): any bytes are applied to the model's keys or refused
// with a Status naming the file, never a crash, an exception or an out-of-range value accepted.
#include <cstdint>

#include "config/hf_config.h"
#include "config/job_config.h"
#include "fuzz/fuzz_files.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string& dir = rp::fuzz::ScratchDir();
  rp::fuzz::WriteFile(dir + "/config.json", {reinterpret_cast<const char*>(data), size});
  rp::core::ModelConfig model;
  if (rp::core::ApplyHfConfig(dir, &model).ok() && (model.hidden_size < 1 || model.num_layers < 1 ||
                                                    model.vocab_size < 1 || model.num_heads < 1))
    __builtin_trap();  // accepted values pass the job keys' ranges
  return 0;
}
