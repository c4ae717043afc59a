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

SimResult Simulate(const SimInput& in) {
  const int S = static_cast<int>(in.stages.size());
  const int N = in.workers, M = in.microbatches, K = in.calls, T = in.steps;
  const int jobs_per_step = S * K;
  SimResult r;
  r.busy.assign(N, 0.0);
  r.step_done.assign(T, 0.0);
  int owners = 0;
  for (const auto& st : in.stages)
    for (int o : st.owners) owners = std::max(owners, o + 1);
  owners = std::max(owners, static_cast<int>(in.update_s.size()));
  owners = std::max(owners, in.lookup_owner + 1);
  if (in.device_blocks > 0) owners = std::max(owners, in.device_owner_base + in.device_blocks);
  // final_at[t][o]: layer o's gradient of step t is final; updated[t][o]: its update is published.
  std::vector<std::vector<double>> final_at(T, std::vector<double>(owners, 0.0));
  std::vector<std::vector<double>> updated(T, std::vector<double>(owners, 0.0));
  std::vector<std::vector<bool>> has_grad(T, std::vector<bool>(owners, false));
  // When each step's norm is known: set by run_updates (host norm) or where commits wait for it.
  std::vector<double> norm_known(T, 0.0);
  auto device_updated_owner = [&](int o) { return o >= 1 && o <= in.device_blocks; };
  double optimizer_free = 0.0;
  auto run_updates = [&](int t) {
    std::vector<int> order;
    for (int o = 0; o < owners; ++o)
      if (has_grad[t][o]) order.push_back(o);
    // Norms in the order the gradients became final, one after another on the optimizer's
    // threads (they share its memory bandwidth); a gradient's update waits for its norm.
    std::vector<int> by_final = order;
    std::stable_sort(by_final.begin(), by_final.end(),
                     [&](int a, int b) { return final_at[t][a] < final_at[t][b]; });
    std::vector<double> normed(owners, 0.0);
    double norm_free = 0.0;
    for (int o : by_final) {
      norm_free = std::max(norm_free, final_at[t][o]) +
                  (o < static_cast<int>(in.norm_s.size()) ? in.norm_s[o] : 0.0);
      normed[o] = norm_free;
    }
    double all_final = 0.0;
    for (int o : order) all_final = std::max(all_final, normed[o]);
    if (!in.updates_wait_for_norm) order = by_final;
    auto cost_of = [&](int o) {
      return o < static_cast<int>(in.update_s.size()) ? in.update_s[o] : 0.0;
    };
    const bool rows_first =
        in.lookup_owner > 0 && in.updates_wait_for_norm && !order.empty() && order[0] == 0;
    if (rows_first) {
      // The next step's rows of owner 0, then the others, then owner 0's other rows.
      updated[t][in.lookup_owner] =
          std::max(optimizer_free, all_final) + in.lookup_fraction * cost_of(0);
      optimizer_free = updated[t][in.lookup_owner];
      order.erase(order.begin());
      order.push_back(0);
    }
    if (in.device_blocks > 0) {
      // The worker's copies are there at the norm; the host does those layers after all others
      // (the tied embedding's other rows included).
      if (in.updates_wait_for_norm) norm_known[t] = all_final;
      for (int l = 1; l <= in.device_blocks; ++l)
        updated[t][in.device_owner_base + l - 1] = norm_known[t];
      std::stable_partition(order.begin(), order.end(),
                            [&](int o) { return !device_updated_owner(o); });
    }
    for (int o : order) {
      const double ready = in.updates_wait_for_norm ? all_final : normed[o];
      const double cost =
          rows_first && o == 0 ? (1.0 - in.lookup_fraction) * cost_of(0) : cost_of(o);
      const double start = std::max(optimizer_free, ready);
      updated[t][o] = start + cost;
      optimizer_free = updated[t][o];
    }
    if (in.lookup_owner > 0 && !rows_first) updated[t][in.lookup_owner] = updated[t][0];
    if (!in.gather_s.empty()) {
      // Each update is fetchable once gathered from every node. Layer o is gathered by worker
      // o mod N (shm::GatheringWorker), each worker's layers one at a time in ascending order.
      std::vector<double> queue_free(std::max(1, N), 0.0);
      std::vector<double> gathered(owners, 0.0);
      for (int o = 0; o < owners; ++o) {
        if (!has_grad[t][o]) continue;
        const double cost = o < static_cast<int>(in.gather_s.size()) ? in.gather_s[o] : 0.0;
        double& free = queue_free[o % std::max(1, N)];
        free = std::max(free, updated[t][o]) + cost;
        gathered[o] = free;
      }
      for (int o = 0; o < owners; ++o)
        if (has_grad[t][o]) updated[t][o] = gathered[o];
    }
  };

  std::vector<double> compute_free(N, 0.0), began(N, 0.0), weights_free(N, 0.0), grads_free(N, 0.0);
  std::vector<double> first_start(N, -1.0), last_end(N, 0.0);
  // chain[c][m]: when microbatch m of call c finished its call's latest dispatched stage.
  std::vector<std::vector<double>> chain(K, std::vector<double>(M, 0.0));
  std::vector<JobSlot> order = in.order;
  bool valid = order.size() == static_cast<size_t>(jobs_per_step);
  for (const auto& j : order)
    valid = valid && j.call >= 0 && j.call < K && j.stage >= 0 && j.stage < S;
  if (!valid) order.clear();  // not one step's jobs: call by call (the contract's default)
  if (order.empty())
    for (int c = 0; c < K; ++c)
      for (int s = 0; s < S; ++s) order.push_back({c, s});
  struct Held {
    double from, to, bytes;
  };
  std::vector<std::vector<Held>> held(N);
  struct GradientJob {
    int stage, call, worker;
    double end;  // its last microbatch's
  };
  // Writes back job g's gradients of step t, starting no earlier than `earliest`, on its worker's
  // gradient stream; returns when its layers' gradients are final. A gradient slot of step t is
  // free once step t - 1's update of its layer has read it (stale1: the update runs during this
  // step). Exact mode's second passes, which hold the slots after the layer is published, are
  // not modelled: the profile's rate is the first pass's, and the second passes run well ahead of
  // the next step's commits on the H200 (a slot that waited would show as a later commit and
  // more gradients held on device).
  auto commit = [&](int t, const GradientJob& g, double earliest) {
    const SimStage& st = in.stages[g.stage];
    double slot_free = 0.0;
    if (t > 0)
      for (int o : st.owners) slot_free = std::max(slot_free, updated[t - 1][o]);
    const double start = std::max({earliest, grads_free[g.worker], slot_free});
    double copy = in.d2h_bytes_per_s > 0 ? st.grad_bytes / in.d2h_bytes_per_s : 0.0;
    if (g.call > 0 && in.h2d_bytes_per_s > 0) copy += st.grad_bytes / in.h2d_bytes_per_s;
    copy += NodeSumSeconds(in, st.grad_bytes);
    const double end = grads_free[g.worker] = start + copy;
    // The job's fp32 gradients stay on the device from its end until the copy is done.
    held[g.worker].push_back({g.end, end, st.grad_bytes});
    for (int o : st.owners) {
      final_at[t][o] = std::max(final_at[t][o], end);
      has_grad[t][o] = true;
    }
    return end;
  };
  std::vector<GradientJob> waiting;  // SimInput::commits_wait_for_norm: this step's, in job order
  int updates_done_for = -1;
  for (int t = 0; t < T; ++t) {
    const int need = t - in.version_lag;  // the step whose updates this step's weights include
    // Every earlier step's gradients are final by now (its jobs come first), so its updates
    // are known: step t's weights wait for step `need`'s, its commits for step t - 1's.
    while (updates_done_for < t - 1) run_updates(++updates_done_for);
    for (int pos = 0; pos < jobs_per_step; ++pos) {
      const int c = order[pos].call, s = order[pos].stage;
      const int64_t k = static_cast<int64_t>(t) * jobs_per_step + pos;
      const int w = static_cast<int>(k % N);
      const SimStage& st = in.stages[s];
      auto copy_s = [&](double bytes) {
        return in.h2d_bytes_per_s > 0 ? bytes / in.h2d_bytes_per_s : 0.0;
      };
      auto ready_at = [&](const std::vector<int>& owner_layers) {
        double ready = 0.0;
        if (need >= 0)
          for (int o : owner_layers) ready = std::max(ready, updated[need][o]);
        return ready;
      };
      double fetch_end = std::max(weights_free[w], began[w]);
      std::vector<double> layer_copied;  // per fetch: when its copy ends
      if (st.fetches.empty()) {          // one copy after the last owner's update
        fetch_end = std::max(fetch_end, ready_at(st.owners)) + copy_s(st.weight_bytes);
      } else {  // layer by layer, each as soon as it is published
        for (const SimFetch& f : st.fetches) {
          fetch_end = std::max(fetch_end, ready_at(f.owners)) + copy_s(f.bytes);
          layer_copied.push_back(fetch_end);
        }
      }
      weights_free[w] = fetch_end;
      double now = std::max(compute_free[w], fetch_end);
      double outputs_done = now;  // the job's last output copy (copies_overlap)
      const size_t L = st.layer_compute_s.size();
      double lm_begin = 0.0;
      bool layer_major = false;
      if (in.layer_major != SimInput::LayerMajor::kNever && L > 1 && L == layer_copied.size() &&
          M > 1) {
        lm_begin = std::max(compute_free[w], layer_copied[0]);
        for (int m = 0; m < M && s > 0; ++m) lm_begin = std::max(lm_begin, chain[c][m]);
        layer_major = in.layer_major == SimInput::LayerMajor::kAlways || lm_begin < fetch_end;
      }
      if (layer_major) now = lm_begin;
      began[w] = now;
      const double in_copy = in.h2d_bytes_per_s > 0 ? st.in_bytes / in.h2d_bytes_per_s : 0.0;
      const double out_copy = in.d2h_bytes_per_s > 0 ? st.out_bytes / in.d2h_bytes_per_s : 0.0;
      if (layer_major) {
        double overhead = st.compute_s;
        for (double x : st.layer_compute_s) overhead -= x;
        // The inputs' copies (all M, on the activations stream) come first; then each layer over
        // every microbatch once it is copied.
        if (in.copies_overlap) now += in_copy;  // the others' copies overlap the first's compute
        if (first_start[w] < 0) first_start[w] = now;
        if (!in.copies_overlap)
          now += M * in_copy;  // in series, and busy, as microbatch order has them
        now += M * std::max(0.0, overhead);
        for (size_t i = 0; i < L; ++i)
          now = std::max(now, layer_copied[i]) + M * st.layer_compute_s[i];
        if (!in.copies_overlap) now += M * out_copy;
        for (int m = 0; m < M; ++m) chain[c][m] = now + (in.copies_overlap ? out_copy : 0.0);
        outputs_done = chain[c][M - 1];
        r.busy[w] += M * (st.compute_s + (in.copies_overlap ? 0.0 : in_copy + out_copy));
      } else if (in.copies_overlap) {
        double copy_free = now;  // the activations stream, from the job's start
        for (int m = 0; m < M; ++m) {
          copy_free = std::max(copy_free, s > 0 ? chain[c][m] : 0.0) + in_copy;
          now = std::max(now, copy_free);
          if (first_start[w] < 0) first_start[w] = now;
          now += st.compute_s;
          chain[c][m] = now + out_copy;
          outputs_done = chain[c][m];
          r.busy[w] += st.compute_s;
        }
      } else {
        const double per_mb = st.compute_s + in_copy + out_copy;
        for (int m = 0; m < M; ++m) {
          if (s > 0) now = std::max(now, chain[c][m]);
          if (first_start[w] < 0) first_start[w] = now;
          now += per_mb;
          chain[c][m] = now;
          r.busy[w] += per_mb;
        }
        outputs_done = now;
      }
      compute_free[w] = last_end[w] = now;
      double done = std::max(now, outputs_done);
      if (st.grad_bytes > 0 && in.commits_wait_for_norm) {
        waiting.push_back({s, c, w, now});
      } else if (st.grad_bytes > 0) {
        done = commit(t, {s, c, w, now}, now);
      }
      r.step_done[t] = std::max(r.step_done[t], done);
    }
    if (!waiting.empty()) {
      // Commits waiting for the norm: it is known when the step's last gradient job has ended;
      // then the step's commits go last stage first, each on its worker's gradient stream.
      double norm_at = 0.0;
      for (const GradientJob& g : waiting) norm_at = std::max(norm_at, g.end);
      norm_known[t] = norm_at;
      // Device updates: stages inside the covered blocks after all others.
      std::vector<GradientJob> ordered(waiting.rbegin(), waiting.rend());
      std::stable_partition(ordered.begin(), ordered.end(), [&](const GradientJob& g) {
        return !in.stages[g.stage].device_updated;
      });
      // A streamed arena: a commit waits for room, which the host's updates of earlier commits'
      // layers release, one commit after another from where the previous step's updates left
      // the optimizer (run_updates' order: the commits' grant order, covered layers last). A
      // tied layer's update waits for its last commit; its slots are not in arena_bytes.
      std::vector<int> last_commit(owners, -1);
      if (in.arena_bytes > 0)
        for (size_t i = 0; i < ordered.size(); ++i)
          for (int o : in.stages[ordered[i].stage].owners) last_commit[o] = static_cast<int>(i);
      std::vector<std::pair<double, double>>
          placed;  // (released at, bytes) per layer, in update order
      double host_free = optimizer_free;
      for (size_t i = 0; i < ordered.size(); ++i) {
        const SimStage& st = in.stages[ordered[i].stage];
        double start = norm_at;
        if (in.arena_bytes > 0) {
          double used = 0.0;
          for (const auto& [released, bytes] : placed)
            if (released > start) used += bytes;
          for (const auto& [released, bytes] : placed) {
            if (used + st.arena_bytes <= in.arena_bytes) break;
            if (released > start) {
              start = released;
              used -= bytes;
            }
          }
        }
        const double end = commit(t, ordered[i], start);
        r.step_done[t] = std::max(r.step_done[t], end);
        if (in.arena_bytes <= 0) continue;
        for (size_t j = 0; j < st.owners.size(); ++j) {
          const int o = st.owners[j];
          const double bytes = j < st.owner_arena_bytes.size() ? st.owner_arena_bytes[j] : 0.0;
          if (last_commit[o] != static_cast<int>(i)) continue;  // updated after a later commit
          host_free = std::max(host_free, end) +
                      (o < static_cast<int>(in.update_s.size()) ? in.update_s[o] : 0.0);
          if (bytes > 0) placed.push_back({host_free, bytes});
        }
      }
      waiting.clear();
    }
  }
  while (updates_done_for < T - 1) run_updates(++updates_done_for);
  r.makespan = 0.0;
  for (int t = 0; t < T; ++t) {
    r.makespan = std::max(r.makespan, r.step_done[t]);
    for (int o = 0; o < owners; ++o) r.makespan = std::max(r.makespan, updated[t][o]);
  }
  double busy = 0.0, fill = 0.0, drain = 0.0;
  for (int w = 0; w < N; ++w) {
    busy += r.busy[w];
    if (first_start[w] < 0) {  // a worker that never ran anything is idle throughout: count as fill
      fill += r.makespan;
      continue;
    }
    fill += first_start[w];
    drain += r.makespan - last_end[w];
  }
  const double total = r.makespan * N;
  if (total > 0) {
    r.bubble_ratio = std::max(0.0, 1.0 - busy / total);
    r.fill_ratio = fill / total;
    r.drain_ratio = drain / total;
    r.imbalance_ratio = std::max(0.0, r.bubble_ratio - r.fill_ratio - r.drain_ratio);
  }
  r.peak_held_grad_bytes.assign(N, 0.0);
  for (int w = 0; w < N; ++w) {
    std::vector<std::pair<double, double>> events;  // (time, +/- bytes); releases sort first
    for (const auto& h : held[w]) {
      events.push_back({h.from, h.bytes});
      events.push_back({h.to, -h.bytes});
    }
    std::sort(events.begin(), events.end());
    double cur = 0.0;
    for (const auto& [time, delta] : events) {
      cur += delta;
      r.peak_held_grad_bytes[w] = std::max(r.peak_held_grad_bytes[w], cur);
    }
  }
  r.steady_step_s = T > 1 ? (r.step_done[T - 1] - r.step_done[0]) / (T - 1) : r.makespan;
  r.steady_bubble_ratio =
      r.steady_step_s > 0 ? std::max(0.0, 1.0 - busy / T / (N * r.steady_step_s)) : 0.0;
  return r;
}

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

