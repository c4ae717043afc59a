// SPDX-License-Identifier: Apache-2.0
#include "optim/adamw.h"
#include "common/environment.h"

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

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

uint16_t FloatToHalf(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  const uint32_t sign = (bits >> 16) & 0x8000u;
  const uint32_t abs = bits & 0x7fffffffu;
  if (abs > 0x7f800000u)
    return static_cast<uint16_t>(sign | 0x7e00u | ((abs >> 13) & 0x3ffu));  // NaN, quiet
  if (abs >= 0x477ff000u)
    return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to >= 65520: infinity
  if (abs < 0x38800000u) {
    // Below the smallest normal half (2^-14): a subnormal, units of 2^-24, rounded to nearest even.
    if (abs < 0x33000000u) return static_cast<uint16_t>(sign);  // <= 2^-25: rounds to zero
    const uint32_t exp = abs >> 23, mant = (abs & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - exp;  // mant * 2^(exp - 150) in units of 2^-24
    const uint32_t q = mant >> shift, rem = mant & ((1u << shift) - 1u), half = 1u << (shift - 1);
    return static_cast<uint16_t>(sign | (q + (rem > half || (rem == half && (q & 1u)))));
  }
  // Normal: rebias the exponent (127 -> 15) and round the 13 dropped mantissa bits to nearest even;
  // a carry out of the mantissa correctly bumps the exponent.
  const uint32_t rebiased = abs - 0x38000000u;
  return static_cast<uint16_t>(sign | ((rebiased + 0xfffu + ((rebiased >> 13) & 1u)) >> 13));
}

float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1fu) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112u) << 23) | (mant << 13);
  } else {
    float f = static_cast<float>(mant) * 0x1p-24f;  // subnormal (or zero): exact
    std::memcpy(&bits, &f, 4);
    bits |= sign;
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

namespace {
#if defined(__x86_64__)
__attribute__((target("avx,f16c"))) void FloatsToHalvesF16c(const float* in, uint16_t* out,
                                                            int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(in + i), _MM_FROUND_TO_NEAREST_INT));
  for (; i < n; ++i) out[i] = FloatToHalf(in[i]);
}
#endif
}  // namespace

void FloatsToHalves(const float* in, uint16_t* out, int64_t n) {
#if defined(__x86_64__)
  static const bool f16c = __builtin_cpu_supports("f16c");
  if (f16c && BestSimdLevel() != SimdLevel::kScalar) return FloatsToHalvesF16c(in, out, n);
#endif
  for (int64_t i = 0; i < n; ++i) out[i] = FloatToHalf(in[i]);
}

void ToComputeCopy(const float* in, void* out, int64_t n, ComputeDtype dtype) {
  switch (dtype) {
    case ComputeDtype::kFloat32: std::memcpy(out, in, static_cast<size_t>(n) * 4); return;
    case ComputeDtype::kFloat16: FloatsToHalves(in, static_cast<uint16_t*>(out), n); return;
    case ComputeDtype::kBFloat16:
      for (int64_t i = 0; i < n; ++i) static_cast<uint16_t*>(out)[i] = FloatToBFloat16(in[i]);
      return;
  }
}

