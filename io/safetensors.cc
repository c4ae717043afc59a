// SPDX-License-Identifier: Apache-2.0
#include "io/safetensors.h"

#include <algorithm>
#include <cerrno>
#include <cstring>

#include <nlohmann/json.hpp>

#include "common/cores.h"
#include "common/parallel.h"
#include "io/run_output.h"

namespace rp::core {
namespace {

Status Bad(const std::string& what, const std::string& problem) {
  return Status::InvalidArgument(what + ": " + problem);
}

float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu, bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);  // inf / nan
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {  // subnormal: normalize
    int e = -1;
    do {
      mant <<= 1;
      e++;
    } while ((mant & 0x400u) == 0);
    bits = sign | (static_cast<uint32_t>(112 - e) << 23) | ((mant & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

}  // namespace

void FloatToBf16(const float* in, int64_t n, uint16_t* out) {
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, in + i, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) {
      out[i] = static_cast<uint16_t>((bits >> 16) | 0x40u);  // a quiet NaN
      continue;
    }
    bits += 0x7fffu + ((bits >> 16) & 1u);
    out[i] = static_cast<uint16_t>(bits >> 16);
  }
}

void FloatToHalf(const float* in, int64_t n, uint16_t* out) {
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, in + i, 4);
    const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
    const uint32_t abs = bits & 0x7fffffffu;
    if (abs > 0x7f800000u) {  // NaN
      out[i] = static_cast<uint16_t>(sign | 0x7e00u);
    } else if (abs >= 0x477ff000u) {  // rounds to beyond 65504: infinity
      out[i] = static_cast<uint16_t>(sign | 0x7c00u);
    } else if (abs >= 0x38800000u) {  // a normal half: rebias, round the 13 dropped bits to even
      const uint32_t r = abs - 0x38000000u;
      out[i] = static_cast<uint16_t>(sign | ((r + 0xfffu + ((r >> 13) & 1u)) >> 13));
    } else if (abs >=
               0x33000000u) {  // a subnormal half: shift the implicit-1 mantissa, round to even
      const uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
      const int shift = 126 - static_cast<int>(abs >> 23);  // 14..24
      const uint32_t half_ulp = 1u << (shift - 1), low = mant & ((1u << shift) - 1);
      uint32_t h = mant >> shift;
      if (low > half_ulp || (low == half_ulp && (h & 1u))) ++h;
      out[i] = static_cast<uint16_t>(sign | h);
    } else {
      out[i] = sign;  // below half the smallest subnormal: zero
    }
  }
}

int SafetensorsDtypeBytes(const std::string& d) {
  if (d == "F64" || d == "I64" || d == "U64") return 8;
  if (d == "F32" || d == "I32" || d == "U32") return 4;
  if (d == "F16" || d == "BF16" || d == "I16" || d == "U16") return 2;
  if (d == "I8" || d == "U8" || d == "BOOL") return 1;
  return 0;
}

int64_t SafetensorInfo::Numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

Status ParseSafetensorsHeader(const std::string& what, const std::string& text, uint64_t data_bytes,
                              std::vector<SafetensorInfo>* tensors,
                              std::map<std::string, std::string>* metadata) {
  auto j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return Bad(what, "the header is not valid JSON");
  if (!j.is_object()) return Bad(what, "the header is not a JSON object");
  tensors->clear();
  metadata->clear();
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& name = it.key();
    const auto& v = it.value();
    if (name == "__metadata__") {
      if (!v.is_object()) return Bad(what, "__metadata__ is not an object");
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string())
          return Bad(what, "__metadata__ value of \"" + m.key() + "\" is not a string");
        (*metadata)[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    const std::string t = "tensor \"" + name + "\"";
    if (!v.is_object()) return Bad(what, t + " is not an object");
    if (!v.contains("dtype") || !v["dtype"].is_string()) return Bad(what, t + " has no dtype");
    if (!v.contains("shape") || !v["shape"].is_array()) return Bad(what, t + " has no shape");
    if (!v.contains("data_offsets") || !v["data_offsets"].is_array() ||
        v["data_offsets"].size() != 2)
      return Bad(what, t + " has no [begin, end] data_offsets");
    SafetensorInfo info;
    info.name = name;
    info.dtype = v["dtype"].get<std::string>();
    const int elem = SafetensorsDtypeBytes(info.dtype);
    if (elem == 0) return Bad(what, t + " has unknown dtype \"" + info.dtype + "\"");
    uint64_t numel = 1;
    for (const auto& d : v["shape"]) {
      if (!d.is_number_integer() || d.get<int64_t>() < 0)
        return Bad(what, t + " has a negative or non-integer dimension");
      const uint64_t dim = d.get<uint64_t>();
      if (dim != 0 && numel > (uint64_t{1} << 62) / dim)
        return Bad(what, t + " has a shape whose size overflows");
      numel *= dim;
      info.shape.push_back(static_cast<int64_t>(dim));
    }
    for (const auto& o : v["data_offsets"])
      if (!o.is_number_unsigned())
        return Bad(what, t + " has a negative or non-integer data offset");
    info.begin = v["data_offsets"][0].get<uint64_t>();
    info.end = v["data_offsets"][1].get<uint64_t>();
    if (info.begin > info.end || info.end > data_bytes)
      return Bad(what, t + " has data_offsets [" + std::to_string(info.begin) + ", " +
                           std::to_string(info.end) + "] outside the " +
                           std::to_string(data_bytes) + "-byte data region (truncated file?)");
    if (numel * static_cast<uint64_t>(elem) != info.end - info.begin)
      return Bad(what, t + " has shape and dtype worth " +
                           std::to_string(numel * static_cast<uint64_t>(elem)) +
                           " bytes but data_offsets span " + std::to_string(info.end - info.begin));
    tensors->push_back(std::move(info));
  }
  // The ranges must tile the data region: no overlap, no hole, nothing past the end.
  std::vector<const SafetensorInfo*> by_offset;
  for (const auto& t : *tensors) by_offset.push_back(&t);
  std::sort(by_offset.begin(), by_offset.end(), [](auto* a, auto* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
  });
  uint64_t pos = 0;
  for (const auto* t : by_offset) {
    if (t->begin < pos)
      return Bad(what, "tensor \"" + t->name + "\" overlaps another tensor's data");
    if (t->begin > pos)
      return Bad(what, "bytes [" + std::to_string(pos) + ", " + std::to_string(t->begin) +
                           ") of the data region belong to no tensor");
    pos = t->end;
  }
  if (pos != data_bytes)
    return Bad(what, "the data region has " + std::to_string(data_bytes - pos) +
                         " trailing bytes no tensor uses");
  std::sort(tensors->begin(), tensors->end(),
            [](const auto& a, const auto& b) { return a.name < b.name; });
  return Status::Ok();
}

