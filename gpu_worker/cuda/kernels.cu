// SPDX-License-Identifier: Apache-2.0
// The project's own CUDA kernels (contracts in kernels.h). Both are memory-bound: what they
// replace is a chain of LibTorch elementwise kernels, each a full pass over a large tensor (the
// loss: an fp32 copy of the logits, softmax forward and backward, a conversion back; RoPE:
// multiply, roll, multiply-add on strided views). Here each element is read once or twice and
// written once.
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>

#include "gpu_worker/cuda/kernels.h"

namespace rp::worker::kernels {
namespace {

__device__ __forceinline__ float ToFloat(float v) { return v; }
__device__ __forceinline__ float ToFloat(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T>
__device__ __forceinline__ T FromFloat(float v);
template <>
__device__ __forceinline__ float FromFloat<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 FromFloat<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// (max, sum of exp(x - max)) pairs: the running state of a one-pass softmax normalizer.
__device__ __forceinline__ void Merge(float& m, float& s, float m2, float s2) {
  const float mx = fmaxf(m, m2);
  if (mx == -INFINITY) return;  // both empty
  s = s * expf(m - mx) + s2 * expf(m2 - mx);
  m = mx;
}

__device__ __forceinline__ void Push(float& m, float& s, float v) {
  if (v == -INFINITY) return;  // contributes nothing (and -inf - -inf would be NaN)
  if (v > m) {
    s = s * expf(m - v) + 1.0f;
    m = v;
  } else {
    s += expf(v - m);
  }
}

// 16-byte packs of elements: one vector load or store per pack.
template <typename T>
struct alignas(16) Pack {
  static constexpr int kWidth = 16 / sizeof(T);
  T v[kWidth];
};

constexpr int kLossThreads = 1024;

template <typename T, bool kPacked>
__global__ void __launch_bounds__(kLossThreads)
CrossEntropyKernel(T* logits, const int64_t* labels, int64_t vocab, float scale, bool write_grad,
                   float* row_loss) {
  const int64_t row = blockIdx.x;
  T* x = logits + row * vocab;
  const int64_t label = labels[row];
  const bool ignored = label == -100;
  const bool bad = !ignored && (label < 0 || label >= vocab);
  // Read before any thread overwrites the row with its gradient (the block barriers below
  // order this read before every write).
  const float label_logit = threadIdx.x == 0 && !ignored && !bad ? ToFloat(x[label]) : 0.0f;

  float m = -INFINITY, s = 0.0f;
  constexpr int W = Pack<T>::kWidth;
  if (kPacked) {
    const Pack<T>* p = reinterpret_cast<const Pack<T>*>(x);
    for (int64_t j = threadIdx.x; j < vocab / W; j += kLossThreads) {
      const Pack<T> pk = p[j];
#pragma unroll
      for (int k = 0; k < W; ++k) Push(m, s, ToFloat(pk.v[k]));
    }
  } else {
    for (int64_t j = threadIdx.x; j < vocab; j += kLossThreads) Push(m, s, ToFloat(x[j]));
  }
  for (int o = 16; o > 0; o >>= 1)
    Merge(m, s, __shfl_xor_sync(0xffffffffu, m, o), __shfl_xor_sync(0xffffffffu, s, o));
  __shared__ float warp_m[32], warp_s[32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    warp_m[warp] = m;
    warp_s[warp] = s;
  }
  __syncthreads();
  if (warp == 0) {
    m = lane < kLossThreads / 32 ? warp_m[lane] : -INFINITY;
    s = lane < kLossThreads / 32 ? warp_s[lane] : 0.0f;
    for (int o = 16; o > 0; o >>= 1)
      Merge(m, s, __shfl_xor_sync(0xffffffffu, m, o), __shfl_xor_sync(0xffffffffu, s, o));
    if (lane == 0) {
      warp_m[0] = m;
      warp_s[0] = s;
    }
  }
  __syncthreads();
  const float lse = warp_m[0] + logf(warp_s[0]);
  if (threadIdx.x == 0) row_loss[row] = ignored ? 0.0f : bad ? NAN : lse - label_logit;
  if (!write_grad) return;

  auto grad = [&](float v, int64_t j) {
    if (ignored || bad) return 0.0f;
    return (expf(v - lse) - (j == label ? 1.0f : 0.0f)) * scale;
  };
  if (kPacked) {
    Pack<T>* p = reinterpret_cast<Pack<T>*>(x);
    for (int64_t j = threadIdx.x; j < vocab / W; j += kLossThreads) {
      Pack<T> pk = p[j];
#pragma unroll
      for (int k = 0; k < W; ++k) pk.v[k] = FromFloat<T>(grad(ToFloat(pk.v[k]), j * W + k));
      p[j] = pk;
    }
  } else {
    for (int64_t j = threadIdx.x; j < vocab; j += kLossThreads) x[j] = FromFloat<T>(grad(ToFloat(x[j]), j));
  }
}

template <typename T>
cudaError_t LaunchCrossEntropy(void* logits, const int64_t* labels, int64_t rows, int64_t vocab,
                               float scale, bool write_grad, float* row_loss, cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  if (rows > 0x7fffffff) return cudaErrorInvalidValue;
  // Rows start on 16-byte boundaries when the vocabulary is a multiple of the pack width (the
  // tensor itself comes from the caching allocator, 512-byte aligned).
  const bool packed = vocab % Pack<T>::kWidth == 0 &&
                      reinterpret_cast<uintptr_t>(logits) % 16 == 0;
  T* x = static_cast<T*>(logits);
  if (packed)
    CrossEntropyKernel<T, true><<<static_cast<unsigned>(rows), kLossThreads, 0, stream>>>(
        x, labels, vocab, scale, write_grad, row_loss);
  else
    CrossEntropyKernel<T, false><<<static_cast<unsigned>(rows), kLossThreads, 0, stream>>>(
        x, labels, vocab, scale, write_grad, row_loss);
  return cudaGetLastError();
}

template <typename T>
__global__ void RopeKernel(const T* x, const T* cos, const T* sin, T* y, int64_t pairs,
                           int64_t seq, int64_t heads, int64_t half, bool backward) {
  for (int64_t p = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; p < pairs;
       p += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = p / half, i = p % half;
    const int64_t pos = (row / heads) % seq;
    const T* xr = x + row * 2 * half;
    T* yr = y + row * 2 * half;
    const T* c = cos + pos * 2 * half;
    const T* sn = sin + pos * 2 * half;
    const float a = ToFloat(xr[i]), b = ToFloat(xr[i + half]);
    const float ca = ToFloat(c[i]), cb = ToFloat(c[i + half]);
    const float sa = ToFloat(sn[i]), sb = ToFloat(sn[i + half]);
    // Element i pairs with i + half in both directions; the backward applies the transposed
    // rotation, which swaps which half's sine multiplies the partner.
    yr[i] = FromFloat<T>(a * ca + b * (backward ? sb : sa));
    yr[i + half] = FromFloat<T>(b * cb + a * (backward ? sa : sb));
  }
}

template <typename T>
cudaError_t LaunchRope(const void* x, const void* cos, const void* sin, void* y, int64_t rows,
                       int64_t seq, int64_t heads, int64_t dim, bool backward, cudaStream_t stream) {
  if (dim % 2 != 0 || seq <= 0 || heads <= 0) return cudaErrorInvalidValue;
  const int64_t pairs = rows * (dim / 2);
  if (pairs <= 0) return cudaSuccess;
  constexpr int kThreads = 256;
  const int64_t blocks = std::min<int64_t>((pairs + kThreads - 1) / kThreads, 132 * 64);
  RopeKernel<T><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      static_cast<const T*>(x), static_cast<const T*>(cos), static_cast<const T*>(sin),
      static_cast<T*>(y), pairs, seq, heads, dim / 2, backward);
  return cudaGetLastError();
}

// The bit-pattern rounding of the coordinator's FloatToBFloat16 (coordinator/optim/adamw.cc),
// not the hardware conversion: the two sources of bf16 weights (a compute copy the optimizer
// wrote, or a master rounded here) must agree bit for bit, NaN payloads included.
__device__ __forceinline__ uint32_t RoundBits(uint32_t bits) {
  if ((bits & 0x7fffffffu) > 0x7f800000u) return (bits >> 16) | 0x40u;  // NaN, made quiet
  return (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
}

// Four values per thread and step: one 16-byte load, one 8-byte store.
__global__ void RoundToBFloat16Kernel(const float4* src, uint2* dst, int64_t quads) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < quads;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float4 v = src[i];
    uint2 out;
    out.x = RoundBits(__float_as_uint(v.x)) | (RoundBits(__float_as_uint(v.y)) << 16);
    out.y = RoundBits(__float_as_uint(v.z)) | (RoundBits(__float_as_uint(v.w)) << 16);
    dst[i] = out;
  }
}

__global__ void RoundToBFloat16TailKernel(const float* src, uint16_t* dst, int64_t n) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) dst[i] = static_cast<uint16_t>(RoundBits(__float_as_uint(src[i])));
}

}  // namespace