void FromComputeCopy(const void* in, float* out, int64_t n, ComputeDtype dtype) {
  const auto* h = static_cast<const uint16_t*>(in);
  switch (dtype) {
    case ComputeDtype::kFloat32: std::memcpy(out, in, static_cast<size_t>(n) * 4); return;
    case ComputeDtype::kFloat16:
      for (int64_t i = 0; i < n; ++i) out[i] = HalfToFloat(h[i]);
      return;
    case ComputeDtype::kBFloat16:
      for (int64_t i = 0; i < n; ++i) out[i] = BFloat16ToFloat(h[i]);
      return;
  }
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

using AdamWConsts = AdamWConstants;

// The oracle: one element. Same operation order as torch.optim.AdamW's single-tensor path, so
// results agree with it to rounding. Every SIMD path below performs exactly these operations.
// kMaster/kMoments say whether the master and the moments are written (UpdateWrites); values
// never written are still computed the same way, and the compiler drops what nothing uses.
template <typename Out, bool kMaster, bool kMoments>
inline void AdamWElement(const AdamWConsts& k, const float* grad, float* master, float* m, float* v,
                         Out* out_copy, int64_t i) {
  const float g = grad[i] * k.grad_scale;
  float p = master[i] * k.decay;
  const float mi = m[i] * k.b1 + g * k.one_minus_b1;
  const float vi = v[i] * k.b2 + g * g * k.one_minus_b2;
  const float denom = std::sqrt(vi) / k.bc2_sqrt + k.eps;
  p = p - k.step_size * (mi / denom);
  if constexpr (kMaster) master[i] = p;
  if constexpr (kMoments) {
    m[i] = mi;
    v[i] = vi;
  }
  if constexpr (std::is_same_v<Out, float>) out_copy[i] = p;
  if constexpr (std::is_same_v<Out, uint16_t>) out_copy[i] = ToBf16Branchless(p);
}

// Out = void: the master is its own compute copy (fp32, as in rp-train-ref).
// Kept a plain loop (no auto-vectorization) so it really is the one-element-at-a-time reference.
template <typename Out, bool kMaster, bool kMoments>
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("no-tree-vectorize")))
#endif
void AdamWScalar(const AdamWConsts& k, const float* grad, float* master, float* m, float* v,
                 Out* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    AdamWElement<Out, kMaster, kMoments>(k, grad, master, m, v, out, i);
}

#if defined(__x86_64__)
template <typename Out, bool kMaster, bool kMoments>
__attribute__((target("avx2"))) void AdamWAvx2(const AdamWConsts& k, const float* grad,
                                               float* master, float* m, float* v, Out* out,
                                               int64_t n) {
  const __m256 scale = _mm256_set1_ps(k.grad_scale), decay = _mm256_set1_ps(k.decay);
  const __m256 b1 = _mm256_set1_ps(k.b1), b2 = _mm256_set1_ps(k.b2);
  const __m256 omb1 = _mm256_set1_ps(k.one_minus_b1), omb2 = _mm256_set1_ps(k.one_minus_b2);
  const __m256 step = _mm256_set1_ps(k.step_size), bc2 = _mm256_set1_ps(k.bc2_sqrt);
  const __m256 eps = _mm256_set1_ps(k.eps);
  const __m256i round_base = _mm256_set1_epi32(0x7fff), one = _mm256_set1_epi32(1);
  const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff), inf = _mm256_set1_epi32(0x7f800000);
  const __m256i quiet = _mm256_set1_epi32(0x40);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_mul_ps(_mm256_loadu_ps(grad + i), scale);
    __m256 p = _mm256_mul_ps(_mm256_loadu_ps(master + i), decay);
    const __m256 mi =
        _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(m + i), b1), _mm256_mul_ps(g, omb1));
    const __m256 vi = _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(v + i), b2),
                                    _mm256_mul_ps(_mm256_mul_ps(g, g), omb2));
    const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(vi), bc2), eps);
    p = _mm256_sub_ps(p, _mm256_mul_ps(step, _mm256_div_ps(mi, denom)));
    if constexpr (kMaster) _mm256_storeu_ps(master + i, p);
    if constexpr (kMoments) {
      _mm256_storeu_ps(m + i, mi);
      _mm256_storeu_ps(v + i, vi);
    }
    if constexpr (std::is_same_v<Out, float>) _mm256_storeu_ps(out + i, p);
    if constexpr (std::is_same_v<Out, uint16_t>) {
      // Round to nearest even on the bit pattern; NaN keeps its top bits and is made quiet.
      const __m256i bits = _mm256_castps_si256(p);
      const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), one);
      const __m256i rounded =
          _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(round_base, lsb)), 16);
      const __m256i nan = _mm256_or_si256(_mm256_srli_epi32(bits, 16), quiet);
      const __m256i is_nan = _mm256_cmpgt_epi32(_mm256_and_si256(bits, abs_mask), inf);
      const __m256i h = _mm256_blendv_epi8(rounded, nan, is_nan);
      // Pack 8 x 32-bit (each < 2^16, so no saturation) into 8 x 16-bit, fixing lane order.
      const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(h, h), 0x08);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm256_castsi256_si128(packed));
    }
  }
  for (; i < n; ++i) AdamWElement<Out, kMaster, kMoments>(k, grad, master, m, v, out, i);
}