StatusOr<SafetensorsFile> SafetensorsFile::Open(const std::string& path) {
  RP_ASSIGN_OR_RETURN(MappedFile file, MappedFile::Open(path, "safetensors"));
  const uint64_t size = file.size();
  if (size < 8)
    return Bad(path, "shorter than the 8-byte header length (truncated or not safetensors)");
  SafetensorsFile f;
  f.path_ = path;
  f.file_ = std::move(file);
  const uint8_t* bytes = f.file_.data();
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | bytes[i];
  if (n > kMaxHeaderBytes)
    return Bad(path, "header length " + std::to_string(n) + " exceeds the 100 MiB limit");
  if (n > size - 8)
    return Bad(path, "header length " + std::to_string(n) + " runs past the end of the " +
                         std::to_string(size) + "-byte file (truncated?)");
  const std::string header(reinterpret_cast<const char*>(bytes + 8), n);
  RP_RETURN_IF_ERROR(ParseSafetensorsHeader(path, header, size - 8 - n, &f.tensors_, &f.metadata_));
  f.data_ = bytes + 8 + n;
  return f;
}

const SafetensorInfo* SafetensorsFile::Find(const std::string& name) const {
  auto it =
      std::lower_bound(tensors_.begin(), tensors_.end(), name,
                       [](const SafetensorInfo& t, const std::string& n) { return t.name < n; });
  return it != tensors_.end() && it->name == name ? &*it : nullptr;
}

Status SafetensorsFile::ReadAsFloat(const SafetensorInfo& t, float* out) const {
  const uint8_t* p = Data(t);
  const int64_t n = t.Numel();
  if (t.dtype != "F32" && t.dtype != "BF16" && t.dtype != "F16")
    return Bad(path_, "tensor \"" + t.name + "\" has dtype " + t.dtype +
                          ", not a floating type (F32, BF16, F16)");
  // A large model's checkpoint is tens of GB read once at start-up: every core takes chunks of
  // each tensor (the mapped file's page faults and the conversion both spread), each element
  // converted on its own, so the result does not depend on the split.
  constexpr int64_t kChunk = int64_t{1} << 20;
  const int threads = n >= 4 * kChunk ? UsableCores() : 1;
  const bool f32 = t.dtype == "F32", bf16 = t.dtype == "BF16";
  ParallelFor((n + kChunk - 1) / kChunk, threads, [&](int64_t c) {
    const int64_t begin = c * kChunk, end = std::min(n, begin + kChunk);
    if (f32) {
      std::memcpy(out + begin, p + 4 * begin, static_cast<size_t>(end - begin) * 4);
    } else if (bf16) {
      for (int64_t i = begin; i < end; ++i) {
        uint16_t h;
        std::memcpy(&h, p + 2 * i, 2);
        const uint32_t bits = static_cast<uint32_t>(h) << 16;
        std::memcpy(out + i, &bits, 4);
      }
    } else {
      for (int64_t i = begin; i < end; ++i) {
        uint16_t h;
        std::memcpy(&h, p + 2 * i, 2);
        out[i] = HalfToFloat(h);
      }
    }
  });
  return Status::Ok();
}

Status WriteSafetensors(const std::string& path, const std::vector<SafetensorToWrite>& tensors,
                        const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const auto& t : tensors) {
    const int elem = SafetensorsDtypeBytes(t.dtype);
    uint64_t numel = 1;
    for (int64_t d : t.shape) numel *= static_cast<uint64_t>(d);
    if (elem == 0 || numel * static_cast<uint64_t>(elem) != t.bytes)
      return Status::InvalidArgument("writing " + path + ": tensor \"" + t.name + "\" has " +
                                     std::to_string(t.bytes) + " bytes, not its shape and dtype's");
    header[t.name] = {
        {"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {offset, offset + t.bytes}}};
    offset += t.bytes;
  }
  std::string text = header.dump();
  text.resize((text.size() + 7) / 8 * 8, ' ');
  uint8_t length[8];
  for (int i = 0; i < 8; ++i) length[i] = static_cast<uint8_t>((text.size() >> (8 * i)) & 0xff);
  // Streamed tensor by tensor: no second copy of the model in memory.
  RP_ASSIGN_OR_RETURN(AtomicFile f, AtomicFile::Create(path));
  RP_RETURN_IF_ERROR(f.Append(length, 8));
  RP_RETURN_IF_ERROR(f.Append(text.data(), text.size()));
  for (const auto& t : tensors) RP_RETURN_IF_ERROR(f.Append(t.data, t.bytes));
  return f.Commit();
}

}  // namespace rp::core
