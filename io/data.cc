// SPDX-License-Identifier: Apache-2.0
#include "io/data.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <numeric>
#include <sstream>

#include <nlohmann/json.hpp>

#include "common/rng.h"

namespace rp::core {

StatusOr<Dataset> Dataset::OpenFile(const JobConfig& c, const std::string& key) {
  Dataset d;
  d.config_ = c;
  d.key_ = key;
  if (c.data.packing == core::DataPacking::kAuto)
    return Status::Internal(
        "data.packing: \"auto\" reached the dataset unresolved (ParseJobConfig resolves it)");
  if (c.data.format == core::DataFormat::kBytes) {
    std::ifstream in(c.data.path, std::ios::binary);
    if (!in) return Status::InvalidArgument(d.key_ + ": cannot read " + c.data.path);
    d.bytes_.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    const int64_t S = c.data.seq_len;
    if (static_cast<int64_t>(d.bytes_.size()) < S + 1)
      return Status::InvalidArgument(d.key_ + ": " + c.data.path + " is shorter than seq_len + 1");
    // Non-overlapping windows of S + 1 bytes (inputs and shifted labels), stride S.
    d.windows_ = (static_cast<int64_t>(d.bytes_.size()) - 1) / S;
  } else if (c.data.format == core::DataFormat::kTokens) {
    RP_RETURN_IF_ERROR(d.OpenTokens());
  } else if (c.data.format == core::DataFormat::kJsonl) {
    RP_RETURN_IF_ERROR(d.OpenJsonl());
  } else {
    d.windows_ = 0;  // synthetic: unbounded
  }
  return d;
}

namespace {
// Windows held out of data.path by data.eval_fraction (the last ones in file order).
StatusOr<int64_t> HeldOutWindows(const JobConfig& c, int64_t windows) {
  if (c.data.eval_fraction <= 0.0 || c.data.format == core::DataFormat::kRandom ||
      !c.data.eval_path.empty())
    return 0;
  const int64_t held = std::max<int64_t>(
      1, static_cast<int64_t>(static_cast<double>(windows) * c.data.eval_fraction));
  if (held >= windows)
    return Status::InvalidArgument("data.eval_fraction: holding out " + std::to_string(held) +
                                   " of the " + std::to_string(windows) + " windows of " +
                                   c.data.path + " leaves none to train on");
  return held;
}
}  // namespace

StatusOr<Dataset> Dataset::Open(const JobConfig& c) {
  RP_ASSIGN_OR_RETURN(Dataset d, OpenFile(c, "data.path"));
  RP_ASSIGN_OR_RETURN(int64_t held, HeldOutWindows(c, d.windows_));
  d.windows_ -= held;
  return d;
}

StatusOr<Dataset> Dataset::OpenEval(const JobConfig& c) {
  if (c.data.format == core::DataFormat::kRandom) {
    RP_ASSIGN_OR_RETURN(Dataset d, OpenFile(c, "data.path"));
    return d;
  }
  if (!c.data.eval_path.empty()) {
    JobConfig e = c;
    e.data.path = c.data.eval_path;
    return OpenFile(e, "data.eval_path");
  }
  RP_ASSIGN_OR_RETURN(Dataset d, OpenFile(c, "data.path"));
  RP_ASSIGN_OR_RETURN(int64_t held, HeldOutWindows(c, d.windows_));
  if (held == 0)
    return Status::InvalidArgument(
        "train.eval_every: no eval set (data.eval_path or data.eval_fraction)");
  d.first_window_ = d.windows_ - held;
  d.windows_ = held;
  return d;
}

Status Dataset::OpenTokens() {
  const std::string& path = config_.data.path;
  const std::string sidecar = path + ".json";
  std::ifstream side(sidecar);
  if (!side)
    return Status::InvalidArgument(
        key_ + ": " + sidecar + " (the dtype/vocab_size sidecar of " + path +
        ") is missing; tools/prepare_data.py writes a token file with its sidecar");
  std::stringstream ss;
  ss << side.rdbuf();
  auto j = nlohmann::json::parse(ss.str(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object() || !j.contains("dtype") || !j["dtype"].is_string() ||
      !j.contains("vocab_size") || !j["vocab_size"].is_number_integer())
    return Status::InvalidArgument(
        key_ + ": " + sidecar + " must be {\"dtype\": \"uint16\"|\"uint32\", \"vocab_size\": N}");
  // Every key is known: one this reader does not implement would change what is trained on.
  static const char* const kKeys[] = {"dtype",  "vocab_size",     "documents", "loss_mask",
                                      "tokens", "trained_tokens", "tokenizer", "source"};
  for (const auto& item : j.items())
    if (const std::string k = item.key();
        std::find_if(std::begin(kKeys), std::end(kKeys), [&](const char* n) { return k == n; }) ==
        std::end(kKeys))
      return Status::InvalidArgument(
          key_ + ": " + sidecar + ": unknown key \"" + k +
          "\" (known: dtype, vocab_size, documents, loss_mask, tokens, trained_tokens, "
          "tokenizer, source)");
  const std::string dtype = j["dtype"].get<std::string>();
  token_bytes_ = dtype == "uint16" ? 2 : dtype == "uint32" ? 4 : 0;
  if (token_bytes_ == 0)
    return Status::InvalidArgument(key_ + ": " + sidecar + ": dtype \"" + dtype +
                                   "\" is not uint16 or uint32");
  const int64_t vocab = j["vocab_size"].get<int64_t>();
  if (vocab < 1)
    return Status::InvalidArgument(key_ + ": " + sidecar + " says vocab_size " +
                                   std::to_string(vocab) + "; a vocabulary has at least one token");
  if (vocab > config_.model.vocab_size)
    return Status::InvalidArgument(key_ + ": " + sidecar + " says vocab_size " +
                                   std::to_string(vocab) + ", more than model.vocab_size " +
                                   std::to_string(config_.model.vocab_size));
  RP_ASSIGN_OR_RETURN(MappedFile file, MappedFile::Open(path, key_));
  const uint64_t size = file.size();
  if (size % static_cast<uint64_t>(token_bytes_) != 0 || size == 0)
    return Status::InvalidArgument(key_ + ": " + path + " holds " + std::to_string(size) +
                                   " bytes, not a whole number of " + dtype + " tokens");
  tokens_map_ = std::make_shared<const MappedFile>(std::move(file));
  tokens_ = tokens_map_->data();
  const int64_t n = static_cast<int64_t>(size) / token_bytes_;
  if (j.contains("tokens") && (!j["tokens"].is_number_integer() || j["tokens"].get<int64_t>() != n))
    return Status::InvalidArgument(key_ + ": " + sidecar + " says tokens " + j["tokens"].dump() +
                                   ", " + path + " holds " + std::to_string(n) +
                                   " (an interrupted or mixed-up write?)");
  // Below the tokenizer's vocabulary (the sidecar's), which is at most the model's: an id past it
  // means the file and its sidecar do not belong together.
  for (int64_t i = 0; i < n; ++i)
    if (TokenAt(i) >= vocab)
      return Status::InvalidArgument(
          key_ + ": " + path + ": token " + std::to_string(TokenAt(i)) + " at position " +
          std::to_string(i) + " is not below the vocab_size " + std::to_string(vocab) + " that " +
          sidecar + " says (model.vocab_size " + std::to_string(config_.model.vocab_size) + ")");
  // The loss mask: one byte per token, 1 where the token is a target (predicted by the one before).
  std::shared_ptr<const MappedFile> mask;
  if (j.contains("loss_mask")) {
    if (!j["loss_mask"].is_boolean())
      return Status::InvalidArgument(key_ + ": " + sidecar + ": loss_mask must be true or false");
    if (j["loss_mask"].get<bool>()) {
      RP_ASSIGN_OR_RETURN(MappedFile m, MappedFile::Open(path + ".mask", key_ + " loss mask"));
      if (static_cast<int64_t>(m.size()) != n)
        return Status::InvalidArgument(key_ + ": " + path + ".mask holds " +
                                       std::to_string(m.size()) +
                                       " bytes, one per token would be " + std::to_string(n));
      for (int64_t i = 0; i < n; ++i)
        if (m.data()[i] > 1)
          return Status::InvalidArgument(key_ + ": " + path + ".mask: byte " + std::to_string(i) +
                                         " is " + std::to_string(m.data()[i]) + ", not 0 or 1");
      mask = std::make_shared<const MappedFile>(std::move(m));
    }
  }
  const int64_t S = config_.data.seq_len;
  if (!j.contains("documents")) {
    if (config_.data.packing != core::DataPacking::kStream)
      return Status::InvalidArgument(
          key_ + ": data.packing = \"" + std::string(EnumName(config_.data.packing)) +
          "\" needs document boundaries, and " + sidecar + " names no document index");
    if (n < S + 1)
      return Status::InvalidArgument(key_ + ": " + path + " holds " + std::to_string(n) +
                                     " tokens, fewer than seq_len + 1 = " + std::to_string(S + 1));
    mask_map_ = std::move(mask);
    windows_ = (n - 1) / S;
    return Status::Ok();
  }
  // Records: <path>.docs holds documents + 1 little-endian uint64 offsets, from 0 to the token
  // count, each document at least one token. They pack as JSONL records do.
  if (!j["documents"].is_number_integer() || j["documents"].get<int64_t>() < 1)
    return Status::InvalidArgument(key_ + ": " + sidecar +
                                   ": documents must be a count of at least 1");
  const int64_t docs = j["documents"].get<int64_t>();
  RP_ASSIGN_OR_RETURN(MappedFile index, MappedFile::Open(path + ".docs", key_ + " document index"));
  if (index.size() != static_cast<uint64_t>(docs + 1) * 8)
    return Status::InvalidArgument(
        key_ + ": " + path + ".docs holds " + std::to_string(index.size()) + " bytes; " +
        std::to_string(docs) + " documents need " + std::to_string((docs + 1) * 8) +
        " (documents + 1 uint64 offsets)");
  auto offset = [&index](int64_t d) {
    uint64_t v;
    std::memcpy(&v, index.data() + 8 * d, 8);
    return v;
  };
  if (offset(0) != 0 || offset(docs) != static_cast<uint64_t>(n))
    return Status::InvalidArgument(
        key_ + ": " + path + ".docs must run from 0 to the token count " + std::to_string(n) +
        "; it runs from " + std::to_string(offset(0)) + " to " + std::to_string(offset(docs)));
  for (int64_t d = 0; d < docs; ++d) {
    const uint64_t begin = offset(d), end = offset(d + 1);
    if (end <= begin || end > static_cast<uint64_t>(n))
      return Status::InvalidArgument(
          key_ + ": " + path + ".docs: document " + std::to_string(d) +
          (end > static_cast<uint64_t>(n) ? " ends past the token count " + std::to_string(n)
                                          : std::string(" is empty or runs backwards")) +
          " (offsets " + std::to_string(begin) + ", " + std::to_string(end) + ")");
    const size_t len = static_cast<size_t>(end - begin);
    std::vector<int32_t> record(len), targets(len);
    for (size_t i = 0; i < len; ++i) {
      const int64_t at = static_cast<int64_t>(begin + i);
      record[i] = static_cast<int32_t>(TokenAt(at));
      targets[i] = i + 1 < len && (!mask || mask->data()[at + 1] == 1)
                       ? static_cast<int32_t>(TokenAt(at + 1))
                       : static_cast<int32_t>(kIgnoreIndex);
    }
    PackRecord(std::move(record), std::move(targets));
  }
  // The packed stream holds everything now.
  tokens_map_.reset();
  tokens_ = nullptr;
  return FinishPacking();
}

Status Dataset::OpenJsonl() {
  const std::string& path = config_.data.path;
  std::ifstream in(path);
  if (!in) return Status::InvalidArgument(key_ + ": cannot read " + path);
  const int64_t V = config_.model.vocab_size;
  std::string line;
  for (int64_t lineno = 1; std::getline(in, line); ++lineno) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string at = key_ + ": " + path + ":" + std::to_string(lineno) + ": ";
    auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || !j.is_object())
      return Status::InvalidArgument(at + "not a JSON object");
    if (!j.contains("input_ids") || !j["input_ids"].is_array() || j["input_ids"].empty())
      return Status::InvalidArgument(at + "no non-empty \"input_ids\" array");
    const auto& ids = j["input_ids"];
    const size_t n = ids.size();
    std::vector<int64_t> target(n);
    const bool has_labels = j.contains("labels"), has_mask = j.contains("loss_mask");
    if (has_labels && has_mask)
      return Status::InvalidArgument(at + "give \"labels\" or \"loss_mask\", not both");
    if ((has_labels && (!j["labels"].is_array() || j["labels"].size() != n)) ||
        (has_mask && (!j["loss_mask"].is_array() || j["loss_mask"].size() != n)))
      return Status::InvalidArgument(
          at + "\"labels\" / \"loss_mask\" must be arrays as long as \"input_ids\"");
    for (size_t i = 0; i < n; ++i) {
      if (!ids[i].is_number_integer() || ids[i].get<int64_t>() < 0 || ids[i].get<int64_t>() >= V)
        return Status::InvalidArgument(at + "input_ids[" + std::to_string(i) +
                                       "] is not a token id below model.vocab_size " +
                                       std::to_string(V));
      if (has_labels) {
        const auto& l = j["labels"][i];
        if (!l.is_number_integer() ||
            (l.get<int64_t>() != kIgnoreIndex && (l.get<int64_t>() < 0 || l.get<int64_t>() >= V)))
          return Status::InvalidArgument(at + "labels[" + std::to_string(i) +
                                         "] is neither -100 nor a token id");
      }
      if (has_mask) {
        const auto& mk = j["loss_mask"][i];
        if (!mk.is_number_integer() || (mk.get<int64_t>() != 0 && mk.get<int64_t>() != 1))
          return Status::InvalidArgument(at + "loss_mask[" + std::to_string(i) + "] is not 0 or 1");
      }
    }
    // Position i predicts the record's token i + 1 (or its label); the last predicts nothing.
    std::vector<int32_t> record(n), targets(n);
    for (size_t i = 0; i < n; ++i) {
      int64_t t = kIgnoreIndex;
      if (i + 1 < n) {
        if (has_labels) t = j["labels"][i + 1].get<int64_t>();
        else if (!has_mask || j["loss_mask"][i + 1].get<int64_t>() == 1)
          t = ids[i + 1].get<int64_t>();
      }
      record[i] = static_cast<int32_t>(ids[i].get<int64_t>());
      targets[i] = static_cast<int32_t>(t);
    }
    PackRecord(std::move(record), std::move(targets));
  }
  return FinishPacking();
}

