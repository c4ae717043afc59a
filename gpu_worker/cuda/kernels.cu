// SPDX-License-Identifier: Apache-2.0
// The project's own CUDA kernels (contracts in kernels.h). Both are memory-bound: what they
// replace is a chain of LibTorch elementwise kernels, each a full pass over a large tensor (the
// loss: an fp32 copy of the logits, softmax forward and backward, a conversion back; RoPE:
// multiply, roll, multiply-add on strided views). Here each element is read once or twice and
// written once.
#include <cuda_bf16.h>
#include <cuda_fp8.h>

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
__device__ __forceinline__ float FromFloat<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __nv_bfloat16 FromFloat<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

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
    CrossEntropyKernel(T* logits, const int64_t* labels, int64_t vocab, float scale,
                       bool write_grad, float* row_loss) {
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
    for (int64_t j = threadIdx.x; j < vocab; j += kLossThreads)
      x[j] = FromFloat<T>(grad(ToFloat(x[j]), j));
  }
}

template <typename T>
cudaError_t LaunchCrossEntropy(void* logits, const int64_t* labels, int64_t rows, int64_t vocab,
                               float scale, bool write_grad, float* row_loss, cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  if (rows > 0x7fffffff) return cudaErrorInvalidValue;
  // Rows start on 16-byte boundaries when the vocabulary is a multiple of the pack width (the
  // tensor itself comes from the caching allocator, 512-byte aligned).
  const bool packed = vocab % Pack<T>::kWidth == 0 && reinterpret_cast<uintptr_t>(logits) % 16 == 0;
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
__global__ void RopeKernel(const T* x, const T* cos, const T* sin, T* y, int64_t pairs, int64_t seq,
                           int64_t heads, int64_t half, bool backward) {
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
                       int64_t seq, int64_t heads, int64_t dim, bool backward,
                       cudaStream_t stream) {
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

// ---- Per-head RMSNorm + RoPE. One warp per dim-vector; lane l holds elements
// [l*kPer, (l+1)*kPer). Element i pairs with (i + dim/2) % dim, which sits at the same offset in
// lane l ^ 16 (dim = 32 * kPer), so the rotation is one shuffle.
constexpr int kNormWarps = 8;  // vectors per block and step

__device__ __forceinline__ float WarpSum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

template <typename T, int kPer>
__global__ void __launch_bounds__(kNormWarps * 32)
    HeadNormRopeKernel(const T* x, const T* w, const T* cos, const T* sin, T* y, int64_t rows,
                       int64_t seq, int64_t heads, float eps) {
  constexpr int kDim = 32 * kPer;
  const int lane = threadIdx.x % 32;
  const int c = lane * kPer;
  float wv[kPer];
  for (int j = 0; j < kPer; ++j) wv[j] = ToFloat(w[c + j]);
  for (int64_t r = blockIdx.x * static_cast<int64_t>(kNormWarps) + threadIdx.x / 32; r < rows;
       r += static_cast<int64_t>(gridDim.x) * kNormWarps) {
    const T* xr = x + r * kDim;
    const int64_t pos = (r / heads) % seq;
    float v[kPer];
    float ss = 0.0f;
    for (int j = 0; j < kPer; ++j) {
      v[j] = ToFloat(xr[c + j]);
      ss += v[j] * v[j];
    }
    const float rstd = rsqrtf(WarpSum(ss) / kDim + eps);
    T* yr = y + r * kDim;
    for (int j = 0; j < kPer; ++j) {
      const float n = v[j] * rstd * wv[j];
      const float partner = __shfl_xor_sync(0xffffffffu, n, 16);
      yr[c + j] = FromFloat<T>(n * ToFloat(cos[pos * kDim + c + j]) +
                               partner * ToFloat(sin[pos * kDim + c + j]));
    }
  }
}

template <typename T, int kPer>
__global__ void __launch_bounds__(kNormWarps * 32)
    HeadNormRopeBackwardKernel(const T* x, const T* w, const T* cos, const T* sin, const T* dy,
                               T* dx, float* dw, int64_t rows, int64_t seq, int64_t heads,
                               float eps) {
  constexpr int kDim = 32 * kPer;
  constexpr int kHalf = kDim / 2;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int c = lane * kPer;
  float wv[kPer], dw_acc[kPer];
  for (int j = 0; j < kPer; ++j) {
    wv[j] = ToFloat(w[c + j]);
    dw_acc[j] = 0.0f;
  }
  for (int64_t r = blockIdx.x * static_cast<int64_t>(kNormWarps) + warp; r < rows;
       r += static_cast<int64_t>(gridDim.x) * kNormWarps) {
    const T* xr = x + r * kDim;
    const T* dyr = dy + r * kDim;
    const int64_t pos = (r / heads) % seq;
    float v[kPer], g[kPer];
    float ss = 0.0f;
    for (int j = 0; j < kPer; ++j) {
      v[j] = ToFloat(xr[c + j]);
      ss += v[j] * v[j];
    }
    const float rstd = rsqrtf(WarpSum(ss) / kDim + eps);
    float dot = 0.0f;
    for (int j = 0; j < kPer; ++j) {
      // The rotation's transpose: the partner's gradient times the sine at the partner's index.
      const int i = c + j;
      const float d = ToFloat(dyr[i]);
      const float partner = __shfl_xor_sync(0xffffffffu, d, 16);
      g[j] = d * ToFloat(cos[pos * kDim + i]) +
             partner * ToFloat(sin[pos * kDim + (i + kHalf) % kDim]);
      const float n = v[j] * rstd;
      dw_acc[j] += g[j] * n;
      g[j] *= wv[j];  // dL/d(normalized)
      dot += g[j] * n;
    }
    dot = WarpSum(dot) / kDim;
    T* dxr = dx + r * kDim;
    for (int j = 0; j < kPer; ++j) dxr[c + j] = FromFloat<T>(rstd * (g[j] - v[j] * rstd * dot));
  }
  // Weight gradient: the block's warps meet in shared memory, then one atomic add per column.
  if (dw == nullptr) return;  // block-uniform: no thread reaches the barrier below
  __shared__ float part[kNormWarps][kDim];
  for (int j = 0; j < kPer; ++j) part[warp][c + j] = dw_acc[j];
  __syncthreads();
  for (int col = threadIdx.x; col < kDim; col += blockDim.x) {
    float sum = 0.0f;
    for (int k = 0; k < kNormWarps; ++k) sum += part[k][col];
    atomicAdd(dw + col, sum);
  }
}

template <typename T, int kPer>
cudaError_t LaunchHeadNormRope(const void* x, const void* w, const void* cos, const void* sin,
                               void* y, const void* dy, void* dx, float* dw, int64_t rows,
                               int64_t seq, int64_t heads, float eps, bool backward,
                               cudaStream_t stream) {
  const int64_t blocks = std::min<int64_t>((rows + kNormWarps - 1) / kNormWarps, 132 * 16);
  if (backward)
    HeadNormRopeBackwardKernel<T, kPer>
        <<<static_cast<unsigned>(blocks), kNormWarps * 32, 0, stream>>>(
            static_cast<const T*>(x), static_cast<const T*>(w), static_cast<const T*>(cos),
            static_cast<const T*>(sin), static_cast<const T*>(dy), static_cast<T*>(dx), dw, rows,
            seq, heads, eps);
  else
    HeadNormRopeKernel<T, kPer><<<static_cast<unsigned>(blocks), kNormWarps * 32, 0, stream>>>(
        static_cast<const T*>(x), static_cast<const T*>(w), static_cast<const T*>(cos),
        static_cast<const T*>(sin), static_cast<T*>(y), rows, seq, heads, eps);
  return cudaGetLastError();
}

template <typename T>
cudaError_t DispatchHeadNormRope(const void* x, const void* w, const void* cos, const void* sin,
                                 void* y, const void* dy, void* dx, float* dw, int64_t rows,
                                 int64_t seq, int64_t heads, int64_t dim, float eps, bool backward,
                                 cudaStream_t stream) {
  if (seq <= 0 || heads <= 0) return cudaErrorInvalidValue;
  if (rows <= 0) return cudaSuccess;
  switch (dim) {
    case 64:
      return LaunchHeadNormRope<T, 2>(x, w, cos, sin, y, dy, dx, dw, rows, seq, heads, eps,
                                      backward, stream);
    case 128:
      return LaunchHeadNormRope<T, 4>(x, w, cos, sin, y, dy, dx, dw, rows, seq, heads, eps,
                                      backward, stream);
    case 256:
      return LaunchHeadNormRope<T, 8>(x, w, cos, sin, y, dy, dx, dw, rows, seq, heads, eps,
                                      backward, stream);
    default: return cudaErrorInvalidValue;
  }
}

// ---- RMSNorm over the hidden size, with the residual add before it, in two layouts of the same
// arithmetic: the packed one below whenever every row array is 16-byte aligned, and this scalar
// one otherwise. Here a block of kRowThreads threads takes a row at a time; thread t holds
// elements j * kRowThreads + t (j < kPer), so each load instruction of a warp reads consecutive
// elements, but 2 bytes each in bf16: 64 bytes per warp and instruction, an eighth of what one
// instruction of 16-byte accesses moves.
constexpr int kRowThreads = 256;

// The block's sum of v, the same in every thread (a fixed order: deterministic). `scratch` holds
// a float per warp of the block's kThreads.
template <int kThreads>
__device__ __forceinline__ float BlockSum(float v, float* scratch) {
  static_assert(kThreads % 32 == 0 && kThreads <= 1024, "whole warps of one block");
  v = WarpSum(v);
  __syncthreads();  // the previous row's readers are done with scratch
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
  __syncthreads();
  float total = 0.0f;
  for (int k = 0; k < kThreads / 32; ++k) total += scratch[k];
  return total;
}

template <typename T, int kPer>
__global__ void __launch_bounds__(kRowThreads)
    AddRmsNormKernel(const T* x, const T* res, const T* w, T* sum, T* y, int64_t rows, float eps) {
  constexpr int kDim = kRowThreads * kPer;
  __shared__ float scratch[kRowThreads / 32];
  float wv[kPer];
  for (int j = 0; j < kPer; ++j) wv[j] = ToFloat(w[j * kRowThreads + threadIdx.x]);
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const int64_t base = r * kDim + threadIdx.x;
    float v[kPer];
    float ss = 0.0f;
    for (int j = 0; j < kPer; ++j) {
      const int64_t i = base + j * kRowThreads;
      float a = ToFloat(x[i]);
      if (res != nullptr) {
        // Rounded as the separate add would leave it: the residual stream and the norm's input.
        const T rounded = FromFloat<T>(a + ToFloat(res[i]));
        sum[i] = rounded;
        a = ToFloat(rounded);
      }
      v[j] = a;
      ss += a * a;
    }
    const float rstd = rsqrtf(BlockSum<kRowThreads>(ss, scratch) / kDim + eps);
    for (int j = 0; j < kPer; ++j) y[base + j * kRowThreads] = FromFloat<T>(v[j] * rstd * wv[j]);
  }
}

template <typename T, int kPer>
__global__ void __launch_bounds__(kRowThreads)
    RmsNormBackwardKernel(const T* s, const T* w, const T* dy, const T* ds_other, T* ds, float* dw,
                          int64_t rows, float eps) {
  constexpr int kDim = kRowThreads * kPer;
  __shared__ float scratch[kRowThreads / 32];
  float wv[kPer], dw_acc[kPer];
  for (int j = 0; j < kPer; ++j) {
    wv[j] = ToFloat(w[j * kRowThreads + threadIdx.x]);
    dw_acc[j] = 0.0f;
  }
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const int64_t base = r * kDim + threadIdx.x;
    float v[kPer], g[kPer];
    float ss = 0.0f;
    for (int j = 0; j < kPer; ++j) {
      v[j] = ToFloat(s[base + j * kRowThreads]);
      ss += v[j] * v[j];
    }
    const float rstd = rsqrtf(BlockSum<kRowThreads>(ss, scratch) / kDim + eps);
    float dot = 0.0f;
    for (int j = 0; j < kPer; ++j) {
      const float d = ToFloat(dy[base + j * kRowThreads]);
      const float n = v[j] * rstd;
      dw_acc[j] += d * n;
      g[j] = d * wv[j];  // dL/d(normalized)
      dot += g[j] * n;
    }
    dot = BlockSum<kRowThreads>(dot, scratch) / kDim;
    for (int j = 0; j < kPer; ++j) {
      const int64_t i = base + j * kRowThreads;
      float out = rstd * (g[j] - v[j] * rstd * dot);
      if (ds_other != nullptr) out += ToFloat(ds_other[i]);
      ds[i] = FromFloat<T>(out);
    }
  }
  if (dw == nullptr) return;
  // One atomic add per column and block: the grid is a few blocks per SM, each over many rows.
  for (int j = 0; j < kPer; ++j) atomicAdd(dw + j * kRowThreads + threadIdx.x, dw_acc[j]);
}

