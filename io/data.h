// SPDX-License-Identifier: Apache-2.0
// Dataset: deterministic token batches.
//
// Formats (data.format): "bytes" (a text file, one token per byte), "tokens" (a flat file of
// uint16 or uint32 token ids with a JSON sidecar <path>.json: {"dtype": "uint16"|"uint32",
// "vocab_size": N}; memory-mapped, every id checked against model.vocab_size when opened; the
// sidecar may add "documents": D, a document index <path>.docs of D + 1 little-endian uint64
// token offsets from 0 to the token count, which makes the file D records packed as JSONL records
// are, and "loss_mask": true, <path>.mask holding one byte per token, 1 where the token is a
// target; "tokens", "trained_tokens", "tokenizer" and "source" are checked or informational, any
// other key is refused; tools/prepare_data.py writes all of them),
// "jsonl" (one JSON object per line: "input_ids", optional "labels" (same length, -100 = ignore,
// Hugging Face alignment: the model predicts labels[j + 1] at position j) or "loss_mask" (0/1 per
// token); a record's last position predicts nothing, so no target crosses a record boundary),
// "random" (synthetic). Windows are visited in a per-epoch order shuffled by the seed.
//
// Packing (data.packing) decides what a window of seq_len tokens holds and what each token sees:
//  * "stream": "bytes" and "tokens" without a document index are cut into non-overlapping
//    windows of seq_len + 1 tokens (stride seq_len); records ("jsonl", indexed "tokens") are
//    concatenated and cut every seq_len tokens. Positions run 0..seq_len-1 in every window:
//    attention crosses record boundaries.
//  * "documents" (records only): records in file order, each whole record placed in the current
//    window if it fits in the room left, else in a new one (the rest of the old one padded).
//    Every record is a document: its RoPE positions start at 0 and its tokens attend to its own
//    earlier tokens only.
//  * "pad" (records only): one record per window, the rest padded.
//  Padding is token 0 with no target, a document of its own. A record longer than seq_len
//  (data.long_records): "split" into seq_len pieces, each starting a window, positions
//  continuing across the pieces (a piece attends to itself only); "truncate" to its first
//  seq_len tokens; "drop". Documents are told apart by their positions alone: a document begins
//  at a window's first token and wherever a position is not its predecessor's plus one
//  (model/documents.h).
//
// Eval set (train.eval_every): data.eval_path (a file in data.format), or the last
// data.eval_fraction of data.path's windows, which the training view then never visits; for
// "random", a synthetic stream of its own. FillEval(i) writes eval microbatch i from the eval
// windows in file order (no shuffling), so every evaluation sees the same set.
//
// Contract: Fill(step, call, mb) writes this node's microbatch `mb` of round `call` of optimizer
// step `step` as int64 token ids, labels and RoPE positions ([microbatch_size, seq_len] each,
// row-major; positions may be null when the caller does not need them). The
// result is a pure function of (config, seed, step, StepMicrobatch(call, mb)): the pipelined
// coordinator and rp-train-ref draw identical batches, and a step draws the same sequences
// whatever the node count. Labels use -100 for ignored positions.
// Not thread-safe (epoch permutations are cached); one owner per process.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/mapped_file.h"
#include "common/status.h"
#include "config/job_config.h"

namespace rp::core {

inline constexpr int64_t kIgnoreIndex = -100;

class Dataset {
 public:
  // The training view (without the held-out eval windows).
  static StatusOr<Dataset> Open(const JobConfig& config);
  // The eval view (see above).
  static StatusOr<Dataset> OpenEval(const JobConfig& config);

