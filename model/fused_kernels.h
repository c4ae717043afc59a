// SPDX-License-Identifier: Apache-2.0
// FusedKernels: the Transformer's optional fast paths for a device that has them.
//
// Contract:
//  * Each method computes what the Transformer's LibTorch composite computes for the same inputs
//    (up to rounding: fp32 statistics, one rounding to the tensor's dtype), on the tensors'
//    device, enqueued on the worker's compute stream (LibTorch's default stream; the CUDA
//    backend switches the current stream only inside its own copy paths, never around model
//    math), without synchronizing. One difference: a label outside the
//    vocabulary gives a NaN row loss (and a zero gradient row) where the composite throws; the
//    data loader has already refused such tokens, and a NaN loss is visible in the metrics.
//  * The CPU path never uses them: the composite ops stay the oracle, and the GPU tests compare
//    a worker using these kernels with it. A backend provides them through its Device (the CUDA
//    worker's come from gpu_worker/cuda; model/ itself never includes CUDA headers).
//  * Inputs are float32 or bfloat16; anything else (or a tensor on another device) throws
//    std::invalid_argument naming the argument.
#pragma once

#include <ATen/ATen.h>

#include <utility>

namespace rp::model {

class FusedKernels {
 public:
  virtual ~FusedKernels() = default;

  // logits [n, vocab] contiguous, labels [n] int64 (-100 = ignored). Returns each row's
  // cross-entropy as fp32 [n] (0 for an ignored row, NaN for a label outside [0, vocab)). With
  // write_grad, overwrites `logits` with scale * (softmax - onehot(label)), the gradient of
  // scale * sum(row losses), zeros for ignored rows. No fp32 copy of the logits is made.
  virtual at::Tensor CrossEntropyInPlace(at::Tensor logits, const at::Tensor& labels, double scale,
                                         bool write_grad) const = 0;

  // Rotary embedding of x [batch, seq, heads, dim] (contiguous) with tables cos and sin_signed
  // [seq, dim] (sin with its first half negated): x * cos + roll(x, dim/2) * sin_signed, as
  // Transformer::Rope computes on the transposed view. `backward` applies the transpose (maps
  // dL/dy to dL/dx).
  virtual at::Tensor Rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin_signed,
                          bool backward) const = 0;

  // Qwen3's per-head q/k RMSNorm (weight w [dim], epsilon eps) followed by RoPE, in one pass:
  // Rope(RmsNorm(x)) for x [batch, seq, heads, dim] contiguous, with one rounding instead of two.
  // HeadNormRopeSupports(dim) says whether `dim` is one the kernel takes (64, 128, 256).
  virtual bool HeadNormRopeSupports(int64_t dim) const = 0;
  virtual at::Tensor HeadNormRope(const at::Tensor& x, const at::Tensor& w, const at::Tensor& cos,
                                  const at::Tensor& sin_signed, double eps) const = 0;
  // From dL/dy (x's shape): {dL/dx, dL/dw} (dL/dw in w's dtype, summed in fp32; undefined
  // without `weight_grad`).
  virtual std::pair<at::Tensor, at::Tensor> HeadNormRopeBackward(
      const at::Tensor& x, const at::Tensor& w, const at::Tensor& cos, const at::Tensor& sin_signed,
      double eps, const at::Tensor& dy, bool weight_grad) const = 0;

  // RMSNorm of x [..., dim] (contiguous) with weight w [dim]: x / sqrt(mean(x^2) + eps) * w, fp32
  // statistics, one rounding. With `res` defined (x's shape and dtype) it normalizes the residual
  // add s = x + res instead, rounded to the dtype as a separate add would be, and returns
  // {s, y}; else {undefined, y}. RmsNormSupports(dim) says whether the kernel takes `dim`.
  virtual bool RmsNormSupports(int64_t dim) const = 0;
  virtual std::pair<at::Tensor, at::Tensor> AddRmsNorm(const at::Tensor& x, const at::Tensor& res,
                                                       const at::Tensor& w, double eps) const = 0;
  // From dL/dy and s (what was normalized): {dL/ds + ds_other (ds_other: the gradient reaching s
  // from its other uses, or undefined), dL/dw in w's dtype, summed in fp32 (undefined without
  // `weight_grad`)}.
  virtual std::pair<at::Tensor, at::Tensor> RmsNormBackward(const at::Tensor& s,
                                                            const at::Tensor& w, double eps,
                                                            const at::Tensor& dy,
                                                            const at::Tensor& ds_other,
                                                            bool weight_grad) const = 0;

  // silu(gate) * up for gate, up [..., cols] with contiguous last dims and equal shapes (views
  // into one [..., 2 * cols] tensor are fine); the result is contiguous.
  virtual at::Tensor SwiGlu(const at::Tensor& gate, const at::Tensor& up) const = 0;
  // From dL/dy: {dL/dgate, dL/dup}, contiguous.
  virtual std::pair<at::Tensor, at::Tensor> SwiGluBackward(const at::Tensor& gate,
                                                           const at::Tensor& up,
                                                           const at::Tensor& dy) const = 0;

  // sink += dy^T x for dy [rows, out] and x [rows, in], both contiguous and of one dtype, into a
  // contiguous float32 sink [out, in]: one matrix product whose products are summed in fp32 and
  // added to the sink in fp32 (no rounding to the inputs' dtype). What at::linear's backward
  // computes for its weight, without rounding it before the sum (Transformer::SetWeightGradSinks).
  virtual void AddWeightGrad(const at::Tensor& sink, const at::Tensor& dy,
                             const at::Tensor& x) const = 0;

  // e4m3 matrix products (train.dtype = "fp8", model/fp8.h's scaling rule).
  // E4m3MatmulSupported: whether this device multiplies row-scaled e4m3 matrices (CUDA: one
  // small product through at::_scaled_mm is tried once; which GPUs LibTorch runs it on depends
  // on its version and build).
  virtual bool E4m3MatmulSupported() const = 0;
  // x [rows, cols] contiguous -> {x / scales rounded to e4m3 (float8_e4m3fn [rows, cols]), the
  // rows' scales (fp32 [rows, 1])}, in one pass; for rows of finite values the same bits as
  // model::E4m3RowScales and model::RoundToE4m3 give (a non-finite row: a NaN scale).
  virtual std::pair<at::Tensor, at::Tensor> QuantizeRowsE4m3(const at::Tensor& x) const = 0;
  // (a * a_scales) (b * b_scales)^T as bf16 [m, n], for a [m, k] and b [n, k] with their scales
  // as QuantizeRowsE4m3 returns them (k and n multiples of 16), the products summed in fp32.
  // `fast_accum`: the tensor cores' faster accumulation (partial sums promoted less often).
  virtual at::Tensor MatmulE4m3(const at::Tensor& a, const at::Tensor& a_scales,
                                const at::Tensor& b, const at::Tensor& b_scales,
                                bool fast_accum) const = 0;
};

}  // namespace rp::model
