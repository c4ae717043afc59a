// SPDX-License-Identifier: Apache-2.0
#include "planning/simulator.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "planning/grad_arena.h"

namespace rp::core {

double TransferSeconds(const SimStage& st, double h2d, double d2h) {
  return (h2d > 0 ? st.in_bytes / h2d : 0.0) + (d2h > 0 ? st.out_bytes / d2h : 0.0);
}

namespace {

// One run of the simulation: what the steps share (when each layer's gradient is final and its
// update published, each worker's streams, the microbatches' chains) and the parts of a step.
class StepSimulation {
 public:
  explicit StepSimulation(const SimInput& in);
  SimResult Run();

 private:
  struct Held {
    double from, to, bytes;
  };
  struct GradientJob {
    int stage, call, worker;
    double end;  // its last microbatch's
  };

  double UpdateCost(int o) const {
    return o < static_cast<int>(in_.update_s.size()) ? in_.update_s[o] : 0.0;
  }
  double H2dSeconds(double bytes) const {
    return in_.h2d_bytes_per_s > 0 ? bytes / in_.h2d_bytes_per_s : 0.0;
  }
  void RunUpdates(int t);
  void GatherUpdates(int t);
  double Commit(int t, const GradientJob& g, double earliest);
  void RunJob(int t, int pos);
  // The job's weight copies on worker w's weight stream; when the last ends, and per fetch when
  // its copy ends (empty for one copy of the whole stage).
  double FetchWeights(int need, int w, const SimStage& st, std::vector<double>* layer_copied);
  // The job's microbatches on worker w from `now`; returns when its compute ends and sets when
  // its last output copy ends.
  double RunMicrobatches(int c, int s, int w, double now, double fetch_end,
                         const std::vector<double>& layer_copied, double* outputs_done);
  void CommitWaiting(int t);
  void Summarize(SimResult* r) const;