// The forward's packed layout: a block of kThreads = dim / 8 threads per row (1024 -> 128, 2048 ->
// 256, 2560 -> 320, 4096 -> 512, 5120 -> 640), and thread t holds the 16-byte packs j * kThreads +
// t of the row (j < kVecs: one pack of 8 bf16, or two of 4 fp32). Each load or store instruction of
// a warp moves 512 contiguous bytes, eight times the scalar layout's 64 in bf16, so a row takes an
// eighth of the memory instructions. The arithmetic is the scalar kernel's, element for element;
// only the order of the sum of squares differs, still fixed.
constexpr int kPackedRowElems = 8;  // elements per thread and row, either dtype

// Blocks per SM of the grid, which the launch bounds keep within the registers (so the whole
// grid is resident at once: a second wave of blocks would take its rows after the first's). The
// forward fills an SM in bf16 (2,048 threads): a block waiting at a row's barrier leaves the
// SM's other blocks with their loads in flight. fp32 threads hold two packs per operand, and half
// as many of them per SM keep as many bytes in flight without spilling.
constexpr int kForwardThreadsPerSm = 2048;
template <typename T>
constexpr int BlocksPerSm(int bf16_threads_per_sm, int threads) {
  const int blocks = bf16_threads_per_sm / (static_cast<int>(sizeof(T)) / 2) / threads;
  return blocks > 0 ? blocks : 1;
}