// GCC 12's _mm512_sqrt_ps reads an intentionally undefined pass-through operand and warns.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
// Software prefetch distance of the AVX-512 loop, in elements (0 = none): see adamw.h. 512
// (2 KiB ahead on each stream) measured best with rp-optim-bench (docs/benchmarks.md, "The CPU
// optimizer alone"): the hardware prefetchers stop at each 4 KiB page, software prefetches do
// not.
std::atomic<int64_t> prefetch_elements{[] {
  const auto e = EnvironmentValue("RP_OPTIM_PREFETCH");
  return e ? std::atoll(e->c_str()) : int64_t{512};
}()};

template <typename Out, bool kMaster, bool kMoments>
__attribute__((target("avx512f"))) void AdamWAvx512(const AdamWConsts& k, const float* grad,
                                                    float* master, float* m, float* v, Out* out,
                                                    int64_t n) {
  const __m512 scale = _mm512_set1_ps(k.grad_scale), decay = _mm512_set1_ps(k.decay);
  const __m512 b1 = _mm512_set1_ps(k.b1), b2 = _mm512_set1_ps(k.b2);
  const __m512 omb1 = _mm512_set1_ps(k.one_minus_b1), omb2 = _mm512_set1_ps(k.one_minus_b2);
  const __m512 step = _mm512_set1_ps(k.step_size), bc2 = _mm512_set1_ps(k.bc2_sqrt);
  const __m512 eps = _mm512_set1_ps(k.eps);
  const __m512i round_base = _mm512_set1_epi32(0x7fff), one = _mm512_set1_epi32(1);
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff), inf = _mm512_set1_epi32(0x7f800000);
  const __m512i quiet = _mm512_set1_epi32(0x40);
  // The master is read unless this pass writes neither it nor a copy of it.
  constexpr bool kReadsMaster = kMaster || !std::is_void_v<Out>;
  const int64_t pf = prefetch_elements.load(std::memory_order_relaxed);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    if (pf > 0) {
      // Addresses past the arrays' ends are formed as integers (pointer arithmetic there would be
      // undefined); a prefetch never faults.
      auto ahead = [&](const float* p) {
        return reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(p + i) +
                                             static_cast<uintptr_t>(pf) * 4);
      };
      _mm_prefetch(ahead(grad), _MM_HINT_T0);
      _mm_prefetch(ahead(m), _MM_HINT_T0);
      _mm_prefetch(ahead(v), _MM_HINT_T0);
      if constexpr (kReadsMaster) _mm_prefetch(ahead(master), _MM_HINT_T0);
    }
    const __m512 g = _mm512_mul_ps(_mm512_loadu_ps(grad + i), scale);
    __m512 p = _mm512_mul_ps(_mm512_loadu_ps(master + i), decay);
    const __m512 mi =
        _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(m + i), b1), _mm512_mul_ps(g, omb1));
    const __m512 vi = _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(v + i), b2),
                                    _mm512_mul_ps(_mm512_mul_ps(g, g), omb2));
    const __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(vi), bc2), eps);
    p = _mm512_sub_ps(p, _mm512_mul_ps(step, _mm512_div_ps(mi, denom)));
    if constexpr (kMaster) _mm512_storeu_ps(master + i, p);
    if constexpr (kMoments) {
      _mm512_storeu_ps(m + i, mi);
      _mm512_storeu_ps(v + i, vi);
    }
    if constexpr (std::is_same_v<Out, float>) _mm512_storeu_ps(out + i, p);
    if constexpr (std::is_same_v<Out, uint16_t>) {
      const __m512i bits = _mm512_castps_si512(p);
      const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), one);
      const __m512i rounded =
          _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(round_base, lsb)), 16);
      const __m512i nan = _mm512_or_si512(_mm512_srli_epi32(bits, 16), quiet);
      const __mmask16 is_nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(bits, abs_mask), inf);
      const __m512i h = _mm512_mask_blend_epi32(is_nan, rounded, nan);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), _mm512_cvtepi32_epi16(h));
    }
  }
  for (; i < n; ++i) AdamWElement<Out, kMaster, kMoments>(k, grad, master, m, v, out, i);
}
#pragma GCC diagnostic pop
#endif

