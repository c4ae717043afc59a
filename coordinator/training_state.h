// SPDX-License-Identifier: Apache-2.0
// Training-state checkpoints: what --resume needs to continue a run exactly.
//
// File "<output_dir>/<checkpoint.dir>/step-<8 digits>.rpstate" (never *.safetensors: that name is
// kept for Hugging Face / PEFT exports):
//   bytes [0, 8)     magic "RPSTATE1"
//   bytes [8, 16)    little-endian uint64 H: length of the JSON header that follows
//   bytes [16, 16+H) JSON: {"version", "steps_done", "state_hash", "masters_in_state",
//                    "sections": [{"name", "offset", "bytes", "crc32_chunk_bytes", "crc32"}]};
//                    offsets are absolute and 4096-aligned; "crc32" lists the CRC-32 of each
//                    64 MiB chunk of the section; "masters_in_state" and the checksums are
//                    absent in older files
//   sections         raw bytes: "optim" (the optimizer segment: moments, and the masters unless
//                    workers fetch them) and "compute" (every compute-copy buffer, so stale1's
//                    older weights resume too; the fp32 masters when workers fetch them)
// Nothing else is needed: the learning rate, the data order and the init are pure functions of
// the step and the seed (config/lr_schedule.h, io/data.h).
//
// Contract:
//  * Write() is atomic: a temporary name in the same directory, fsync, rename, fsync of the
//    directory. A crash leaves either the previous set of files or the new one, never a torn
//    checkpoint under the final name. Afterwards only the newest `keep` checkpoints remain.
//  * FindLatest() returns the newest checkpoint whose header parses; Read() checks where the
//    masters live (schedule.weights_source, named in its own message), the state hash (parameter
//    names and sizes, compute dtype, optimizer, mode), every section's size against what the
//    caller expects, every chunk's checksum (when the file has them) and that nothing follows the
//    last section, and names the file, the section and the byte range when they differ.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "common/status.h"
#include "config/job_config.h"
#include "config/model_spec.h"
#include "shm/layout.h"

namespace rp::coord {

struct StateSection {
  using Describe = std::function<std::string(uint64_t begin, uint64_t end)>;
  StateSection(std::string name_, uint8_t* data_, uint64_t bytes_, Describe describe_ = {})
      : name(std::move(name_)), data(data_), bytes(bytes_), describe(std::move(describe_)) {}
  std::string name;
  uint8_t* data;
  uint64_t bytes;
  // Optional: which tensors lie in bytes [begin, end) of the section, for messages about damage.
  Describe describe;
};

struct StateFile {
  std::string path;
  int64_t steps_done = 0;
};

// The sections a checkpoint of this layout holds: "optim" (the optimizer segment) and "compute"
// (every compute-copy buffer of the state segment). `optim` and `state` are the mapped segments,
// or null where only the sizes are wanted (checking a header).
std::vector<StateSection> CheckpointSections(const shm::ArenaLayout& layout, uint8_t* optim, uint8_t* state);

// What must match for a checkpoint to be loadable into this job's segments.
uint64_t TrainingStateHash(const core::JobConfig& config, const core::ModelSpec& spec,
                           const shm::ArenaLayout& layout);
std::string CheckpointDir(const core::JobConfig& config);

// What one write cost (for the log and metrics).
struct WriteStats {
  uint64_t bytes = 0;
  double checksum_s = 0.0;  // CRC-32 of every chunk
  double total_s = 0.0;     // checksums, writes, fsyncs and the rename
};
// `masters_in_state`: shm::ArenaLayout::masters_in_state of the writing (reading) job.
// `checksum_threads` (0: every core) compute the chunks' CRCs in parallel.
Status WriteTrainingState(const std::string& dir, int64_t steps_done, uint64_t state_hash,
                          bool masters_in_state, const std::vector<StateSection>& sections, int keep,
                          int checksum_threads = 0, WriteStats* stats = nullptr);
// NotFound when the directory holds no checkpoint.
StatusOr<StateFile> FindLatestTrainingState(const std::string& dir);
Status ReadTrainingState(const StateFile& file, uint64_t state_hash, bool masters_in_state,
                         const std::vector<StateSection>& sections);
// Read()'s checks without reading the sections (their data may be null): where the masters live,
// the hash, the sections' names and sizes, and the file's length. What rp-launch checks before
// --resume starts anything; damaged bytes are found by Read().
Status CheckTrainingState(const StateFile& file, uint64_t state_hash, bool masters_in_state,
                          const std::vector<StateSection>& sections);

}  // namespace rp::coord