template <typename T, int kThreads>
__global__ void __launch_bounds__(kThreads, BlocksPerSm<T>(kForwardThreadsPerSm, kThreads))
    AddRmsNormPackedKernel(const T* x, const T* res, const T* w, T* sum, T* y, int64_t rows,
                           float eps) {
  using P = Pack<T>;
  constexpr int kW = P::kWidth, kVecs = kPackedRowElems / kW;
  constexpr int kDim = kThreads * kPackedRowElems, kRowPacks = kDim / kW;
  __shared__ float scratch[kThreads / 32];
  // The weight is read element by element (once per block): its pointer need not be aligned.
  float wv[kVecs][kW];
#pragma unroll
  for (int j = 0; j < kVecs; ++j)
#pragma unroll
    for (int k = 0; k < kW; ++k) wv[j][k] = ToFloat(w[(j * kThreads + threadIdx.x) * kW + k]);
  const P* xp = reinterpret_cast<const P*>(x);
  const P* rp = reinterpret_cast<const P*>(res);
  P* sp = reinterpret_cast<P*>(sum);
  P* yp = reinterpret_cast<P*>(y);
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const int64_t base = r * kRowPacks + threadIdx.x;
    // Every load of the row first, then the stores: nothing waits on a store's possible aliasing.
    P v[kVecs], add[kVecs];
#pragma unroll
    for (int j = 0; j < kVecs; ++j) v[j] = xp[base + j * kThreads];
    if (res != nullptr) {
#pragma unroll
      for (int j = 0; j < kVecs; ++j) add[j] = rp[base + j * kThreads];
#pragma unroll
      for (int j = 0; j < kVecs; ++j) {
        // Rounded as the separate add would leave it: the residual stream and the norm's input.
#pragma unroll
        for (int k = 0; k < kW; ++k)
          v[j].v[k] = FromFloat<T>(ToFloat(v[j].v[k]) + ToFloat(add[j].v[k]));
        sp[base + j * kThreads] = v[j];
      }
    }
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < kVecs; ++j)
#pragma unroll
      for (int k = 0; k < kW; ++k) {
        const float a = ToFloat(v[j].v[k]);
        ss += a * a;
      }
    const float rstd = rsqrtf(BlockSum<kThreads>(ss, scratch) / kDim + eps);