cudaError_t RoundToBFloat16(const float* src, uint16_t* dst, int64_t n, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  constexpr int kThreads = 256;
  const bool aligned = reinterpret_cast<uintptr_t>(src) % 16 == 0 && reinterpret_cast<uintptr_t>(dst) % 8 == 0;
  const int64_t quads = aligned ? n / 4 : 0;
  if (quads > 0) {
    const int64_t blocks = std::min<int64_t>((quads + kThreads - 1) / kThreads, 132 * 32);
    RoundToBFloat16Kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
        reinterpret_cast<const float4*>(src), reinterpret_cast<uint2*>(dst), quads);
  }
  const int64_t rest = n - quads * 4;
  if (rest > 0) {
    RoundToBFloat16TailKernel<<<static_cast<unsigned>((rest + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
        src + quads * 4, dst + quads * 4, rest);
  }
  return cudaGetLastError();
}

cudaError_t CrossEntropyRows(Dtype dtype, void* logits, const int64_t* labels, int64_t rows,
                             int64_t vocab, float scale, bool write_grad, float* row_loss,
                             cudaStream_t stream) {
  if (dtype == Dtype::kBFloat16)
    return LaunchCrossEntropy<__nv_bfloat16>(logits, labels, rows, vocab, scale, write_grad, row_loss, stream);
  return LaunchCrossEntropy<float>(logits, labels, rows, vocab, scale, write_grad, row_loss, stream);
}

cudaError_t Rope(Dtype dtype, const void* x, const void* cos, const void* sin_signed, void* y,
                 int64_t rows, int64_t seq, int64_t heads, int64_t dim, bool backward,
                 cudaStream_t stream) {
  if (dtype == Dtype::kBFloat16)
    return LaunchRope<__nv_bfloat16>(x, cos, sin_signed, y, rows, seq, heads, dim, backward, stream);
  return LaunchRope<float>(x, cos, sin_signed, y, rows, seq, heads, dim, backward, stream);
}

}  // namespace rp::worker::kernels
