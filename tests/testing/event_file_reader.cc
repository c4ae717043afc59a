// SPDX-License-Identifier: Apache-2.0
#include "tests/testing/event_file_reader.h"

#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string_view>

#include <nlohmann/json.hpp>

namespace rp::testing {

uint32_t ReferenceCrc32c(const void* data, size_t bytes) {
  // Bit by bit, reflected Castagnoli polynomial.
  const auto* p = static_cast<const uint8_t*>(data);
  uint32_t crc = 0xffffffffu;
  for (size_t i = 0; i < bytes; ++i) {
    crc ^= p[i];
    for (int b = 0; b < 8; ++b) crc = (crc >> 1) ^ (0x82f63b78u & (0u - (crc & 1u)));
  }
  return ~crc;
}

namespace {

uint32_t Unmask(uint32_t masked) {
  const uint32_t rot = masked - 0xa282ead8u;
  return (rot >> 17) | (rot << 15);
}

uint64_t LittleEndian(const std::string& s, size_t at, int bytes) {
  uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | static_cast<uint8_t>(s[at + i]);
  return v;
}

// A protobuf message's fields, one at a time.
class WireReader {
 public:
  explicit WireReader(std::string_view bytes) : b_(bytes) {}
  bool done() const { return at_ >= b_.size(); }
  bool Varint(uint64_t* v) {
    *v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (at_ >= b_.size()) return false;
      const uint8_t c = static_cast<uint8_t>(b_[at_++]);
      *v |= static_cast<uint64_t>(c & 0x7f) << shift;
      if (!(c & 0x80)) return true;
    }
    return false;
  }
  bool Fixed(int bytes, uint64_t* v) {
    if (at_ + bytes > b_.size()) return false;
    *v = 0;
    for (int i = bytes - 1; i >= 0; --i) *v = (*v << 8) | static_cast<uint8_t>(b_[at_ + i]);
    at_ += bytes;
    return true;
  }
  bool Bytes(std::string_view* out) {
    uint64_t n = 0;
    if (!Varint(&n) || at_ + n > b_.size()) return false;
    *out = b_.substr(at_, n);
    at_ += n;
    return true;
  }
  // Reads a field's key and leaves its value to the caller; `Skip` passes over one it does not
  // want.
  bool Key(int* field, int* wire) {
    uint64_t k = 0;
    if (!Varint(&k)) return false;
    *field = static_cast<int>(k >> 3);
    *wire = static_cast<int>(k & 7);
    return true;
  }
  bool Skip(int wire) {
    uint64_t v = 0;
    std::string_view s;
    switch (wire) {
      case 0: return Varint(&v);
      case 1: return Fixed(8, &v);
      case 2: return Bytes(&s);
      case 5: return Fixed(4, &v);
      default: return false;
    }
  }

 private:
  std::string_view b_;
  size_t at_ = 0;
};

bool DecodeValue(std::string_view bytes, std::pair<std::string, float>* out) {
  // A value must carry simple_value (TensorBoard skips one without it): absent is malformed here.
  bool has_value = false;
  WireReader r(bytes);
  while (!r.done()) {
    int field = 0, wire = 0;
    if (!r.Key(&field, &wire)) return false;
    if (field == 1 && wire == 2) {
      std::string_view s;
      if (!r.Bytes(&s)) return false;
      out->first = std::string(s);
    } else if (field == 2 && wire == 5) {
      uint64_t v = 0;
      if (!r.Fixed(4, &v)) return false;
      const uint32_t bits = static_cast<uint32_t>(v);
      std::memcpy(&out->second, &bits, 4);
      has_value = true;
    } else if (!r.Skip(wire)) {
      return false;
    }
  }
  return has_value;
}

bool DecodeEvent(std::string_view bytes, EventRecord* e) {
  WireReader r(bytes);
  while (!r.done()) {
    int field = 0, wire = 0;
    if (!r.Key(&field, &wire)) return false;
    uint64_t v = 0;
    std::string_view s;
    if (field == 1 && wire == 1) {
      if (!r.Fixed(8, &v)) return false;
      std::memcpy(&e->wall_time, &v, 8);
    } else if (field == 2 && wire == 0) {
      if (!r.Varint(&v)) return false;
      e->step = static_cast<int64_t>(v);
    } else if (field == 3 && wire == 2) {
      if (!r.Bytes(&s)) return false;
      e->file_version = std::string(s);
    } else if (field == 5 && wire == 2) {
      if (!r.Bytes(&s)) return false;
      WireReader summary(s);
      while (!summary.done()) {
        int f = 0, w = 0;
        if (!summary.Key(&f, &w)) return false;
        std::string_view value;
        if (f == 1 && w == 2) {
          if (!summary.Bytes(&value)) return false;
          std::pair<std::string, float> scalar;
          if (!DecodeValue(value, &scalar)) return false;
          e->scalars.push_back(std::move(scalar));
        } else if (!summary.Skip(w)) {
          return false;
        }
      }
    } else if (!r.Skip(wire)) {
      return false;
    }
  }
  return true;
}

}  // namespace