#pragma unroll
    for (int j = 0; j < kVecs; ++j) {
      P out;
#pragma unroll
      for (int k = 0; k < kW; ++k) out.v[k] = FromFloat<T>(ToFloat(v[j].v[k]) * rstd * wv[j][k]);
      yp[base + j * kThreads] = out;
    }
  }
}

template <typename T, int kThreads>
cudaError_t LaunchAddRmsNormPacked(const void* x, const void* res, const void* w, void* sum,
                                   void* y, int64_t rows, float eps, cudaStream_t stream) {
  static_assert(kThreads % 32 == 0 && kThreads <= 1024, "whole warps of one block");
  const int64_t blocks =
      std::min<int64_t>(rows, 132 * BlocksPerSm<T>(kForwardThreadsPerSm, kThreads));
  AddRmsNormPackedKernel<T, kThreads><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      static_cast<const T*>(x), static_cast<const T*>(res), static_cast<const T*>(w),
      static_cast<T*>(sum), static_cast<T*>(y), rows, eps);
  return cudaGetLastError();
}

template <typename T, int kPer>
cudaError_t LaunchRmsNorm(const void* x, const void* res, const void* w, void* sum, void* y,
                          const void* dy, void* ds, float* dw, int64_t rows, float eps,
                          bool backward, cudaStream_t stream) {
  // The forward takes the packed layout whenever the row arrays (not the weight: read by
  // element) allow 16-byte accesses; rows then start aligned too, every size being a multiple of
  // 256 elements. A null pointer is an unused one. The backward keeps the scalar layout: a packed
  // one was slower than LibTorch's on a Qwen3-4B block where the scalar one is level with it
  // (rp-block-bench; docs/benchmarks.md), its per-column weight-gradient sums taking more
  // registers per thread.
  auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  static_assert(kRowThreads * kPer % kPackedRowElems == 0, "whole packs per thread");
  if (!backward && aligned(x) && aligned(res) && aligned(sum) && aligned(y))
    return LaunchAddRmsNormPacked<T, kRowThreads * kPer / kPackedRowElems>(x, res, w, sum, y, rows,
                                                                           eps, stream);
  // Four blocks per SM (1,024 threads) keep enough loads in flight; more would multiply the
  // backward's weight-gradient atomics.
  const int64_t blocks = std::min<int64_t>(rows, 132 * 4);
  if (backward)
    RmsNormBackwardKernel<T, kPer><<<static_cast<unsigned>(blocks), kRowThreads, 0, stream>>>(
        static_cast<const T*>(x), static_cast<const T*>(w), static_cast<const T*>(dy),
        static_cast<const T*>(res), static_cast<T*>(ds), dw, rows, eps);
  else
    AddRmsNormKernel<T, kPer><<<static_cast<unsigned>(blocks), kRowThreads, 0, stream>>>(
        static_cast<const T*>(x), static_cast<const T*>(res), static_cast<const T*>(w),
        static_cast<T*>(sum), static_cast<T*>(y), rows, eps);
  return cudaGetLastError();
}

