// SPDX-License-Identifier: Apache-2.0
// One optimizer step over a whole model: global gradient norm, clipping, AdamW per parameter.
//
// Shared by rp-coordinator (arrays in shared memory) and rp-train-ref (arrays in its own
// tensors), so both apply bit-identical updates to bit-identical gradients.
// The norm is summed per parameter in double and then over parameters in index order, so it
// does not depend on the thread count.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "optim/adamw.h"
#include "config/job_config.h"
#include "shm/layout.h"

namespace rp::coord {

// The compute copy's dtype for a job's train.dtype.
inline ComputeDtype ComputeDtypeOf(core::TrainDtype d) {
  switch (d) {
    case core::TrainDtype::kBf16:
    case core::TrainDtype::kFp8:
      return ComputeDtype::kBFloat16;  // fp8 rounds inside the products only
    case core::TrainDtype::kFp16: return ComputeDtype::kFloat16;
    case core::TrainDtype::kFp32: break;
  }
  return ComputeDtype::kFloat32;
}

struct ParamArrays {
  float* master = nullptr;
  float* m = nullptr;
  float* v = nullptr;
  const float* grad = nullptr;
  void* compute = nullptr;  // may alias master when the compute dtype is fp32
  int64_t numel = 0;
  bool decay = true;
  // > 0: the parameter is row-summed (core::ModelSpec::TiedRowElems, which the synchronous step
  // and the asynchronous optimizer both take it from, so their norms keep the same bits): its
  // chunks are whole rows of this many elements and its squared sum is RowwiseSquaredSum's.
  int64_t row_elems = 0;
};

// Parameters are processed in chunks of this many elements; the global norm is the sum of
// per-(parameter, chunk) partial sums taken in (parameter, chunk) order, so the synchronous step
// below and the coordinator's asynchronous per-layer optimizer get bit-identical norms.
inline constexpr int64_t kOptimizerChunk = 1 << 20;
static_assert(kOptimizerChunk == shm::kSquareChunkElems,
              "workers' gradient squares use the optimizer's chunks");
// Elements per chunk of a parameter: kOptimizerChunk, or for a row-summed parameter the most
// whole rows of `row_elems` that fit (at least one).
inline int64_t ChunkElems(int64_t row_elems) {
  return row_elems > 0 ? std::max<int64_t>(1, kOptimizerChunk / row_elems) * row_elems
                       : kOptimizerChunk;
}
// Squared sum of n floats in double: eight interleaved partial sums combined in a fixed order
// (optimizer_step.cc says why), so the same input gives the same bits everywhere.
double SquaredSum(const float* g, int64_t n);
// Adds `other` into g (g[i] += other[i], fp32) and returns the squared sum of the result, summed
// exactly as SquaredSum sums it: the tied parameters' fold and their norm in one pass over memory
// (the fold is on the exact-mode boundary's critical path: the embedding's last gradient comes
// last).
double AddAndSquaredSum(float* g, const float* other, int64_t n);
// The squared sum of a row-summed chunk: SquaredSum of each row of `cols` elements, added in row
// order. Why rows: the tied embedding's gradient is the head's (dense, final early in the
// backward) plus the input lookup's, which is zero outside the rows of the step's tokens and
// comes last. Summed by rows, the head's rows are squared while the backward runs and only the
// looked-up rows are folded and squared again at the step boundary (AsyncOptimizer), with the
// same bits as summing every row there.
double RowwiseSquaredSum(const float* g, int64_t rows, int64_t cols);
// Multiplier for gradients with global norm `norm` under clipping threshold `clip` (0 = off).
double ClipScale(double norm, double clip);

// Updates elements [0, n) of one parameter with the configured optimizer (adamw or sgd); `v` is
// unused (may be null) for sgd. `writes` picks the pass (adamw.h: UpdateWrites). The one place
// both the synchronous step and the asynchronous per-layer optimizer go through.
void UpdateRange(const core::OptimizerConfig& opt, double lr, int64_t step_one_based, bool decay,
                 float grad_scale, const float* grad, float* master, float* m, float* v, int64_t n,
                 void* compute, ComputeDtype dtype, UpdateWrites writes = UpdateWrites::kAll);

struct OptimizerStepResult {
  double grad_norm = 0.0;   // before clipping
  double clip_scale = 1.0;  // multiplier applied to the gradients
};

OptimizerStepResult OptimizerStep(const std::vector<ParamArrays>& params,
                                  const core::OptimizerConfig& opt, double lr,
                                  int64_t step_one_based, double grad_clip, ComputeDtype dtype,
                                  int threads);

}  // namespace rp::coord
