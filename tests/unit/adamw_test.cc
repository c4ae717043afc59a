// SPDX-License-Identifier: Apache-2.0
#include <gtest/gtest.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <ATen/ATen.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "optim/adamw.h"
#include "optim/loss_scaler.h"
#include "optim/optimizer_step.h"

namespace rp::coord {
namespace {

TEST(AdamW, MatchesTorchOptimAdamWOverSeveralSteps) {
  at::manual_seed(3);
  for (int64_t n : {1, 7, 1000, 4099}) {
    at::Tensor p_ref = at::randn({n});
    std::vector<float> master(p_ref.data_ptr<float>(), p_ref.data_ptr<float>() + n);
    std::vector<float> m(n, 0.f), v(n, 0.f), compute(n, 0.f);
    p_ref.set_requires_grad(true);
    const double lr = 3e-3, wd = 0.1;
    torch::optim::AdamW opt(
        {p_ref}, torch::optim::AdamWOptions(lr).betas({0.9, 0.95}).eps(1e-8).weight_decay(wd));
    for (int step = 1; step <= 5; ++step) {
      at::Tensor g = at::randn({n});
      p_ref.mutable_grad() = g.clone();
      opt.step();
      AdamWHyper h{lr, 0.9, 0.95, 1e-8, wd, step};
      AdamWUpdate(h, 1.0f, g.data_ptr<float>(), master.data(), m.data(), v.data(), n,
                  compute.data(), ComputeDtype::kFloat32);
    }
    at::Tensor ours = at::from_blob(master.data(), {n}).clone();
    at::Tensor ref = p_ref.detach();
    const double max_diff = (ours - ref).abs().max().item<double>();
    EXPECT_LT(max_diff, 1e-6) << "n=" << n;
    EXPECT_TRUE(at::equal(at::from_blob(compute.data(), {n}), ours));
  }
}

TEST(Sgd, MatchesTorchOptimSgdWithMomentumAndWeightDecay) {
  at::manual_seed(8);
  const int64_t n = 1029;
  at::Tensor p_ref = at::randn({n});
  std::vector<float> master(p_ref.data_ptr<float>(), p_ref.data_ptr<float>() + n);
  std::vector<float> buf(n, 0.f), compute(n, 0.f);
  p_ref.set_requires_grad(true);
  torch::optim::SGD opt({p_ref}, torch::optim::SGDOptions(0.05).momentum(0.9).weight_decay(0.01));
  for (int step = 1; step <= 5; ++step) {
    at::Tensor g = at::randn({n});
    p_ref.mutable_grad() = g.clone();
    opt.step();
    SgdUpdate(SgdHyper{0.05, 0.9, 0.01}, 1.0f, g.data_ptr<float>(), master.data(), buf.data(), n,
              compute.data(), ComputeDtype::kFloat32);
  }
  at::Tensor ours = at::from_blob(master.data(), {n}).clone();
  EXPECT_LT((ours - p_ref.detach()).abs().max().item<double>(), 1e-6);
  EXPECT_TRUE(at::equal(at::from_blob(compute.data(), {n}), ours));
}

TEST(AdamW, Bf16ComputeCopyIsTheRoundedMaster) {
  at::manual_seed(6);
  const int64_t n = 1037;  // not a multiple of any vector width: exercises the loop tail
  at::Tensor g = at::randn({n});
  std::vector<float> master(n, 0.5f), m(n, 0.f), v(n, 0.f);
  std::vector<uint16_t> bf(n, 0);
  AdamWHyper h{1e-2, 0.9, 0.95, 1e-8, 0.1, 1};
  AdamWUpdate(h, 1.0f, g.data_ptr<float>(), master.data(), m.data(), v.data(), n, bf.data(),
              ComputeDtype::kBFloat16);
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(bf[i], FloatToBFloat16(master[i])) << i;
}

// Distance in units in the last place between two floats of the same sign class.
int64_t UlpDistance(float a, float b) {
  int32_t ia, ib;
  std::memcpy(&ia, &a, 4);
  std::memcpy(&ib, &b, 4);
  if (ia < 0) ia = std::numeric_limits<int32_t>::min() - ia;
  if (ib < 0) ib = std::numeric_limits<int32_t>::min() - ib;
  return std::abs(static_cast<int64_t>(ia) - static_cast<int64_t>(ib));
}

// Every SIMD path this CPU has against the scalar oracle: random data over several magnitudes,
// lengths that are not multiples of 8 or 16, a gradient scale (clipping), both compute dtypes,
// several steps (bias correction). The contract allows 4 ulp; the paths do the same IEEE
// operations, so the count of differing elements is reported too.
TEST(AdamW, SimdPathsMatchTheScalarOracle) {
  std::mt19937 rng(11);
  std::normal_distribution<float> normal;
  std::vector<SimdLevel> levels = {SimdLevel::kAvx2, SimdLevel::kAvx512};
  int tested = 0;
  for (SimdLevel level : levels) {
    if (static_cast<int>(level) > static_cast<int>(BestSimdLevel())) continue;
    tested++;
    for (int64_t n : {1, 7, 15, 17, 33, 1000, 4099}) {
      for (ComputeDtype dtype : {ComputeDtype::kBFloat16, ComputeDtype::kFloat32}) {
        std::vector<float> g(n), master(n), m(n), v(n);
        for (int64_t i = 0; i < n; ++i) {
          const float mag = std::pow(10.0f, static_cast<float>(i % 7) - 4.0f);
          g[i] = normal(rng) * mag;
          master[i] = normal(rng);
          m[i] = normal(rng) * 1e-3f;
          v[i] = std::abs(normal(rng)) * 1e-6f;
        }
        if (n > 3) g[3] = 0.0f;
        auto master2 = master, m2 = m, v2 = v;
        std::vector<float> out32(n), out32b(n);
        std::vector<uint16_t> out16(n), out16b(n);
        void* o1 =
            dtype == ComputeDtype::kFloat32 ? static_cast<void*>(out32.data()) : out16.data();
        void* o2 =
            dtype == ComputeDtype::kFloat32 ? static_cast<void*>(out32b.data()) : out16b.data();
        for (int64_t step = 1; step <= 3; ++step) {
          AdamWHyper h{1e-3, 0.9, 0.95, 1e-8, 0.1, step};
          AdamWUpdateWith(SimdLevel::kScalar, h, 0.5f, g.data(), master.data(), m.data(), v.data(),
                          n, o1, dtype);
          AdamWUpdateWith(level, h, 0.5f, g.data(), master2.data(), m2.data(), v2.data(), n, o2,
                          dtype);
        }
        int64_t worst = 0;
        for (int64_t i = 0; i < n; ++i) {
          worst = std::max({worst, UlpDistance(master[i], master2[i]), UlpDistance(m[i], m2[i]),
                            UlpDistance(v[i], v2[i])});
          if (dtype == ComputeDtype::kBFloat16)
            ASSERT_EQ(out16b[i], FloatToBFloat16(master2[i]))
                << SimdLevelName(level) << " n=" << n << " i=" << i;
          else ASSERT_EQ(out32b[i], master2[i]);
        }
        EXPECT_LE(worst, 4) << SimdLevelName(level) << " n=" << n;
        EXPECT_EQ(worst, 0) << "expected the same bits: " << SimdLevelName(level) << " n=" << n;
      }
    }
  }
  std::printf("SIMD paths checked against the scalar oracle: %d (best here: %s)\n", tested,
              SimdLevelName(BestSimdLevel()));
}

// The exact-mode optimizer updates in two passes (kFetched, then kRest; adamw.h). For every SIMD
// path of AdamW (SGD runs the loader's pick each time), every compute-copy layout (master aliased
// as its own fp32 copy, a separate fp32 copy, a bf16 copy) and both optimizers: the two passes
// leave exactly the bits of one kAll pass, and after the first pass alone only the fetched array
// has changed.
TEST(AdamW, TwoPassesLeaveTheBitsOfOne) {
  std::mt19937 rng(12);
  std::normal_distribution<float> normal;
  enum class Copy { kAliased, kFloat32, kBFloat16 };
  for (SimdLevel level : {SimdLevel::kScalar, SimdLevel::kAvx2, SimdLevel::kAvx512}) {
    if (static_cast<int>(level) > static_cast<int>(BestSimdLevel())) continue;
    for (bool sgd : {false, true}) {
      for (Copy copy : {Copy::kAliased, Copy::kFloat32, Copy::kBFloat16}) {
        const int64_t n = 1043;  // a loop tail for every vector width
        struct Arrays {
          std::vector<float> master, m, v, out32;
          std::vector<uint16_t> out16;
        };
        Arrays one, two;
        std::vector<float> g(n);
        for (int64_t i = 0; i < n; ++i) g[i] = normal(rng) * 1e-2f;
        one.master.resize(n);
        one.m.resize(n);
        one.v.resize(n);
        for (int64_t i = 0; i < n; ++i) {
          one.master[i] = normal(rng);
          one.m[i] = normal(rng) * 1e-3f;
          one.v[i] = std::abs(normal(rng)) * 1e-6f;
        }
        one.out32.assign(n, 0.0f);
        one.out16.assign(n, 0);
        two = one;
        auto target = [&](Arrays& a, ComputeDtype* dtype) -> void* {
          *dtype = copy == Copy::kBFloat16 ? ComputeDtype::kBFloat16 : ComputeDtype::kFloat32;
          if (copy == Copy::kAliased) return a.master.data();
          if (copy == Copy::kFloat32) return a.out32.data();
          return a.out16.data();
        };
        auto update = [&](Arrays& a, UpdateWrites writes) {
          ComputeDtype dtype;
          void* out = target(a, &dtype);
          if (sgd)
            SgdUpdate(SgdHyper{0.05, 0.9, 0.01}, 0.5f, g.data(), a.master.data(), a.m.data(), n,
                      out, dtype, writes);
          else
            AdamWUpdateWith(level, AdamWHyper{1e-3, 0.9, 0.95, 1e-8, 0.1, 2}, 0.5f, g.data(),
                            a.master.data(), a.m.data(), a.v.data(), n, out, dtype, writes);
        };
        const std::string what = std::string(SimdLevelName(level)) + (sgd ? " sgd" : " adamw") +
                                 " copy " + std::to_string(static_cast<int>(copy));
        const Arrays before = one;
        update(one, UpdateWrites::kAll);
        update(two, UpdateWrites::kFetched);
        if (sgd && copy == Copy::kAliased) {
          // Nothing can be deferred there (adamw.h): the first pass is the whole update.
          EXPECT_EQ(two.master, one.master) << what;
          EXPECT_EQ(two.m, one.m) << what;
          update(two, UpdateWrites::kRest);
          EXPECT_EQ(two.master, one.master) << what;
          EXPECT_EQ(two.m, one.m) << what;
          continue;
        }
        // Only the fetched array changed.
        EXPECT_EQ(two.m, before.m) << what;
        EXPECT_EQ(two.v, before.v) << what;
        if (copy == Copy::kAliased) {
          EXPECT_EQ(two.master, one.master) << what;
        } else {
          EXPECT_EQ(two.master, before.master) << what;
          EXPECT_EQ(two.out32, one.out32) << what;
          EXPECT_EQ(two.out16, one.out16) << what;
        }
        update(two, UpdateWrites::kRest);
        EXPECT_EQ(std::memcmp(one.master.data(), two.master.data(), n * 4), 0) << what;
        EXPECT_EQ(std::memcmp(one.m.data(), two.m.data(), n * 4), 0) << what;
        EXPECT_EQ(std::memcmp(one.v.data(), two.v.data(), n * 4), 0) << what;
        EXPECT_EQ(two.out32, one.out32) << what;
        EXPECT_EQ(two.out16, one.out16) << what;
        EXPECT_NE(one.m, before.m) << what;
      }
    }
  }
}

// The gradient norm's squared sum: eight interleaved partial sums in element order, combined
// pairwise (optimizer_step.h), whatever instruction set runs it; the fused fold gives the bits of
// the add followed by the sum.
TEST(OptimizerStep, SquaredSumIsTheDefinedLaneSum) {
  std::mt19937 rng(13);
  std::normal_distribution<float> normal;
  for (int64_t n : {0, 1, 7, 8, 9, 1000, 4099}) {
    std::vector<float> g(n), o(n);
    for (int64_t i = 0; i < n; ++i) {
      g[i] = normal(rng) * std::pow(10.0f, static_cast<float>(i % 5) - 2.0f);
      o[i] = normal(rng);
    }
    double lane[8] = {};
    for (int64_t i = 0; i < n; ++i)
      lane[i % 8] += static_cast<double>(g[i]) * static_cast<double>(g[i]);
    const double want =
        ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
    EXPECT_EQ(SquaredSum(g.data(), n), want) << n;
    std::vector<float> folded = g;
    for (int64_t i = 0; i < n; ++i) folded[i] += o[i];
    std::vector<float> fused = g;
    const double s = AddAndSquaredSum(fused.data(), o.data(), n);
    EXPECT_EQ(fused, folded) << n;
    EXPECT_EQ(s, SquaredSum(folded.data(), n)) << n;
  }
}

TEST(AdamW, BFloat16ConversionMatchesATen) {
  at::manual_seed(4);
  at::Tensor x =
      at::cat({at::randn({10000}) * 100, at::tensor({0.f, -0.f, 1e-40f, 65504.f, 3.0e38f})});
  at::Tensor ref = x.to(at::kBFloat16).to(at::kFloat);
  for (int64_t i = 0; i < x.numel(); ++i) {
    float f = x[i].item<float>();
    ASSERT_EQ(BFloat16ToFloat(FloatToBFloat16(f)), ref[i].item<float>()) << f;
  }
}

TEST(AdamW, HalfConversionsMatchATen) {
  // Every half back to float.
  for (uint32_t h = 0; h < 65536; ++h) {
    c10::Half ref;
    ref.x = static_cast<uint16_t>(h);
    const float want = static_cast<float>(ref), got = HalfToFloat(static_cast<uint16_t>(h));
    if (std::isnan(want)) {
      ASSERT_TRUE(std::isnan(got)) << h;
    } else {
      ASSERT_EQ(std::memcmp(&want, &got, 4), 0) << h;
    }
  }
  // Floats to half: random magnitudes across the whole range, ties, the subnormals, overflow.
  at::manual_seed(5);
  std::vector<float> xs;
  at::Tensor r = at::randn({20000}) * at::pow(2.0, at::randint(-30, 20, {20000}).to(at::kFloat));
  for (int64_t i = 0; i < r.numel(); ++i) xs.push_back(r[i].item<float>());
  for (float f :
       {0.f, -0.f, 65504.f, 65519.99f, 65520.f, -65520.f, 1e30f, 5.9604645e-8f, 2.9802322e-8f,
        2.9802326e-8f, 8.940697e-8f, 6.097555e-5f, 6.1035156e-5f, 1.0009766f, 1.0004883f,
        1.0014648f, std::numeric_limits<float>::infinity(), 1e-45f})
    xs.push_back(f);
  std::vector<uint16_t> fast(xs.size());
  FloatsToHalves(xs.data(), fast.data(), static_cast<int64_t>(xs.size()));
  for (size_t i = 0; i < xs.size(); ++i) {
    const uint16_t want = c10::Half(xs[i]).x;
    ASSERT_EQ(FloatToHalf(xs[i]), want) << xs[i];
    ASSERT_EQ(fast[i], want) << xs[i];
  }
  const float nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(std::isnan(HalfToFloat(FloatToHalf(nan))));
}

TEST(AdamW, Fp16ComputeCopyIsTheRoundedMasterInEitherPassOrder) {
  core::OptimizerConfig opt;
  std::vector<float> grad = {0.5f, -1.25f, 3.0f, 1e-3f}, master = {1.0f, -2.0f, 70000.0f, 0.1f};
  std::vector<float> m(4, 0.0f), v(4, 0.0f);
  auto one = master, one_m = m, one_v = v, two = master, two_m = m, two_v = v;
  std::vector<uint16_t> c1(4), c2(4);
  UpdateRange(opt, 1e-2, 1, true, 1.0f, grad.data(), one.data(), one_m.data(), one_v.data(), 4,
              c1.data(), ComputeDtype::kFloat16, UpdateWrites::kAll);
  UpdateRange(opt, 1e-2, 1, true, 1.0f, grad.data(), two.data(), two_m.data(), two_v.data(), 4,
              c2.data(), ComputeDtype::kFloat16, UpdateWrites::kFetched);
  UpdateRange(opt, 1e-2, 1, true, 1.0f, grad.data(), two.data(), two_m.data(), two_v.data(), 4,
              c2.data(), ComputeDtype::kFloat16, UpdateWrites::kRest);
  std::vector<float> f32 = master, f32_m = m, f32_v = v;
  UpdateRange(opt, 1e-2, 1, true, 1.0f, grad.data(), f32.data(), f32_m.data(), f32_v.data(), 4,
              f32.data(), ComputeDtype::kFloat32, UpdateWrites::kAll);
  EXPECT_EQ(one, f32);
  EXPECT_EQ(two, f32);
  EXPECT_EQ(one_m, f32_m);
  EXPECT_EQ(two_v, f32_v);
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(c1[i], c10::Half(f32[i]).x) << i;
    EXPECT_EQ(c2[i], c10::Half(f32[i]).x) << i;
  }
  EXPECT_TRUE(std::isinf(HalfToFloat(c1[2])));  // 70000 is past fp16's range
}

TEST(LossScaler, FollowsGradScalersRule) {
  // torch.amp.GradScaler(init_scale=1000, growth_factor=3, backoff_factor=0.3, growth_interval=3)
  // after each step's found-inf flag, worked out by hand from its update rule.
  core::LossScaling c{1000.0, 3.0, 0.3, 3};
  const bool inf[] = {false, false, false, true, false, false, false, false, true, true};
  const double scale[] = {1000, 1000, 3000, 900, 900, 900, 2700, 2700, 810, 243};
  const int64_t tracker[] = {1, 2, 0, 0, 1, 2, 0, 1, 0, 0};
  const int64_t skipped[] = {0, 0, 0, 1, 1, 1, 1, 1, 2, 3};
  shm::LossScalerState s = InitialLossScaler(c);
  EXPECT_EQ(s.step, -1);
  for (int t = 0; t < 10; ++t) {
    s = NextLossScaler(s, inf[t], c);
    EXPECT_EQ(s.step, t);
    EXPECT_EQ(s.scale, static_cast<double>(static_cast<float>(scale[t]))) << t;
    EXPECT_EQ(s.growth_tracker, tracker[t]) << t;
    EXPECT_EQ(s.skipped, skipped[t]) << t;
  }
  // The scale is fp32: 0.3 x 2700 rounds as torch's float tensor does, and growth stops short of
  // infinity.
  EXPECT_EQ(NextLossScaler({0, 2700.0, 0, 0}, true, c).scale,
            static_cast<double>(static_cast<float>(2700 * 0.3)));
  core::LossScaling big{3e38, 2.0, 0.5, 1};
  EXPECT_EQ(NextLossScaler(InitialLossScaler(big), false, big).scale, static_cast<double>(3e38f));
}

TEST(OptimizerStep, ClipsByGlobalNormAndIsThreadCountIndependent) {
  at::manual_seed(5);
  std::vector<at::Tensor> grads = {at::randn({300}) * 3, at::randn({5000}) * 2};
  auto run = [&](int threads, std::vector<std::vector<float>>* out) {
    std::vector<std::vector<float>> master, m, v;
    std::vector<ParamArrays> arrays;
    for (auto& g : grads) {
      master.emplace_back(g.numel(), 1.0f);
      m.emplace_back(g.numel(), 0.0f);
      v.emplace_back(g.numel(), 0.0f);
    }
    for (size_t i = 0; i < grads.size(); ++i) {
      ParamArrays a;
      a.master = master[i].data();
      a.m = m[i].data();
      a.v = v[i].data();
      a.grad = grads[i].data_ptr<float>();
      a.compute = master[i].data();
      a.numel = grads[i].numel();
      arrays.push_back(a);
    }
    core::OptimizerConfig o;
    auto r = OptimizerStep(arrays, o, 1e-2, 1, 1.0, ComputeDtype::kFloat32, threads);
    *out = master;
    return r;
  };
  std::vector<std::vector<float>> a, b;
  auto r1 = run(1, &a);
  auto r4 = run(4, &b);
  const double norm =
      std::sqrt(grads[0].pow(2).sum().item<double>() + grads[1].pow(2).sum().item<double>());
  EXPECT_NEAR(r1.grad_norm, norm, 1e-6 * norm);
  EXPECT_NEAR(r1.clip_scale, 1.0 / norm, 1e-6);
  EXPECT_EQ(r1.grad_norm, r4.grad_norm);
  EXPECT_EQ(a, b);
}

}  // namespace
}  // namespace rp::coord