template <typename T>
cudaError_t DispatchRmsNorm(const void* x, const void* res, const void* w, void* sum, void* y,
                            const void* dy, void* ds, float* dw, int64_t rows, int64_t dim,
                            float eps, bool backward, cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  switch (dim) {
    case kRowThreads * 4:
      return LaunchRmsNorm<T, 4>(x, res, w, sum, y, dy, ds, dw, rows, eps, backward, stream);
    case kRowThreads * 8:
      return LaunchRmsNorm<T, 8>(x, res, w, sum, y, dy, ds, dw, rows, eps, backward, stream);
    case kRowThreads * 10:
      return LaunchRmsNorm<T, 10>(x, res, w, sum, y, dy, ds, dw, rows, eps, backward, stream);
    case kRowThreads * 12:
      return LaunchRmsNorm<T, 12>(x, res, w, sum, y, dy, ds, dw, rows, eps, backward, stream);
    case kRowThreads * 16:
      return LaunchRmsNorm<T, 16>(x, res, w, sum, y, dy, ds, dw, rows, eps, backward, stream);
    case kRowThreads * 20:
      return LaunchRmsNorm<T, 20>(x, res, w, sum, y, dy, ds, dw, rows, eps, backward, stream);
    default: return cudaErrorInvalidValue;
  }
}

// ---- SwiGLU, elementwise: index e = row * cols + col; gate/up rows at stride ld.
__device__ __forceinline__ float Sigmoid(float g) { return 1.0f / (1.0f + expf(-g)); }

template <typename T>
__global__ void SwiGluKernel(const T* gate, const T* up, int64_t ld, const T* dy, T* y_or_dgate,
                             T* dup, int64_t rows, int64_t cols, bool backward) {
  const int64_t n = rows * cols;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = e / cols, col = e % cols;
    const float g = ToFloat(gate[row * ld + col]), u = ToFloat(up[row * ld + col]);
    const float s = Sigmoid(g);
    if (!backward) {
      y_or_dgate[e] = FromFloat<T>(g * s * u);
    } else {
      const float d = ToFloat(dy[e]);
      y_or_dgate[e] = FromFloat<T>(d * u * s * (1.0f + g * (1.0f - s)));
      dup[e] = FromFloat<T>(d * g * s);
    }
  }
}

