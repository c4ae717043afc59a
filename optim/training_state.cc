// SPDX-License-Identifier: Apache-2.0
#include "optim/training_state.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <chrono>
#include <functional>
#include <map>
#include <thread>
#include <vector>

#include <zlib.h>
#include <nlohmann/json.hpp>

#include "common/rng.h"
#include "common/unique_fd.h"
#include "config/mode_key_access.h"
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

// The CRC-32 of each piece (offset from `base`, bytes), the pieces spread over threads.
std::vector<uint32_t> PieceCrcs(const uint8_t* base,
                                const std::vector<std::pair<uint64_t, uint64_t>>& pieces,
                                int max_threads = 0) {
  std::vector<uint32_t> crcs(pieces.size());
  const uint64_t cores = max_threads > 0 ? static_cast<uint64_t>(max_threads)
                                         : std::max(1u, std::thread::hardware_concurrency());
  const uint64_t threads = std::min<uint64_t>(pieces.size(), cores);
  auto work = [&](uint64_t t) {
    // zlib's CRC-32 (the same polynomial and bits as Boost.CRC's crc_32_type, which earlier files
    // were checked with; about 9x faster per core).
    for (uint64_t i = t; i < pieces.size(); i += threads)
      crcs[i] = static_cast<uint32_t>(crc32_z(crc32_z(0L, Z_NULL, 0), base + pieces[i].first,
                                              static_cast<size_t>(pieces[i].second)));
  };
  std::vector<std::thread> pool;
  for (uint64_t t = 1; t < threads; ++t) pool.emplace_back(work, t);
  if (threads > 0) work(0);
  for (auto& th : pool) th.join();
  return crcs;
}

