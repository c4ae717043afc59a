// SPDX-License-Identifier: Apache-2.0
#include "coordinator/optim/adamw.h"

#include <atomic>
#include <cmath>
#include <cstring>
#include <thread>
#include <type_traits>
#include <vector>

namespace rp::coord {

uint16_t FloatToBFloat16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);  // NaN
  const uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

float BFloat16ToFloat(uint16_t b) {
  uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

namespace {

// Round-to-nearest-even without a branch, so the loop below vectorizes. NaN stays NaN (quiet).
inline uint16_t ToBf16Branchless(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const uint32_t nan = (bits >> 16) | 0x40u;
  const bool is_nan = (bits & 0x7fffffffu) > 0x7f800000u;
  return static_cast<uint16_t>(is_nan ? nan : rounded);
}

// One element-wise pass; the compute copy's type is a template parameter so the inner loop has no
// branch (Out = void: the master is its own compute copy, as in rp-train-ref). The same operation order as torch.optim.AdamW (single-tensor path) so results agree to
// rounding. target_clones compiles AVX-512, AVX2 and baseline versions and picks one at load
// time for the CPU at hand (the coordinator host is not known at build time).
template <typename Out>
__attribute__((target_clones("avx512f", "avx2", "default")))
void AdamWLoop(const float* __restrict grad, float* __restrict master, float* __restrict m,
               float* __restrict v, Out* __restrict out_copy, int64_t n, float grad_scale, float decay,
               float b1, float b2, float one_minus_b1, float one_minus_b2, float step_size,
               float bc2_sqrt, float eps) {
  for (int64_t i = 0; i < n; ++i) {
    const float g = grad[i] * grad_scale;
    float p = master[i] * decay;
    const float mi = m[i] * b1 + g * one_minus_b1;
    const float vi = v[i] * b2 + g * g * one_minus_b2;
    const float denom = std::sqrt(vi) / bc2_sqrt + eps;
    p = p - step_size * (mi / denom);
    master[i] = p;
    m[i] = mi;
    v[i] = vi;
    if constexpr (std::is_same_v<Out, float>) out_copy[i] = p;
    if constexpr (std::is_same_v<Out, uint16_t>) out_copy[i] = ToBf16Branchless(p);
  }
}

// Calls loop(out) with the compute copy typed for its dtype, or with a void* null when the master
// is its own copy (fp32, aliased): one place that picks the loop instantiation for every optimizer.
template <typename Loop>
void WithComputeCopy(void* compute, const float* master, ComputeDtype dtype, Loop&& loop) {
  if (dtype == ComputeDtype::kFloat32 && compute == master) loop(static_cast<void*>(nullptr));
  else if (dtype == ComputeDtype::kFloat32) loop(static_cast<float*>(compute));
  else loop(static_cast<uint16_t*>(compute));
}

}  // namespace

void AdamWUpdate(const AdamWHyper& h, float grad_scale, const float* grad, float* master, float* m,
                 float* v, int64_t n, void* compute, ComputeDtype compute_dtype) {
  const double bc1 = 1.0 - std::pow(h.beta1, static_cast<double>(h.step));
  const double bc2 = 1.0 - std::pow(h.beta2, static_cast<double>(h.step));
  const float step_size = static_cast<float>(h.lr / bc1);
  const float bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  const float decay = static_cast<float>(1.0 - h.lr * h.weight_decay);
  const float b1 = static_cast<float>(h.beta1), b2 = static_cast<float>(h.beta2);
  const float one_minus_b1 = static_cast<float>(1.0 - h.beta1);
  const float one_minus_b2 = static_cast<float>(1.0 - h.beta2);
  const float eps = static_cast<float>(h.eps);
  WithComputeCopy(compute, master, compute_dtype, [&](auto* out) {
    AdamWLoop(grad, master, m, v, out, n, grad_scale, decay, b1, b2, one_minus_b1, one_minus_b2,
              step_size, bc2_sqrt, eps);
  });
}

namespace {
template <typename Out>
__attribute__((target_clones("avx512f", "avx2", "default")))
void SgdLoop(const float* __restrict grad, float* __restrict master, float* __restrict buf,
             Out* __restrict out_copy, int64_t n, float grad_scale, float lr, float mu, float wd) {
  for (int64_t i = 0; i < n; ++i) {
    const float p = master[i];
    const float d = grad[i] * grad_scale + wd * p;
    const float b = buf[i] * mu + d;
    const float np = p - lr * b;
    buf[i] = b;
    master[i] = np;
    if constexpr (std::is_same_v<Out, float>) out_copy[i] = np;
    if constexpr (std::is_same_v<Out, uint16_t>) out_copy[i] = ToBf16Branchless(np);
  }
}
}  // namespace

void SgdUpdate(const SgdHyper& h, float grad_scale, const float* grad, float* master, float* buf,
               int64_t n, void* compute, ComputeDtype compute_dtype) {
  const float lr = static_cast<float>(h.lr), mu = static_cast<float>(h.momentum);
  const float wd = static_cast<float>(h.weight_decay);
  WithComputeCopy(compute, master, compute_dtype, [&](auto* out) {
    SgdLoop(grad, master, buf, out, n, grad_scale, lr, mu, wd);
  });
}

void ParallelFor(int64_t n, int threads, const std::function<void(int64_t)>& fn) {
  if (threads <= 1 || n <= 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  std::atomic<int64_t> next{0};
  auto body = [&] {
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) fn(i);
  };
  std::vector<std::thread> pool;
  const int t = static_cast<int>(std::min<int64_t>(threads, n));
  for (int i = 1; i < t; ++i) pool.emplace_back(body);
  body();
  for (auto& th : pool) th.join();
}

}  // namespace rp::coord
