// SPDX-License-Identifier: Apache-2.0
// The shared-memory state segment: header POD and arena layout.
//
// Segment "rp-<session>-state" (one per run, created 0600 by the coordinator before any worker
// attaches, never resized; see docs/shm_layout.md):
//
//   [0, 4096)            SegmentHeader (below)
//   layer versions       std::atomic<uint64_t> per pipeline layer: the number of optimizer
//                        updates its owned parameters' compute copies hold. Written only by the
//                        coordinator (release), read by workers (acquire) before a weight fetch.
//   compute copies       per parameter, in parameter order (so one layer's weights are one
//                        contiguous run), dtype = train.dtype; what workers fetch. In stale1
//                        mode a second such region follows (double buffer by version parity)
//   masters              fp32 per parameter                      (coordinator only)
//   adam m, adam v       fp32 per parameter                      (coordinator only)
//   gradients            fp32 per gradient slot (a parameter use by a layer); workers add a
//                        job's gradients here when the coordinator grants the commit
//   token / label slots  int64 [2 parities][M microbatches][microbatch_size * seq_len]
//   hidden slots         [2][M][plan.hidden_boundaries][microbatch_size * seq_len * hidden]
//   input-grad slots     [2][M][plan.grad_boundaries ][microbatch_size * seq_len * hidden]
//
// Every array starts on a kArenaAlign boundary. Accumulation call g uses parity g % 2, so call
// g+1 can fill its slots while call g drains. The layout is a pure function of the job config;
// its hash is stored in the header and every attacher recomputes and compares it, so a worker
// built or configured differently refuses to attach instead of reading garbage.
// No interprocess mutexes live here: single-writer fields and control messages only.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "core/job_config.h"
#include "core/model_spec.h"
#include "core/plan.h"

namespace rp::shm {

inline constexpr uint64_t kSegmentMagic = 0x3174536550695052ull;  // "RPiPeSt1"
inline constexpr uint32_t kSegmentVersion = 1;
inline constexpr uint64_t kHeaderBytes = 4096;
inline constexpr uint64_t kArenaAlign = 4096;

struct SegmentHeader {
  uint64_t magic;
  uint32_t version;
  uint32_t header_bytes;
  uint64_t layout_hash;
  uint64_t total_bytes;
  uint64_t trainable_params;
  int32_t coordinator_pid;
  uint32_t reserved0;
  // Set to 1 by the coordinator (release) after the arenas hold initialized weights.
  std::atomic<uint32_t> ready;
  uint32_t reserved1;
  char session[48];
};
static_assert(sizeof(std::atomic<uint32_t>) == 4 && std::atomic<uint32_t>::is_always_lock_free,
              "the header's flag must be a plain lock-free word to be shared across processes");
static_assert(offsetof(SegmentHeader, magic) == 0);
static_assert(offsetof(SegmentHeader, layout_hash) == 16);
static_assert(offsetof(SegmentHeader, ready) == 48);
static_assert(offsetof(SegmentHeader, session) == 56);
static_assert(sizeof(SegmentHeader) == 104);
static_assert(sizeof(SegmentHeader) <= kHeaderBytes);

// Byte offsets of every array in the segment. Pure function of the config (see above).
struct ArenaLayout {
  uint64_t total_bytes = 0;
  uint64_t hash = 0;
  int compute_elem_bytes = 4;
  std::vector<uint64_t> compute, master, adam_m, adam_v;  // per parameter; adam_v empty for sgd
  std::vector<uint64_t> grad;                             // per gradient slot
  uint64_t compute_begin = 0, compute_end = 0;            // the compute-copy region (buffer 0)
  int compute_buffers = 1;                                // 2 in stale1 mode: version v in v % 2
  uint64_t layer_versions = 0;                            // std::atomic<uint64_t>[num layers]
  uint64_t tokens = 0, labels = 0, hidden = 0, input_grad = 0;
  uint64_t tokens_per_mb = 0;        // elements per token slot
  uint64_t act_elems = 0;            // elements per hidden / input-grad slot
  uint64_t act_slot_bytes = 0;       // bytes per slot, aligned
  int microbatches = 0, num_hidden = 0, num_grad = 0;

  // Compute copy of parameter p in buffer b (0 in exact mode; version % 2 in stale1 mode).
  uint64_t ComputeCopy(int p, int buffer) const {
    return compute[p] + static_cast<uint64_t>(buffer) * (compute_end - compute_begin);
  }
  uint64_t TokenSlot(int parity, int mb) const;
  uint64_t LabelSlot(int parity, int mb) const;
  uint64_t HiddenSlot(int parity, int mb, int idx) const;
  uint64_t InputGradSlot(int parity, int mb, int idx) const;
};

ArenaLayout ComputeLayout(const core::JobConfig& config, const core::ModelSpec& spec,
                          const core::PipelinePlan& plan);

static_assert(sizeof(std::atomic<uint64_t>) == 8 && std::atomic<uint64_t>::is_always_lock_free,
              "layer versions must be plain lock-free words to be shared across processes");

inline std::string StateSegmentName(const std::string& session) { return "rp-" + session + "-state"; }

}  // namespace rp::shm
