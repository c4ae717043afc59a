// SPDX-License-Identifier: Apache-2.0
#include "coordinator/training_state.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <chrono>
#include <thread>
#include <vector>

#include <zlib.h>
#include <nlohmann/json.hpp>

#include "common/rng.h"
#include "common/unique_fd.h"
#include "io/run_output.h"

namespace rp::coord {
namespace {

// Opens a checkpoint for reading: a regular file (a FIFO or a device in its place is refused,
// not waited on), never through a link planted in the checkpoint directory.
StatusOr<UniqueFd> OpenStateFile(const std::string& path) {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOFOLLOW));
  if (fd.get() < 0) return Status::FromErrno("opening " + path, errno);
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0 || !S_ISREG(st.st_mode))
    return Status::InvalidArgument("checkpoint " + path + " is not a regular file");
  return fd;
}


namespace fs = std::filesystem;
constexpr char kMagic[8] = {'R', 'P', 'S', 'T', 'A', 'T', 'E', '1'};
constexpr int kFormatVersion = 1;
constexpr uint64_t kAlign = 4096;
constexpr uint64_t kMaxHeader = 1 << 20;

uint64_t AlignUp(uint64_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

// Checksums: CRC-32 (zlib) of each 64 MiB chunk of a section, the chunks spread over
// threads so a 100 GB checkpoint is not held back by one core.
constexpr uint64_t kCrcChunk = uint64_t{64} << 20;

std::vector<uint32_t> ChunkCrcs(const uint8_t* data, uint64_t bytes, int max_threads = 0) {
  const uint64_t chunks = (bytes + kCrcChunk - 1) / kCrcChunk;
  std::vector<uint32_t> crcs(chunks);
  const uint64_t cores = max_threads > 0 ? static_cast<uint64_t>(max_threads) : std::max(1u, std::thread::hardware_concurrency());
  const uint64_t threads = std::min<uint64_t>(chunks, cores);
  auto work = [&](uint64_t t) {
    for (uint64_t c = t; c < chunks; c += threads) {
      // zlib's CRC-32 (the same polynomial and bits as Boost.CRC's crc_32_type, which earlier files
      // were checked with; about 9x faster per core).
      crcs[c] = static_cast<uint32_t>(
          crc32_z(crc32_z(0L, Z_NULL, 0), data + c * kCrcChunk, static_cast<size_t>(std::min(kCrcChunk, bytes - c * kCrcChunk))));
    }
  };
  std::vector<std::thread> pool;
  for (uint64_t t = 1; t < threads; ++t) pool.emplace_back(work, t);
  if (threads > 0) work(0);
  for (auto& th : pool) th.join();
  return crcs;
}

Status ReadAll(int fd, uint8_t* p, uint64_t n, uint64_t offset, const std::string& path) {
  while (n > 0) {
    const ssize_t r = ::pread(fd, p, std::min<uint64_t>(n, 1 << 30), static_cast<off_t>(offset));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return Status::FromErrno("reading " + path, errno);
    if (r == 0) return Status::InvalidArgument("checkpoint " + path + " is truncated");
    p += r;
    n -= static_cast<uint64_t>(r);
    offset += static_cast<uint64_t>(r);
  }
  return Status::Ok();
}

std::string FileName(int64_t steps_done) {
  char name[64];
  std::snprintf(name, sizeof(name), "step-%08lld.rpstate", static_cast<long long>(steps_done));
  return name;
}

// This writer's checkpoint names in `dir` (step-<8 digits>.rpstate), oldest first.
std::vector<std::string> ListStateFiles(const std::string& dir) {
  std::error_code ec;
  std::vector<std::string> names;
  if (!fs::is_directory(dir, ec)) return names;
  for (auto& e : fs::directory_iterator(dir, ec)) {
    const std::string n = e.path().filename().string();
    if (n.size() == FileName(0).size() && n.rfind("step-", 0) == 0 && e.path().extension() == ".rpstate")
      names.push_back(n);
  }
  std::sort(names.begin(), names.end());
  return names;
}

// Parses the header of `path`; InvalidArgument naming the file when it is not a checkpoint.
StatusOr<nlohmann::json> ReadHeader(int fd, const std::string& path, uint64_t file_bytes) {
  uint8_t head[16];
  if (file_bytes < 16) return Status::InvalidArgument("checkpoint " + path + " is truncated (no header)");
  RP_RETURN_IF_ERROR(ReadAll(fd, head, 16, 0, path));
  if (std::memcmp(head, kMagic, 8) != 0)
    return Status::InvalidArgument("checkpoint " + path + " does not start with RPSTATE1");
  uint64_t len;
  std::memcpy(&len, head + 8, 8);
  if (len == 0 || len > kMaxHeader || 16 + len > file_bytes)
    return Status::InvalidArgument("checkpoint " + path + " has a bad header length " + std::to_string(len));
  std::string text(len, '\0');
  RP_RETURN_IF_ERROR(ReadAll(fd, reinterpret_cast<uint8_t*>(text.data()), len, 16, path));
  auto j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object() || !j.contains("steps_done") || !j.contains("sections") ||
      !j.contains("state_hash") || !j["sections"].is_array())
    return Status::InvalidArgument("checkpoint " + path + " has a malformed JSON header");
  if (j.value("version", 0) != kFormatVersion)
    return Status::InvalidArgument("checkpoint " + path + " has format version " +
                                   std::to_string(j.value("version", 0)) + ", this build reads " +
                                   std::to_string(kFormatVersion));
  return j;
}

}  // namespace