Status Dataset::FinishPacking() {
  if (config_.data.packing != core::DataPacking::kStream) PadToWindowEnd();
  const int64_t S = config_.data.seq_len;
  windows_ = static_cast<int64_t>(packed_tokens_.size()) / S;
  if (windows_ == 0)
    return Status::InvalidArgument(
        key_ + ": " + config_.data.path + " holds " + std::to_string(packed_tokens_.size()) +
        " tokens" +
        (stats_.dropped > 0
             ? " after dropping " + std::to_string(stats_.dropped) + " records longer than seq_len"
             : std::string()) +
        ", fewer than one sequence of seq_len " + std::to_string(S));
  return Status::Ok();
}

void Dataset::PadToWindowEnd() {
  const size_t S = static_cast<size_t>(config_.data.seq_len);
  // Padding is a document of its own: positions from 0, so it starts one wherever it begins.
  for (int32_t pos = 0; packed_tokens_.size() % S != 0; ++pos) {
    packed_tokens_.push_back(0);
    packed_targets_.push_back(static_cast<int32_t>(kIgnoreIndex));
    packed_positions_.push_back(pos);
    ++stats_.padding;
  }
}

void Dataset::PackRecord(std::vector<int32_t> tokens, std::vector<int32_t> targets) {
  const auto packing = config_.data.packing;
  const size_t S = static_cast<size_t>(config_.data.seq_len);
  ++stats_.records;
  if (packing == core::DataPacking::kStream) {
    stats_.tokens += static_cast<int64_t>(tokens.size());
    packed_tokens_.insert(packed_tokens_.end(), tokens.begin(), tokens.end());
    packed_targets_.insert(packed_targets_.end(), targets.begin(), targets.end());
    return;
  }
  if (tokens.size() > S) {
    switch (config_.data.long_records) {
      case core::LongRecords::kDrop: ++stats_.dropped; return;
      case core::LongRecords::kTruncate:
        // As a record of seq_len tokens: its last position predicts nothing.
        ++stats_.truncated;
        tokens.resize(S);
        targets.resize(S);
        targets.back() = static_cast<int32_t>(kIgnoreIndex);
        break;
      case core::LongRecords::kSplit: ++stats_.split; break;
    }
  }
  stats_.tokens += static_cast<int64_t>(tokens.size());
  const bool split = tokens.size() > S;
  for (size_t first = 0; first < tokens.size(); first += S) {
    const size_t n = std::min(S, tokens.size() - first);
    const size_t room = S - packed_tokens_.size() % S;
    // A record starts a window in "pad" packing; a piece of a split record always starts one;
    // in "documents" packing a record that does not fit the room left starts the next window.
    if (packed_tokens_.size() % S != 0 && (packing == core::DataPacking::kPad || split || n > room))
      PadToWindowEnd();
    packed_tokens_.insert(packed_tokens_.end(), tokens.begin() + first, tokens.begin() + first + n);
    packed_targets_.insert(packed_targets_.end(), targets.begin() + first,
                           targets.begin() + first + n);
    for (size_t i = 0; i < n; ++i) packed_positions_.push_back(static_cast<int32_t>(first + i));
  }
}

