// SPDX-License-Identifier: Apache-2.0
// Training-state checkpoints: what --resume needs to continue a run exactly.
//
// File "<output_dir>/<checkpoint.dir>/step-<8 digits>.rpstate" (never *.safetensors: that name is
// kept for Hugging Face / PEFT exports):
//   bytes [0, 8)     magic "RPSTATE1"
//   bytes [8, 16)    little-endian uint64 H: length of the JSON header that follows
//   bytes [16, 16+H) JSON: {"version", "steps_done", "state_hash", "masters_in_state", "run",
//                    "sections": [{"name", "offset", "bytes", "crc32_chunk_bytes", "crc32"}]};
//                    offsets are absolute and 4096-aligned; "crc32" lists the CRC-32 of each
//                    64 MiB chunk of the section; "run" holds the run-defining key values
//                    (core::RunDefiningValues); "masters_in_state", "run" and the checksums are
//                    absent in older files
//   sections         raw bytes: "optim" (the optimizer segment: moments, and the masters unless
//                    workers fetch them), "compute" (every compute-copy buffer, so stale1's
//                    older weights resume too; the fp32 masters when workers fetch them) and,
//                    with fp16, "loss_scaling" (the dynamic loss scale's state)
// Sharded state (ExecutionPlan::sharded_state) on N nodes: node r writes
// "step-<8 digits>.shard-<r>-of-<N>.rpstate" into the same directory, its header adding "shard"
// and "shards", with "optim" (its optimizer segment: its shares only) and "compute_shares" (its
// share of each parameter in each compute-copy buffer, buffer-major, then parameter order,
// packed). A step's checkpoint is the whole file or every shard file of one N; any node count
// reads any of them back, share by share (ShareSections).
// Nothing else is needed: the learning rate, the data order and the init are pure functions of
// the step and the seed (config/lr_schedule.h, io/data.h).
//
// Contract:
//  * Write() is atomic: a temporary name in the same directory, fsync, rename, fsync of the
//    directory. A crash leaves either the previous set of files or the new one, never a torn
//    checkpoint under the final name. Afterwards a whole file's writer keeps only the newest
//    `keep` whole files; a shard's writer removes only its own shard files, and only of steps
//    older than the newest `keep` complete checkpoints, so a node that fails mid-write never costs
//    the last complete one. Neither removes the other kind's files, nor shards of another count.
//  * FindLatest() returns the newest complete checkpoint (whole file, or every shard) whose header
//    parses; Read() checks where the
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
  // Optional (written sections only): the section is these (offset from `data`, bytes) pieces,
  // packed in order, `bytes` their sum; empty: [data, data + bytes).
  std::vector<std::pair<uint64_t, uint64_t>> pieces;
};
// Calls fn(source, bytes, offset in the section) for each contiguous piece of `s`, in order.
void ForEachPiece(const StateSection& s,
                  const std::function<void(const uint8_t*, uint64_t, uint64_t)>& fn);

// Which file of a checkpoint a writer writes: node `rank` of `count` (count 1: the whole file).
struct ShardId {
  int rank = 0;
  int count = 1;
};

struct StateFile {
  std::string path;  // the whole file, or shard 0's
  int64_t steps_done = 0;
  std::vector<std::string> paths;  // every file of the checkpoint, by shard (one, or none: `path`)
};

// Reading one file of a checkpoint share by share: the bytes `from` .. `from + bytes` of its
// section go to `to`.
struct SectionCopy {
  uint64_t from;
  uint8_t* to;
  uint64_t bytes;
};
struct ExpectedSection {
  std::string name;
  uint64_t bytes = 0;
  std::vector<SectionCopy> copies;
};
// The sections of file `shard` of a checkpoint written on shard.count nodes, as this job's layout
// reads them, and (with `optim` and `state` non-null) the copies that put every share of the
// compute copies and this node's share of the masters and moments (layout.share) in place.
std::vector<ExpectedSection> ShareSections(const core::JobConfig& config,
                                           const core::ModelSpec& spec,
                                           const shm::ArenaLayout& layout, ShardId shard,
                                           uint8_t* optim, uint8_t* state);