std::vector<StateSection> CheckpointSections(const shm::ArenaLayout& layout, uint8_t* optim, uint8_t* state) {
  const uint64_t region = layout.compute_end - layout.compute_begin;
  return {{"optim", optim, layout.optim_total_bytes},
          {"compute", state ? state + layout.compute_begin : nullptr,
           region * static_cast<uint64_t>(layout.compute_buffers)}};
}

uint64_t TrainingStateHash(const core::JobConfig& c, const core::ModelSpec& spec,
                           const shm::ArenaLayout& layout) {
  uint64_t h = HashKey({0x5741u, static_cast<uint64_t>(layout.compute_elem_bytes),
                        static_cast<uint64_t>(layout.compute_buffers), layout.optim_total_bytes,
                        layout.compute_end - layout.compute_begin});
  // Mixed in only when set, so checkpoints written before the choice existed (compute copies)
  // keep their hash; ReadTrainingState names this mismatch on its own.
  if (layout.masters_in_state) h = HashKey({h, 0x4d41u});
  for (const auto& p : spec.params) {
    for (char ch : p.name) h = SplitMix64(h ^ static_cast<uint8_t>(ch));
    h = HashKey({h, static_cast<uint64_t>(p.numel)});
  }
  // The modes' job-file spellings, so checkpoints keep the hash they were written with.
  for (const std::string s : {core::EnumName(c.optimizer.name), core::EnumName(c.optimizer.mode)})
    for (char ch : s) h = SplitMix64(h ^ static_cast<uint8_t>(ch));
  if (!spec.frozen.empty()) {
    // LoRA: the checkpoint leaves the base out; resuming reloads it from the same source, so the
    // source (checkpoint path, or the seed of a random base) must be the same.
    for (const auto& p : spec.frozen) {
      for (char ch : p.name) h = SplitMix64(h ^ static_cast<uint8_t>(ch));
      h = HashKey({h, 0xF0u, static_cast<uint64_t>(p.numel)});
    }
    for (char ch : c.model.path) h = SplitMix64(h ^ static_cast<uint8_t>(ch));
    uint64_t alpha_bits = 0;  // a different alpha is a different model for the same adapters
    std::memcpy(&alpha_bits, &c.lora.alpha, sizeof(alpha_bits));
    h = HashKey({h, alpha_bits});
    if (c.model.path.empty()) h = HashKey({h, static_cast<uint64_t>(c.train.seed)});
  }
  return h;
}

std::string CheckpointDir(const core::JobConfig& c) {
  return (fs::path(c.job.output_dir) / c.checkpoint.dir).string();
}

