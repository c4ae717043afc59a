// SPDX-License-Identifier: Apache-2.0
// AdamW on flat fp32 arrays (torch.optim.AdamW semantics: decoupled weight decay, bias
// correction); updates are spread over threads with common/parallel.h's ParallelFor.
//
// Contract: AdamWUpdate() makes one pass over n elements: reads master, m, v and grad (times
// grad_scale, which carries gradient clipping), writes master, m, v and the compute copy (fp32 or
// bf16, round-to-nearest-even). Three implementations: the scalar loop (the oracle), AVX2 and
// AVX-512 intrinsics. They do the same IEEE operations in the same order (no FMA contraction,
// correctly rounded sqrt and division), so every path gives the scalar loop's bits; the fastest
// one the CPU supports is picked once at run time (RP_SIMD=scalar|avx2|avx512 caps it).
// Pure function of its arguments; call it on disjoint ranges from several threads.
#pragma once

#include <cstdint>
#include <functional>

#include "common/parallel.h"
#include "optim/adamw_constants.h"

namespace rp::coord {

struct AdamWHyper {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;  // already 0 for parameters excluded from decay
  int64_t step = 1;           // 1-based, for bias correction
};

// kFloat16: the update writes the master (as if it were its own copy), then rounds it into the
// compute copy (FloatsToHalves): one more pass over the master than bf16's fused write, on the
// fp16 path only.
enum class ComputeDtype : uint8_t { kFloat32, kBFloat16, kFloat16 };

// Which of an update's outputs one pass writes. An update can run as two passes over the same
// inputs: kFetched writes only what workers fetch (the compute copy, or the master when the master
// is its own copy) and kRest writes everything else (the moments, and the master when a separate
// copy exists). Both passes recompute the same values with the same operations, so kFetched then
// kRest leaves exactly the bits kAll leaves. Why split: in exact mode the next step's forward
// waits only for the fetched array, and a pass that skips writing the moments moves 20-28% fewer
// bytes (see AsyncOptimizer). SGD with the master as its own copy cannot defer anything (its
// momentum reads the old master): there kFetched does everything and kRest nothing.
enum class UpdateWrites : uint8_t { kAll, kFetched, kRest };

enum class SimdLevel : uint8_t { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };
const char* SimdLevelName(SimdLevel level);
// What this CPU supports, capped by the RP_SIMD environment variable; computed once.
SimdLevel BestSimdLevel();

// The fp32 constants AdamWUpdate uses for `h` and `grad_scale` (adamw_constants.h): for updates
// computed elsewhere (a worker's device) that must give the same bits.
AdamWConstants MakeAdamWConstants(const AdamWHyper& h, float grad_scale);

void AdamWUpdate(const AdamWHyper& h, float grad_scale, const float* grad, float* master, float* m,
                 float* v, int64_t n, void* compute, ComputeDtype compute_dtype,
                 UpdateWrites writes = UpdateWrites::kAll);
// The same with an explicit implementation (tests and the benchmark); `level` must not exceed
// what the CPU supports (checked: falls back to the best supported level).
void AdamWUpdateWith(SimdLevel level, const AdamWHyper& h, float grad_scale, const float* grad,
                     float* master, float* m, float* v, int64_t n, void* compute,
                     ComputeDtype compute_dtype, UpdateWrites writes = UpdateWrites::kAll);

// Software prefetch distance of the AVX-512 AdamW loop in elements, 0 for none (default 512, or
// the RP_OPTIM_PREFETCH environment variable). For rp-optim-bench, which compares distances in
// one run; it changes speed only, never results.
void SetAdamWPrefetchDistance(int64_t elements);

// SGD with momentum, torch.optim.SGD semantics (dampening 0, not Nesterov): d = g + wd * p;
// buf = momentum * buf + d (buf starts at zero, so the first step's buf is d); p -= lr * buf.
struct SgdHyper {
  double lr = 1e-2;
  double momentum = 0.9;
  double weight_decay = 0.0;
};
void SgdUpdate(const SgdHyper& h, float grad_scale, const float* grad, float* master, float* buf,
               int64_t n, void* compute, ComputeDtype compute_dtype,
               UpdateWrites writes = UpdateWrites::kAll);

uint16_t FloatToBFloat16(float f);
float BFloat16ToFloat(uint16_t b);
// IEEE binary16, round to nearest even; overflow gives infinity, NaN stays NaN (quiet). The
// range form uses the CPU's F16C conversion where it has one (the same bits).
uint16_t FloatToHalf(float f);
float HalfToFloat(uint16_t h);
void FloatsToHalves(const float* in, uint16_t* out, int64_t n);
// n fp32 values into a compute copy of `dtype`, and back (exact for what the copy can hold).
void ToComputeCopy(const float* in, void* out, int64_t n, ComputeDtype dtype);
void FromComputeCopy(const void* in, float* out, int64_t n, ComputeDtype dtype);

using ::rp::ParallelFor;  // common/parallel.h

}  // namespace rp::coord
