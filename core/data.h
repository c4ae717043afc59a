// SPDX-License-Identifier: Apache-2.0
// Dataset: deterministic token batches.
//
// Contract: Fill(step, call, mb) writes microbatch `mb` of accumulation call `call` of optimizer
// step `step` as int64 token ids and labels ([microbatch_size, seq_len] each, row-major). The
// result is a pure function of (config, seed, step, call, mb): the pipelined coordinator and
// rp-train-ref draw identical batches. Labels use -100 for ignored positions.
// Not thread-safe (epoch permutations are cached); one owner per process.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"
#include "core/job_config.h"

namespace rp::core {

inline constexpr int64_t kIgnoreIndex = -100;

class Dataset {
 public:
  static StatusOr<Dataset> Open(const JobConfig& config);

  void Fill(int64_t step, int64_t call, int64_t mb, int64_t* tokens, int64_t* labels);
  // Number of labels != kIgnoreIndex in one optimizer step (loss normalizer).
  int64_t CountStepTargets(int64_t step);
  int64_t NumWindows() const { return windows_; }

 private:
  Dataset() = default;
  const std::vector<int64_t>& Permutation(int64_t epoch);

  JobConfig config_;
  std::vector<uint8_t> bytes_;
  int64_t windows_ = 0;
  int64_t cached_epoch_ = -1;
  std::vector<int64_t> perm_;
};

}  // namespace rp::core
