// SPDX-License-Identifier: Apache-2.0
#include "coordinator/optim/optimizer_step.h"

#include <cmath>

namespace rp::coord {

double SquaredSum(const float* g, int64_t n) {
  double s = 0.0;
  for (int64_t j = 0; j < n; ++j) s += static_cast<double>(g[j]) * g[j];
  return s;
}

double ClipScale(double norm, double clip) {
  return clip > 0.0 && norm > clip ? clip / (norm + 1e-6) : 1.0;
}

void UpdateRange(const core::OptimizerConfig& opt, double lr, int64_t step_one_based, bool decay,
                 float grad_scale, const float* grad, float* master, float* m, float* v, int64_t n,
                 void* compute, ComputeDtype dtype, UpdateWrites writes) {
  const double wd = decay ? opt.weight_decay : 0.0;
  if (opt.name == "sgd") {
    SgdUpdate(SgdHyper{lr, opt.momentum, wd}, grad_scale, grad, master, m, n, compute, dtype, writes);
    return;
  }
  AdamWUpdate(AdamWHyper{lr, opt.beta1, opt.beta2, opt.eps, wd, step_one_based}, grad_scale, grad,
              master, m, v, n, compute, dtype, writes);
}

OptimizerStepResult OptimizerStep(const std::vector<ParamArrays>& params,
                                  const core::OptimizerConfig& opt, double lr,
                                  int64_t step_one_based, double grad_clip, ComputeDtype dtype,
                                  int threads) {
  struct Task { size_t param; int64_t begin, end; };
  std::vector<Task> tasks;
  for (size_t i = 0; i < params.size(); ++i)
    for (int64_t b = 0; b < params[i].numel; b += kOptimizerChunk)
      tasks.push_back({i, b, std::min(params[i].numel, b + kOptimizerChunk)});
  std::vector<double> partial(tasks.size(), 0.0);
  ParallelFor(static_cast<int64_t>(tasks.size()), threads, [&](int64_t t) {
    partial[t] = SquaredSum(params[tasks[t].param].grad + tasks[t].begin, tasks[t].end - tasks[t].begin);
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