  void Fill(int64_t step, int64_t call, int64_t mb, int64_t* tokens, int64_t* labels,
            int64_t* positions = nullptr);
  // Microbatch `index` of step `step` counted over the whole step, every node's microbatches
  // (core::StepMicrobatch): Fill(step, call, mb) is FillStepMicrobatch(step, StepMicrobatch(...)).
  void FillStepMicrobatch(int64_t step, int64_t index, int64_t* tokens, int64_t* labels,
                          int64_t* positions = nullptr);
  void FillEval(int64_t index, int64_t* tokens, int64_t* labels, int64_t* positions = nullptr);
  // Number of labels != kIgnoreIndex in one optimizer step, over every node's microbatches (the
  // loss normalizer).
  int64_t CountStepTargets(int64_t step);
  int64_t NumWindows() const { return windows_; }

  // What the file held and how it was packed (this view's windows only in `windows`).
  struct PackingStats {
    int64_t records = 0;
    int64_t tokens = 0;   // records' tokens after splitting, truncating and dropping
    int64_t padding = 0;  // padding tokens in the packed stream
    int64_t split = 0, truncated = 0, dropped = 0;  // records longer than seq_len
  };
  const PackingStats& stats() const { return stats_; }
  // One line for the log: records, tokens, windows, packing and the share of real tokens, and the
  // records longer than seq_len; "" for synthetic data.
  std::string PackingSummary() const;
  // One line: windows per epoch, sequences per step, steps per epoch and train.steps in epochs;
  // "" for synthetic data.
  std::string LengthSummary() const;

 private:
  Dataset() = default;
  // Opens data.path of `config`; `key` names the file's key in errors.
  static StatusOr<Dataset> OpenFile(const JobConfig& config, const std::string& key);
  void FillWindow(int64_t w, int64_t* tokens, int64_t* labels, int64_t* positions) const;
  void FillRandom(uint64_t key, int64_t* tokens, int64_t* labels, int64_t* positions) const;
  // Appends one record (its tokens and per-position targets) to the packed stream as
  // data.packing and data.long_records say.
  void PackRecord(std::vector<int32_t> tokens, std::vector<int32_t> targets);
  void PadToWindowEnd();
  // After the last record: pads the last window (documents, pad), counts the windows and refuses
  // data without one whole window.
  Status FinishPacking();
  const std::vector<int64_t>& Permutation(int64_t epoch);
  Status OpenTokens();
  Status OpenJsonl();

  int64_t TokenAt(int64_t i) const;

  JobConfig config_;
  std::vector<uint8_t> bytes_;
  std::shared_ptr<const MappedFile> tokens_map_;  // "tokens": the mapped file, shared by copies
  std::shared_ptr<const MappedFile> mask_map_;    // "tokens" streamed with a loss mask: <path>.mask
  const uint8_t* tokens_ = nullptr;
  int token_bytes_ = 0;                                  // 2 or 4
  std::vector<int32_t> packed_tokens_, packed_targets_;  // "jsonl": the packed stream
  std::vector<int32_t> packed_positions_;                // with its RoPE positions
  PackingStats stats_;
  int64_t windows_ = 0;  // windows this view visits, from first_window_
  int64_t first_window_ = 0;
  std::string key_ = "data.path";
  int64_t cached_epoch_ = -1;
  std::vector<int64_t> perm_;
};

// train.epochs > 0: opens the training view of data.path and sets train.steps = ceil(epochs x
// its windows / SequencesPerStep), then the warmup of optimizer.warmup_ratio (ResolveWarmup), and
// refuses a train.stop_after past those steps (at least one step). Called once on a freshly loaded
// job by ResolveRun (rp-launch) and rp-train-ref; train.epochs = 0: nothing to do.
Status ResolveTrainingLength(JobConfig* c);

// The rows of an embedding of `vocab` rows that the tokens of `slots` (each `per_slot` ids)
// look up: ascending, each once; ids outside [0, vocab) are not rows. The coordinator
// (AsyncOptimizer::SetTouchedRows) and the worker (a compact lookup slot, core::CompactLookupRows)
// both take the step's rows from here, so they agree on which row is where.
std::vector<int64_t> SortedTokenRows(const std::vector<const int64_t*>& slots, int64_t per_slot,
                                     int64_t vocab);

}  // namespace rp::core
