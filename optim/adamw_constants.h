// SPDX-License-Identifier: Apache-2.0
// AdamWConstants: the fp32 constants of one AdamW step (optim/adamw.h makes them from
// the step's hyperparameters). A POD with no includes beyond <cstdint>, so nvcc-compiled kernels
// take the very values the CPU loops use.
//
// Contract: with g = grad x grad_scale, one element's update is, in this order and rounding each
// operation to fp32 (no fused multiply-add):
//   p = master x decay;  m' = m x b1 + g x one_minus_b1;  v' = v x b2 + (g x g) x one_minus_b2;
//   denom = sqrt(v') / bc2_sqrt + eps;  p = p - step_size x (m' / denom).
// Every implementation (the CPU's scalar, AVX2 and AVX-512 loops, the CUDA kernel) does exactly
// these operations, so all of them give the same bits.
#pragma once

#include <cstdint>

namespace rp::coord {

struct AdamWConstants {
  float grad_scale, decay, b1, b2, one_minus_b1, one_minus_b2, step_size, bc2_sqrt, eps;
};
static_assert(sizeof(AdamWConstants) == 36, "AdamWConstants is nine floats");

}  // namespace rp::coord