SimdLevel DetectSimdLevel() {
  SimdLevel best = SimdLevel::kScalar;
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2")) best = SimdLevel::kAvx2;
  if (__builtin_cpu_supports("avx512f")) best = SimdLevel::kAvx512;
#endif
  if (const auto cap = EnvironmentValue("RP_SIMD")) {
    const std::string& c = *cap;
    const SimdLevel want = c == "scalar" ? SimdLevel::kScalar
                           : c == "avx2" ? SimdLevel::kAvx2
                                         : best;
    if (static_cast<int>(want) < static_cast<int>(best)) best = want;
  }
  return best;
}

// Calls loop(out, write_master, write_moments) with the compute copy typed for its dtype (a void*
// null when the master is its own copy: fp32, aliased, or a pass that writes no copy) and the two
// write flags as std::bool_constant: the one place that maps (copy, UpdateWrites) to a loop
// instantiation, for every optimizer.
template <typename Loop>
void WithWrites(void* compute, const float* master, ComputeDtype dtype, UpdateWrites writes,
                Loop&& loop) {
  using Yes = std::true_type;
  using No = std::false_type;
  void* const none = nullptr;
  if (dtype == ComputeDtype::kFloat32 && compute == master) {
    // The master is what workers fetch: kFetched writes it, kRest the moments.
    switch (writes) {
      case UpdateWrites::kAll: return loop(none, Yes{}, Yes{});
      case UpdateWrites::kFetched: return loop(none, Yes{}, No{});
      case UpdateWrites::kRest: return loop(none, No{}, Yes{});
    }
    return;
  }
  if (writes == UpdateWrites::kRest) return loop(none, Yes{}, Yes{});
  auto typed = [&](auto* out) {
    if (writes == UpdateWrites::kAll) loop(out, Yes{}, Yes{});
    else loop(out, No{}, No{});
  };
  if (dtype == ComputeDtype::kFloat32) typed(static_cast<float*>(compute));
  else typed(static_cast<uint16_t*>(compute));
}

}  // namespace

void SetAdamWPrefetchDistance(int64_t elements) {
#if defined(__x86_64__)
  prefetch_elements.store(elements);
#else
  (void)elements;
#endif
}

const char* SimdLevelName(SimdLevel level) {
  switch (level) {
    case SimdLevel::kScalar: return "scalar";
    case SimdLevel::kAvx2: return "avx2";
    case SimdLevel::kAvx512: return "avx512";
  }
  return "?";
}

SimdLevel BestSimdLevel() {
  static const SimdLevel level = DetectSimdLevel();
  return level;
}

AdamWConstants MakeAdamWConstants(const AdamWHyper& h, float grad_scale) {
  const double bc1 = 1.0 - std::pow(h.beta1, static_cast<double>(h.step));
  const double bc2 = 1.0 - std::pow(h.beta2, static_cast<double>(h.step));
  AdamWConstants k;
  k.grad_scale = grad_scale;
  k.step_size = static_cast<float>(h.lr / bc1);
  k.bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  k.decay = static_cast<float>(1.0 - h.lr * h.weight_decay);
  k.b1 = static_cast<float>(h.beta1);
  k.b2 = static_cast<float>(h.beta2);
  k.one_minus_b1 = static_cast<float>(1.0 - h.beta1);
  k.one_minus_b2 = static_cast<float>(1.0 - h.beta2);
  k.eps = static_cast<float>(h.eps);
  return k;
}

