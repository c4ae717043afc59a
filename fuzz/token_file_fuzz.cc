// SPDX-License-Identifier: Apache-2.0
// A token file with its sidecars (data.format = "tokens"): the input is "<sidecar JSON>\n--\n
// <token bytes>\n--\n<document index>\n--\n<loss mask>". Refused with a Status or read, never a
// crash or an out-of-bounds access; every id read is below the vocabulary.
#include <cstdint>
#include <vector>

#include "config/job_config.h"
#include "fuzz/fuzz_files.h"
#include "io/data.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto parts = rp::fuzz::Parts(data, size, 4);
  const std::string path = rp::fuzz::ScratchDir() + "/tokens.bin";
  rp::fuzz::WriteFile(path + ".json", parts[0]);
  rp::fuzz::WriteFile(path, parts[1]);
  rp::fuzz::WriteFile(path + ".docs", parts[2]);
  rp::fuzz::WriteFile(path + ".mask", parts[3]);
  auto config = rp::core::ParseJobConfig(
      std::string("[model]\nvocab_size = 300\n[data]\nformat = \"tokens\"\n"
                  "path = \"") +
          path +
          "\"\nseq_len = 8\n[train]\n"
          "microbatches = 1\naccum_calls = 1\nmicrobatch_size = 2\n",
      "/", {});
  if (!config.ok()) return 0;  // a sidecar whose document index decides the packing may refuse here
  auto dataset = rp::core::Dataset::Open(*config);
  if (!dataset.ok()) return 0;
  std::vector<int64_t> tokens(16), labels(16), positions(16);
  for (int64_t step = 0; step < 3; ++step) {
    dataset->Fill(step, 0, 0, tokens.data(), labels.data(), positions.data());
    for (int64_t t : tokens)
      if (t < 0 || t >= 300) __builtin_trap();
  }
  return 0;
}