std::vector<uint32_t> ChunkCrcs(const uint8_t* data, uint64_t bytes, int max_threads = 0) {
  std::vector<std::pair<uint64_t, uint64_t>> chunks;
  for (uint64_t at = 0; at < bytes; at += kCrcChunk)
    chunks.emplace_back(at, std::min(kCrcChunk, bytes - at));
  return PieceCrcs(data, chunks, max_threads);
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

std::string FileName(int64_t steps_done, ShardId shard = {}) {
  char name[96];
  if (shard.count > 1)
    std::snprintf(name, sizeof(name), "step-%08lld.shard-%d-of-%d.rpstate",
                  static_cast<long long>(steps_done), shard.rank, shard.count);
  else std::snprintf(name, sizeof(name), "step-%08lld.rpstate", static_cast<long long>(steps_done));
  return name;
}

// A shard file's name parsed (FileName with shard.count > 1); false for any other name.
bool ParseShardName(const std::string& n, int64_t* steps, ShardId* shard) {
  long long st = 0;
  int r = 0, c = 0, end = 0;
  if (std::sscanf(n.c_str(), "step-%8lld.shard-%d-of-%d.rpstate%n", &st, &r, &c, &end) != 3 ||
      end != static_cast<int>(n.size()) || c < 2 || r < 0 || r >= c || n != FileName(st, {r, c}))
    return false;
  *steps = st;
  *shard = {r, c};
  return true;
}

// Shard `shard`'s files in `dir`: (steps, path).
std::vector<std::pair<int64_t, std::string>> ShardFiles(const std::string& dir, ShardId shard) {
  std::error_code ec;
  std::vector<std::pair<int64_t, std::string>> files;
  if (!fs::is_directory(dir, ec)) return files;
  for (auto& e : fs::directory_iterator(dir, ec)) {
    int64_t st = 0;
    ShardId id;
    if (ParseShardName(e.path().filename().string(), &st, &id) && id.rank == shard.rank &&
        id.count == shard.count)
      files.emplace_back(st, e.path().string());
  }
  return files;
}

// Every complete checkpoint in `dir` by step: its files by shard (a whole file: one). Where a step
// has both a whole file and shard sets, or sets of several counts, the whole file wins, then the
// smallest complete count.
std::map<int64_t, std::vector<std::string>> CompleteCheckpoints(const std::string& dir) {
  std::error_code ec;
  std::map<int64_t, std::vector<std::string>> whole;
  std::map<int64_t, std::map<int, std::vector<std::string>>> sets;
  if (!fs::is_directory(dir, ec)) return whole;
  for (auto& e : fs::directory_iterator(dir, ec)) {
    const std::string n = e.path().filename().string();
    int64_t st = 0;
    ShardId id;
    if (n.size() == FileName(0).size() && n.rfind("step-", 0) == 0 &&
        e.path().extension() == ".rpstate") {
      long long v = 0;
      if (std::sscanf(n.c_str(), "step-%8lld.rpstate", &v) == 1) whole[v] = {e.path().string()};
    } else if (ParseShardName(n, &st, &id)) {
      auto& files = sets[st][id.count];
      files.resize(static_cast<size_t>(id.count));
      files[static_cast<size_t>(id.rank)] = e.path().string();
    }
  }
  for (auto& [st, counts] : sets) {
    if (whole.count(st)) continue;
    for (auto& [count, files] : counts)
      if (std::none_of(files.begin(), files.end(),
                       [](const std::string& f) { return f.empty(); })) {
        whole[st] = files;
        break;
      }
  }
  return whole;
}

// This writer's checkpoint names in `dir` (step-<8 digits>.rpstate), oldest first.
std::vector<std::string> ListStateFiles(const std::string& dir) {
  std::error_code ec;
  std::vector<std::string> names;
  if (!fs::is_directory(dir, ec)) return names;
  for (auto& e : fs::directory_iterator(dir, ec)) {
    const std::string n = e.path().filename().string();
    if (n.size() == FileName(0).size() && n.rfind("step-", 0) == 0 &&
        e.path().extension() == ".rpstate")
      names.push_back(n);
  }
  std::sort(names.begin(), names.end());
  return names;
}

// Parses the header of `path`; InvalidArgument naming the file when it is not a checkpoint.
StatusOr<nlohmann::json> ReadHeader(int fd, const std::string& path, uint64_t file_bytes) {
  uint8_t head[16];
  if (file_bytes < 16)
    return Status::InvalidArgument("checkpoint " + path + " is truncated (no header)");
  RP_RETURN_IF_ERROR(ReadAll(fd, head, 16, 0, path));
  if (std::memcmp(head, kMagic, 8) != 0)
    return Status::InvalidArgument("checkpoint " + path + " does not start with RPSTATE1");
  uint64_t len;
  std::memcpy(&len, head + 8, 8);
  if (len == 0 || len > kMaxHeader || 16 + len > file_bytes)
    return Status::InvalidArgument("checkpoint " + path + " has a bad header length " +
                                   std::to_string(len));
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

std::vector<StateSection> CheckpointSections(const shm::ArenaLayout& layout, uint8_t* optim,
                                             uint8_t* state) {
  const uint64_t region = layout.compute_end - layout.compute_begin;
  uint8_t* compute = state ? state + layout.compute_begin : nullptr;
  if (!layout.sharded) {
    std::vector<StateSection> out = {
        {"optim", optim, layout.optim_total_bytes},
        {"compute", compute, region * static_cast<uint64_t>(layout.compute_buffers)}};
    // fp16: the loss scaler's states (shm::LossScaleRecord), which a resume continues from.
    if (layout.loss_scaling != 0)
      out.push_back({"loss_scaling", state ? state + layout.loss_scaling : nullptr,
                     sizeof(shm::LossScaleRecord)});
    return out;
  }
  // Sharded: this node's shares of the compute copies (the other nodes' are theirs to write).
  StateSection shares("compute_shares", compute, 0);
  const uint64_t elem = static_cast<uint64_t>(layout.weights_elem_bytes);
  for (int b = 0; b < layout.compute_buffers; ++b)
    for (size_t p = 0; p < layout.share.size(); ++p) {
      const uint64_t n = static_cast<uint64_t>(layout.share[p].size()) * elem;
      if (n == 0) continue;
      shares.pieces.emplace_back(layout.ComputeCopy(static_cast<int>(p), b) - layout.compute_begin +
                                     static_cast<uint64_t>(layout.share[p].begin) * elem,
                                 n);
      shares.bytes += n;
    }
  return {{"optim", optim, layout.optim_total_bytes}, std::move(shares)};
}

uint64_t TrainingStateHash(const core::JobConfig& c, const core::ModelSpec& spec,
                           const shm::ArenaLayout& layout) {
  // The optimizer segment's size on one node: a checkpoint of shards resumes on any node count.
  const uint64_t optim_bytes =
      shm::ComputeOptimLayout(spec, layout.masters_in_state, c.optimizer.name, 1, 0).total_bytes;
  uint64_t h = HashKey({0x5741u, static_cast<uint64_t>(layout.compute_elem_bytes),
                        static_cast<uint64_t>(layout.compute_buffers), optim_bytes,
                        layout.compute_end - layout.compute_begin});
  // Mixed in only when set, so checkpoints written before the choice existed (compute copies)
  // keep their hash; ReadTrainingState names this mismatch on its own.
  if (layout.masters_in_state) h = HashKey({h, 0x4d41u});
  if (layout.loss_scaling != 0) h = HashKey({h, 0xF16u});  // fp16 and bf16 copies are both 2 bytes
  for (const auto& p : spec.params) {
    for (char ch : p.name) h = SplitMix64(h ^ static_cast<uint8_t>(ch));
    h = HashKey({h, static_cast<uint64_t>(p.numel)});
  }
  // The modes' job-file spellings, so checkpoints keep the hash they were written with (the
  // checkpoint records the optimizer mode key itself: ModeKeyGrant).
  const core::OptimizerMode mode = c.optimizer.mode.Read(core::ModeKeyGrant::Access());
  for (const std::string s : {core::EnumName(c.optimizer.name), core::EnumName(mode)})
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

void ForEachPiece(const StateSection& s,
                  const std::function<void(const uint8_t*, uint64_t, uint64_t)>& fn) {
  if (s.pieces.empty()) {
    fn(s.data, s.bytes, 0);
    return;
  }
  uint64_t at = 0;
  for (const auto& [offset, bytes] : s.pieces) {
    fn(s.data + offset, bytes, at);
    at += bytes;
  }
}

std::vector<ExpectedSection> ShareSections(const core::JobConfig& c, const core::ModelSpec& spec,
                                           const shm::ArenaLayout& layout, ShardId shard,
                                           uint8_t* optim, uint8_t* state) {
  const shm::OptimLayout old = shm::ComputeOptimLayout(spec, layout.masters_in_state,
                                                       c.optimizer.name, shard.count, shard.rank);
  ExpectedSection o{"optim", old.total_bytes, {}};
  const uint64_t region = layout.compute_end - layout.compute_begin;
  const uint64_t elem = static_cast<uint64_t>(layout.weights_elem_bytes);
  ExpectedSection w{shard.count > 1 ? "compute_shares" : "compute", 0, {}};
  uint64_t packed = 0;
  for (int b = 0; b < layout.compute_buffers; ++b)
    for (size_t p = 0; p < spec.params.size(); ++p) {
      const core::ElemRange r = old.share[p];
      // The whole file keeps the region as it lies in memory; shard files pack their shares.
      const uint64_t from =
          shard.count > 1 ? packed
                          : layout.compute[p] - layout.compute_begin + b * region + r.begin * elem;
      packed += static_cast<uint64_t>(r.size()) * elem;
      if (state && r.size() > 0)
        w.copies.push_back({from,
                            state + layout.ComputeCopy(static_cast<int>(p), b) + r.begin * elem,
                            static_cast<uint64_t>(r.size()) * elem});
    }
  w.bytes = shard.count > 1 ? packed : region * static_cast<uint64_t>(layout.compute_buffers);
  if (optim) {
    // This node's share of every optimizer-segment array: the part of it in the file's share.
    auto arrays = [&](const std::vector<uint64_t>& from, const std::vector<uint64_t>& to) {
      for (size_t p = 0; p < spec.params.size() && !from.empty(); ++p) {
        const int64_t lo = std::max(old.share[p].begin, layout.share[p].begin);
        const int64_t hi = std::min(old.share[p].end, layout.share[p].end);
        if (lo >= hi) continue;
        o.copies.push_back({from[p] + static_cast<uint64_t>(lo - old.share[p].begin) * 4,
                            optim + layout.ShareElem(to, static_cast<int>(p), lo),
                            static_cast<uint64_t>(hi - lo) * 4});
      }
    };
    if (!layout.masters_in_state) arrays(old.master, layout.master);
    arrays(old.adam_m, layout.adam_m);
    arrays(old.adam_v, layout.adam_v);
  }
  if (layout.loss_scaling == 0) return {o, w};
  ExpectedSection scaling{"loss_scaling", sizeof(shm::LossScaleRecord), {}};
  if (state)
    scaling.copies.push_back({0, state + layout.loss_scaling, sizeof(shm::LossScaleRecord)});
  return {o, w, scaling};
}

Status WriteTrainingState(const std::string& dir, int64_t steps_done, uint64_t state_hash,
                          bool masters_in_state, const core::RunRecord& run,
                          const std::vector<StateSection>& given, int keep, int checksum_threads,
                          WriteStats* stats, ShardId shard) {
  // Each section (or each piece of one) is an extent of its own, written in section order.
  std::vector<SectionShape> shapes;
  std::vector<SourcedExtent> extents;
  for (const auto& s : given) {
    const int section = static_cast<int>(shapes.size());
    shapes.push_back({s.name, s.bytes});
    ForEachPiece(s, [&](const uint8_t* from, uint64_t n, uint64_t at) {
      if (n > 0) extents.push_back({section, at, n, from, -1});
    });
  }
  return WriteTrainingStateExtents(dir, steps_done, state_hash, masters_in_state, run, shapes,
                                   extents, keep, checksum_threads, stats, shard);
}

Status WriteTrainingStateExtents(const std::string& dir, int64_t steps_done, uint64_t state_hash,
                                 bool masters_in_state, const core::RunRecord& run,
                                 const std::vector<SectionShape>& shapes,
                                 const std::vector<SourcedExtent>& extents, int keep,
                                 int checksum_threads, WriteStats* stats, ShardId shard,
                                 const std::function<void(int)>& written) {
  const auto t0 = std::chrono::steady_clock::now();
  auto since = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  // The extents tile every section exactly once.
  {
    std::vector<std::vector<std::pair<uint64_t, uint64_t>>> spans(shapes.size());
    for (const auto& e : extents) {
      if (e.section < 0 || e.section >= static_cast<int>(shapes.size()))
        return Status::Internal("checkpoint writer: an extent names section " +
                                std::to_string(e.section) + " of " + std::to_string(shapes.size()));
      spans[e.section].emplace_back(e.offset, e.bytes);
    }
    for (size_t i = 0; i < shapes.size(); ++i) {
      std::sort(spans[i].begin(), spans[i].end());
      uint64_t at = 0;
      for (const auto& [offset, bytes] : spans[i]) {
        if (offset != at) break;
        at += bytes;
      }
      if (at != shapes[i].bytes)
        return Status::Internal("checkpoint writer: the extents of section \"" + shapes[i].name +
                                "\" cover bytes [0, " + std::to_string(at) +
                                ") without a gap or overlap, not all " +
                                std::to_string(shapes[i].bytes));
    }
  }
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return Status::IoError("checkpoint directory " + dir + ": " + ec.message());
  nlohmann::json header = {{"version", kFormatVersion},
                           {"steps_done", steps_done},
                           {"state_hash", std::to_string(state_hash)},
                           {"masters_in_state", masters_in_state},
                           {"run", run}};
  if (shard.count > 1) {
    header["shard"] = shard.rank;
    header["shards"] = shard.count;
  }
  // The checksums are known only once every byte is written, so the sections are placed after a
  // header whose every checksum has the most digits; the real one is no longer. Its length (a
  // checksum per chunk: 16 KB for a 98 GB state) depends on the offsets' digits too: placed
  // after the header as it would be, until the offsets no longer lengthen it.
  nlohmann::json list = nlohmann::json::array();
  for (const auto& sh : shapes)
    list.push_back(
        {{"name", sh.name},
         {"offset", 0},
         {"bytes", sh.bytes},
         {"crc32_chunk_bytes", kCrcChunk},
         {"crc32", std::vector<uint32_t>((sh.bytes + kCrcChunk - 1) / kCrcChunk, 0xffffffffu)}});
  uint64_t first = 0, end = 0;
  for (uint64_t room = 0; first == 0 || room > first;) {
    first = AlignUp(room + 1);
    end = first;
    for (auto& e : list) {
      e["offset"] = end;
      end = AlignUp(end + e["bytes"].get<uint64_t>());
    }
    header["sections"] = list;
    room = 16 + header.dump().size();
  }
  // Per section and chunk, the CRC-32 of each piece written (offset in the chunk, bytes, CRC).
  struct Piece {
    uint64_t at, bytes;
    uint32_t crc;
  };
  std::vector<std::vector<std::vector<Piece>>> pieces(shapes.size());
  for (size_t i = 0; i < shapes.size(); ++i)
    pieces[i].resize((shapes[i].bytes + kCrcChunk - 1) / kCrcChunk);
  std::vector<size_t> last_of_group;
  for (size_t k = 0; k < extents.size(); ++k)
    if (extents[k].group >= 0) {
      if (static_cast<size_t>(extents[k].group) >= last_of_group.size())
        last_of_group.resize(extents[k].group + 1, 0);
      last_of_group[extents[k].group] = k;
    }
  double checksum_s = 0.0;
  const std::string final_path = (fs::path(dir) / FileName(steps_done, shard)).string();
  {
    RP_ASSIGN_OR_RETURN(core::AtomicFile f, core::AtomicFile::Create(final_path, 0600));
    for (size_t k = 0; k < extents.size(); ++k) {
      const SourcedExtent& e = extents[k];
      // Its pieces within the section's chunks, checksummed in parallel, then written.
      std::vector<std::pair<uint64_t, uint64_t>> cut;  // (offset in the section, bytes)
      for (uint64_t at = e.offset; at < e.offset + e.bytes;) {
        const uint64_t n = std::min(e.offset + e.bytes, (at / kCrcChunk + 1) * kCrcChunk) - at;
        cut.emplace_back(at, n);
        at += n;
      }
      const double c0 = since();
      std::vector<std::pair<uint64_t, uint64_t>> in_extent = cut;
      for (auto& piece : in_extent) piece.first -= e.offset;
      const std::vector<uint32_t> crcs = PieceCrcs(e.src, in_extent, checksum_threads);
      checksum_s += since() - c0;
      for (size_t i = 0; i < cut.size(); ++i)
        pieces[e.section][cut[i].first / kCrcChunk].push_back(
            {cut[i].first % kCrcChunk, cut[i].second, crcs[i]});
      RP_RETURN_IF_ERROR(
          f.WriteAt(list[e.section]["offset"].get<uint64_t>() + e.offset, e.src, e.bytes));
      // The kernel holds the bytes now: the source may change.
      if (e.group >= 0 && last_of_group[e.group] == k && written) written(e.group);
    }
    // Each chunk's CRC from its pieces', in order (zlib's combination of adjacent CRCs).
    for (size_t i = 0; i < shapes.size(); ++i) {
      std::vector<uint32_t> chunk_crcs;
      for (auto& chunk : pieces[i]) {
        std::sort(chunk.begin(), chunk.end(),
                  [](const Piece& a, const Piece& b) { return a.at < b.at; });
        uLong crc = crc32_z(0L, Z_NULL, 0);
        for (const Piece& piece : chunk)
          crc = crc32_combine(crc, piece.crc, static_cast<z_off_t>(piece.bytes));
        chunk_crcs.push_back(static_cast<uint32_t>(crc));
      }
      list[i]["crc32"] = chunk_crcs;
    }
    header["sections"] = list;
    const std::string text = header.dump();
    if (16 + text.size() > first)
      return Status::Internal("checkpoint writer: the header (" + std::to_string(text.size()) +
                              " bytes) outgrew the room before the first section");
    uint8_t head[16];
    std::memcpy(head, kMagic, 8);
    const uint64_t len = text.size();
    std::memcpy(head + 8, &len, 8);
    RP_RETURN_IF_ERROR(f.WriteAt(0, head, 16));
    RP_RETURN_IF_ERROR(f.WriteAt(16, text.data(), len));
    RP_RETURN_IF_ERROR(f.Truncate(end));
    RP_RETURN_IF_ERROR(f.Commit());
  }
  if (stats) {
    stats->checksum_s = checksum_s;
    stats->total_s = since();
    stats->bytes = 0;
    for (const auto& sh : shapes) stats->bytes += sh.bytes;
  }
  if (shard.count > 1) {
    // A shard's writer: its own files of steps older than the newest `keep` complete checkpoints.
    if (keep <= 0) return Status::Ok();
    const auto complete = CompleteCheckpoints(dir);
    if (complete.size() <= static_cast<size_t>(keep)) return Status::Ok();
    const int64_t oldest_kept = std::prev(complete.end(), keep)->first;
    for (const auto& [st, path] : ShardFiles(dir, shard))
      if (st < oldest_kept) fs::remove(path, ec);
    return Status::Ok();
  }
  // Prune: only this writer's step-*.rpstate names, oldest first, never the one just written.
  const std::vector<std::string> names = ListStateFiles(dir);
  for (size_t i = 0; keep > 0 && i + static_cast<size_t>(keep) < names.size(); ++i)
    if (names[i] != FileName(steps_done)) fs::remove(fs::path(dir) / names[i], ec);
  return Status::Ok();
}

Status RemoveLaterShardFiles(const std::string& dir, int64_t steps_done, ShardId shard) {
  std::error_code ec;
  for (const auto& [st, path] : ShardFiles(dir, shard))
    if (st > steps_done && !fs::remove(path, ec) && ec)
      return Status::IoError("removing " + path +
                             " (a checkpoint part after the resumed step): " + ec.message());
  return Status::Ok();
}

StatusOr<StateFile> FindLatestTrainingState(const std::string& dir) {
  return FindTrainingState(dir, -1);
}

StatusOr<StateFile> FindTrainingState(const std::string& dir, int64_t steps_done) {
  const auto complete = CompleteCheckpoints(dir);
  if (complete.empty())
    return Status::NotFound(
        "no complete training checkpoint (step-*.rpstate, or every step-*.shard-*.rpstate "
        "of one step) in " +
        dir);
  auto chosen = complete.rbegin();
  if (steps_done >= 0) {
    auto it = complete.find(steps_done);
    if (it == complete.end()) {
      std::string held;
      for (const auto& [steps, paths] : complete)
        held += (held.empty() ? "" : ", ") + std::to_string(steps);
      return Status::NotFound("no complete checkpoint after step " + std::to_string(steps_done) +
                              " in " + dir + " (it holds steps " + held + ")");
    }
    chosen = std::make_reverse_iterator(std::next(it));
  }
  StateFile f;
  f.paths = chosen->second;
  f.path = f.paths[0];
  RP_ASSIGN_OR_RETURN(UniqueFd fd, OpenStateFile(f.path));
  std::error_code ec;
  const uint64_t size = fs::file_size(f.path, ec);
  RP_ASSIGN_OR_RETURN(auto header, ReadHeader(fd.get(), f.path, size));
  f.steps_done = header["steps_done"].get<int64_t>();
  if (f.steps_done <= 0)
    return Status::InvalidArgument("checkpoint " + f.path + " records no completed step");
  return f;
}

StatusOr<core::RunRecord> ReadRunRecord(const StateFile& file) {
  RP_ASSIGN_OR_RETURN(UniqueFd fd, OpenStateFile(file.path));
  std::error_code ec;
  const uint64_t size = fs::file_size(file.path, ec);
  RP_ASSIGN_OR_RETURN(auto header, ReadHeader(fd.get(), file.path, size));
  core::RunRecord run;
  if (!header.contains("run")) return run;
  const auto& j = header["run"];
  if (!j.is_object())
    return Status::InvalidArgument("checkpoint " + file.path +
                                   " has a malformed JSON header (run)");
  for (const auto& [key, value] : j.items()) {
    if (!value.is_string())
      return Status::InvalidArgument("checkpoint " + file.path +
                                     " has a malformed JSON header (run." + key + ")");
    run[key] = value.get<std::string>();
  }
  return run;
}

namespace {

// The header checks of ReadTrainingState against the expected sections' names and sizes, for
// file `shard` of a checkpoint; returns the header.
StatusOr<nlohmann::json> CheckedHeader(
    int fd, const std::string& path, uint64_t size, uint64_t state_hash, bool masters_in_state,
    const std::vector<std::pair<std::string, uint64_t>>& sections, ShardId shard) {
  RP_ASSIGN_OR_RETURN(auto header, ReadHeader(fd, path, size));
  const auto& written =
      header.contains("masters_in_state") ? header["masters_in_state"] : nlohmann::json(false);
  if (!written.is_boolean())
    return Status::InvalidArgument("checkpoint " + path +
                                   " has a malformed JSON header (masters_in_state)");
  if (written.get<bool>() != masters_in_state) {
    auto where = [](bool in_state) {
      return std::string(
          in_state ? "the fp32 masters workers fetch (exact mode with schedule.weights_source = "
                     "\"auto\")"
                   : "a compute copy beside the masters (stale1, or schedule.weights_source = "
                     "\"compute_copy\")");
    };
    return Status::InvalidArgument("checkpoint " + path + " holds " + where(written.get<bool>()) +
                                   ", this job keeps " + where(masters_in_state) +
                                   "; resume it with the checkpoint's setting");
  }
  // Exact mode keeps two buffers of the weights workers fetch only with a speculative update
  // (stale1 always has two, and a change of mode fails the hash below): name the key.
  for (const auto& [name, want] : sections) {
    if (name != "compute" || !header["sections"].is_array()) continue;
    for (const auto& e : header["sections"])
      if (e.is_object() && e.value("name", "") == name && e.contains("bytes") &&
          e["bytes"].is_number_unsigned()) {
        const uint64_t got = e["bytes"].get<uint64_t>();
        if (got != want && (got == 2 * want || 2 * got == want))
          return Status::InvalidArgument(
              "checkpoint " + path + " holds " + (got > want ? "two buffers" : "one buffer") +
              " of the weights workers fetch, this job " + (got > want ? "one" : "two") +
              ": in exact mode two come with optimizer.speculative_update = true; resume "
              "it with the checkpoint's setting");
      }
  }
  if (header["state_hash"] != std::to_string(state_hash))
    return Status::InvalidArgument("checkpoint " + path +
                                   " was written for a different model, "
                                   "compute dtype, optimizer or optimizer mode than this job's");
  const auto shard_field = [&](const char* key, int fallback) {
    return header.contains(key) && header[key].is_number_integer() ? header[key].get<int>()
                                                                   : fallback;
  };
  if (shard_field("shard", 0) != shard.rank || shard_field("shards", 1) != shard.count)
    return Status::InvalidArgument(
        "checkpoint " + path + " says it is shard " + std::to_string(shard_field("shard", 0)) +
        " of " + std::to_string(shard_field("shards", 1)) + ", its name shard " +
        std::to_string(shard.rank) + " of " + std::to_string(shard.count));
  const auto& list = header["sections"];
  if (list.size() != sections.size())
    return Status::InvalidArgument("checkpoint " + path + " has " + std::to_string(list.size()) +
                                   " sections, expected " + std::to_string(sections.size()));
  for (size_t i = 0; i < sections.size(); ++i) {
    const auto& e = list[i];
    const auto& [name, want_bytes] = sections[i];
    if (!e.is_object() || e.value("name", "") != name || !e.contains("offset") ||
        !e["offset"].is_number_unsigned() || !e.contains("bytes") ||
        !e["bytes"].is_number_unsigned())
      return Status::InvalidArgument("checkpoint " + path + ": section " + std::to_string(i) +
                                     " is not \"" + name + "\"");
    const uint64_t off = e["offset"].get<uint64_t>(), bytes = e["bytes"].get<uint64_t>();
    if (bytes != want_bytes)
      return Status::InvalidArgument("checkpoint " + path + ": section \"" + name + "\" holds " +
                                     std::to_string(bytes) + " bytes, this job needs " +
                                     std::to_string(want_bytes));
    if (off > size || bytes > size - off)
      return Status::InvalidArgument("checkpoint " + path + ": section \"" + name +
                                     "\" runs past the end of the file (truncated?)");
    // Files written before checksums existed have none; every newer one is verified.
    if (e.contains("crc32") &&
        (!e["crc32"].is_array() || e.value("crc32_chunk_bytes", uint64_t{0}) != kCrcChunk ||
         e["crc32"].size() != (bytes + kCrcChunk - 1) / kCrcChunk))
      return Status::InvalidArgument("checkpoint " + path + ": section \"" + name +
                                     "\" has a malformed checksum list");
  }
  // Nothing may follow the last section (the writer truncates the file there).
  uint64_t end = 0;
  for (const auto& e : list)
    end = std::max(end, AlignUp(e["offset"].get<uint64_t>() + e["bytes"].get<uint64_t>()));
  if (size != end)
    return Status::InvalidArgument("checkpoint " + path + " has " + std::to_string(size) +
                                   " bytes, its sections end at " + std::to_string(end) +
                                   ": bytes were appended or cut");
  return header;
}

Status ChecksumMismatch(const std::string& path, const std::string& section, uint64_t a, uint64_t b,
                        const std::string& what) {
  return Status::InvalidArgument("checkpoint " + path + ": bytes [" + std::to_string(a) + ", " +
                                 std::to_string(b) + ") of section \"" + section + "\"" +
                                 (what.empty() ? std::string() : " (" + what + ")") +
                                 " do not match their checksum: the file is damaged");
}

// ReadTrainingState: the header's checks, then every section's bytes read and verified.
Status LoadTrainingState(const StateFile& file, uint64_t state_hash, bool masters_in_state,
                         const std::vector<StateSection>& sections) {
  RP_ASSIGN_OR_RETURN(UniqueFd fd, OpenStateFile(file.path));
  std::error_code ec;
  const uint64_t size = fs::file_size(file.path, ec);
  std::vector<std::pair<std::string, uint64_t>> expected;
  for (const auto& s : sections) expected.emplace_back(s.name, s.bytes);
  RP_ASSIGN_OR_RETURN(auto header, CheckedHeader(fd.get(), file.path, size, state_hash,
                                                 masters_in_state, expected, {}));
  const auto& list = header["sections"];
  for (size_t i = 0; i < sections.size(); ++i) {
    const auto& e = list[i];
    const uint64_t off = e["offset"].get<uint64_t>(), bytes = e["bytes"].get<uint64_t>();
    RP_RETURN_IF_ERROR(ReadAll(fd.get(), sections[i].data, bytes, off, file.path));
    if (!e.contains("crc32")) continue;
    const auto& want = e["crc32"];
    const std::vector<uint32_t> got = ChunkCrcs(sections[i].data, bytes);
    for (size_t c = 0; c < got.size(); ++c) {
      if (want[c].is_number_unsigned() && want[c].get<uint64_t>() == got[c]) continue;
      const uint64_t a = c * kCrcChunk, b = std::min(bytes, (c + 1) * kCrcChunk);
      return ChecksumMismatch(file.path, sections[i].name, a, b,
                              sections[i].describe ? sections[i].describe(a, b) : "");
    }
  }
  return Status::Ok();
}

// One file of a checkpoint, streamed a checksum chunk at a time into the copies' destinations.
Status ReadShareFile(const std::string& path, int64_t steps_done, uint64_t state_hash,
                     bool masters_in_state, ShardId shard, std::vector<ExpectedSection> sections,
                     bool read) {
  RP_ASSIGN_OR_RETURN(UniqueFd fd, OpenStateFile(path));
  std::error_code ec;
  const uint64_t size = fs::file_size(path, ec);
  std::vector<std::pair<std::string, uint64_t>> expected;
  for (const auto& s : sections) expected.emplace_back(s.name, s.bytes);
  RP_ASSIGN_OR_RETURN(auto header, CheckedHeader(fd.get(), path, size, state_hash, masters_in_state,
                                                 expected, shard));
  if (header["steps_done"] != steps_done)
    return Status::InvalidArgument("checkpoint " + path + " holds " + header["steps_done"].dump() +
                                   " steps, the other files of its checkpoint " +
                                   std::to_string(steps_done));
  if (!read) return Status::Ok();
  std::vector<uint8_t> chunk;
  const auto& list = header["sections"];
  for (size_t i = 0; i < sections.size(); ++i) {
    auto& copies = sections[i].copies;
    std::sort(copies.begin(), copies.end(),
              [](const SectionCopy& a, const SectionCopy& b) { return a.from < b.from; });
    const auto& e = list[i];
    const uint64_t off = e["offset"].get<uint64_t>(), bytes = e["bytes"].get<uint64_t>();
    size_t next = 0;  // the first copy not wholly before this chunk
    for (uint64_t a = 0; a < bytes; a += kCrcChunk) {
      const uint64_t b = std::min(bytes, a + kCrcChunk);
      chunk.resize(static_cast<size_t>(b - a));
      RP_RETURN_IF_ERROR(ReadAll(fd.get(), chunk.data(), b - a, off + a, path));
      if (e.contains("crc32")) {
        const auto& want = e["crc32"][a / kCrcChunk];
        if (!want.is_number_unsigned() ||
            want.get<uint64_t>() != ChunkCrcs(chunk.data(), b - a, 1)[0])
          return ChecksumMismatch(path, sections[i].name, a, b, "");
      }
      while (next < copies.size() && copies[next].from + copies[next].bytes <= a) ++next;
      for (size_t k = next; k < copies.size() && copies[k].from < b; ++k) {
        const uint64_t lo = std::max(a, copies[k].from),
                       hi = std::min(b, copies[k].from + copies[k].bytes);
        if (lo < hi)
          std::memcpy(copies[k].to + (lo - copies[k].from), chunk.data() + (lo - a), hi - lo);
      }
    }
  }
  return Status::Ok();
}

}  // namespace

Status ReadTrainingState(const StateFile& file, uint64_t state_hash, bool masters_in_state,
                         const std::vector<StateSection>& sections) {
  return LoadTrainingState(file, state_hash, masters_in_state, sections);
}

Status ReadTrainingStateShares(const StateFile& file, const core::JobConfig& config,
                               const core::ModelSpec& spec, const shm::ArenaLayout& layout,
                               uint64_t state_hash, uint8_t* optim, uint8_t* state) {
  const std::vector<std::string> paths =
      file.paths.empty() ? std::vector<std::string>{file.path} : file.paths;
  const ShardId whole{0, 1};
  for (size_t r = 0; r < paths.size(); ++r) {
    const ShardId shard =
        paths.size() > 1 ? ShardId{static_cast<int>(r), static_cast<int>(paths.size())} : whole;
    RP_RETURN_IF_ERROR(ReadShareFile(paths[r], file.steps_done, state_hash, layout.masters_in_state,
                                     shard,
                                     ShareSections(config, spec, layout, shard, optim, state),
                                     /*read=*/optim != nullptr && state != nullptr));
  }
  return Status::Ok();
}

}  // namespace rp::coord
