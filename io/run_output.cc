// SPDX-License-Identifier: Apache-2.0
#include "io/run_output.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

namespace rp::core {

namespace fs = std::filesystem;

Status CheckNoPlantedLinks(const JobConfig& c) {
  const fs::path dir(c.job.output_dir);
  std::vector<std::string> ours = {"logs",          "metrics.jsonl", "summary.json", "trace.json",
                                   "profile.json",  "run-spec.json", "job.toml",     "tb",
                                   c.checkpoint.dir};
  if (!c.checkpoint.export_hf.empty()) ours.push_back(c.checkpoint.export_hf);
  if (!c.lora.export_dir.empty()) ours.push_back(c.lora.export_dir);
  for (const auto& name : ours) {
    std::error_code ec;
    if (fs::is_symlink(dir / name, ec))
      return Status::InvalidArgument(
          "job.output_dir: " + (dir / name).string() +
          " is a symbolic link; the run writes there and does not follow links it did not "
          "create (remove it, or choose another output_dir)");
  }
  return Status::Ok();
}

Status CheckOutputDir(const JobConfig& c) {
  std::error_code ec;
  const fs::path dir(c.job.output_dir);
  if (fs::exists(dir, ec) && !fs::is_directory(dir, ec))
    return Status::InvalidArgument("job.output_dir: " + dir.string() +
                                   " exists and is not a directory");
  RP_RETURN_IF_ERROR(CheckNoPlantedLinks(c));
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
  if (ec)
    return Status::IoError("job.output_dir: cannot create " + c.job.output_dir + ": " +
                           ec.message());
  return Status::Ok();
}

Status CheckOutputDirForResume(const JobConfig& c) {
  RP_RETURN_IF_ERROR(CheckNoPlantedLinks(c));
  const fs::path metrics = fs::path(c.job.output_dir) / "metrics.jsonl";
  std::error_code ec;
  if (!fs::is_regular_file(metrics, ec))
    return Status::InvalidArgument("--resume: " + metrics.string() +
                                   " does not exist; resume "
                                   "needs the output directory of the interrupted run");
  return Status::Ok();
}

Status PrepareOutputDirForResume(const JobConfig& c, int64_t steps_done) {
  RP_RETURN_IF_ERROR(CheckOutputDirForResume(c));
  const fs::path metrics = fs::path(c.job.output_dir) / "metrics.jsonl";
  std::ifstream in(metrics);
  if (!in) return Status::IoError("--resume: cannot read " + metrics.string());
  std::string kept, dropped, line;
  while (std::getline(in, line)) {
    auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || !j.contains("step") || !j["step"].is_number_integer())
      continue;  // a torn last line
    (j["step"].get<int64_t>() <= steps_done ? kept : dropped) += line + "\n";
  }
  if (!dropped.empty())
    RP_RETURN_IF_ERROR(
        WriteFileAtomically((fs::path(c.job.output_dir) /
                             ("metrics.interrupted-" + std::to_string(steps_done) + ".jsonl"))
                                .string(),
                            dropped));
  return WriteFileAtomically(metrics.string(), kept);
}

StatusOr<MetricsWriter> MetricsWriter::OpenForAppend(const std::string& path) {
  // The clock continues from the last line that has one.
  double elapsed_before = 0.0;
  {
    std::ifstream in(path);
    std::string line;
    while (std::getline(in, line)) {
      const auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
      if (j.is_object() && j.contains("elapsed_s") && j["elapsed_s"].is_number())
        elapsed_before = j["elapsed_s"].get<double>();
    }
  }
  int fd = ::open(path.c_str(), O_WRONLY | O_APPEND | O_CLOEXEC);
  if (fd < 0) return Status::FromErrno("opening " + path + " to append", errno);
  std::FILE* f = ::fdopen(fd, "a");
  if (!f) {
    ::close(fd);
    return Status::FromErrno("fdopen " + path, errno);
  }
  return MetricsWriter(f, elapsed_before);
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

nlohmann::json CheckpointJson(const StepMetrics::Checkpoint& c) {
  return {{"after_step", c.after_step},
          {"bytes", c.bytes},
          {"write_s", c.write_s},
          {"checksum_s", c.checksum_s},
          {"background", c.background}};
}

Status MetricsWriter::Append(const StepMetrics& m, nlohmann::json* written) {
  nlohmann::json j;
  j["step"] = m.step;
  j["loss"] = m.loss;
  j["lr"] = m.lr;
  j["grad_norm"] = m.grad_norm;
  j["tokens"] = m.tokens;
  j["step_time_s"] = m.step_time_s;
  j["tokens_per_s"] = m.step_time_s > 0 ? static_cast<double>(m.tokens) / m.step_time_s : 0.0;
  if (m.bubble_ratio >= 0) j["bubble_ratio"] = m.bubble_ratio;
  if (m.eval_loss >= 0) {
    j["eval_loss"] = m.eval_loss;
    j["eval_tokens"] = m.eval_tokens;
  }
  if (m.h2d_bytes >= 0) {
    j["h2d_bytes"] = m.h2d_bytes;
    if (m.step_time_s > 0)
      j["h2d_gb_per_s"] = static_cast<double>(m.h2d_bytes) / m.step_time_s / 1e9;
  }
  if (m.loss_scale >= 0) {
    j["loss_scale"] = m.loss_scale;
    j["skipped"] = m.skipped;
  }
  constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
  if (m.device_peak_bytes >= 0)
    j["device_peak_gib"] = static_cast<double>(m.device_peak_bytes) / kGiB;
  if (m.host_bytes >= 0) j["host_gib"] = static_cast<double>(m.host_bytes) / kGiB;
  for (const auto& c : m.checkpoints) j["checkpoints"].push_back(CheckpointJson(c));
  const auto wall = std::chrono::system_clock::now().time_since_epoch();
  j["time"] =
      static_cast<double>(std::chrono::duration_cast<std::chrono::milliseconds>(wall).count()) /
      1e3;
  j["elapsed_s"] = elapsed_before_ +
                   std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  std::string line = j.dump() + "\n";
  if (std::fwrite(line.data(), 1, line.size(), f_) != line.size() || std::fflush(f_) != 0)
    return Status::FromErrno("writing metrics", errno);
  if (written) *written = std::move(j);
  return Status::Ok();
}

StatusOr<AtomicFile> AtomicFile::Create(const std::string& path, int mode) {
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, mode);
  if (fd < 0) return Status::FromErrno("creating " + tmp, errno);
  return AtomicFile(path, tmp, fd);
}