// Eight bf16 (or four fp32) per thread and step, when every row start is 16-byte aligned.
template <typename T>
__global__ void SwiGluPackedKernel(const T* gate, const T* up, int64_t ld, const T* dy,
                                   T* y_or_dgate, T* dup, int64_t rows, int64_t cols,
                                   bool backward) {
  using P = Pack<T>;
  constexpr int kW = P::kWidth;
  const int64_t packs_per_row = cols / kW, n = rows * packs_per_row;
  for (int64_t p = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; p < n;
       p += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = p / packs_per_row, col = (p % packs_per_row) * kW;
    const P gp = *reinterpret_cast<const P*>(gate + row * ld + col);
    const P upk = *reinterpret_cast<const P*>(up + row * ld + col);
    P out, out2;
    if (!backward) {
      for (int k = 0; k < kW; ++k) {
        const float g = ToFloat(gp.v[k]);
        out.v[k] = FromFloat<T>(g * Sigmoid(g) * ToFloat(upk.v[k]));
      }
      *reinterpret_cast<P*>(y_or_dgate + row * cols + col) = out;
    } else {
      const P dp = *reinterpret_cast<const P*>(dy + row * cols + col);
      for (int k = 0; k < kW; ++k) {
        const float g = ToFloat(gp.v[k]), u = ToFloat(upk.v[k]), d = ToFloat(dp.v[k]);
        const float s = Sigmoid(g);
        out.v[k] = FromFloat<T>(d * u * s * (1.0f + g * (1.0f - s)));
        out2.v[k] = FromFloat<T>(d * g * s);
      }
      *reinterpret_cast<P*>(y_or_dgate + row * cols + col) = out;
      *reinterpret_cast<P*>(dup + row * cols + col) = out2;
    }
  }
}

template <typename T>
cudaError_t LaunchSwiGlu(const void* gate, const void* up, int64_t ld, const void* dy, void* a,
                         void* b, int64_t rows, int64_t cols, bool backward, cudaStream_t stream) {
  if (cols <= 0 || ld < cols) return cudaErrorInvalidValue;
  if (rows <= 0) return cudaSuccess;
  constexpr int kThreads = 256;
  constexpr int kW = Pack<T>::kWidth;
  auto aligned = [](const void* p) {
    return p == nullptr || reinterpret_cast<uintptr_t>(p) % 16 == 0;
  };
  const bool packed = cols % kW == 0 && ld % kW == 0 && aligned(gate) && aligned(up) &&
                      aligned(dy) && aligned(a) && aligned(b);
  const int64_t work = packed ? rows * (cols / kW) : rows * cols;
  const int64_t blocks = std::min<int64_t>((work + kThreads - 1) / kThreads, 132 * 32);
  auto* g = static_cast<const T*>(gate);
  auto* u = static_cast<const T*>(up);
  auto* d = static_cast<const T*>(dy);
  if (packed)
    SwiGluPackedKernel<T><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
        g, u, ld, d, static_cast<T*>(a), static_cast<T*>(b), rows, cols, backward);
  else
    SwiGluKernel<T><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
        g, u, ld, d, static_cast<T*>(a), static_cast<T*>(b), rows, cols, backward);
  return cudaGetLastError();
}

// The bit-pattern rounding of the coordinator's FloatToBFloat16 (optim/adamw.cc),
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

// The CPU loops' operations in their order (adamw_constants.h); _rn intrinsics are never
// contracted into fused multiply-adds, and the sqrt and division are correctly rounded.
template <bool kBf16>
__global__ void AdamWComputeCopyKernel(coord::AdamWConstants k, const float* grad,
                                       const float* master, const float* m, const float* v,
                                       void* out, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float g = __fmul_rn(grad[i], k.grad_scale);
    float p = __fmul_rn(master[i], k.decay);
    const float mi = __fadd_rn(__fmul_rn(m[i], k.b1), __fmul_rn(g, k.one_minus_b1));
    const float vi = __fadd_rn(__fmul_rn(v[i], k.b2), __fmul_rn(__fmul_rn(g, g), k.one_minus_b2));
    const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), k.bc2_sqrt), k.eps);
    p = __fsub_rn(p, __fmul_rn(k.step_size, __fdiv_rn(mi, denom)));
    if constexpr (kBf16) {
      static_cast<uint16_t*>(out)[i] = static_cast<uint16_t>(RoundBits(__float_as_uint(p)));
    } else {
      static_cast<float*>(out)[i] = p;
    }
  }
}

}  // namespace

cudaError_t RoundToBFloat16(const float* src, uint16_t* dst, int64_t n, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  constexpr int kThreads = 256;
  const bool aligned =
      reinterpret_cast<uintptr_t>(src) % 16 == 0 && reinterpret_cast<uintptr_t>(dst) % 8 == 0;
  const int64_t quads = aligned ? n / 4 : 0;
  if (quads > 0) {
    const int64_t blocks = std::min<int64_t>((quads + kThreads - 1) / kThreads, 132 * 32);
    RoundToBFloat16Kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
        reinterpret_cast<const float4*>(src), reinterpret_cast<uint2*>(dst), quads);
  }
  const int64_t rest = n - quads * 4;
  if (rest > 0) {
    RoundToBFloat16TailKernel<<<static_cast<unsigned>((rest + kThreads - 1) / kThreads), kThreads,
                                0, stream>>>(src + quads * 4, dst + quads * 4, rest);
  }
  return cudaGetLastError();
}

