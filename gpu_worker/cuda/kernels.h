// SPDX-License-Identifier: Apache-2.0
// Launchers of the project's own CUDA kernels (kernels.cu). Plain pointers and the CUDA runtime
// only: the .cu file is compiled by nvcc without LibTorch's headers, and the tensor-level checks
// (device, dtype, contiguity, shapes) are the caller's (fused_kernels.cc).
//
// Contract, common to every launcher: pointers are device memory on the current device, arrays
// are contiguous, `dtype` names the element type of every floating-point array of the call, and
// the work is enqueued on `stream` (nothing synchronizes). Returns the launch's error.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "optim/adamw_constants.h"

namespace rp::worker::kernels {

enum class Dtype { kFloat32, kBFloat16 };

// Cross-entropy of `rows` rows of `vocab` logits against int64 labels (-100 = ignored row).
// row_loss[r] (fp32) = logsumexp(logits[r]) - logits[r][label], 0 for an ignored row, NaN for a
// label outside [0, vocab). With write_grad, logits[r] is overwritten by its gradient
// scale * (softmax(logits[r]) - onehot(label)) (zeros for an ignored row), rounded once to dtype.
// Statistics are fp32: a row max, then a sum of exponentials relative to it (one read of the
// row), then one more read and one write for the gradient.
cudaError_t CrossEntropyRows(Dtype dtype, void* logits, const int64_t* labels, int64_t rows,
                             int64_t vocab, float scale, bool write_grad, float* row_loss,
                             cudaStream_t stream);

// Rotary embedding in the rotate-half convention on x of shape [rows / (seq * heads)..., seq,
// heads, dim] (dim even), with tables cos, sin_signed of shape [seq, dim], where sin_signed is
// sin with its first half negated (model/transformer.cc):
//   forward:  y[i] = x[i] cos[i] + x[(i + dim/2) % dim] sin_signed[i]
//   backward: y[i] = x[i] cos[i] + x[(i + dim/2) % dim] sin_signed[(i + dim/2) % dim]
// (the backward maps dL/dy to dL/dx; the rotation's transpose is itself shifted by dim/2).
// `rows` = number of dim-vectors; computed in fp32 and rounded once.
cudaError_t Rope(Dtype dtype, const void* x, const void* cos, const void* sin_signed, void* y,
                 int64_t rows, int64_t seq, int64_t heads, int64_t dim, bool backward,
                 cudaStream_t stream);

// RMSNorm of each dim-vector followed by RoPE, fused (Qwen3's per-head q/k norm), on x of shape
// [..., seq, heads, dim] (`rows` dim-vectors), weight w [dim], tables as Rope():
//   n = x / sqrt(mean(x^2) + eps) * w;   y = rope(n)   (fp32 inside, one rounding).
// dim must be 64, 128 or 256 (one warp per vector); anything else returns cudaErrorInvalidValue.
cudaError_t HeadNormRope(Dtype dtype, const void* x, const void* w, const void* cos,
                         const void* sin_signed, void* y, int64_t rows, int64_t seq, int64_t heads,
                         int64_t dim, float eps, cudaStream_t stream);
// Its backward from dL/dy: writes dL/dx (dtype) and adds dL/dw into dw_f32 [dim] (fp32, which
// the caller zeroes; null: no weight gradient). Recomputes the statistics from x (nothing saved but
// x).
cudaError_t HeadNormRopeBackward(Dtype dtype, const void* x, const void* w, const void* cos,
                                 const void* sin_signed, const void* dy, void* dx, float* dw_f32,
                                 int64_t rows, int64_t seq, int64_t heads, int64_t dim, float eps,
                                 cudaStream_t stream);

// RMSNorm over rows of `dim` (the model's hidden size), optionally after the residual add that
// precedes it: with `res` non-null, s = x + res is rounded to the dtype and written to `sum`
// (the residual stream), and s is normalized; else s = x.
//   y = s / sqrt(mean(s^2) + eps) * w   (fp32 inside, one rounding).
// One block per row at a time; the forward's threads make 16-byte accesses when the row arrays
// are 16-byte aligned (else element by element, as the backward's; `w` may have any alignment).
// RmsNormSupports(dim) says which sizes, the same for both dtypes: 1024, 2048, 2560, 3072, 4096 and
// 5120.
bool RmsNormSupports(int64_t dim);
cudaError_t AddRmsNorm(Dtype dtype, const void* x, const void* res, const void* w, void* sum,
                       void* y, int64_t rows, int64_t dim, float eps, cudaStream_t stream);
// Its backward from dL/dy, given s: writes dL/ds (plus `ds_other`, the gradient reaching s from
// its other uses, when non-null: the residual's) to `ds`, and adds dL/dw into dw_f32 [dim]
// (fp32, zeroed by the caller; null: no weight gradient).
cudaError_t RmsNormBackward(Dtype dtype, const void* s, const void* w, const void* dy,
                            const void* ds_other, void* ds, float* dw_f32, int64_t rows,
                            int64_t dim, float eps, cudaStream_t stream);

// SwiGLU: y = silu(gate) * up over `rows` rows of `cols`; gate and up rows start every `ld`
// elements (ld = cols for separate tensors), y is contiguous [rows, cols]. fp32 inside.
cudaError_t SwiGlu(Dtype dtype, const void* gate, const void* up, int64_t ld, void* y, int64_t rows,
                   int64_t cols, cudaStream_t stream);
// Its backward: d_gate = dy * up * silu'(gate), d_up = dy * silu(gate), both contiguous
// [rows, cols] (dy too).
cudaError_t SwiGluBackward(Dtype dtype, const void* gate, const void* up, int64_t ld,
                           const void* dy, void* d_gate, void* d_up, int64_t rows, int64_t cols,
                           cudaStream_t stream);

// e4m3 quantization by rows (train.dtype = "fp8"; the rule of model/fp8.h): for each of `rows`
// rows of `cols` elements of x, the row's scale is the smallest power of two 2^k with
// amax / 2^k <= 448 (1 for a row of zeros, NaN for a row holding a non-finite value), written to
// scales[row] (fp32); each element x / 2^k is rounded to e4m3 (to nearest, ties to even,
// saturating at +-448) and its byte written to q (OCP e4m3fn); a non-finite row's bytes are
// whatever its finite elements round to, its NaN scale making the product NaN. One block per
// row: one read for the row's maximum, one more read and one write. rows <= INT32_MAX (the
// caller checks).
cudaError_t QuantizeRowsE4m3(Dtype dtype, const void* x, uint8_t* q, float* scales, int64_t rows,
                             int64_t cols, cudaStream_t stream);

// Rounds n fp32 values to bf16 (round to nearest even on the bit pattern; a NaN stays NaN, made
// quiet), bit for bit as the coordinator's FloatToBFloat16: what a worker fetching the fp32
// masters does to each chunk of weights. `dst` holds the raw bf16 bits.
cudaError_t RoundToBFloat16(const float* src, uint16_t* dst, int64_t n, cudaStream_t stream);

// One AdamW step's compute copy of n elements (adamw_constants.h's operations, each rounded to
// fp32 with the _rn intrinsics so nvcc fuses none of them): out[i] is the updated master, as fp32
// or rounded to bf16 like RoundToBFloat16. grad, master, m and v are only read.
cudaError_t AdamWComputeCopy(const coord::AdamWConstants& k, const float* grad, const float* master,
                             const float* m, const float* v, void* out, Dtype out_dtype, int64_t n,
                             cudaStream_t stream);

}  // namespace rp::worker::kernels
