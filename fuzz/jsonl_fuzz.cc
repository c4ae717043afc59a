// SPDX-License-Identifier: Apache-2.0
// The JSONL reader (data.format = "jsonl") on any bytes: refused with a Status or read and
// packed into windows, never a crash, a hang or an out-of-bounds access (ASan, UBSan).
#include <cstdint>
#include <vector>

#include "config/job_config.h"
#include "fuzz/fuzz_files.h"
#include "io/data.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = rp::fuzz::ScratchDir() + "/records.jsonl";
  rp::fuzz::WriteFile(path, {reinterpret_cast<const char*>(data), size});
  for (const char* packing : {"documents", "stream"}) {
    auto config = rp::core::ParseJobConfig(
        std::string("[model]\nvocab_size = 300\n[data]\nformat = \"jsonl\"\n"
                    "path = \"") +
            path + "\"\nseq_len = 16\npacking = \"" + packing +
            "\"\n[train]\nmicrobatches = 1\naccum_calls = 1\n"
            "microbatch_size = 2\n",
        "/", {});
    if (!config.ok()) __builtin_trap();  // the job itself is valid
    auto dataset = rp::core::Dataset::Open(*config);
    if (!dataset.ok()) continue;
    std::vector<int64_t> tokens(32), labels(32), positions(32);
    dataset->Fill(0, 0, 0, tokens.data(), labels.data(), positions.data());
    for (int64_t t : tokens)
      if (t < 0 || t >= 300) __builtin_trap();  // every id was checked against the vocabulary
  }
  return 0;
}
