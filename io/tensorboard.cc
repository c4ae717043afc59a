// SPDX-License-Identifier: Apache-2.0
#include "io/tensorboard.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <filesystem>
#include <fstream>

#include <boost/crc.hpp>

#include "io/tensorboard_event.pb.h"

namespace rp::core {

namespace fs = std::filesystem;

namespace {

// metrics.jsonl key -> TensorBoard tag. The tag keeps the key after its group, so a reader can
// map every scalar back to the metrics.jsonl field it came from.
struct ScalarTag {
  const char* key;
  const char* tag;
};
constexpr ScalarTag kScalarTags[] = {
    {"loss", "train/loss"},
    {"eval_loss", "eval/eval_loss"},
    {"lr", "train/lr"},
    {"grad_norm", "train/grad_norm"},
    {"loss_scale", "train/loss_scale"},
    {"tokens_per_s", "speed/tokens_per_s"},
    {"step_time_s", "speed/step_time_s"},
    {"bubble_ratio", "speed/bubble_ratio"},
    {"h2d_gb_per_s", "speed/h2d_gb_per_s"},
    {"device_peak_gib", "memory/device_peak_gib"},
    {"host_gib", "memory/host_gib"},
};

double NowSeconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::string EventFileName() {
  char host[256] = {};
  if (::gethostname(host, sizeof(host) - 1) != 0) std::snprintf(host, sizeof(host), "host");
  return "events.out.tfevents." + std::to_string(static_cast<int64_t>(NowSeconds())) + "." + host +
         "." + std::to_string(::getpid());
}

std::string Framed(const std::string& data) {
  std::string out;
  const uint64_t len = data.size();
  char len_bytes[8];
  for (int i = 0; i < 8; ++i) len_bytes[i] = static_cast<char>((len >> (8 * i)) & 0xff);
  auto put32 = [&out](uint32_t v) {
    for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  };
  out.append(len_bytes, 8);
  put32(MaskedCrc32c(len_bytes, 8));
  out += data;
  put32(MaskedCrc32c(data.data(), data.size()));
  return out;
}

std::string VersionRecord() {
  tensorboard::Event e;
  e.set_wall_time(NowSeconds());
  e.set_file_version("brain.Event:2");
  return Framed(e.SerializeAsString());
}

StatusOr<std::string> StepRecord(const nlohmann::json& line) {
  if (!line.is_object() || !line.contains("step") || !line["step"].is_number_integer())
    return Status::InvalidArgument("tensorboard: a metrics line without an integer \"step\"");
  tensorboard::Event e;
  e.set_step(line["step"].get<int64_t>());
  e.set_wall_time(line.contains("time") && line["time"].is_number() ? line["time"].get<double>()
                                                                    : NowSeconds());
  auto* summary = e.mutable_summary();
  for (const auto& [tag, value] : TensorBoardScalars(line)) {
    auto* v = summary->add_value();
    v->set_tag(tag);
    v->set_simple_value(value);
  }
  return Framed(e.SerializeAsString());
}

Status WriteAll(int fd, const std::string& bytes, const std::string& path) {
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return Status::FromErrno("writing " + path, errno);
    done += static_cast<size_t>(n);
  }
  return Status::Ok();
}

}  // namespace

uint32_t Crc32c(const void* data, size_t bytes) {
  boost::crc_optimal<32, 0x1EDC6F41, 0xFFFFFFFF, 0xFFFFFFFF, true, true> crc;
  crc.process_bytes(data, bytes);
  return crc.checksum();
}

uint32_t MaskedCrc32c(const void* data, size_t bytes) {
  const uint32_t c = Crc32c(data, bytes);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

std::vector<std::pair<std::string, float>> TensorBoardScalars(const nlohmann::json& line) {
  std::vector<std::pair<std::string, float>> out;
  for (const auto& s : kScalarTags) {
    const auto it = line.find(s.key);
    if (it == line.end() || !it->is_number()) continue;
    out.emplace_back(s.tag, static_cast<float>(it->get<double>()));
  }
  return out;
}

StatusOr<TensorBoardWriter> TensorBoardWriter::Create(const std::string& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return Status::IoError("metrics.tensorboard: cannot create " + dir + ": " + ec.message());
  const std::string path = (fs::path(dir) / EventFileName()).string();
  UniqueFd fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_APPEND | O_CLOEXEC, 0644));
  if (fd.get() < 0) return Status::FromErrno("creating " + path, errno);
  TensorBoardWriter w(std::move(fd), path);
  RP_RETURN_IF_ERROR(w.WriteRecord(VersionRecord()));
  return w;
}

StatusOr<TensorBoardWriter> TensorBoardWriter::Rebuild(const std::string& dir,
                                                       const std::string& metrics_jsonl) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return Status::IoError("metrics.tensorboard: cannot create " + dir + ": " + ec.message());
  std::string bytes = VersionRecord();
  {
    std::ifstream in(metrics_jsonl);
    if (!in) return Status::IoError("tensorboard: cannot read " + metrics_jsonl);
    std::string text;
    while (std::getline(in, text)) {
      const auto line = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
      if (line.is_discarded() || !line.is_object() || !line.contains("step"))
        continue;  // a torn last line
      RP_ASSIGN_OR_RETURN(auto record, StepRecord(line));
      bytes += record;
    }
  }
  // Complete under a name TensorBoard does not read, then renamed: a crash leaves the old files.
  const std::string path = (fs::path(dir) / EventFileName()).string();
  const std::string tmp = (fs::path(dir) / (".rebuilding." + std::to_string(::getpid()))).string();
  {
    UniqueFd out(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
    if (out.get() < 0) return Status::FromErrno("creating " + tmp, errno);
    Status s = WriteAll(out.get(), bytes, tmp);
    if (s.ok() && ::fsync(out.get()) != 0) s = Status::FromErrno("fsync " + tmp, errno);
    if (s.ok() && ::rename(tmp.c_str(), path.c_str()) != 0)
      s = Status::FromErrno("renaming " + tmp, errno);
    if (!s.ok()) {
      ::unlink(tmp.c_str());
      return s;
    }
  }
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (entry.path().string() != path && name.find("tfevents") != std::string::npos &&
        entry.is_regular_file(ec))
      fs::remove(entry.path(), ec);
  }
  UniqueFd fd(::open(path.c_str(), O_WRONLY | O_APPEND | O_CLOEXEC));
  if (fd.get() < 0) return Status::FromErrno("opening " + path + " to append", errno);
  return TensorBoardWriter(std::move(fd), path);
}

Status TensorBoardWriter::Append(const nlohmann::json& line) {
  RP_ASSIGN_OR_RETURN(auto record, StepRecord(line));
  return WriteRecord(record);
}

Status TensorBoardWriter::WriteRecord(const std::string& bytes) {
  return WriteAll(fd_.get(), bytes, path_);
}

}  // namespace rp::core