EventFile ParseEventFile(const std::string& b) {
  EventFile out;
  size_t at = 0;
  for (int record = 1; at < b.size(); ++record) {
    const std::string where = "record " + std::to_string(record) + ": ";
    if (b.size() - at < 12) {
      out.error = where + "the file ends inside the record's header";
      return out;
    }
    const uint64_t len = LittleEndian(b, at, 8);
    if (Unmask(static_cast<uint32_t>(LittleEndian(b, at + 8, 4))) !=
        ReferenceCrc32c(b.data() + at, 8)) {
      out.error = where + "the length's CRC does not match";
      return out;
    }
    if (b.size() - at - 12 < len + 4) {
      out.error = where + "the file ends inside the record's data";
      return out;
    }
    const std::string_view data(b.data() + at + 12, len);
    if (Unmask(static_cast<uint32_t>(LittleEndian(b, at + 12 + len, 4))) !=
        ReferenceCrc32c(data.data(), len)) {
      out.error = where + "the data's CRC does not match";
      return out;
    }
    EventRecord e;
    if (!DecodeEvent(data, &e)) {
      out.error = where + "the data is not a well-formed Event";
      return out;
    }
    out.events.push_back(std::move(e));
    at += 12 + len + 4;
  }
  return out;
}

const char* const kTensorBoardFields[11] = {
    "loss",        "eval_loss",    "lr",           "grad_norm",       "loss_scale", "tokens_per_s",
    "step_time_s", "bubble_ratio", "h2d_gb_per_s", "device_peak_gib", "host_gib"};

std::string EventsMatchMetrics(const std::string& tb_dir, const std::string& metrics_jsonl) {
  std::vector<std::string> files;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(tb_dir, ec))
    if (e.path().filename().string().find("tfevents") != std::string::npos)
      files.push_back(e.path().string());
  if (ec) return "cannot list " + tb_dir + ": " + ec.message();
  if (files.size() != 1)
    return tb_dir + " holds " + std::to_string(files.size()) + " event files, not 1";
  const EventFile f = ReadEventFile(files[0]);
  if (!f.error.empty()) return files[0] + ": " + f.error;
  if (f.events.empty() || f.events[0].file_version != "brain.Event:2")
    return files[0] + ": the first record is not the file_version event";
  std::ifstream in(metrics_jsonl);
  std::string text;
  size_t i = 1;
  for (; std::getline(in, text); ++i) {
    const auto line = nlohmann::json::parse(text);
    const std::string where = "line " + std::to_string(i) + " (step " + line["step"].dump() + "): ";
    if (i >= f.events.size()) return where + "no event for it";
    const EventRecord& e = f.events[i];
    if (e.step != line["step"].get<int64_t>())
      return where + "the event's step is " + std::to_string(e.step);
    if (e.wall_time != line["time"].get<double>())
      return where + "the event's wall time differs from \"time\"";
    size_t expected = 0;
    for (const char* field : kTensorBoardFields) {
      if (!line.contains(field) || !line[field].is_number()) continue;
      ++expected;
      const float want = static_cast<float>(line[field].get<double>());
      bool found = false;
      for (const auto& [tag, value] : e.scalars) {
        const auto slash = tag.find('/');
        if (slash == std::string::npos || tag.substr(slash + 1) != field) continue;
        found = true;
        if (value != want)
          return where + tag + " is " + std::to_string(value) + ", metrics.jsonl " +
                 line[field].dump();
      }
      if (!found) return where + "no scalar for " + field;
    }
    if (e.scalars.size() != expected)
      return where + std::to_string(e.scalars.size()) + " scalars where metrics.jsonl has " +
             std::to_string(expected);
  }
  if (i != f.events.size())
    return std::to_string(f.events.size() - i) + " events after the last line of metrics.jsonl";
  return "";
}

EventFile ReadEventFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return {{}, "cannot open " + path};
  std::stringstream ss;
  ss << in.rdbuf();
  return ParseEventFile(ss.str());
}

}  // namespace rp::testing
