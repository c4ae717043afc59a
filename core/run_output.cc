// SPDX-License-Identifier: Apache-2.0
#include "core/run_output.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

namespace rp::core {

namespace fs = std::filesystem;

Status CheckOutputDir(const JobConfig& c) {
  std::error_code ec;
  const fs::path dir(c.job.output_dir);
  if (fs::exists(dir, ec) && !fs::is_directory(dir, ec))
    return Status::InvalidArgument("job.output_dir: " + dir.string() + " exists and is not a directory");
  for (const char* name : {"metrics.jsonl", "summary.json"})
    if (fs::exists(dir / name, ec))
      return Status::InvalidArgument("job.output_dir: " + (dir / name).string() +
                                     " holds a previous run's metrics; choose another output_dir "
                                     "or move it away (nothing is overwritten)");
  if (fs::exists(dir / c.checkpoint.dir, ec) && !fs::is_empty(dir / c.checkpoint.dir, ec))
    return Status::InvalidArgument("job.output_dir: " + (dir / c.checkpoint.dir).string() +
                                   " holds a previous run's checkpoints");
  return Status::Ok();
}

Status PrepareOutputDir(const JobConfig& c) {
  RP_RETURN_IF_ERROR(CheckOutputDir(c));
  std::error_code ec;
  fs::create_directories(c.job.output_dir, ec);
  if (ec) return Status::IoError("job.output_dir: cannot create " + c.job.output_dir + ": " + ec.message());
  return Status::Ok();
}

Status PrepareOutputDirForResume(const JobConfig& c, int64_t steps_done) {
  const fs::path metrics = fs::path(c.job.output_dir) / "metrics.jsonl";
  std::ifstream in(metrics);
  if (!in)
    return Status::InvalidArgument("--resume: " + metrics.string() + " does not exist; resume "
                                   "needs the output directory of the interrupted run");
  std::string kept, dropped, line;
  while (std::getline(in, line)) {
    auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || !j.contains("step") || !j["step"].is_number_integer()) continue;  // a torn last line
    (j["step"].get<int64_t>() <= steps_done ? kept : dropped) += line + "\n";
  }
  if (!dropped.empty())
    RP_RETURN_IF_ERROR(WriteFileAtomically(
        (fs::path(c.job.output_dir) / ("metrics.interrupted-" + std::to_string(steps_done) + ".jsonl")).string(),
        dropped));
  return WriteFileAtomically(metrics.string(), kept);
}

StatusOr<MetricsWriter> MetricsWriter::OpenForAppend(const std::string& path) {
  int fd = ::open(path.c_str(), O_WRONLY | O_APPEND | O_CLOEXEC);
  if (fd < 0) return Status::FromErrno("opening " + path + " to append", errno);
  std::FILE* f = ::fdopen(fd, "a");
  if (!f) {
    ::close(fd);
    return Status::FromErrno("fdopen " + path, errno);
  }
  return MetricsWriter(f);
}

StatusOr<MetricsWriter> MetricsWriter::Open(const std::string& path) {
  // O_EXCL: a second writer (or a stale file) is an error, never a silent truncate.
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) return Status::FromErrno("creating " + path, errno);
  std::FILE* f = ::fdopen(fd, "w");
  if (!f) {
    ::close(fd);
    return Status::FromErrno("fdopen " + path, errno);
  }
  return MetricsWriter(f);
}

MetricsWriter::~MetricsWriter() {
  if (f_) std::fclose(f_);
}

Status MetricsWriter::Append(const StepMetrics& m) {
  nlohmann::json j;
  j["step"] = m.step;
  j["loss"] = m.loss;
  j["lr"] = m.lr;
  j["grad_norm"] = m.grad_norm;
  j["tokens"] = m.tokens;
  j["step_time_s"] = m.step_time_s;
  j["tokens_per_s"] = m.step_time_s > 0 ? static_cast<double>(m.tokens) / m.step_time_s : 0.0;
  if (m.bubble_ratio >= 0) j["bubble_ratio"] = m.bubble_ratio;
  if (m.h2d_bytes >= 0) {
    j["h2d_bytes"] = m.h2d_bytes;
    if (m.step_time_s > 0) j["h2d_gb_per_s"] = static_cast<double>(m.h2d_bytes) / m.step_time_s / 1e9;
  }
  std::string line = j.dump() + "\n";
  if (std::fwrite(line.data(), 1, line.size(), f_) != line.size() || std::fflush(f_) != 0)
    return Status::FromErrno("writing metrics", errno);
  return Status::Ok();
}

Status WriteFileAtomically(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return Status::FromErrno("creating " + tmp, errno);
  size_t done = 0;
  while (done < text.size()) {
    ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      Status s = Status::FromErrno("writing " + tmp, errno);
      ::close(fd);
      ::unlink(tmp.c_str());
      return s;
    }
    done += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    Status s = Status::FromErrno("fsync " + tmp, errno);
    ::unlink(tmp.c_str());
    return s;
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    Status s = Status::FromErrno("renaming " + tmp + " to " + path, errno);
    ::unlink(tmp.c_str());
    return s;
  }
  return Status::Ok();
}

}  // namespace rp::core
