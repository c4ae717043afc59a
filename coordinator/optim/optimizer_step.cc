// SPDX-License-Identifier: Apache-2.0
#include "coordinator/optim/optimizer_step.h"

#include <cmath>

namespace rp::coord {

OptimizerStepResult OptimizerStep(const std::vector<ParamArrays>& params,
                                  const core::OptimizerConfig& opt, double lr,
                                  int64_t step_one_based, double grad_clip, ComputeDtype dtype,
                                  int threads) {
  std::vector<double> sq(params.size(), 0.0);
  ParallelFor(static_cast<int64_t>(params.size()), threads, [&](int64_t i) {
    double s = 0.0;
    const float* g = params[i].grad;
    for (int64_t j = 0; j < params[i].numel; ++j) s += static_cast<double>(g[j]) * g[j];
    sq[i] = s;
  });
  double total = 0.0;
  for (double s : sq) total += s;
  OptimizerStepResult r;
  r.grad_norm = std::sqrt(total);
  if (grad_clip > 0.0 && r.grad_norm > grad_clip) r.clip_scale = grad_clip / (r.grad_norm + 1e-6);

  // Large tensors are split into chunks so one embedding matrix does not serialize the step.
  constexpr int64_t kChunk = 1 << 18;
  struct Task { size_t param; int64_t begin, end; };
  std::vector<Task> tasks;
  for (size_t i = 0; i < params.size(); ++i)
    for (int64_t b = 0; b < params[i].numel; b += kChunk)
      tasks.push_back({i, b, std::min(params[i].numel, b + kChunk)});
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
