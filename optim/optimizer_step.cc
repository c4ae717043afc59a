// SPDX-License-Identifier: Apache-2.0
#include "optim/optimizer_step.h"

#include <cmath>

namespace rp::coord {

namespace {
// Element j of a chunk goes to partial sum j % kLanes; the partial sums are combined pairwise in
// a fixed order. Why lanes: one chain of dependent double additions runs at one element per add
// latency (about 0.75e9 elements/s per core), which made the norm of the tied embedding's last
// gradient the largest item of the exact-mode boundary after the update itself; eight
// independent chains run at memory speed. The result does not depend on the machine or thread
// count (each lane is summed in element order; a float times a float is exact in double).
constexpr int kLanes = 8;
double Combine(const double* lane) {
  return ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
}
}  // namespace

// Written as whole groups of kLanes plus a tail so the compiler vectorizes the lanes (each lane
// keeps its own order: no reassociation), in each instruction set the CPU may have.
__attribute__((target_clones("avx512f", "avx2", "default"))) double SquaredSum(const float* g,
                                                                               int64_t n) {
  double lane[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes)
    for (int k = 0; k < kLanes; ++k) lane[k] += static_cast<double>(g[j + k]) * g[j + k];
  for (; j < n; ++j) lane[j % kLanes] += static_cast<double>(g[j]) * g[j];
  return Combine(lane);
}

__attribute__((target_clones("avx512f", "avx2", "default"))) double AddAndSquaredSum(
    float* g, const float* other, int64_t n) {
  double lane[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes)
    for (int k = 0; k < kLanes; ++k) {
      const float x = g[j + k] + other[j + k];
      g[j + k] = x;
      lane[k] += static_cast<double>(x) * x;
    }
  for (; j < n; ++j) {
    const float x = g[j] + other[j];
    g[j] = x;
    lane[j % kLanes] += static_cast<double>(x) * x;
  }
  return Combine(lane);
}

double RowwiseSquaredSum(const float* g, int64_t rows, int64_t cols) {
  double total = 0.0;
  for (int64_t r = 0; r < rows; ++r) total += SquaredSum(g + r * cols, cols);
  return total;
}

double ClipScale(double norm, double clip) {
  return clip > 0.0 && norm > clip ? clip / (norm + 1e-6) : 1.0;
}

void UpdateRange(const core::OptimizerConfig& opt, double lr, int64_t step_one_based, bool decay,
                 float grad_scale, const float* grad, float* master, float* m, float* v, int64_t n,
                 void* compute, ComputeDtype dtype, UpdateWrites writes) {
  const double wd = decay ? opt.weight_decay : 0.0;
  if (dtype == ComputeDtype::kFloat16) {
    // The master as its own copy (its first pass writes it, the second the moments), then rounded
    // into the half copy by whichever pass writes what workers fetch.
    UpdateRange(opt, lr, step_one_based, decay, grad_scale, grad, master, m, v, n, master,
                ComputeDtype::kFloat32, writes);
    if (writes != UpdateWrites::kRest) FloatsToHalves(master, static_cast<uint16_t*>(compute), n);
    return;
  }
  if (opt.name == core::OptimizerName::kSgd) {
    SgdUpdate(SgdHyper{lr, opt.momentum, wd}, grad_scale, grad, master, m, n, compute, dtype,
              writes);
    return;
  }
  AdamWUpdate(AdamWHyper{lr, opt.beta1, opt.beta2, opt.eps, wd, step_one_based}, grad_scale, grad,
              master, m, v, n, compute, dtype, writes);
}

OptimizerStepResult OptimizerStep(const std::vector<ParamArrays>& params,
                                  const core::OptimizerConfig& opt, double lr,
                                  int64_t step_one_based, double grad_clip, ComputeDtype dtype,
                                  int threads) {
  struct Task {
    size_t param;
    int64_t begin, end;
  };
  std::vector<Task> tasks;
  for (size_t i = 0; i < params.size(); ++i) {
    const int64_t chunk = ChunkElems(params[i].row_elems);
    for (int64_t b = 0; b < params[i].numel; b += chunk)
      tasks.push_back({i, b, std::min(params[i].numel, b + chunk)});
  }
  std::vector<double> partial(tasks.size(), 0.0);
  ParallelFor(static_cast<int64_t>(tasks.size()), threads, [&](int64_t t) {
    const ParamArrays& p = params[tasks[t].param];
    const float* g = p.grad + tasks[t].begin;
    const int64_t n = tasks[t].end - tasks[t].begin;
    partial[t] =
        p.row_elems > 0 ? RowwiseSquaredSum(g, n / p.row_elems, p.row_elems) : SquaredSum(g, n);
  });
  double total = 0.0;
  for (double s : partial) total += s;
  OptimizerStepResult r;
  r.grad_norm = std::sqrt(total);
  r.clip_scale = ClipScale(r.grad_norm, grad_clip);
  const float scale = static_cast<float>(r.clip_scale);
  ParallelFor(static_cast<int64_t>(tasks.size()), threads, [&](int64_t t) {
    const Task& task = tasks[t];
    const ParamArrays& p = params[task.param];
    const size_t elem = dtype == ComputeDtype::kFloat32 ? 4 : 2;
    UpdateRange(opt, lr, step_one_based, p.decay, scale, p.grad + task.begin, p.master + task.begin,
                p.m + task.begin, p.v ? p.v + task.begin : nullptr, task.end - task.begin,
                static_cast<char*>(p.compute) + task.begin * elem, dtype);
  });
  return r;
}

}  // namespace rp::coord