SimInput BuildSimInput(const JobConfig& c, const ModelSpec& spec, const PipelinePlan& plan,
                       const Profile& profile, int workers, int steps) {
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
  in.version_lag = c.optimizer.mode == core::OptimizerMode::kStale1 ? 2 : 1;
  // Gradients waiting in the workers: the norm comes from their squares before any commit, and
  // each parameter is updated as its commit lands (coordinator::AsyncOptimizer), with no norm
  // pass on the host.
  in.commits_wait_for_norm = core::GradientsWaitInWorkers(c);
  in.updates_wait_for_norm = core::UpdatesWaitForNorm(c) && !in.commits_wait_for_norm;
  in.copies_overlap =
      c.job.device != core::DeviceKind::kCpu;  // as WorkloadKey() tells the two kinds apart
  in.order = StepJobOrder(plan, in.calls, InterleaveCalls(c));
  in.layer_major =
      c.bench.layer_major_forward == core::Tristate::kNever    ? SimInput::LayerMajor::kNever
      : c.bench.layer_major_forward == core::Tristate::kAlways ? SimInput::LayerMajor::kAlways
                                                               : SimInput::LayerMajor::kAuto;
  const double elem = static_cast<double>(core::ComputeElemBytes(c));
  // Trainable weights cross the link as fp32 when workers fetch the masters.
  const int weight_elem = WorkersFetchMasters(c) ? 4 : static_cast<int>(elem);
  const double tokens = static_cast<double>(c.TokensPerMicrobatch());
  // Activations kept in the worker (schedule.activations = "worker") cost no host transfers, and
  // neither do activation pools: their device-to-device copies (tens of microseconds per slot on
  // one GPU, a few hundred over NVLink) are left out.
  const double act = c.schedule.activations == core::Activations::kWorker || ActivationsInPools(c)
                         ? 0.0
                         : tokens * static_cast<double>(c.model.hidden_size) * elem;
  const double ids = tokens * 8.0;  // int64 token ids or labels
  // The embedding looked up from host memory: its stages copy nothing for it and wait for the
  // next step's rows (SimInput::lookup_owner), about this fraction of the table for tokens drawn
  // uniformly (real text repeats more, so fewer rows).
  const bool mapped = LookupInPlaceParam(c, spec) >= 0;
  // Distinct rows of a step's tokens, expected for tokens drawn uniformly.
  const double vocab = static_cast<double>(c.model.vocab_size);
  const double step_tokens =
      tokens * static_cast<double>(core::Round(c).microbatches * core::Round(c).calls);
  const double touched_rows = -vocab * std::expm1(step_tokens * std::log1p(-1.0 / vocab));
  if (mapped) {
    in.lookup_owner = plan.num_layers;
    in.lookup_fraction = touched_rows / vocab;
  }
  in.device_blocks = DeviceUpdateBlocks(c);
  in.device_owner_base = plan.num_layers + 1;
  auto device_updated = [&](int l) { return DeviceUpdatesLayer(c, l); };
  // A streamed arena delays the commits that wait for the norm (SimInput::arena_bytes); when it
  // holds every gradient, or its size is refused (the run would not start), room is left out.
  std::vector<std::vector<uint64_t>> arena_by_owner;  // per stage, per owner layer
  if (in.commits_wait_for_norm) {
    auto sizing = SizeGradArena(c, spec, plan, &arena_by_owner);
    if (sizing.ok() && sizing->chosen < sizing->all_slots)
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
      st.compute_s += s.kind == StageKind::kForward
                          ? lc.forward_s
                          : (adopted ? 0.0 : lc.recompute_s) + lc.backward_s;
      // train.layer_recompute: a gradient stage first runs its layers (not the head) without
      // autograd, then rebuilds each one's graph.
      if (grads && c.train.layer_recompute && l < plan.num_layers - 1) st.compute_s += lc.forward_s;
      if (s.kind == StageKind::kForward) st.layer_compute_s.push_back(lc.forward_s);
      SimFetch f;  // the worker copies each layer as soon as its weights are published
      // Steady state: the frozen base is on the device since the first step (FrozenOnDevice).
      f.bytes = static_cast<double>(
          spec.LayerWeightBytes(l, weight_elem, FrozenOnDevice(c) ? 0 : static_cast<int>(elem)));
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
    // The norm moves host memory at the first pass's rate: that pass reads the master, both
    // moments and the gradient and writes the fetched copy (the fp32 master, or a compute copy;
    // stale1's one pass writes all of them).
    const double pass_bytes = c.optimizer.mode == core::OptimizerMode::kStale1
                                  ? 16.0 + 12.0 + elem
                                  : 16.0 + (WorkersFetchMasters(c) ? 4.0 : elem);
    const double host_bytes_per_s = profile.optimizer_params_per_s * pass_bytes;
    std::vector<int> slots(spec.params.size(), 0);
    for (const auto& g : spec.grad_slots) slots[g.param]++;
    for (size_t p = 0; p < spec.params.size(); ++p) {
      const ParamSpec& ps = spec.params[p];
      // A device-updated layer's host update is one whole pass: masters and moments written too.
      const double whole = 28.0 + (WorkersFetchMasters(c) ? 0.0 : elem);
      const double pass =
          device_updated(ps.owner_layer) && !in.commits_wait_for_norm ? whole / pass_bytes : 1.0;
      in.update_s[ps.owner_layer] +=
          pass * static_cast<double>(ps.numel) / profile.optimizer_params_per_s;
      // A tied embedding squares its head slot's rows before its lookup slot is final; at the
      // end it folds (reads both, writes one) and squares the rows of the step's tokens only.
      const double bytes = spec.TiedRowElems(static_cast<int>(p)) > 0
                               ? touched_rows * static_cast<double>(ps.shape[1]) * 12.0
                               : static_cast<double>(ps.numel) * 4.0 * slots[p];
      if (!in.commits_wait_for_norm) in.norm_s[ps.owner_layer] += bytes / host_bytes_per_s;
    }
  }
  if (ShardedState(c)) {
    // Each node updates its share; the weights workers fetch are then gathered from every node.
    for (double& u : in.update_s) u /= static_cast<double>(c.nodes.count);
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
