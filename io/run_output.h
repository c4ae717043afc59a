// SPDX-License-Identifier: Apache-2.0
// The run's output directory: metrics.jsonl (one JSON object per optimizer step) and
// summary.json. Shared by rp-coordinator and rp-train-ref so their files compare line by line.
//
// Contract: PrepareOutputDir() creates the directory if needed and refuses (InvalidArgument) one
// that already holds a previous run's metrics or checkpoints: nothing on disk is overwritten.
// Both checks (fresh and resume) refuse a symbolic link in place of any name the run writes in
// the directory (logs, metrics, summary, trace, profile, checkpoints, exports): a link planted
// there would send the run's writes somewhere else. The directory itself may be a link (the
// user's choice of where it lives).
// MetricsWriter flushes each line as it is written, so a crash loses at most the current step.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/status.h"
#include "common/unique_fd.h"
#include "config/job_config.h"

namespace rp::core {

Status CheckOutputDir(const JobConfig& config);  // no side effects
// Only the link check (what --resume needs of a directory that holds a run).
Status CheckNoPlantedLinks(const JobConfig& config);
Status PrepareOutputDir(const JobConfig& config);
// What --resume needs of the directory (no side effects): no planted links, and the interrupted
// run's metrics.jsonl.
Status CheckOutputDirForResume(const JobConfig& config);
// For --resume after `steps_done` steps: the directory must exist; metrics.jsonl keeps the lines
// of steps <= steps_done (rewritten atomically; the lines of later steps, which the resumed run
// recomputes, are kept in metrics.interrupted-<steps_done>.jsonl) and is then appended to.
Status PrepareOutputDirForResume(const JobConfig& config, int64_t steps_done);

struct StepMetrics {
  int64_t step = 0;  // 1-based: the number of optimizer updates applied after this step
  double loss = 0.0;
  double lr = 0.0;
  double grad_norm = 0.0;
  int64_t tokens = 0;
  double step_time_s = 0.0;
  double bubble_ratio = -1.0;  // omitted when < 0
  int64_t h2d_bytes = -1;      // host-to-device bytes the step's jobs read; omitted when < 0
  // Mean token cross-entropy of the eval set after this step's update (train.eval_every);
  // omitted when < 0.
  double eval_loss = -1.0;
  int64_t eval_tokens = 0;
  // fp16 (core::ScalesLoss): the scale the step's loss was multiplied by, and whether its
  // gradients were not all finite, so it updated nothing (grad_norm is then null); omitted when
  // loss_scale < 0.
  double loss_scale = -1.0;
  bool skipped = false;
  // Peak device memory held by tensors on any worker so far (CUDA workers), and the host memory the
  // run holds (its /dev/shm segments plus the coordinator's anonymous resident memory); written in
  // GiB as device_peak_gib and host_gib, omitted when < 0.
  int64_t device_peak_bytes = -1;
  int64_t host_bytes = -1;
  // Training checkpoints whose write completed since the previous line.
  struct Checkpoint {
    int64_t after_step = 0;
    uint64_t bytes = 0;
    double write_s = 0.0;     // checksums, writes, fsyncs and the rename
    double checksum_s = 0.0;  // of which the CRC-32s
    bool background = false;  // written from a copy off the coordinator's loop
  };
  std::vector<Checkpoint> checkpoints;
};

// A checkpoint record as metrics.jsonl and summary.json write it.
nlohmann::json CheckpointJson(const StepMetrics::Checkpoint& c);

// metrics.jsonl: one JSON object per step. Every line also holds "time" (Unix seconds, the wall
// clock when it was written) and "elapsed_s" (seconds since the writer was opened, plus, when
// appending, the last line's elapsed_s already in the file: a resumed run's clock continues).
class MetricsWriter {
 public:
  static StatusOr<MetricsWriter> Open(const std::string& path);
  // Appends to an existing file (resume).
  static StatusOr<MetricsWriter> OpenForAppend(const std::string& path);
  MetricsWriter(MetricsWriter&& o) noexcept
      : f_(o.f_), start_(o.start_), elapsed_before_(o.elapsed_before_) {
    o.f_ = nullptr;
  }
  MetricsWriter(const MetricsWriter&) = delete;
  MetricsWriter& operator=(const MetricsWriter&) = delete;
  ~MetricsWriter();
  // Writes one line; `line`, when given, receives the object written (what TensorBoard gets).
  Status Append(const StepMetrics& m, nlohmann::json* line = nullptr);

 private:
  explicit MetricsWriter(std::FILE* f, double elapsed_before = 0.0)
      : f_(f), start_(std::chrono::steady_clock::now()), elapsed_before_(elapsed_before) {}
  std::FILE* f_;
  std::chrono::steady_clock::time_point start_;
  double elapsed_before_;
};

// summary.json, with its room taken when the run starts: a disk that fills up during the run
// (checkpoints, trace.json) still gets the summary that says so. Reserve() writes a valid JSON
// placeholder ({"status": "running"} padded with spaces to `bytes`); Write() replaces it in
// place (pwrite, truncate to its length, fsync). Never throws; one owner of the descriptor.
class SummaryFile {
 public:
  static StatusOr<SummaryFile> Reserve(const std::string& path, size_t bytes = 64 << 10);
  Status Write(const std::string& json);

 private:
  explicit SummaryFile(UniqueFd fd, std::string path)
      : fd_(std::move(fd)), path_(std::move(path)) {}
  UniqueFd fd_;
  std::string path_;
};

// A file that appears under its final name only when complete: bytes go to a temporary name
// in the same directory; Commit() fsyncs, renames over `path` and fsyncs the directory, so a
// crash leaves the old file or the new one, never a torn one. Destroyed uncommitted (an error
// path), it removes the temporary file. Never throws; one owner of the descriptor.
class AtomicFile {
 public:
  static StatusOr<AtomicFile> Create(const std::string& path, int mode = 0644);
  AtomicFile(AtomicFile&& o) noexcept;
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;
  AtomicFile& operator=(AtomicFile&&) = delete;
  ~AtomicFile();
  // Writes at `offset` (sparse files allowed: the gaps read as zeros).
  Status WriteAt(uint64_t offset, const void* data, uint64_t bytes);
  // Appends after the last byte written by Append.
  Status Append(const void* data, uint64_t bytes);
  Status Truncate(uint64_t bytes);
  Status Commit();

 private:
  AtomicFile(std::string path, std::string tmp, int fd)
      : path_(std::move(path)), tmp_(std::move(tmp)), fd_(fd) {}
  std::string path_, tmp_;
  int fd_ = -1;
  uint64_t append_at_ = 0;
};

// Writes `text` to `path` atomically (an AtomicFile).
Status WriteFileAtomically(const std::string& path, const std::string& text);

}  // namespace rp::core
