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
    AdamWHyper h{lr, opt.beta1, opt.beta2, opt.eps, p.decay ? opt.weight_decay : 0.0,
                 step_one_based};
    const size_t elem = dtype == ComputeDtype::kFloat32 ? 4 : 2;
    AdamWUpdate(h, scale, p.grad + task.begin, p.master + task.begin, p.m + task.begin,
                p.v + task.begin, task.end - task.begin,
                static_cast<char*>(p.compute) + task.begin * elem, dtype);
  });
  return r;
}

}  // namespace rp::coord