// The sections a checkpoint of this layout holds: "optim" (the optimizer segment) and "compute"
// (every compute-copy buffer of the state segment), or with sharded state "compute_shares" (this
// node's shares of them, as pieces). `optim` and `state` are the mapped segments,
// or null where only the sizes are wanted (checking a header).
std::vector<StateSection> CheckpointSections(const shm::ArenaLayout& layout, uint8_t* optim,
                                             uint8_t* state);

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
// `run`: the job's core::RunDefiningValues, kept in the header for --resume to compare.
Status WriteTrainingState(const std::string& dir, int64_t steps_done, uint64_t state_hash,
                          bool masters_in_state, const core::RunRecord& run,
                          const std::vector<StateSection>& sections, int keep,
                          int checksum_threads = 0, WriteStats* stats = nullptr,
                          ShardId shard = {});
// One contiguous run of a checkpoint's bytes and where they come from: bytes [offset, offset +
// bytes) of section `section`, read from `src`. Extents of one `group` (>= 0) share a source that
// may change once all of them are written; -1: no such group.
struct SourcedExtent {
  int section;
  uint64_t offset, bytes;
  const uint8_t* src;
  int group = -1;
};
struct SectionShape {
  std::string name;
  uint64_t bytes;
};
// WriteTrainingState from extents that tile each section exactly once (an Internal error names
// the section otherwise), in the order given: each extent is checksummed just before its bytes go
// to the file, and once the last extent of a group is written (the kernel has its bytes)
// `written(group)` is called on the writing thread, so its source may change from then on. The
// same file, atomicity and pruning as WriteTrainingState, which is this with one extent per
// section (or per piece).
Status WriteTrainingStateExtents(const std::string& dir, int64_t steps_done, uint64_t state_hash,
                                 bool masters_in_state, const core::RunRecord& run,
                                 const std::vector<SectionShape>& shapes,
                                 const std::vector<SourcedExtent>& extents, int keep,
                                 int checksum_threads = 0, WriteStats* stats = nullptr,
                                 ShardId shard = {}, const std::function<void(int)>& written = {});
// Removes shard `shard`'s files of steps after `steps_done` from `dir`: what a resumed run's node
// does first, so a file of the run it continues (a step that never completed) cannot later make
// a checkpoint together with the new run's files.
Status RemoveLaterShardFiles(const std::string& dir, int64_t steps_done, ShardId shard);
// NotFound when the directory holds no checkpoint.
StatusOr<StateFile> FindLatestTrainingState(const std::string& dir);
// The complete checkpoint after `steps_done` steps; NotFound naming the steps the directory holds.
StatusOr<StateFile> FindTrainingState(const std::string& dir, int64_t steps_done);
// The run-defining values the checkpoint's run recorded (core::RunDefiningValues); empty for a
// file written before checkpoints recorded them.
StatusOr<core::RunRecord> ReadRunRecord(const StateFile& file);
Status ReadTrainingState(const StateFile& file, uint64_t state_hash, bool masters_in_state,
                         const std::vector<StateSection>& sections);
// Any checkpoint (whole or shards of any count) into this job's segments (ShareSections), with
// every check ReadTrainingState makes on each file, plus its shard number; streamed a checksum
// chunk at a time, so no file is held in memory whole. With null `optim` and `state`, only the
// checks that need no reading (where the masters live, the hash, the sections' names and sizes,
// the files' lengths): what rp-launch checks before --resume starts anything.
Status ReadTrainingStateShares(const StateFile& file, const core::JobConfig& config,
                               const core::ModelSpec& spec, const shm::ArenaLayout& layout,
                               uint64_t state_hash, uint8_t* optim, uint8_t* state);

}  // namespace rp::coord
