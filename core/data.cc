// SPDX-License-Identifier: Apache-2.0
#include "core/data.h"

#include <fstream>
#include <numeric>

#include "common/rng.h"

namespace rp::core {

StatusOr<Dataset> Dataset::Open(const JobConfig& c) {
  Dataset d;
  d.config_ = c;
  if (c.data.format == "bytes") {
    std::ifstream in(c.data.path, std::ios::binary);
    if (!in) return Status::InvalidArgument("data.path: cannot read " + c.data.path);
    d.bytes_.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    const int64_t S = c.data.seq_len;
    if (static_cast<int64_t>(d.bytes_.size()) < S + 1)
      return Status::InvalidArgument("data.path: " + c.data.path + " is shorter than seq_len + 1");
    // Non-overlapping windows of S + 1 bytes (inputs and shifted labels), stride S.
    d.windows_ = (static_cast<int64_t>(d.bytes_.size()) - 1) / S;
  } else {
    d.windows_ = 0;  // synthetic: unbounded
  }
  return d;
}

const std::vector<int64_t>& Dataset::Permutation(int64_t epoch) {
  if (cached_epoch_ == epoch) return perm_;
  perm_.resize(windows_);
  std::iota(perm_.begin(), perm_.end(), 0);
  if (config_.data.shuffle) {
    CounterRng rng(HashKey({static_cast<uint64_t>(config_.train.seed), 0xDA7Au,
                            static_cast<uint64_t>(epoch)}));
    for (int64_t i = windows_ - 1; i > 0; --i)
      std::swap(perm_[i], perm_[rng.NextBelow(static_cast<uint64_t>(i + 1))]);
  }
  cached_epoch_ = epoch;
  return perm_;
}

void Dataset::Fill(int64_t step, int64_t call, int64_t mb, int64_t* tokens, int64_t* labels) {
  const auto& t = config_.train;
  const int64_t S = config_.data.seq_len;
  for (int64_t i = 0; i < t.microbatch_size; ++i) {
    const int64_t g = ((step * t.accum_calls + call) * t.microbatches + mb) * t.microbatch_size + i;
    int64_t* tok = tokens + i * S;
    int64_t* lab = labels + i * S;
    if (config_.data.format == "random") {
      CounterRng rng(HashKey({static_cast<uint64_t>(config_.train.seed), 0x5EEDu,
                              static_cast<uint64_t>(g)}));
      const uint64_t V = static_cast<uint64_t>(config_.model.vocab_size);
      int64_t prev = static_cast<int64_t>(rng.NextBelow(V));
      for (int64_t j = 0; j < S; ++j) {
        int64_t next = static_cast<int64_t>(rng.NextBelow(V));
        tok[j] = prev;
        lab[j] = next;
        prev = next;
      }
      continue;
    }
    const int64_t epoch = g / windows_;
    const int64_t w = Permutation(epoch)[g % windows_];
    const uint8_t* src = bytes_.data() + w * S;
    for (int64_t j = 0; j < S; ++j) {
      tok[j] = src[j];
      lab[j] = src[j + 1];
    }
  }
}

int64_t Dataset::CountStepTargets(int64_t step) {
  const auto& t = config_.train;
  const int64_t n = t.microbatch_size * config_.data.seq_len;
  std::vector<int64_t> tok(n), lab(n);
  int64_t count = 0;
  for (int64_t c = 0; c < t.accum_calls; ++c)
    for (int64_t m = 0; m < t.microbatches; ++m) {
      Fill(step, c, m, tok.data(), lab.data());
      for (auto l : lab) count += l != kIgnoreIndex;
    }
  return count;
}

}  // namespace rp::core