cudaError_t AdamWComputeCopy(const coord::AdamWConstants& k, const float* grad, const float* master,
                             const float* m, const float* v, void* out, Dtype out_dtype, int64_t n,
                             cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  constexpr int kThreads = 256;
  const auto blocks =
      static_cast<unsigned>(std::min<int64_t>((n + kThreads - 1) / kThreads, 132 * 32));
  if (out_dtype == Dtype::kBFloat16) {
    AdamWComputeCopyKernel<true><<<blocks, kThreads, 0, stream>>>(k, grad, master, m, v, out, n);
  } else {
    AdamWComputeCopyKernel<false><<<blocks, kThreads, 0, stream>>>(k, grad, master, m, v, out, n);
  }
  return cudaGetLastError();
}

cudaError_t CrossEntropyRows(Dtype dtype, void* logits, const int64_t* labels, int64_t rows,
                             int64_t vocab, float scale, bool write_grad, float* row_loss,
                             cudaStream_t stream) {
  if (dtype == Dtype::kBFloat16)
    return LaunchCrossEntropy<__nv_bfloat16>(logits, labels, rows, vocab, scale, write_grad,
                                             row_loss, stream);
  return LaunchCrossEntropy<float>(logits, labels, rows, vocab, scale, write_grad, row_loss,
                                   stream);
}

cudaError_t HeadNormRope(Dtype dtype, const void* x, const void* w, const void* cos,
                         const void* sin_signed, void* y, int64_t rows, int64_t seq, int64_t heads,
                         int64_t dim, float eps, cudaStream_t stream) {
  if (dtype == Dtype::kBFloat16)
    return DispatchHeadNormRope<__nv_bfloat16>(x, w, cos, sin_signed, y, nullptr, nullptr, nullptr,
                                               rows, seq, heads, dim, eps, false, stream);
  return DispatchHeadNormRope<float>(x, w, cos, sin_signed, y, nullptr, nullptr, nullptr, rows, seq,
                                     heads, dim, eps, false, stream);
}

cudaError_t HeadNormRopeBackward(Dtype dtype, const void* x, const void* w, const void* cos,
                                 const void* sin_signed, const void* dy, void* dx, float* dw_f32,
                                 int64_t rows, int64_t seq, int64_t heads, int64_t dim, float eps,
                                 cudaStream_t stream) {
  if (dtype == Dtype::kBFloat16)
    return DispatchHeadNormRope<__nv_bfloat16>(x, w, cos, sin_signed, nullptr, dy, dx, dw_f32, rows,
                                               seq, heads, dim, eps, true, stream);
  return DispatchHeadNormRope<float>(x, w, cos, sin_signed, nullptr, dy, dx, dw_f32, rows, seq,
                                     heads, dim, eps, true, stream);
}

bool RmsNormSupports(int64_t dim) {
  if (dim % kRowThreads != 0) return false;
  switch (dim / kRowThreads) {
    case 4:
    case 8:
    case 10:
    case 12:
    case 16:
    case 20: return true;
    default: return false;
  }
}

namespace {
constexpr int kQuantThreads = 256;

template <typename T>
__global__ void __launch_bounds__(kQuantThreads)
    QuantizeRowsE4m3Kernel(const T* x, uint8_t* q, float* scales, int64_t cols) {
  const int64_t row = blockIdx.x;
  const T* in = x + row * cols;
  uint8_t* out = q + row * cols;
  float amax = 0.0f;
  bool finite = true;
  for (int64_t i = threadIdx.x; i < cols; i += kQuantThreads) {
    const float v = ToFloat(in[i]);
    finite = finite && isfinite(v);
    amax = fmaxf(amax, fabsf(v));
  }
  __shared__ float warp_max[kQuantThreads / 32];
  __shared__ int warp_finite[kQuantThreads / 32];
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  finite = __all_sync(0xffffffffu, finite);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    warp_max[warp] = amax;
    warp_finite[warp] = finite;
  }
  __syncthreads();
  amax = 0.0f;
  finite = true;
  for (int w = 0; w < kQuantThreads / 32; ++w) {
    amax = fmaxf(amax, warp_max[w]);
    finite = finite && warp_finite[w];
  }
  // amax = m 2^e, m in [0.5, 1); 448 = 0.875 2^9 (model/fp8.cc has the same rule).
  int e = 0;
  const float m = frexpf(amax, &e);
  int k = e - 9 + (m > 0.875f ? 1 : 0);
  k = amax == 0.0f ? 0 : min(max(k, -126), 126);  // a finite amax gives k <= 120
  const float scale = finite ? __int_as_float((k + 127) << 23) : __int_as_float(0x7fc00000);
  const float inv = __int_as_float((127 - k) << 23);  // 2^-k, exact for |k| <= 126
  if (threadIdx.x == 0) scales[row] = scale;
  for (int64_t i = threadIdx.x; i < cols; i += kQuantThreads)
    out[i] = __nv_cvt_float_to_fp8(ToFloat(in[i]) * inv, __NV_SATFINITE, __NV_E4M3);
}
}  // namespace

