// SPDX-License-Identifier: Apache-2.0
// A reader of TensorBoard event files for tests, written apart from the product's writer
// (io/tensorboard.cc) so that a mistake in one is not repeated in the other: its own bitwise
// CRC-32C and its own protobuf wire-format decoding, no protobuf library, no Boost.CRC.
//
// Contract:
//  * ReadEventFile() checks every record's two masked CRCs and decodes Event { wall_time = 1,
//    step = 2, file_version = 3, summary = 5 { value = 1 { tag = 1, simple_value = 2 } } },
//    skipping fields it does not know as the wire format allows. A summary value without
//    simple_value is malformed (TensorBoard would skip it).
//  * The first problem found stops the read and is described in `error` ("record 4: the data's
//    CRC does not match"); the events before it are kept.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace rp::testing {

uint32_t ReferenceCrc32c(const void* data, size_t bytes);

struct EventRecord {
  double wall_time = 0.0;
  int64_t step = 0;
  std::string file_version;                            // set on a file's first record only
  std::vector<std::pair<std::string, float>> scalars;  // (tag, simple_value)
};

struct EventFile {
  std::vector<EventRecord> events;
  std::string error;  // empty when the whole file read cleanly
};

EventFile ReadEventFile(const std::string& path);
EventFile ParseEventFile(const std::string& bytes);

// The run's TensorBoard directory against its metrics.jsonl: exactly one event file, whose first
// record names the format and whose other records are the lines of metrics.jsonl in order, each
// with the line's step and time and, for every numeric field of kTensorBoardFields, a scalar
// tagged "<group>/<field>" equal to the field as float32 (and no other scalar). Returns the
// first difference, or "" when they agree.
extern const char* const kTensorBoardFields[11];
std::string EventsMatchMetrics(const std::string& tb_dir, const std::string& metrics_jsonl);

}  // namespace rp::testing
