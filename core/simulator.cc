// SPDX-License-Identifier: Apache-2.0
#include "core/simulator.h"

#include <algorithm>

namespace rp::core {

SimResult SimulateRoundRobin(const std::vector<double>& stage_time, int workers, int microbatches,
                             int calls) {
  const int S = static_cast<int>(stage_time.size());
  const int jobs = S * calls;
  SimResult r;
  r.busy.assign(workers, 0.0);
  // end[k][m]: finish time of microbatch m of job k. Jobs are processed in index order, which is
  // a valid topological order: every dependency points to a smaller index.
  std::vector<std::vector<double>> end(jobs, std::vector<double>(microbatches, 0.0));
  std::vector<double> worker_free(workers, 0.0);
  for (int k = 0; k < jobs; ++k) {
    const int w = k % workers, stage = k % S;
    const bool chained = stage > 0;  // the first stage of a call waits only for data
    double t = worker_free[w];
    for (int m = 0; m < microbatches; ++m) {
      if (chained) t = std::max(t, end[k - 1][m]);
      t += stage_time[stage];
      end[k][m] = t;
      r.busy[w] += stage_time[stage];
    }
    worker_free[w] = t;
    r.makespan = std::max(r.makespan, t);
  }
  double busy = 0.0;
  for (double b : r.busy) busy += b;
  r.bubble_ratio = r.makespan > 0 ? 1.0 - busy / (r.makespan * workers) : 0.0;
  return r;
}

std::vector<double> StageFlops(const JobConfig& c, const PipelinePlan& plan) {
  const auto& m = c.model;
  const double tokens = static_cast<double>(c.TokensPerMicrobatch());
  const double seq = static_cast<double>(c.data.seq_len);
  const double block_params = static_cast<double>(
      m.hidden_size * (m.num_heads + 2 * m.num_kv_heads) * m.head_dim +
      m.num_heads * m.head_dim * m.hidden_size + 3 * m.hidden_size * m.intermediate_size);
  // Causal attention: QK^T and PV, half the square.
  const double attention = 2.0 * tokens * seq * static_cast<double>(m.num_heads * m.head_dim);
  const double block_fwd = 2.0 * block_params * tokens + attention;
  const double head_fwd = 2.0 * static_cast<double>(m.vocab_size * m.hidden_size) * tokens;
  auto layer_fwd = [&](int l) { return l == 0 ? 0.0 : l == plan.num_layers - 1 ? head_fwd : block_fwd; };
  std::vector<double> out;
  for (const auto& s : plan.stages) {
    double f = 0.0;
    for (int l = s.begin; l < s.end; ++l) f += layer_fwd(l);
    out.push_back(s.kind == StageKind::kForward ? f : 3.0 * f);
  }
  return out;
}

}  // namespace rp::core