AtomicFile::AtomicFile(AtomicFile&& o) noexcept
    : path_(std::move(o.path_)), tmp_(std::move(o.tmp_)), fd_(o.fd_), append_at_(o.append_at_) {
  o.fd_ = -1;
  o.tmp_.clear();
}

AtomicFile::~AtomicFile() {
  if (fd_ >= 0) ::close(fd_);
  if (!tmp_.empty()) ::unlink(tmp_.c_str());
}

Status AtomicFile::WriteAt(uint64_t offset, const void* data, uint64_t bytes) {
  const auto* p = static_cast<const uint8_t*>(data);
  while (bytes > 0) {
    const ssize_t n =
        ::pwrite(fd_, p, std::min<uint64_t>(bytes, 1 << 30), static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return Status::FromErrno("writing " + tmp_, n < 0 ? errno : EIO);
    p += n;
    bytes -= static_cast<uint64_t>(n);
    offset += static_cast<uint64_t>(n);
  }
  return Status::Ok();
}

Status AtomicFile::Append(const void* data, uint64_t bytes) {
  RP_RETURN_IF_ERROR(WriteAt(append_at_, data, bytes));
  append_at_ += bytes;
  return Status::Ok();
}

Status AtomicFile::Truncate(uint64_t bytes) {
  if (::ftruncate(fd_, static_cast<off_t>(bytes)) != 0)
    return Status::FromErrno("sizing " + tmp_, errno);
  return Status::Ok();
}

Status AtomicFile::Commit() {
  if (::fsync(fd_) != 0) return Status::FromErrno("fsync " + tmp_, errno);
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) return Status::FromErrno("closing " + tmp_, errno);
  if (::rename(tmp_.c_str(), path_.c_str()) != 0)
    return Status::FromErrno("renaming " + tmp_ + " to " + path_, errno);
  tmp_.clear();  // nothing left to remove
  // The rename itself survives a crash only once the directory is synced.
  const std::string dir = std::filesystem::path(path_).parent_path().string();
  const int dfd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
  return Status::Ok();
}

Status WriteFileAtomically(const std::string& path, const std::string& text) {
  RP_ASSIGN_OR_RETURN(AtomicFile f, AtomicFile::Create(path));
  RP_RETURN_IF_ERROR(f.Append(text.data(), text.size()));
  return f.Commit();
}

}  // namespace rp::core

namespace rp::core {

StatusOr<SummaryFile> SummaryFile::Reserve(const std::string& path, size_t bytes) {
  UniqueFd fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0644));
  if (fd.get() < 0) return Status::IoError("creating " + path + ": " + std::strerror(errno));
  std::string placeholder = "{\"status\": \"running\"}\n";
  placeholder.resize(std::max(bytes, placeholder.size()), ' ');
  if (::pwrite(fd.get(), placeholder.data(), placeholder.size(), 0) !=
      static_cast<ssize_t>(placeholder.size()))
    return Status::IoError("reserving " + std::to_string(bytes) + " bytes for " + path + ": " +
                           std::strerror(errno));
  return SummaryFile(std::move(fd), path);
}

Status SummaryFile::Write(const std::string& json) {
  if (::pwrite(fd_.get(), json.data(), json.size(), 0) != static_cast<ssize_t>(json.size()) ||
      ::ftruncate(fd_.get(), static_cast<off_t>(json.size())) != 0 || ::fsync(fd_.get()) != 0)
    return Status::IoError("writing " + path_ + ": " + std::strerror(errno));
  return Status::Ok();
}

}  // namespace rp::core