cudaError_t QuantizeRowsE4m3(Dtype dtype, const void* x, uint8_t* q, float* scales, int64_t rows,
                             int64_t cols, cudaStream_t stream) {
  if (rows == 0 || cols == 0) return cudaSuccess;
  if (rows > INT32_MAX) return cudaErrorInvalidValue;
  if (dtype == Dtype::kBFloat16)
    QuantizeRowsE4m3Kernel<__nv_bfloat16>
        <<<static_cast<unsigned>(rows), kQuantThreads, 0, stream>>>(
            static_cast<const __nv_bfloat16*>(x), q, scales, cols);
  else
    QuantizeRowsE4m3Kernel<float><<<static_cast<unsigned>(rows), kQuantThreads, 0, stream>>>(
        static_cast<const float*>(x), q, scales, cols);
  return cudaGetLastError();
}

cudaError_t AddRmsNorm(Dtype dtype, const void* x, const void* res, const void* w, void* sum,
                       void* y, int64_t rows, int64_t dim, float eps, cudaStream_t stream) {
  if (dtype == Dtype::kBFloat16)
    return DispatchRmsNorm<__nv_bfloat16>(x, res, w, sum, y, nullptr, nullptr, nullptr, rows, dim,
                                          eps, false, stream);
  return DispatchRmsNorm<float>(x, res, w, sum, y, nullptr, nullptr, nullptr, rows, dim, eps, false,
                                stream);
}

cudaError_t RmsNormBackward(Dtype dtype, const void* s, const void* w, const void* dy,
                            const void* ds_other, void* ds, float* dw_f32, int64_t rows,
                            int64_t dim, float eps, cudaStream_t stream) {
  if (dtype == Dtype::kBFloat16)
    return DispatchRmsNorm<__nv_bfloat16>(s, ds_other, w, nullptr, nullptr, dy, ds, dw_f32, rows,
                                          dim, eps, true, stream);
  return DispatchRmsNorm<float>(s, ds_other, w, nullptr, nullptr, dy, ds, dw_f32, rows, dim, eps,
                                true, stream);
}

cudaError_t SwiGlu(Dtype dtype, const void* gate, const void* up, int64_t ld, void* y, int64_t rows,
                   int64_t cols, cudaStream_t stream) {
  if (dtype == Dtype::kBFloat16)
    return LaunchSwiGlu<__nv_bfloat16>(gate, up, ld, nullptr, y, nullptr, rows, cols, false,
                                       stream);
  return LaunchSwiGlu<float>(gate, up, ld, nullptr, y, nullptr, rows, cols, false, stream);
}

cudaError_t SwiGluBackward(Dtype dtype, const void* gate, const void* up, int64_t ld,
                           const void* dy, void* d_gate, void* d_up, int64_t rows, int64_t cols,
                           cudaStream_t stream) {
  if (dtype == Dtype::kBFloat16)
    return LaunchSwiGlu<__nv_bfloat16>(gate, up, ld, dy, d_gate, d_up, rows, cols, true, stream);
  return LaunchSwiGlu<float>(gate, up, ld, dy, d_gate, d_up, rows, cols, true, stream);
}

cudaError_t Rope(Dtype dtype, const void* x, const void* cos, const void* sin_signed, void* y,
                 int64_t rows, int64_t seq, int64_t heads, int64_t dim, bool backward,
                 cudaStream_t stream) {
  if (dtype == Dtype::kBFloat16)
    return LaunchRope<__nv_bfloat16>(x, cos, sin_signed, y, rows, seq, heads, dim, backward,
                                     stream);
  return LaunchRope<float>(x, cos, sin_signed, y, rows, seq, heads, dim, backward, stream);
}

}  // namespace rp::worker::kernels