std::string Dataset::PackingSummary() const {
  if (config_.data.format == core::DataFormat::kRandom) return "";
  const int64_t S = config_.data.seq_len;
  std::ostringstream o;
  o << key_ << ": ";
  if (stats_.records > 0) o << stats_.records << " records, " << stats_.tokens << " tokens, ";
  o << windows_ << " windows of " << S << " tokens (" << EnumName(config_.data.packing)
    << " packing";
  const int64_t all = static_cast<int64_t>(packed_tokens_.size());
  if (all > 0 && stats_.padding > 0) {
    o.setf(std::ios::fixed);
    o.precision(1);
    o << ", " << 100.0 * static_cast<double>(all - stats_.padding) / static_cast<double>(all)
      << "% of the tokens are records'";
  }
  o << ")";
  if (stats_.split + stats_.truncated + stats_.dropped > 0)
    o << "; records longer than seq_len: " << stats_.split << " split, " << stats_.truncated
      << " truncated, " << stats_.dropped << " dropped";
  return o.str();
}

std::string Dataset::LengthSummary() const {
  if (config_.data.format == core::DataFormat::kRandom || windows_ == 0) return "";
  const int64_t per_step = SequencesPerStep(config_);
  const double steps_per_epoch = static_cast<double>(windows_) / static_cast<double>(per_step);
  const double epochs = static_cast<double>(config_.train.steps) / steps_per_epoch;
  std::ostringstream o;
  o.setf(std::ios::fixed);
  o.precision(2);
  o << windows_ << " windows per epoch, " << per_step << " per step: " << steps_per_epoch
    << " steps per epoch; " << config_.train.steps << " steps = " << epochs << " epochs"
    << (config_.train.epochs > 0 ? " (train.epochs)" : " (train.steps)");
  return o.str();
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
    CounterRng rng(HashKey(
        {static_cast<uint64_t>(config_.train.seed), 0xDA7Au, static_cast<uint64_t>(epoch)}));
    for (int64_t i = windows_ - 1; i > 0; --i)
      std::swap(perm_[i], perm_[rng.NextBelow(static_cast<uint64_t>(i + 1))]);
  }
  cached_epoch_ = epoch;
  return perm_;
}