  const SimInput& in_;
  const int S_, N_, M_, K_, T_;
  int owners_ = 0;
  SimResult r_;
  // final_at_[t][o]: layer o's gradient of step t is final; updated_[t][o]: its update is
  // published.
  std::vector<std::vector<double>> final_at_, updated_;
  std::vector<std::vector<bool>> has_grad_;
  // When each step's norm is known: set by RunUpdates (host norm) or where commits wait for it.
  std::vector<double> norm_known_;
  double optimizer_free_ = 0.0;
  std::vector<double> compute_free_, began_, weights_free_, grads_free_, first_start_, last_end_;
  // chain_[c][m]: when microbatch m of call c finished its call's latest dispatched stage.
  std::vector<std::vector<double>> chain_;
  std::vector<JobSlot> order_;
  std::vector<std::vector<Held>> held_;
  std::vector<GradientJob> waiting_;  // SimInput::commits_wait_for_norm: this step's, in job order
};

StepSimulation::StepSimulation(const SimInput& in)
    : in_(in),
      S_(static_cast<int>(in.stages.size())),
      N_(in.workers),
      M_(in.microbatches),
      K_(in.calls),
      T_(in.steps) {
  r_.busy.assign(N_, 0.0);
  r_.step_done.assign(T_, 0.0);
  for (const auto& st : in.stages)
    for (int o : st.owners) owners_ = std::max(owners_, o + 1);
  owners_ = std::max(owners_, static_cast<int>(in.update_s.size()));
  owners_ = std::max(owners_, in.lookup_owner + 1);
  if (in.device_blocks > 0) owners_ = std::max(owners_, in.device_owner_base + in.device_blocks);
  final_at_.assign(T_, std::vector<double>(owners_, 0.0));
  updated_.assign(T_, std::vector<double>(owners_, 0.0));
  has_grad_.assign(T_, std::vector<bool>(owners_, false));
  norm_known_.assign(T_, 0.0);
  for (auto* v : {&compute_free_, &began_, &weights_free_, &grads_free_, &last_end_})
    v->assign(N_, 0.0);
  first_start_.assign(N_, -1.0);
  chain_.assign(K_, std::vector<double>(M_, 0.0));
  held_.assign(N_, {});
  order_ = in.order;
  bool valid = order_.size() == static_cast<size_t>(S_ * K_);
  for (const auto& j : order_)
    valid = valid && j.call >= 0 && j.call < K_ && j.stage >= 0 && j.stage < S_;
  if (!valid) order_.clear();  // not one step's jobs: call by call (the contract's default)
  if (order_.empty())
    for (int c = 0; c < K_; ++c)
      for (int s = 0; s < S_; ++s) order_.push_back({c, s});
}

void StepSimulation::RunUpdates(int t) {
  std::vector<int> order;
  for (int o = 0; o < owners_; ++o)
    if (has_grad_[t][o]) order.push_back(o);
  // Norms in the order the gradients became final, one after another on the optimizer's
  // threads (they share its memory bandwidth); a gradient's update waits for its norm.
  std::vector<int> by_final = order;
  std::stable_sort(by_final.begin(), by_final.end(),
                   [&](int a, int b) { return final_at_[t][a] < final_at_[t][b]; });
  std::vector<double> normed(owners_, 0.0);
  double norm_free = 0.0;
  for (int o : by_final) {
    norm_free = std::max(norm_free, final_at_[t][o]) +
                (o < static_cast<int>(in_.norm_s.size()) ? in_.norm_s[o] : 0.0);
    normed[o] = norm_free;
  }
  double all_final = 0.0;
  for (int o : order) all_final = std::max(all_final, normed[o]);
  if (!in_.updates_wait_for_norm) order = by_final;
  const bool rows_first =
      in_.lookup_owner > 0 && in_.updates_wait_for_norm && !order.empty() && order[0] == 0;
  if (rows_first) {
    // The next step's rows of owner 0, then the others, then owner 0's other rows.
    updated_[t][in_.lookup_owner] =
        std::max(optimizer_free_, all_final) + in_.lookup_fraction * UpdateCost(0);
    optimizer_free_ = updated_[t][in_.lookup_owner];
    order.erase(order.begin());
    order.push_back(0);
  }
  if (in_.device_blocks > 0) {
    // The worker's copies are there at the norm; the host does those layers after all others
    // (the tied embedding's other rows included).
    if (in_.updates_wait_for_norm) norm_known_[t] = all_final;
    for (int l = 1; l <= in_.device_blocks; ++l)
      updated_[t][in_.device_owner_base + l - 1] = norm_known_[t];
    std::stable_partition(order.begin(), order.end(),
                          [&](int o) { return !(o >= 1 && o <= in_.device_blocks); });
  }
  for (int o : order) {
    const double ready = in_.updates_wait_for_norm ? all_final : normed[o];
    const double cost =
        rows_first && o == 0 ? (1.0 - in_.lookup_fraction) * UpdateCost(0) : UpdateCost(o);
    const double start = std::max(optimizer_free_, ready);
    updated_[t][o] = start + cost;
    optimizer_free_ = updated_[t][o];
  }
  // Second passes publish nothing; they keep the optimizer (its memory bandwidth) busy before
  // the next step's first passes.
  for (int o : order)
    if (o < static_cast<int>(in_.second_pass_s.size())) optimizer_free_ += in_.second_pass_s[o];
  if (in_.lookup_owner > 0 && !rows_first) updated_[t][in_.lookup_owner] = updated_[t][0];
  if (!in_.gather_s.empty()) GatherUpdates(t);
}

// Each update is fetchable once gathered from every node. Layer o is gathered by worker o mod N
// (shm::GatheringWorker), each worker's layers one at a time in ascending order.
void StepSimulation::GatherUpdates(int t) {
  std::vector<double> queue_free(std::max(1, N_), 0.0);
  std::vector<double> gathered(owners_, 0.0);
  for (int o = 0; o < owners_; ++o) {
    if (!has_grad_[t][o]) continue;
    const double cost = o < static_cast<int>(in_.gather_s.size()) ? in_.gather_s[o] : 0.0;
    double& free = queue_free[o % std::max(1, N_)];
    free = std::max(free, updated_[t][o]) + cost;
    gathered[o] = free;
  }
  for (int o = 0; o < owners_; ++o)
    if (has_grad_[t][o]) updated_[t][o] = gathered[o];
}

// Writes back job g's gradients of step t, starting no earlier than `earliest`, on its worker's
// gradient stream; returns when its layers' gradients are final. A gradient slot of step t is
// free once step t - 1's update of its layer has read it (stale1: the update runs during this
// step). Exact mode's second passes, which hold the slots after the layer is published, are not
// modelled: the profile's rate is the first pass's, and the second passes run well ahead of the
// next step's commits (a slot that waited would show as a later commit and more gradients held
// on device).
double StepSimulation::Commit(int t, const GradientJob& g, double earliest) {
  const SimStage& st = in_.stages[g.stage];
  double slot_free = 0.0;
  if (t > 0)
    for (int o : st.owners) slot_free = std::max(slot_free, updated_[t - 1][o]);
  const double start = std::max({earliest, grads_free_[g.worker], slot_free});
  double copy = in_.d2h_bytes_per_s > 0 ? st.grad_bytes / in_.d2h_bytes_per_s : 0.0;
  if (g.call > 0 && in_.h2d_bytes_per_s > 0) copy += st.grad_bytes / in_.h2d_bytes_per_s;
  copy += NodeSumSeconds(in_, st.grad_bytes);
  const double end = grads_free_[g.worker] = start + copy;
  // The job's fp32 gradients stay on the device from its end until the copy is done.
  held_[g.worker].push_back({g.end, end, st.grad_bytes});
  for (int o : st.owners) {
    final_at_[t][o] = std::max(final_at_[t][o], end);
    has_grad_[t][o] = true;
  }
  return end;
}

double StepSimulation::FetchWeights(int need, int w, const SimStage& st,
                                    std::vector<double>* layer_copied) {
  auto ready_at = [&](const std::vector<int>& owner_layers) {
    double ready = 0.0;
    if (need >= 0)
      for (int o : owner_layers) ready = std::max(ready, updated_[need][o]);
    return ready;
  };
  double fetch_end = std::max(weights_free_[w], began_[w]);
  if (st.fetches.empty()) {  // one copy after the last owner's update
    fetch_end = std::max(fetch_end, ready_at(st.owners)) + H2dSeconds(st.weight_bytes);
  } else {  // layer by layer, each as soon as it is published
    for (const SimFetch& f : st.fetches) {
      fetch_end = std::max(fetch_end, ready_at(f.owners)) + H2dSeconds(f.bytes);
      layer_copied->push_back(fetch_end);
    }
  }
  weights_free_[w] = fetch_end;
  return fetch_end;
}

double StepSimulation::RunMicrobatches(int c, int s, int w, double now, double fetch_end,
                                       const std::vector<double>& layer_copied,
                                       double* outputs_done) {
  const SimStage& st = in_.stages[s];
  *outputs_done = now;  // the job's last output copy (copies_overlap)
  const size_t L = st.layer_compute_s.size();
  double lm_begin = 0.0;
  bool layer_major = false;
  if (in_.layer_major != SimInput::LayerMajor::kNever && L > 1 && L == layer_copied.size() &&
      M_ > 1) {
    lm_begin = std::max(compute_free_[w], layer_copied[0]);
    for (int m = 0; m < M_ && s > 0; ++m) lm_begin = std::max(lm_begin, chain_[c][m]);
    layer_major = in_.layer_major == SimInput::LayerMajor::kAlways || lm_begin < fetch_end;
  }
  if (layer_major) now = lm_begin;
  began_[w] = now;
  const double in_copy = H2dSeconds(st.in_bytes);
  const double out_copy = in_.d2h_bytes_per_s > 0 ? st.out_bytes / in_.d2h_bytes_per_s : 0.0;
  if (layer_major) {
    double overhead = st.compute_s;
    for (double x : st.layer_compute_s) overhead -= x;
    // The inputs' copies (all M, on the activations stream) come first; then each layer over
    // every microbatch once it is copied.
    if (in_.copies_overlap) now += in_copy;  // the others' copies overlap the first's compute
    if (first_start_[w] < 0) first_start_[w] = now;
    if (!in_.copies_overlap) now += M_ * in_copy;  // in series, and busy, as microbatch order has
    now += M_ * std::max(0.0, overhead);
    for (size_t i = 0; i < L; ++i)
      now = std::max(now, layer_copied[i]) + M_ * st.layer_compute_s[i];
    if (!in_.copies_overlap) now += M_ * out_copy;
    for (int m = 0; m < M_; ++m) chain_[c][m] = now + (in_.copies_overlap ? out_copy : 0.0);
    *outputs_done = chain_[c][M_ - 1];
    r_.busy[w] += M_ * (st.compute_s + (in_.copies_overlap ? 0.0 : in_copy + out_copy));
  } else if (in_.copies_overlap) {
    double copy_free = now;  // the activations stream, from the job's start
    for (int m = 0; m < M_; ++m) {
      copy_free = std::max(copy_free, s > 0 ? chain_[c][m] : 0.0) + in_copy;
      now = std::max(now, copy_free);
      if (first_start_[w] < 0) first_start_[w] = now;
      now += st.compute_s;
      chain_[c][m] = now + out_copy;
      *outputs_done = chain_[c][m];
      r_.busy[w] += st.compute_s;
    }
  } else {
    const double per_mb = st.compute_s + in_copy + out_copy;
    for (int m = 0; m < M_; ++m) {
      if (s > 0) now = std::max(now, chain_[c][m]);
      if (first_start_[w] < 0) first_start_[w] = now;
      now += per_mb;
      chain_[c][m] = now;
      r_.busy[w] += per_mb;
    }
    *outputs_done = now;
  }
  return now;
}

void StepSimulation::RunJob(int t, int pos) {
  const int need = t - in_.version_lag;  // the step whose updates this step's weights include
  const int c = order_[pos].call, s = order_[pos].stage;
  const int64_t k = static_cast<int64_t>(t) * S_ * K_ + pos;
  const int w = static_cast<int>(k % N_);
  const SimStage& st = in_.stages[s];
  std::vector<double> layer_copied;
  const double fetch_end = FetchWeights(need, w, st, &layer_copied);
  double outputs_done = 0.0;
  const double now = RunMicrobatches(c, s, w, std::max(compute_free_[w], fetch_end), fetch_end,
                                     layer_copied, &outputs_done);
  compute_free_[w] = last_end_[w] = now;
  double done = std::max(now, outputs_done);
  if (st.grad_bytes > 0 && in_.commits_wait_for_norm) {
    waiting_.push_back({s, c, w, now});
  } else if (st.grad_bytes > 0) {
    done = Commit(t, {s, c, w, now}, now);
  }
  r_.step_done[t] = std::max(r_.step_done[t], done);
}

// Commits waiting for the norm: it is known when the step's last gradient job has ended; then the
// step's commits go last stage first, each on its worker's gradient stream.
void StepSimulation::CommitWaiting(int t) {
  double norm_at = 0.0;
  for (const GradientJob& g : waiting_) norm_at = std::max(norm_at, g.end);
  norm_known_[t] = norm_at;
  // Device updates: stages inside the covered blocks after all others.
  std::vector<GradientJob> ordered(waiting_.rbegin(), waiting_.rend());
  std::stable_partition(ordered.begin(), ordered.end(),
                        [&](const GradientJob& g) { return !in_.stages[g.stage].device_updated; });
  // A streamed arena: a commit waits for room, which the host's updates of earlier commits'
  // layers release, one commit after another from where the previous step's updates left the
  // optimizer (RunUpdates' order: the commits' grant order, covered layers last). A tied layer's
  // update waits for its last commit; its slots are not in arena_bytes.
  std::vector<int> last_commit(owners_, -1);
  if (in_.arena_bytes > 0)
    for (size_t i = 0; i < ordered.size(); ++i)
      for (int o : in_.stages[ordered[i].stage].owners) last_commit[o] = static_cast<int>(i);
  std::vector<std::pair<double, double>> placed;  // (released at, bytes) per layer, update order
  double host_free = optimizer_free_;
  for (size_t i = 0; i < ordered.size(); ++i) {
    const SimStage& st = in_.stages[ordered[i].stage];
    double start = norm_at;
    if (in_.arena_bytes > 0) {
      double used = 0.0;
      for (const auto& [released, bytes] : placed)
        if (released > start) used += bytes;
      for (const auto& [released, bytes] : placed) {
        if (used + st.arena_bytes <= in_.arena_bytes) break;
        if (released > start) {
          start = released;
          used -= bytes;
        }
      }
    }
    const double end = Commit(t, ordered[i], start);
    r_.step_done[t] = std::max(r_.step_done[t], end);
    if (in_.arena_bytes <= 0) continue;
    for (size_t j = 0; j < st.owners.size(); ++j) {
      const int o = st.owners[j];
      const double bytes = j < st.owner_arena_bytes.size() ? st.owner_arena_bytes[j] : 0.0;
      if (last_commit[o] != static_cast<int>(i)) continue;  // updated after a later commit
      host_free = std::max(host_free, end) + UpdateCost(o);
      if (bytes > 0) placed.push_back({host_free, bytes});
    }
  }
  waiting_.clear();
}

void StepSimulation::Summarize(SimResult* r) const {
  r->makespan = 0.0;
  for (int t = 0; t < T_; ++t) {
    r->makespan = std::max(r->makespan, r->step_done[t]);
    for (int o = 0; o < owners_; ++o) r->makespan = std::max(r->makespan, updated_[t][o]);
  }
  double busy = 0.0, fill = 0.0, drain = 0.0;
  for (int w = 0; w < N_; ++w) {
    busy += r->busy[w];
    if (first_start_[w] < 0) {  // a worker that never ran anything is idle throughout: fill
      fill += r->makespan;
      continue;
    }
    fill += first_start_[w];
    drain += r->makespan - last_end_[w];
  }
  const double total = r->makespan * N_;
  if (total > 0) {
    r->bubble_ratio = std::max(0.0, 1.0 - busy / total);
    r->fill_ratio = fill / total;
    r->drain_ratio = drain / total;
    r->imbalance_ratio = std::max(0.0, r->bubble_ratio - r->fill_ratio - r->drain_ratio);
  }
  r->peak_held_grad_bytes.assign(N_, 0.0);
  for (int w = 0; w < N_; ++w) {
    std::vector<std::pair<double, double>> events;  // (time, +/- bytes); releases sort first
    for (const auto& h : held_[w]) {
      events.push_back({h.from, h.bytes});
      events.push_back({h.to, -h.bytes});
    }
    std::sort(events.begin(), events.end());
    double cur = 0.0;
    for (const auto& [time, delta] : events) {
      cur += delta;
      r->peak_held_grad_bytes[w] = std::max(r->peak_held_grad_bytes[w], cur);
    }
  }
  r->steady_step_s = T_ > 1 ? (r->step_done[T_ - 1] - r->step_done[0]) / (T_ - 1) : r->makespan;
  r->steady_bubble_ratio =
      r->steady_step_s > 0 ? std::max(0.0, 1.0 - busy / T_ / (N_ * r->steady_step_s)) : 0.0;
}

SimResult StepSimulation::Run() {
  int updates_done_for = -1;
  for (int t = 0; t < T_; ++t) {
    // Every earlier step's gradients are final by now (its jobs come first), so its updates are
    // known: step t's weights wait for step t - version_lag's, its commits for step t - 1's.
    while (updates_done_for < t - 1) RunUpdates(++updates_done_for);
    for (int pos = 0; pos < S_ * K_; ++pos) RunJob(t, pos);
    if (!waiting_.empty()) CommitWaiting(t);
  }
  while (updates_done_for < T_ - 1) RunUpdates(++updates_done_for);
  SimResult r = r_;
  Summarize(&r);
  return r;
}

}  // namespace

SimResult Simulate(const SimInput& in) { return StepSimulation(in).Run(); }

SimResult SimulateRoundRobin(const std::vector<double>& stage_time, int workers, int microbatches,
                             int calls) {
  SimInput in;
  for (double t : stage_time) {
    SimStage st;
    st.compute_s = t;
    in.stages.push_back(st);
  }
  in.workers = workers;
  in.microbatches = microbatches;
  in.calls = calls;
  return Simulate(in);
}

double NodeSumSeconds(const SimInput& in, double bytes) {
  if (in.nodes <= 1) return 0.0;
  const double n = static_cast<double>(in.nodes);
  const double wire =
      in.node_link_bytes_per_s > 0 ? 2.0 * (n - 1.0) / n * bytes / in.node_link_bytes_per_s : 0.0;
  return wire + 2.0 * (n - 1.0) * in.node_hop_s;
}

double NodeGatherSeconds(const SimInput& in, double bytes) {
  if (in.nodes <= 1) return 0.0;
  const double n = static_cast<double>(in.nodes);
  const double wire =
      in.node_link_bytes_per_s > 0 ? (n - 1.0) / n * bytes / in.node_link_bytes_per_s : 0.0;
  return wire + (n - 1.0) * in.node_hop_s;
}

// One hop of a cross-node sum between hosts: a TCP round trip and Gloo's own work. An assumption
// for real networks, not a measurement: the loopback of a 2-core machine, the only place it was
// measured (rp-node-bench; docs/benchmarks.md, "Several nodes"), times mostly thread wake-ups
// on oversubscribed cores.
constexpr double kNodeHopSeconds = 50e-6;

UpdatePassBytes UpdateBytesPerParam(const JobConfig& c, const ExecutionPlan& x) {
  // Gradient, master and both moments are fp32. Where the master is what workers fetch, the first
  // pass writes it and the second reads only the gradient and the moments (the master's new value
  // is not needed for them); otherwise the first writes the compute copy and the second the
  // master and the moments.
  const double elem = static_cast<double>(ComputeElemBytes(c));
  UpdatePassBytes b;
  if (x.workers_fetch_masters) {
    b.whole = 16.0 + 12.0;
    b.first = 16.0 + 4.0;
    b.second = 12.0 + 8.0;
  } else {
    b.whole = 16.0 + 12.0 + elem;
    b.first = 16.0 + elem;
    b.second = 16.0 + 12.0;
  }
  return b;
}

SimInput BuildSimInput(const JobConfig& c, const ModelSpec& spec, const PipelinePlan& plan,
                       const Profile& profile, int workers, int steps) {
  // The decisions of the job being simulated: the planner simulates trial jobs too.
  const ExecutionPlan x = ResolveExecution(c);
  SimInput in;
  in.workers = workers;
  in.nodes = static_cast<int>(c.nodes.count);
  in.node_link_bytes_per_s = c.schedule.node_link_gb_s * 1e9;
  in.node_hop_s = kNodeHopSeconds;
  in.microbatches = static_cast<int>(core::Round(c).microbatches);
  in.calls = static_cast<int>(core::Round(c).calls);
  in.steps = steps;
  in.h2d_bytes_per_s = profile.h2d_bytes_per_s;
  in.d2h_bytes_per_s = profile.d2h_bytes_per_s;
  in.version_lag = 1 + x.weight_version_lag;
  // Gradients waiting in the workers: the norm comes from their squares before any commit, and
  // each parameter is updated as its commit lands (coordinator::AsyncOptimizer), with no norm
  // pass on the host.
  in.commits_wait_for_norm = x.gradients_wait_in_workers;
  in.updates_wait_for_norm = x.updates_wait_for_norm && !in.commits_wait_for_norm;
  in.copies_overlap =
      c.job.device != core::DeviceKind::kCpu;  // as WorkloadKey() tells the two kinds apart
  in.order = StepJobOrder(plan, in.calls, x.interleave_calls);
  in.layer_major =
      c.bench.layer_major_forward == core::Tristate::kNever    ? SimInput::LayerMajor::kNever
      : c.bench.layer_major_forward == core::Tristate::kAlways ? SimInput::LayerMajor::kAlways
                                                               : SimInput::LayerMajor::kAuto;
  const double elem = static_cast<double>(core::ComputeElemBytes(c));
  // Trainable weights cross the link as fp32 when workers fetch the masters.
  const int weight_elem = x.workers_fetch_masters ? 4 : static_cast<int>(elem);
  const double tokens = static_cast<double>(c.TokensPerMicrobatch());
  // Activations kept in the worker (schedule.activations = "worker") cost no host transfers, and
  // neither do activation pools: their device-to-device copies (tens of microseconds per slot on
  // one GPU, a few hundred over NVLink) are left out.
  const double act =
      x.ActivationsInWorkers() ? 0.0 : tokens * static_cast<double>(c.model.hidden_size) * elem;
  const double ids = tokens * 8.0;  // int64 token ids or labels
  // The embedding looked up from host memory: its stages copy nothing for it and wait for the
  // next step's rows (SimInput::lookup_owner), about this fraction of the table for tokens drawn
  // uniformly (real text repeats more, so fewer rows).
  const bool mapped = LookupInPlaceParam(x, spec) >= 0;
  // Distinct rows of a step's tokens, expected for tokens drawn uniformly.
  const double vocab = static_cast<double>(c.model.vocab_size);
  const double step_tokens =
      tokens * static_cast<double>(core::Round(c).microbatches * core::Round(c).calls);
  const double touched_rows = -vocab * std::expm1(step_tokens * std::log1p(-1.0 / vocab));
  if (mapped) in.lookup_owner = plan.num_layers;
  in.device_blocks = x.device_update_blocks;
  in.device_owner_base = plan.num_layers + 1;
  auto device_updated = [&](int l) { return x.DeviceUpdatesLayer(l); };
  // A streamed arena delays the commits that wait for the norm (SimInput::arena_bytes); when it
  // holds every gradient, or its size is refused (the run would not start), room is left out.
  std::vector<std::vector<uint64_t>> arena_by_owner;  // per stage, per owner layer
  // Whether the arena holds every slot (exact mode's two passes apply only then; a refused size
  // counts as holding them, as the run would not start). Only priced updates need it.
  bool holds_every_slot = true;
  if (in.commits_wait_for_norm ||
      (x.NextStepWaitsForUpdate() && profile.optimizer_params_per_s > 0)) {
    auto sizing =
        SizeGradArena(c, x, spec, plan, in.commits_wait_for_norm ? &arena_by_owner : nullptr);
    holds_every_slot = !sizing.ok() || sizing->chosen >= sizing->all_slots;
    if (in.commits_wait_for_norm && !holds_every_slot)
      in.arena_bytes = static_cast<double>(sizing->chosen - sizing->shared);
  }
  for (size_t i = 0; i < plan.stages.size(); ++i) {
    const Stage& s = plan.stages[i];
    SimStage st;
    const bool grads = s.kind != StageKind::kForward;
    std::vector<bool> owner(plan.num_layers, false);
    for (int l = s.begin; l < s.end; ++l) {
      const LayerCost& lc = profile.layers[l];
      // A kept layer (schedule.kept_blocks) backpropagates through its forward's graph, with the
      // forward's weights.
      const bool adopted = s.kind == StageKind::kBackward && plan.KeepsGraph(l);
      // schedule.keep_attention: a backward stage's recompute takes each block's attention from
      // its forward's record.
      const double recompute = s.kind == StageKind::kBackward && KeepsAttention(c, plan, l)
                                   ? ReplayedRecompute(c, lc, l)
                                   : lc.recompute_s;
      st.compute_s += s.kind == StageKind::kForward ? lc.forward_s
                                                    : (adopted ? 0.0 : recompute) + lc.backward_s;
      // train.layer_recompute: a gradient stage first runs its layers (not the head) without
      // autograd, then rebuilds each one's graph.
      if (grads && c.train.layer_recompute && l < plan.num_layers - 1) st.compute_s += lc.forward_s;
      if (s.kind == StageKind::kForward) st.layer_compute_s.push_back(lc.forward_s);
      SimFetch f;  // the worker copies each layer as soon as its weights are published
      // Steady state: the frozen base is on the device since the first step (frozen_on_device).
      f.bytes = static_cast<double>(
          spec.LayerWeightBytes(l, weight_elem, x.frozen_on_device ? 0 : static_cast<int>(elem)));
      for (const auto& use : spec.layer_uses[l]) {
        // A compact lookup slot (CompactLookupRows) commits the rows of the step's tokens only.
        const ParamSpec& ps = spec.params[use.param];
        const bool compact = CompactLookupRows(c, spec, use.grad_slot) > 0;
        const double elems = compact ? touched_rows * static_cast<double>(ps.shape[1])
                                     : static_cast<double>(ps.numel);
        if (grads) st.grad_bytes += elems * 4.0;
        owner[spec.params[use.param].owner_layer] = true;
        f.owners.push_back(spec.params[use.param].owner_layer);
      }
      if (mapped && l == 0) {
        f.bytes = 0.0;
        f.owners = {in.lookup_owner};
      }
      if (device_updated(l) && !grads) {
        f.bytes = 0.0;  // the worker's own weights: a copy on the device
        f.owners = {in.device_owner_base + l - 1};
      }
      if (adopted) f.bytes = 0.0;
      st.weight_bytes += f.bytes;
      st.fetches.push_back(std::move(f));
    }
    for (int l = 0; l < plan.num_layers; ++l)
      if (owner[l]) {
        st.owners.push_back(l);
        if (in.arena_bytes > 0) {
          st.owner_arena_bytes.push_back(
              static_cast<double>(arena_by_owner[i][static_cast<size_t>(l)]));
          st.arena_bytes += st.owner_arena_bytes.back();
        }
      }
    st.device_updated = grads && !st.owners.empty() &&
                        std::all_of(st.owners.begin(), st.owners.end(), device_updated);
    st.compute_s += profile.microbatch_overhead_s;
    switch (s.kind) {
      case StageKind::kForward:
        st.in_bytes = s.begin == 0 ? ids : act;
        for (int l = s.begin; l < s.end; ++l)
          if (plan.HiddenSlot(l + 1) >= 0) st.out_bytes += act;
        break;
      case StageKind::kFusedTail:
        st.in_bytes = act + ids;
        st.out_bytes = act;
        break;
      case StageKind::kBackward:
        st.in_bytes = (s.begin == 0 ? ids : act) + act;
        st.out_bytes = s.begin > 0 ? act : 0.0;
        break;
    }
    in.stages.push_back(std::move(st));
  }
  if (profile.optimizer_params_per_s > 0) {
    in.update_s.assign(plan.num_layers, 0.0);
    in.norm_s.assign(plan.num_layers, 0.0);
    const UpdatePassBytes pass_bytes = UpdateBytesPerParam(c, x);
    const bool two_passes = x.two_pass_updates && holds_every_slot;
    if (two_passes) in.second_pass_s.assign(plan.num_layers, 0.0);
    // Rows first is a first pass over the next step's rows: in one pass the lookup waits for the
    // whole embedding.
    if (mapped && two_passes) in.lookup_fraction = touched_rows / vocab;
    // The profile's rate is over the pass that publishes each layer, whose bytes it records; a
    // profile without them (the cost model, and profiles written before they were) timed the
    // pass that publishes where exact mode always took two passes with every slot held.
    const double timed_bytes =
        profile.optimizer_pass_bytes > 0
            ? profile.optimizer_pass_bytes
            : pass_bytes.Publishing(x.NextStepWaitsForUpdate() && holds_every_slot);
    const double host_bytes_per_s = profile.optimizer_params_per_s * timed_bytes;
    std::vector<int> slots(spec.params.size(), 0);
    for (const auto& g : spec.grad_slots) slots[g.param]++;
    for (size_t p = 0; p < spec.params.size(); ++p) {
      const ParamSpec& ps = spec.params[p];
      const double numel = static_cast<double>(ps.numel);
      // A device-updated layer's host update is one whole pass: masters and moments written too.
      const bool whole =
          !two_passes || (device_updated(ps.owner_layer) && !in.commits_wait_for_norm);
      in.update_s[ps.owner_layer] +=
          numel * (whole ? pass_bytes.whole : pass_bytes.first) / host_bytes_per_s;
      if (two_passes && !whole)
        in.second_pass_s[ps.owner_layer] += numel * pass_bytes.second / host_bytes_per_s;
      // The norm moves host memory at the same rate. A tied embedding squares its head slot's
      // rows before its lookup slot is final; at the end it folds (reads both, writes one) and
      // squares the rows of the step's tokens only.
      const double bytes = slots[p] == 2 && spec.TiedRowElems(static_cast<int>(p)) > 0
                               ? touched_rows * static_cast<double>(ps.shape[1]) * 12.0
                               : numel * 4.0 * slots[p];
      if (!in.commits_wait_for_norm) in.norm_s[ps.owner_layer] += bytes / host_bytes_per_s;
    }
  }
  if (x.sharded_state) {
    // Each node updates its share; the weights workers fetch are then gathered from every node.
    for (auto* costs : {&in.update_s, &in.second_pass_s})
      for (double& u : *costs) u /= static_cast<double>(c.nodes.count);
    in.gather_s.assign(plan.num_layers, 0.0);
    std::vector<double> bytes(plan.num_layers, 0.0);
    for (const auto& ps : spec.params)
      bytes[ps.owner_layer] += static_cast<double>(ps.numel) * static_cast<double>(weight_elem);
    for (int o = 0; o < plan.num_layers; ++o)
      if (bytes[o] > 0) in.gather_s[o] = NodeGatherSeconds(in, bytes[o]);
  }
  return in;
}

}  // namespace rp::core
