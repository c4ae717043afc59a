// SPDX-License-Identifier: Apache-2.0
#include "model/fp8.h"

#include <limits>
#include <tuple>

namespace rp::model {
namespace {
// 2^k for an int32 tensor k in [-126, 127], built from the exponent bits, so exact on every
// device (a pow() on some backends is not).
at::Tensor PowerOfTwo(const at::Tensor& k) {
  return k.to(at::kInt).add(127).__lshift__(23).view(at::kFloat);
}
}  // namespace

at::Tensor E4m3RowScales(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2, "E4m3RowScales: x must be [rows, cols], got ", x.sizes());
  at::Tensor amax = std::get<0>(x.to(at::kFloat).abs().max(1, /*keepdim=*/true));
  // amax = m 2^e with m in [0.5, 1); 448 = 0.875 2^9. amax / 2^(e-9) = m / 0.875 <= 1 exactly
  // when m <= 0.875, else one more binade is needed.
  auto [m, e] = at::frexp(amax);
  at::Tensor k =
      e.to(at::kInt).sub(9).add(m.gt(0.875).to(at::kInt)).clamp(-126, 126);  // finite: k <= 120
  at::Tensor scales = at::where(amax.eq(0), at::ones_like(amax), PowerOfTwo(k));
  return at::where(at::isfinite(amax), scales,
                   at::full_like(amax, std::numeric_limits<float>::quiet_NaN()));
}

at::Tensor RoundToE4m3(const at::Tensor& v) {
  at::Tensor f = v.to(at::kFloat).clamp(-kE4m3Max, kE4m3Max);
  // |f| = m 2^e with m in [0.5, 1): its binade [2^(e-1), 2^e) has 8 steps of 2^(e-4), and below
  // the smallest normal (2^-6) the steps stay 2^-9. Scaling by powers of two is exact, and
  // round() rounds half to even.
  at::Tensor e = std::get<1>(at::frexp(f)).to(at::kInt);
  at::Tensor step = e.sub(4).clamp_min(-9);
  return at::round(f * PowerOfTwo(step.neg())) * PowerOfTwo(step);
}

at::Tensor E4m3RoundTripRows(const at::Tensor& x) {
  at::Tensor s = E4m3RowScales(x);
  return RoundToE4m3(x.to(at::kFloat) / s) * s;
}

}  // namespace rp::model