void Dataset::Fill(int64_t step, int64_t call, int64_t mb, int64_t* tokens, int64_t* labels,
                   int64_t* positions) {
  FillStepMicrobatch(step, StepMicrobatch(config_, call, mb), tokens, labels, positions);
}

void Dataset::FillStepMicrobatch(int64_t step, int64_t first, int64_t* tokens, int64_t* labels,
                                 int64_t* positions) {
  const auto& t = config_.train;
  const RoundShape whole = GlobalRound(config_);
  const int64_t step_microbatches = whole.calls * whole.microbatches;
  const int64_t S = config_.data.seq_len;
  for (int64_t i = 0; i < t.microbatch_size; ++i) {
    const int64_t g = (step * step_microbatches + first) * t.microbatch_size + i;
    if (config_.data.format == core::DataFormat::kRandom) {
      FillRandom(
          HashKey({static_cast<uint64_t>(config_.train.seed), 0x5EEDu, static_cast<uint64_t>(g)}),
          tokens + i * S, labels + i * S, positions ? positions + i * S : nullptr);
      continue;
    }
    const int64_t epoch = g / windows_;
    FillWindow(Permutation(epoch)[g % windows_], tokens + i * S, labels + i * S,
               positions ? positions + i * S : nullptr);
  }
}

void Dataset::FillEval(int64_t index, int64_t* tokens, int64_t* labels, int64_t* positions) {
  const auto& t = config_.train;
  const int64_t S = config_.data.seq_len;
  for (int64_t i = 0; i < t.microbatch_size; ++i) {
    const int64_t g = index * t.microbatch_size + i;
    if (config_.data.format == core::DataFormat::kRandom) {
      // A stream of its own: no training draw (salt 0x5EED) repeats it.
      FillRandom(
          HashKey({static_cast<uint64_t>(config_.train.seed), 0xE7A1u, static_cast<uint64_t>(g)}),
          tokens + i * S, labels + i * S, positions ? positions + i * S : nullptr);
      continue;
    }
    FillWindow(first_window_ + g % windows_, tokens + i * S, labels + i * S,
               positions ? positions + i * S : nullptr);
  }
}

