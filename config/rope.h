// SPDX-License-Identifier: Apache-2.0
// Rotary position embedding rates: the one definition of every supported RoPE variant.
//
// Contract:
//  * RopeInvFreq() returns head_dim / 2 angular rates (radians per position), the rate of
//    dimension pair i, in double. Position p rotates pair i by p * rate[i]; the tables built from
//    them are cos(p * rate) and sin(p * rate), each multiplied by RopeAttentionFactor().
//  * The variants follow transformers' definitions (modeling_rope_utils): "default"
//    theta^(-2i/d); "linear" that divided by factor; "llama3" the long wavelengths (above
//    original_max_position / low_freq_factor) divided by factor, the short ones (below
//    original_max_position / high_freq_factor) kept, a linear blend between; "yarn" a blend of
//    the default and the linearly scaled rates over a ramp of dimensions set by beta_fast and
//    beta_slow, with cos and sin scaled by attention_factor.
//  * transformers computes the rates and angles in fp32; these are exact in double and rounded
//    once when the tables take the compute dtype.
//  * Pure functions of the config: no state, thread-safe.
#pragma once

#include <vector>

#include "config/job_config.h"

namespace rp::core {

std::vector<double> RopeInvFreq(const RopeConfig& rope, int64_t head_dim);
double RopeAttentionFactor(const RopeConfig& rope);

}  // namespace rp::core
