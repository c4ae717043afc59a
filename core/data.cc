// SPDX-License-Identifier: Apache-2.0
#include "core/data.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <numeric>
#include <sstream>

#include <nlohmann/json.hpp>

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
  } else if (c.data.format == "tokens") {
    RP_RETURN_IF_ERROR(d.OpenTokens());
  } else {
    d.windows_ = 0;  // synthetic: unbounded
  }
  return d;
}

Status Dataset::OpenTokens() {
  const std::string& path = config_.data.path;
  const std::string sidecar = path + ".json";
  std::ifstream side(sidecar);
  if (!side) return Status::InvalidArgument("data.path: " + sidecar + " (the dtype/vocab_size sidecar of " + path + ") is missing");
  std::stringstream ss;
  ss << side.rdbuf();
  auto j = nlohmann::json::parse(ss.str(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object() || !j.contains("dtype") || !j["dtype"].is_string() ||
      !j.contains("vocab_size") || !j["vocab_size"].is_number_integer())
    return Status::InvalidArgument("data.path: " + sidecar + " must be {\"dtype\": \"uint16\"|\"uint32\", \"vocab_size\": N}");
  const std::string dtype = j["dtype"].get<std::string>();
  token_bytes_ = dtype == "uint16" ? 2 : dtype == "uint32" ? 4 : 0;
  if (token_bytes_ == 0) return Status::InvalidArgument("data.path: " + sidecar + ": dtype \"" + dtype + "\" is not uint16 or uint32");
  const int64_t vocab = j["vocab_size"].get<int64_t>();
  if (vocab > config_.model.vocab_size)
    return Status::InvalidArgument("data.path: " + sidecar + " says vocab_size " + std::to_string(vocab) +
                                   ", more than model.vocab_size " + std::to_string(config_.model.vocab_size));
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return Status::FromErrno("data.path: opening " + path, errno);
  struct stat st {};
  ::fstat(fd, &st);
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size % static_cast<uint64_t>(token_bytes_) != 0 || size == 0) {
    ::close(fd);
    return Status::InvalidArgument("data.path: " + path + " holds " + std::to_string(size) +
                                   " bytes, not a whole number of " + dtype + " tokens");
  }
  void* map = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (map == MAP_FAILED) return Status::FromErrno("data.path: mapping " + path, errno);
  tokens_map_ = std::shared_ptr<const void>(map, [size](const void* p) { ::munmap(const_cast<void*>(p), size); });
  tokens_ = static_cast<const uint8_t*>(map);
  const int64_t n = static_cast<int64_t>(size) / token_bytes_;
  const int64_t S = config_.data.seq_len;
  if (n < S + 1)
    return Status::InvalidArgument("data.path: " + path + " holds " + std::to_string(n) +
                                   " tokens, fewer than seq_len + 1 = " + std::to_string(S + 1));
  for (int64_t i = 0; i < n; ++i)
    if (TokenAt(i) >= config_.model.vocab_size)
      return Status::InvalidArgument("data.path: " + path + ": token " + std::to_string(TokenAt(i)) +
                                     " at position " + std::to_string(i) + " is not below model.vocab_size " +
                                     std::to_string(config_.model.vocab_size));
  windows_ = (n - 1) / S;
  return Status::Ok();
}

int64_t Dataset::TokenAt(int64_t i) const {
  if (token_bytes_ == 2) {
    uint16_t v;
    std::memcpy(&v, tokens_ + 2 * i, 2);
    return v;
  }
  uint32_t v;
  std::memcpy(&v, tokens_ + 4 * i, 4);
  return v;
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
    if (tokens_ != nullptr) {
      for (int64_t j = 0; j < S; ++j) {
        tok[j] = TokenAt(w * S + j);
        lab[j] = TokenAt(w * S + j + 1);
      }
      continue;
    }
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