void AdamWUpdateWith(SimdLevel level, const AdamWHyper& h, float grad_scale, const float* grad,
                     float* master, float* m, float* v, int64_t n, void* compute,
                     ComputeDtype compute_dtype, UpdateWrites writes) {
  if (static_cast<int>(level) > static_cast<int>(BestSimdLevel())) level = BestSimdLevel();
  const AdamWConsts k = MakeAdamWConstants(h, grad_scale);
  WithWrites(compute, master, compute_dtype, writes, [&](auto* out, auto wm, auto wmo) {
    using Out = std::remove_pointer_t<decltype(out)>;
    constexpr bool kM = decltype(wm)::value, kMo = decltype(wmo)::value;
    switch (level) {
#if defined(__x86_64__)
      case SimdLevel::kAvx512: return AdamWAvx512<Out, kM, kMo>(k, grad, master, m, v, out, n);
      case SimdLevel::kAvx2: return AdamWAvx2<Out, kM, kMo>(k, grad, master, m, v, out, n);
#else
      case SimdLevel::kAvx512:
      case SimdLevel::kAvx2:
#endif
      case SimdLevel::kScalar: return AdamWScalar<Out, kM, kMo>(k, grad, master, m, v, out, n);
    }
  });
}

void AdamWUpdate(const AdamWHyper& h, float grad_scale, const float* grad, float* master, float* m,
                 float* v, int64_t n, void* compute, ComputeDtype compute_dtype,
                 UpdateWrites writes) {
  AdamWUpdateWith(BestSimdLevel(), h, grad_scale, grad, master, m, v, n, compute, compute_dtype,
                  writes);
}

namespace {
template <typename Out, bool kMaster, bool kMoments>
__attribute__((target_clones("avx512f", "avx2", "default"))) void SgdLoop(
    const float* __restrict grad, float* __restrict master, float* __restrict buf,
    Out* __restrict out_copy, int64_t n, float grad_scale, float lr, float mu, float wd) {
  for (int64_t i = 0; i < n; ++i) {
    const float p = master[i];
    const float d = grad[i] * grad_scale + wd * p;
    const float b = buf[i] * mu + d;
    const float np = p - lr * b;
    if constexpr (kMoments) buf[i] = b;
    if constexpr (kMaster) master[i] = np;
    if constexpr (std::is_same_v<Out, float>) out_copy[i] = np;
    if constexpr (std::is_same_v<Out, uint16_t>) out_copy[i] = ToBf16Branchless(np);
  }
}
}  // namespace

void SgdUpdate(const SgdHyper& h, float grad_scale, const float* grad, float* master, float* buf,
               int64_t n, void* compute, ComputeDtype compute_dtype, UpdateWrites writes) {
  const float lr = static_cast<float>(h.lr), mu = static_cast<float>(h.momentum);
  const float wd = static_cast<float>(h.weight_decay);
  if (compute_dtype == ComputeDtype::kFloat32 && compute == master &&
      writes != UpdateWrites::kAll) {
    // The momentum reads the old master (weight decay enters through the gradient), so with the
    // master as its own copy nothing can be deferred: the first pass does all of it.
    if (writes == UpdateWrites::kRest) return;
    writes = UpdateWrites::kAll;
  }
  WithWrites(compute, master, compute_dtype, writes, [&](auto* out, auto wm, auto wmo) {
    SgdLoop<std::remove_pointer_t<decltype(out)>, decltype(wm)::value, decltype(wmo)::value>(
        grad, master, buf, out, n, grad_scale, lr, mu, wd);
  });
}

}  // namespace rp::coord
