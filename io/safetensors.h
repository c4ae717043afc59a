// SPDX-License-Identifier: Apache-2.0
// The safetensors format (Hugging Face checkpoints, PEFT adapters), read and written by the
// project itself.
//
// Layout of a file: 8 bytes little-endian N; N bytes of UTF-8 JSON mapping tensor names to
// {"dtype", "shape", "data_offsets": [begin, end]} (offsets relative to the byte after the
// header), plus an optional "__metadata__" object of strings; then the raw little-endian data.
//
// Contract:
//  * SafetensorsFile::Open() maps the file read-only and validates everything before returning:
//    header length within the file and at most kMaxHeaderBytes; JSON an object; known dtypes;
//    non-negative shapes whose element count times the dtype's size equals the byte range (with
//    overflow checks); ranges inside the data region, not overlapping, and together covering it
//    exactly. Every rejection is InvalidArgument naming the file and the problem. Nothing on
//    disk is modified.
//  * Tensor data is read through the mapping (no copy of the file); the mapping lives as long as
//    the SafetensorsFile (move-only RAII owner).
//  * WriteSafetensors() writes tensors in the given order, the header padded with spaces to a
//    multiple of 8, atomically (temporary name in the same directory, fsync, rename).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/mapped_file.h"
#include "common/status.h"

namespace rp::core {

inline constexpr uint64_t kMaxHeaderBytes = 100ull << 20;

struct SafetensorInfo {
  std::string name;
  std::string dtype;  // "F32", "BF16", "F16", "F64", "I64", "I32", "I16", "I8", "U8", "BOOL"
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  // byte range inside the data region
  int64_t Numel() const;
};

// Bytes per element of a safetensors dtype name, or 0 if unknown.
int SafetensorsDtypeBytes(const std::string& dtype);

class SafetensorsFile {
 public:
  static StatusOr<SafetensorsFile> Open(const std::string& path);
  SafetensorsFile(SafetensorsFile&&) noexcept = default;
  SafetensorsFile& operator=(SafetensorsFile&&) noexcept = default;

  const std::string& path() const { return path_; }
  const std::vector<SafetensorInfo>& tensors() const { return tensors_; }  // by name
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const SafetensorInfo* Find(const std::string& name) const;
  const uint8_t* Data(const SafetensorInfo& t) const { return data_ + t.begin; }
  // Converts a floating tensor (F32, BF16, F16) to fp32 into `out` (Numel() floats).
  Status ReadAsFloat(const SafetensorInfo& t, float* out) const;

 private:
  SafetensorsFile() = default;
  std::string path_;
  MappedFile file_;
  const uint8_t* data_ = nullptr;  // inside file_'s mapping, which a move keeps in place
  std::vector<SafetensorInfo> tensors_;
  std::map<std::string, std::string> metadata_;
};

// Parses and validates a header (the JSON text) against a data region of `data_bytes` bytes.
// Exposed for the fuzz test; `what` names the file in errors.
Status ParseSafetensorsHeader(const std::string& what, const std::string& json, uint64_t data_bytes,
                              std::vector<SafetensorInfo>* tensors,
                              std::map<std::string, std::string>* metadata);

struct SafetensorToWrite {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
  const void* data;
  uint64_t bytes;
};
Status WriteSafetensors(const std::string& path, const std::vector<SafetensorToWrite>& tensors,
                        const std::map<std::string, std::string>& metadata = {});

// fp32 to bfloat16 / IEEE half, rounded to nearest even as torch's .to() rounds (NaN stays NaN,
// beyond the range gives infinity), for n values.
void FloatToBf16(const float* in, int64_t n, uint16_t* out);
void FloatToHalf(const float* in, int64_t n, uint16_t* out);

}  // namespace rp::core