void Dataset::FillRandom(uint64_t key, int64_t* tok, int64_t* lab, int64_t* pos) const {
  if (pos != nullptr)
    for (int64_t j = 0; j < config_.data.seq_len; ++j) pos[j] = j;
  CounterRng rng(key);
  const uint64_t V = static_cast<uint64_t>(config_.model.vocab_size);
  int64_t prev = static_cast<int64_t>(rng.NextBelow(V));
  for (int64_t j = 0; j < config_.data.seq_len; ++j) {
    int64_t next = static_cast<int64_t>(rng.NextBelow(V));
    tok[j] = prev;
    lab[j] = next;
    prev = next;
  }
}

void Dataset::FillWindow(int64_t w, int64_t* tok, int64_t* lab, int64_t* pos) const {
  const int64_t S = config_.data.seq_len;
  if (pos != nullptr)
    for (int64_t j = 0; j < S; ++j)
      pos[j] = packed_positions_.empty() ? j : packed_positions_[w * S + j];
  if (!packed_tokens_.empty()) {
    for (int64_t j = 0; j < S; ++j) {
      tok[j] = packed_tokens_[w * S + j];
      lab[j] = packed_targets_[w * S + j];
    }
  } else if (tokens_ != nullptr) {
    for (int64_t j = 0; j < S; ++j) {
      tok[j] = TokenAt(w * S + j);
      lab[j] = !mask_map_ || mask_map_->data()[w * S + j + 1] == 1 ? TokenAt(w * S + j + 1)
                                                                   : kIgnoreIndex;
    }
  } else {
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
  const RoundShape whole = GlobalRound(config_);
  for (int64_t k = 0; k < whole.calls * whole.microbatches; ++k) {
    FillStepMicrobatch(step, k, tok.data(), lab.data());
    for (auto l : lab) count += l != kIgnoreIndex;
  }
  return count;
}

Status ResolveTrainingLength(JobConfig* c) {
  if (c->train.epochs == 0) return Status::Ok();
  RP_ASSIGN_OR_RETURN(Dataset data, Dataset::Open(*c));
  const double sequences = c->train.epochs * static_cast<double>(data.NumWindows());
  c->train.steps = std::max<int64_t>(
      1, static_cast<int64_t>(
             std::ceil(sequences / static_cast<double>(SequencesPerStep(*c)) - 1e-9)));
  ResolveWarmup(c);
  if (c->train.stop_after > c->train.steps)
    return Status::InvalidArgument("train.stop_after: " + std::to_string(c->train.stop_after) +
                                   " is past the " + std::to_string(c->train.steps) +
                                   " steps of train.epochs");
  return Status::Ok();
}

std::vector<int64_t> SortedTokenRows(const std::vector<const int64_t*>& slots, int64_t per_slot,
                                     int64_t vocab) {
  std::vector<char> seen(static_cast<size_t>(std::max<int64_t>(vocab, 0)), 0);
  for (const int64_t* ids : slots)
    for (int64_t i = 0; i < per_slot; ++i)
      if (ids[i] >= 0 && ids[i] < vocab) seen[static_cast<size_t>(ids[i])] = 1;
  std::vector<int64_t> rows;
  for (size_t r = 0; r < seen.size(); ++r)
    if (seen[r]) rows.push_back(static_cast<int64_t>(r));
  return rows;
}

}  // namespace rp::core
