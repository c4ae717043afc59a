// SPDX-License-Identifier: Apache-2.0
// TensorBoard event files for a run's per-step scalars (metrics.tensorboard).
//
// Contract:
//  * The file is TensorBoard's record format: for each record, its length (uint64, little
//    endian), the masked CRC-32C of those 8 bytes, the serialized Event, the masked CRC-32C of the
//    Event. The first record of a file is an Event with file_version "brain.Event:2".
//  * What TensorBoard shows is decided once, by TensorBoardScalars(): every number of a
//    metrics.jsonl line that has a tag (see kScalarTags in tensorboard.cc) becomes a scalar of the
//    line's step, with the line's "time" as the event's wall time. A metrics.jsonl line and its
//    event therefore hold the same values (as float32, TensorBoard's scalar type).
//  * Each Append() writes one Event and leaves it in the kernel's hands (a crash loses at most the
//    step being written, as metrics.jsonl).
//  * Rebuild() is for --resume: it writes a new event file holding the events of every line of
//    metrics.jsonl (already cut back to the checkpoint's step), and only once that file is complete
//    removes the directory's older event files, so steps a resumed run repeats appear once.
//  * One owner of the descriptor; never throws.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/status.h"
#include "common/unique_fd.h"

namespace rp::core {

// CRC-32C (Castagnoli), and TensorBoard's mask of it: rotate right by 15, add 0xa282ead8.
uint32_t Crc32c(const void* data, size_t bytes);
uint32_t MaskedCrc32c(const void* data, size_t bytes);

// The scalars one metrics.jsonl line gives TensorBoard: (tag, value), in the table's order.
// Non-numeric and null values are skipped (a skipped fp16 step has no gradient norm).
std::vector<std::pair<std::string, float>> TensorBoardScalars(const nlohmann::json& metrics_line);

class TensorBoardWriter {
 public:
  // A new event file in `dir` (created if missing).
  static StatusOr<TensorBoardWriter> Create(const std::string& dir);
  // A new event file in `dir` that starts with the events of every line of `metrics_jsonl`; the
  // directory's other event files are removed once it is complete.
  static StatusOr<TensorBoardWriter> Rebuild(const std::string& dir,
                                             const std::string& metrics_jsonl);

  TensorBoardWriter(TensorBoardWriter&&) noexcept = default;
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;

  // One metrics.jsonl line (needs "step"; "time" becomes the wall time, now when absent).
  Status Append(const nlohmann::json& metrics_line);
  const std::string& path() const { return path_; }

 private:
  TensorBoardWriter(UniqueFd fd, std::string path) : fd_(std::move(fd)), path_(std::move(path)) {}
  Status WriteRecord(const std::string& bytes);
  UniqueFd fd_;
  std::string path_;
};

}  // namespace rp::core