Status WriteTrainingState(const std::string& dir, int64_t steps_done, uint64_t state_hash,
                          bool masters_in_state, const std::vector<StateSection>& sections, int keep,
                          int checksum_threads, WriteStats* stats) {
  const auto t0 = std::chrono::steady_clock::now();
  auto since = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); };
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return Status::IoError("checkpoint directory " + dir + ": " + ec.message());
  nlohmann::json header = {{"version", kFormatVersion}, {"steps_done", steps_done},
                           {"state_hash", std::to_string(state_hash)},
                           {"masters_in_state", masters_in_state}};
  // Offsets depend on the header's length, which depends on the offsets' digits: reserve room.
  uint64_t offset = AlignUp(16 + 4096 + 128 * sections.size());
  nlohmann::json list = nlohmann::json::array();
  for (const auto& s : sections) {
    list.push_back({{"name", s.name}, {"offset", offset}, {"bytes", s.bytes},
                    {"crc32_chunk_bytes", kCrcChunk}, {"crc32", ChunkCrcs(s.data, s.bytes, checksum_threads)}});
    offset = AlignUp(offset + s.bytes);
  }
  if (stats) stats->checksum_s = since();
  header["sections"] = list;
  const std::string text = header.dump();
  const std::string final_path = (fs::path(dir) / FileName(steps_done)).string();
  {
    RP_ASSIGN_OR_RETURN(core::AtomicFile f, core::AtomicFile::Create(final_path, 0600));
    uint8_t head[16];
    std::memcpy(head, kMagic, 8);
    const uint64_t len = text.size();
    std::memcpy(head + 8, &len, 8);
    RP_RETURN_IF_ERROR(f.Append(head, 16));
    RP_RETURN_IF_ERROR(f.Append(text.data(), len));
    for (size_t i = 0; i < sections.size(); ++i)
      RP_RETURN_IF_ERROR(f.WriteAt(list[i]["offset"].get<uint64_t>(), sections[i].data, sections[i].bytes));
    RP_RETURN_IF_ERROR(f.Truncate(offset));
    RP_RETURN_IF_ERROR(f.Commit());
  }
  if (stats) {
    stats->total_s = since();
    stats->bytes = 0;
    for (const auto& sec : sections) stats->bytes += sec.bytes;
  }
  // Prune: only this writer's step-*.rpstate names, oldest first, never the one just written.
  const std::vector<std::string> names = ListStateFiles(dir);
  for (size_t i = 0; keep > 0 && i + static_cast<size_t>(keep) < names.size(); ++i)
    if (names[i] != FileName(steps_done)) fs::remove(fs::path(dir) / names[i], ec);
  return Status::Ok();
}

StatusOr<StateFile> FindLatestTrainingState(const std::string& dir) {
  const std::vector<std::string> names = ListStateFiles(dir);
  if (names.empty()) return Status::NotFound("no training checkpoint (step-*.rpstate) in " + dir);
  const std::string path = (fs::path(dir) / names.back()).string();
  RP_ASSIGN_OR_RETURN(UniqueFd fd, OpenStateFile(path));
  std::error_code ec;
  const uint64_t size = fs::file_size(path, ec);
  RP_ASSIGN_OR_RETURN(auto header, ReadHeader(fd.get(), path, size));
  StateFile f;
  f.path = path;
  f.steps_done = header["steps_done"].get<int64_t>();
  if (f.steps_done <= 0) return Status::InvalidArgument("checkpoint " + path + " records no completed step");
  return f;
}

