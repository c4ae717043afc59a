// SPDX-License-Identifier: Apache-2.0
// The e4m3 scaling rule of train.dtype = "fp8" (model/fp8.h) against a reference computation: a
// table of every finite e4m3 value decoded from its bits, searched for the nearest value.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <torch/version.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "model/fp8.h"

namespace rp {
namespace {

// Every finite e4m3fn value with its code, decoded from sign, 4 exponent bits (bias 7) and 3
// mantissa bits; exponent field 0 holds the subnormals, and 0x7f / 0xff are NaN.
struct E4m3Value {
  double value;
  int code;
};
std::vector<E4m3Value> E4m3Table() {
  std::vector<E4m3Value> t;
  for (int code = 0; code < 256; ++code) {
    if ((code & 0x7f) == 0x7f) continue;
    const int exp = (code >> 3) & 0xf, mant = code & 0x7;
    const double mag =
        exp == 0 ? mant / 8.0 * std::ldexp(1.0, -6) : (1.0 + mant / 8.0) * std::ldexp(1.0, exp - 7);
    t.push_back({(code & 0x80) ? -mag : mag, code});
  }
  return t;
}

// The nearest table value to v (in double), ties to the even code (mantissa bit 0 clear), and
// +-448 beyond the largest.
double NearestE4m3(double v, const std::vector<E4m3Value>& table) {
  double best = 0, best_dist = std::numeric_limits<double>::infinity();
  int best_code = 0;
  for (const auto& e : table) {
    const double d = std::abs(e.value - v);
    if (d < best_dist || (d == best_dist && (e.code & 1) == 0 && (best_code & 1) == 1)) {
      best = e.value;
      best_dist = d;
      best_code = e.code;
    }
  }
  return best;
}

TEST(E4m3Rounding, MatchesTheNearestTableValueTiesToEven) {
  const auto table = E4m3Table();
  ASSERT_EQ(table.size(), 254u);
  std::vector<float> probes;
  for (const auto& e : table) probes.push_back(static_cast<float>(e.value));  // exact values
  // Midpoints between neighbours (ties) and points a quarter of the way: every binade, the
  // subnormals and the step from the largest subnormal to the smallest normal.
  std::vector<double> sorted;
  for (const auto& e : table) sorted.push_back(e.value);
  std::sort(sorted.begin(), sorted.end());
  for (size_t i = 0; i + 1 < sorted.size(); ++i) {
    const double a = sorted[i], b = sorted[i + 1];
    probes.push_back(static_cast<float>((a + b) / 2));
    probes.push_back(static_cast<float>(a + (b - a) / 4));
    probes.push_back(static_cast<float>(b - (b - a) / 4));
  }
  // Log-uniform magnitudes from far below the smallest subnormal to beyond 448, both signs.
  at::manual_seed(3);
  at::Tensor r = at::exp2(at::rand({4000}, at::kDouble) * 24.0 - 14.0) *
                 (at::rand({4000}, at::kDouble) - 0.5).sign();
  for (int64_t i = 0; i < r.numel(); ++i) probes.push_back(static_cast<float>(r[i].item<double>()));
  probes.insert(probes.end(),
                {460.0f, -1e6f, 0.0f, -0.0f, std::ldexp(1.0f, -10), std::ldexp(3.0f, -11)});

  at::Tensor v = at::tensor(probes);
  at::Tensor got = model::RoundToE4m3(v);
  ASSERT_EQ(got.scalar_type(), at::kFloat);
  int mismatches = 0;
  for (int64_t i = 0; i < v.numel(); ++i) {
    const double want = NearestE4m3(v[i].item<float>(), table);
    const double have = got[i].item<float>();
    if (have != want && mismatches++ < 10)
      ADD_FAILURE() << "RoundToE4m3(" << v[i].item<float>() << ") = " << have
                    << ", nearest e4m3 is " << want;
  }
  EXPECT_EQ(mismatches, 0) << "of " << v.numel();
  EXPECT_TRUE(std::isnan(model::RoundToE4m3(at::tensor({std::nanf("")}))[0].item<float>()));
}

TEST(E4m3RowScales, AreTheSmallestPowersOfTwoThatFitTheRowInto448) {
  const float up = std::nextafter(448.0f, 1e9f);
  at::Tensor x = at::zeros({7, 5});
  x[0][2] = 448.0f;            // fits at 2^0 exactly
  x[1][0] = -up;               // just above: 2^1
  x[2][4] = 448.0f * 1024.0f;  // 2^10
  x[3][1] = 3.0f;              // 3 / 2^-7 = 384 fits, 3 / 2^-8 = 768 does not
  x[4][3] = 1e-30f;            // far below: 2^-108
  // row 5 stays zero: scale 1
  x[6][0] = std::numeric_limits<float>::infinity();
  at::Tensor s = model::E4m3RowScales(x);
  ASSERT_EQ(s.sizes(), (std::vector<int64_t>{7, 1}));
  ASSERT_EQ(s.scalar_type(), at::kFloat);
  EXPECT_EQ(s[0][0].item<float>(), 1.0f);
  EXPECT_EQ(s[1][0].item<float>(), 2.0f);
  EXPECT_EQ(s[2][0].item<float>(), 1024.0f);
  EXPECT_EQ(s[3][0].item<float>(), std::ldexp(1.0f, -7));
  EXPECT_EQ(s[4][0].item<float>(), std::ldexp(1.0f, -108));
  EXPECT_EQ(s[5][0].item<float>(), 1.0f);
  EXPECT_TRUE(std::isnan(s[6][0].item<float>()));

  // Random rows of every magnitude: a power of two, amax / s in (224, 448].
  at::manual_seed(4);
  at::Tensor y = at::randn({300, 64}) * at::exp2(at::rand({300, 1}) * 60.0 - 30.0);
  at::Tensor sy = model::E4m3RowScales(y);
  at::Tensor ratio = std::get<0>(y.abs().max(1, true)) / sy;
  EXPECT_LE(ratio.max().item<float>(), 448.0f);
  EXPECT_GT(ratio.min().item<float>(), 224.0f);
  auto [m, e] = at::frexp(sy);
  EXPECT_TRUE(m.eq(0.5).all().item<bool>());
}

TEST(E4m3RoundTripRows, RoundsEachRowRelativeToItsOwnScale) {
  at::manual_seed(5);
  // Rows six binades apart: each keeps e4m3's relative precision (half a step, 2^-4) at its own
  // scale, which one scale for the whole tensor would not give the small rows.
  at::Tensor x =
      at::randn({12, 256}) * at::exp2(at::arange(12, at::kFloat).mul(-6.0)).view({12, 1});
  x.narrow(1, 0, 16).mul_(1e-5);  // below each row's smallest normal
  at::Tensor y = model::E4m3RoundTripRows(x);
  at::Tensor s = model::E4m3RowScales(x);
  EXPECT_TRUE(y.equal(model::RoundToE4m3(x / s) * s));
  at::Tensor normal = x.abs().ge(s * std::ldexp(1.0, -6));  // e4m3 normals at this row's scale
  at::Tensor rel = ((y - x).abs() / x.abs()).masked_select(normal);
  EXPECT_LE(rel.max().item<float>(), 1.0f / 16.0f);
  EXPECT_GT(rel.max().item<float>(), 1.0f / 64.0f);  // it did round
  // Below the normals the error is at most half a subnormal step (2^-10 at the row's scale).
  at::Tensor sub = ((y - x).abs() / s).masked_select(normal.logical_not());
  ASSERT_GT(sub.numel(), 0);
  EXPECT_LE(sub.max().item<float>(), std::ldexp(1.0f, -10));
  // bf16 input: the same rule on its values.
  at::Tensor xb = x.to(at::kBFloat16);
  EXPECT_TRUE(model::E4m3RoundTripRows(xb).equal(model::E4m3RoundTripRows(xb.to(at::kFloat))));
}

#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 1)
TEST(E4m3Rounding, MatchesLibTorchsFloat8Conversion) {
  at::manual_seed(6);
  at::Tensor v =
      (at::randn({20000}) * at::exp2(at::rand({20000}) * 20.0 - 12.0)).clamp(-448.0, 448.0);
  EXPECT_TRUE(model::RoundToE4m3(v).equal(v.to(at::kFloat8_e4m3fn).to(at::kFloat)));
}
#endif

}  // namespace
}  // namespace rp
