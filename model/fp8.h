// SPDX-License-Identifier: Apache-2.0
// E4M3 arithmetic for train.dtype = "fp8": how a tensor's rows are scaled and rounded before an
// e4m3 matrix product, as LibTorch tensor ops.
//
// Contract:
//  * The format is OCP FP8 E4M3 in its "fn" variant (LibTorch's float8_e4m3fn): no infinities,
//    finite values up to 448, 3 mantissa bits, subnormals in steps of 2^-9.
//  * Scales are powers of two, one per row: row r's is the smallest 2^k with amax_r / 2^k <= 448,
//    k >= -126 (1 for a row of zeros; NaN for a row holding a non-finite value, so that the
//    product is not finite either, as the bf16 product would not be). Dividing by a power of two
//    is exact, so the only rounding of a quantized element is e4m3's own (to nearest, ties to
//    even), whatever device divides.
//  * Every function here runs on the tensor's own device, computes in fp32 and returns fp32
//    values. The CPU tests check them against a table of every e4m3 value; the GPU tests check
//    the CUDA worker's fused quantization (FusedKernels::QuantizeRowsE4m3) against them bit for
//    bit.
#pragma once

#include <ATen/ATen.h>

namespace rp::model {

// The largest finite e4m3 value.
constexpr double kE4m3Max = 448.0;

// x [rows, cols] (any floating dtype) -> its rows' scales, fp32 [rows, 1], each a power of two.
at::Tensor E4m3RowScales(const at::Tensor& x);
// Each element of v (fp32) rounded to the nearest e4m3 value, ties to the even mantissa; beyond
// +-448 saturated to +-448. NaN stays NaN.
at::Tensor RoundToE4m3(const at::Tensor& v);
// What an e4m3 product sees of x [rows, cols]: RoundToE4m3(x / scales) * scales, fp32.
at::Tensor E4m3RoundTripRows(const at::Tensor& x);

}  // namespace rp::model
