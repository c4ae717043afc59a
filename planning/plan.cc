// SPDX-License-Identifier: Apache-2.0
#include "planning/plan.h"

#include <algorithm>
#include <set>
#include <sstream>

namespace rp::core {

const char* StageKindName(StageKind k) {
  switch (k) {
    case StageKind::kForward: return "forward";
    case StageKind::kFusedTail: return "fused_tail";
    case StageKind::kBackward: return "backward";
  }
  return "?";
}

std::vector<int> EqualCuts(int n, int parts) {
  std::vector<int> starts;
  int pos = 0;
  for (int i = 0; i < parts; ++i) {
    starts.push_back(pos);
    pos += n / parts + (i < n % parts ? 1 : 0);
  }
  return starts;
}

std::vector<JobSlot> StepJobOrder(const PipelinePlan& plan, int calls, bool interleave) {
  const int S = static_cast<int>(plan.stages.size());
  const int F = plan.NumForward();
  std::vector<JobSlot> order;
  order.reserve(static_cast<size_t>(S) * calls);
  for (int c = 0; c < calls; c += interleave ? 2 : 1) {
    const int group = interleave ? std::min(2, calls - c) : 1;
    for (int s = 0; s < F; ++s)
      for (int g = 0; g < group; ++g) order.push_back({c + g, s});
    for (int g = 0; g < group; ++g)
      for (int s = F; s < S; ++s) order.push_back({c + g, s});
  }
  return order;
}

int PipelinePlan::NumForward() const {
  int n = 0;
  for (auto& s : stages) n += s.kind == StageKind::kForward;
  return n;
}

int PipelinePlan::HiddenSlot(int b) const {
  auto it = std::lower_bound(hidden_boundaries.begin(), hidden_boundaries.end(), b);
  return it != hidden_boundaries.end() && *it == b
             ? static_cast<int>(it - hidden_boundaries.begin())
             : -1;
}

int PipelinePlan::GradSlot(int b) const {
  auto it = std::lower_bound(grad_boundaries.begin(), grad_boundaries.end(), b);
  return it != grad_boundaries.end() && *it == b ? static_cast<int>(it - grad_boundaries.begin())
                                                 : -1;
}

bool PipelinePlan::IsCheckpoint(int b) const {
  for (auto& s : stages)
    if (s.kind == StageKind::kBackward && s.begin == b && b > 0) return true;
  return false;
}

std::string Stage::Describe() const {
  std::ostringstream o;
  o << (kind == StageKind::kForward    ? "F"
        : kind == StageKind::kBackward ? "B"
                                       : "T")
    << "[" << begin << "," << end << ")";
  return o.str();
}

std::string PipelinePlan::Describe() const {
  std::string out;
  for (size_t i = 0; i < stages.size(); ++i) {
    if (i) out += ' ';
    out += stages[i].Describe();
  }
  return out;
}

int KeptStart(const JobConfig& c, int tail_start) {
  // kKeptBlocksAuto not yet resolved (ResolveMlpTile's probes, before ResolveKeptBlocks): none.
  int start = c.schedule.kept_blocks > 0
                  ? std::max(1, tail_start - static_cast<int>(c.schedule.kept_blocks))
                  : tail_start;
  for (int l = start; l < tail_start; ++l)
    if (SparseBlock(c.model, l - 1)) start = l + 1;
  return start;
}

int KeptAttentionStart(const JobConfig& c, const PipelinePlan& plan) {
  const int end = std::min(plan.kept_start, plan.tail_start);
  return c.schedule.keep_attention > 0
             ? std::max(1, end - static_cast<int>(c.schedule.keep_attention))
             : end;
}

StatusOr<PipelinePlan> BuildPlan(const JobConfig& c) {
  PipelinePlan p;
  const int L = static_cast<int>(c.model.num_layers);
  p.num_layers = L + 2;
  p.tail_start = L + 1 - static_cast<int>(c.schedule.tail_blocks);
  const int t = p.tail_start;
  p.kept_start = KeptStart(c, t);

  auto starts_from = [&](const std::vector<int64_t>& cuts, int64_t count) {
    std::vector<int> starts;
    if (cuts.empty()) return EqualCuts(t, static_cast<int>(count));
    starts.push_back(0);
    for (auto x : cuts) starts.push_back(static_cast<int>(x));
    return starts;
  };
  std::vector<int> fwd = starts_from(c.schedule.forward_cuts, c.schedule.forward_stages);
  std::vector<int> bwd = starts_from(c.schedule.backward_cuts, c.schedule.backward_stages);
  for (size_t i = 0; i < fwd.size(); ++i) {
    int end = i + 1 < fwd.size() ? fwd[i + 1] : t;
    if (end <= fwd[i])
      return Status::InvalidArgument("schedule: empty forward stage at layer " +
                                     std::to_string(fwd[i]));
    p.stages.push_back({StageKind::kForward, fwd[i], end});
  }
  p.stages.push_back({StageKind::kFusedTail, t, L + 2});
  for (size_t i = bwd.size(); i-- > 0;) {
    int end = i + 1 < bwd.size() ? bwd[i + 1] : t;
    if (end <= bwd[i])
      return Status::InvalidArgument("schedule: empty backward stage at layer " +
                                     std::to_string(bwd[i]));
    p.stages.push_back({StageKind::kBackward, bwd[i], end});
  }

  // Coverage check: an invariant of the construction above, verified because a plan that drops
  // or duplicates a layer would train the wrong model silently.
  std::vector<int> fcount(p.num_layers, 0), bcount(p.num_layers, 0);
  for (auto& s : p.stages)
    for (int l = s.begin; l < s.end; ++l) {
      if (s.kind != StageKind::kBackward) fcount[l]++;
      if (s.kind != StageKind::kForward) bcount[l]++;
    }
  for (int l = 0; l < p.num_layers; ++l)
    if (fcount[l] != 1 || bcount[l] != 1)
      return Status::Internal("plan covers layer " + std::to_string(l) + " " +
                              std::to_string(fcount[l]) + "x forward, " +
                              std::to_string(bcount[l]) + "x backward: " + p.Describe());

  std::set<int> hidden, grads;
  for (auto& s : p.stages) {
    if (s.kind == StageKind::kForward) hidden.insert(s.end);
    if (s.kind == StageKind::kBackward && s.begin > 0) hidden.insert(s.begin);
    if (s.kind != StageKind::kForward && s.begin > 0) grads.insert(s.begin);
  }
  p.hidden_boundaries.assign(hidden.begin(), hidden.end());
  p.grad_boundaries.assign(grads.begin(), grads.end());
  return p;
}

}  // namespace rp::core