namespace {

// The header checks of ReadTrainingState; with `read` the sections' bytes are read and verified.
Status LoadTrainingState(const StateFile& file, uint64_t state_hash, bool masters_in_state,
                         const std::vector<StateSection>& sections, bool read) {
  RP_ASSIGN_OR_RETURN(UniqueFd fd, OpenStateFile(file.path));
  std::error_code ec;
  const uint64_t size = fs::file_size(file.path, ec);
  RP_ASSIGN_OR_RETURN(auto header, ReadHeader(fd.get(), file.path, size));
  const auto& written = header.contains("masters_in_state") ? header["masters_in_state"] : nlohmann::json(false);
  if (!written.is_boolean())
    return Status::InvalidArgument("checkpoint " + file.path + " has a malformed JSON header (masters_in_state)");
  if (written.get<bool>() != masters_in_state) {
    auto where = [](bool in_state) {
      return std::string(in_state ? "the fp32 masters workers fetch (schedule.weights_source = \"master\")"
                                  : "a compute copy beside the masters (schedule.weights_source = \"compute_copy\")");
    };
    return Status::InvalidArgument("checkpoint " + file.path + " holds " + where(written.get<bool>()) +
                                   ", this job keeps " + where(masters_in_state) +
                                   "; resume it with the checkpoint's setting");
  }
  if (header["state_hash"] != std::to_string(state_hash))
    return Status::InvalidArgument("checkpoint " + file.path + " was written for a different model, "
                                   "compute dtype, optimizer or optimizer mode than this job's");
  const auto& list = header["sections"];
  if (list.size() != sections.size())
    return Status::InvalidArgument("checkpoint " + file.path + " has " + std::to_string(list.size()) +
                                   " sections, expected " + std::to_string(sections.size()));
  for (size_t i = 0; i < sections.size(); ++i) {
    const auto& e = list[i];
    if (!e.is_object() || e.value("name", "") != sections[i].name || !e.contains("offset") ||
        !e["offset"].is_number_unsigned() || !e.contains("bytes") || !e["bytes"].is_number_unsigned())
      return Status::InvalidArgument("checkpoint " + file.path + ": section " + std::to_string(i) +
                                     " is not \"" + sections[i].name + "\"");
    const uint64_t off = e["offset"].get<uint64_t>(), bytes = e["bytes"].get<uint64_t>();
    if (bytes != sections[i].bytes)
      return Status::InvalidArgument("checkpoint " + file.path + ": section \"" + sections[i].name +
                                     "\" holds " + std::to_string(bytes) + " bytes, this job needs " +
                                     std::to_string(sections[i].bytes));
    if (off > size || bytes > size - off)
      return Status::InvalidArgument("checkpoint " + file.path + ": section \"" + sections[i].name +
                                     "\" runs past the end of the file (truncated?)");
    if (!read) continue;
    RP_RETURN_IF_ERROR(ReadAll(fd.get(), sections[i].data, bytes, off, file.path));
    // Files written before checksums existed have none; every newer one is verified.
    if (!e.contains("crc32")) continue;
    const auto& want = e["crc32"];
    if (!want.is_array() || e.value("crc32_chunk_bytes", uint64_t{0}) != kCrcChunk ||
        want.size() != (bytes + kCrcChunk - 1) / kCrcChunk)
      return Status::InvalidArgument("checkpoint " + file.path + ": section \"" + sections[i].name +
                                     "\" has a malformed checksum list");
    const std::vector<uint32_t> got = ChunkCrcs(sections[i].data, bytes);
    for (size_t c = 0; c < got.size(); ++c) {
      if (want[c].is_number_unsigned() && want[c].get<uint64_t>() == got[c]) continue;
      const uint64_t a = c * kCrcChunk, b = std::min(bytes, (c + 1) * kCrcChunk);
      const std::string what = sections[i].describe ? sections[i].describe(a, b) : std::string();
      return Status::InvalidArgument("checkpoint " + file.path + ": bytes [" + std::to_string(a) + ", " +
                                     std::to_string(b) + ") of section \"" + sections[i].name + "\"" +
                                     (what.empty() ? std::string() : " (" + what + ")") +
                                     " do not match their checksum: the file is damaged");
    }
  }
  // Nothing may follow the last section (the writer truncates the file there).
  uint64_t end = 0;
  for (const auto& e : list) end = std::max(end, AlignUp(e["offset"].get<uint64_t>() + e["bytes"].get<uint64_t>()));
  if (size != end)
    return Status::InvalidArgument("checkpoint " + file.path + " has " + std::to_string(size) + " bytes, its sections end at " +
                                   std::to_string(end) + ": bytes were appended or cut");
  return Status::Ok();
}

}  // namespace

Status ReadTrainingState(const StateFile& file, uint64_t state_hash, bool masters_in_state,
                         const std::vector<StateSection>& sections) {
  return LoadTrainingState(file, state_hash, masters_in_state, sections, /*read=*/true);
}

Status CheckTrainingState(const StateFile& file, uint64_t state_hash, bool masters_in_state,
                          const std::vector<StateSection>& sections) {
  return LoadTrainingState(file, state_hash, masters_in_state, sections, /*read=*/false);
}

}  // namespace rp::coord
