// SPDX-License-Identifier: Apache-2.0
#include "config/rope.h"

#include <algorithm>
#include <cmath>

namespace rp::core {

const char* RopeTypeName(RopeConfig::Type t) {
  switch (t) {
    case RopeConfig::Type::kDefault: return "default";
    case RopeConfig::Type::kLinear: return "linear";
    case RopeConfig::Type::kLlama3: return "llama3";
    case RopeConfig::Type::kYarn: return "yarn";
  }
  return "?";
}

std::vector<double> RopeInvFreq(const RopeConfig& rope, int64_t head_dim) {
  const int64_t half = head_dim / 2;
  const double d = static_cast<double>(head_dim);
  std::vector<double> rate(static_cast<size_t>(half));
  for (int64_t i = 0; i < half; ++i) rate[i] = 1.0 / std::pow(rope.theta, 2.0 * i / d);
  constexpr double kTwoPi = 6.283185307179586476925286766559;
  switch (rope.type) {
    case RopeConfig::Type::kDefault: break;
    case RopeConfig::Type::kLinear:
      for (double& r : rate) r /= rope.factor;
      break;
    case RopeConfig::Type::kLlama3: {
      const double ctx = static_cast<double>(rope.original_max_position);
      const double long_wave = ctx / rope.low_freq_factor;    // beyond it: fully scaled
      const double short_wave = ctx / rope.high_freq_factor;  // below it: unchanged
      for (double& r : rate) {
        const double wavelength = kTwoPi / r;
        if (wavelength > long_wave) {
          r /= rope.factor;
        } else if (wavelength >= short_wave) {
          const double smooth = (ctx / wavelength - rope.low_freq_factor) /
                                (rope.high_freq_factor - rope.low_freq_factor);
          r = (1.0 - smooth) * r / rope.factor + smooth * r;
        }
      }
      break;
    }
    case RopeConfig::Type::kYarn: {
      // The dimension (fractional) at which a rate completes `rotations` turns over the
      // pretraining context.
      const double ctx = static_cast<double>(rope.original_max_position);
      auto dim_for = [&](double rotations) {
        return d * std::log(ctx / (rotations * kTwoPi)) / (2.0 * std::log(rope.theta));
      };
      double low = dim_for(rope.beta_fast), high = dim_for(rope.beta_slow);
      if (rope.truncate) {
        low = std::floor(low);
        high = std::ceil(high);
      }
      low = std::max(low, 0.0);
      high = std::min(high, d - 1.0);
      if (low == high) high += 0.001;  // a one-point ramp would divide by zero
      for (int64_t i = 0; i < half; ++i) {
        const double ramp = std::clamp((static_cast<double>(i) - low) / (high - low), 0.0, 1.0);
        const double keep = 1.0 - ramp;  // the share of the unscaled rate
        rate[i] = rate[i] / rope.factor * (1.0 - keep) + rate[i] * keep;
      }
      break;
    }
  }
  return rate;
}

double RopeAttentionFactor(const RopeConfig& rope) {
  return rope.type == RopeConfig::Type::kYarn ? rope.attention_factor : 1.0;
}

}  // namespace rp::core
