// SPDX-License-Identifier: Apache-2.0
#include <gtest/gtest.h>

#include "planning/grad_arena.h"
#include "planning/partitioner.h"
#include "planning/simulator.h"

namespace rp::core {
namespace {

TEST(Simulator, IsolatedRoundMatchesTheClosedForm) {
  // S = v * N equal stages of time t, M >= N: makespan = v*M*t + (N-1)*t and
  // bubble = (N-1) / (v*M + N-1).
  for (int n : {1, 2, 3, 4})
    for (int v : {1, 2, 3})
      for (int m = n; m <= n + 3; ++m) {
        const double t = 0.5;
        auto r = SimulateRoundRobin(std::vector<double>(v * n, t), n, m, 1);
        EXPECT_NEAR(r.makespan, v * m * t + (n - 1) * t, 1e-12) << n << " " << v << " " << m;
        EXPECT_NEAR(r.bubble_ratio, (n - 1.0) / (v * m + n - 1.0), 1e-12);
      }
}

TEST(Simulator, FewerMicrobatchesThanWorkersLeaveGaps) {
  // N = 4, M = 2, S = 8 equal stages of 1 s, by hand: job k's microbatch 0 ends at k + 1 and its
  // microbatch 1 at k + 2 (each waits for the previous job's same microbatch; workers free up in
  // time), so the last job (7) ends at 9; busy 16 of 4 x 9 worker-seconds.
  auto r = SimulateRoundRobin(std::vector<double>(8, 1.0), 4, 2, 1);
  EXPECT_DOUBLE_EQ(r.makespan, 9.0);
  EXPECT_NEAR(r.bubble_ratio, 1.0 - 16.0 / 36.0, 1e-12);
}

TEST(Simulator, ManyCallsAmortizeFill) {
  const std::vector<double> stages(6, 1.0);
  auto one = SimulateRoundRobin(stages, 3, 4, 1);
  auto many = SimulateRoundRobin(stages, 3, 4, 8);
  EXPECT_LT(many.bubble_ratio, one.bubble_ratio);
  EXPECT_NEAR(many.makespan, 8 * 6 * 4 / 3.0 + 2.0, 1e-9);  // busy/N + one fill
}

// A job of `layers` blocks cut into equal forward and backward stages and a tail of `tail` blocks.
JobConfig StagedJob(int64_t layers, int64_t forward, int64_t backward, int64_t tail) {
  JobConfig c;
  c.model.num_layers = layers;
  c.schedule.forward_stages = forward;
  c.schedule.backward_stages = backward;
  c.schedule.tail_blocks = tail;
  return c;
}

// On the CPU (explicit attention, which keeps its probabilities) a backward stage costs three
// times its forward: the recompute and the backward's two products per forward product. On the
// GPU the fused attention backward also recomputes the scores, so more.
// StagedJob(4, 1, 2, 1) with clipping and an untied head: exact mode holds every gradient.
JobConfig ClippedUntiedJob() {
  JobConfig c = StagedJob(4, 1, 2, 1);
  c.model.tie_embeddings = false;
  c.train.grad_clip = 1.0;
  return c;
}

TEST(Simulator, CostModelWeighsBackwardThreeTimes) {
  JobConfig c = StagedJob(4, 1, 1, 0);
  c.job.device = DeviceKind::kCpu;
  auto plan = MakePlan(c);
  ASSERT_TRUE(plan.ok());
  // At 1 FLOP/s with free links the stages' compute seconds are their FLOPs.
  auto in =
      BuildSimInput(c, BuildModelSpec(c.model), *plan, CostModelProfile(c, 1.0, 0.0, 0.0), 1, 1);
  std::vector<double> f;
  for (const auto& st : in.stages) f.push_back(st.compute_s);
  ASSERT_EQ(f.size(), 3u);  // F[0,5) T[5,6) B[0,5)
  EXPECT_NEAR(f[2], 3.0 * f[0], 1e-6 * f[2]);
  EXPECT_GT(f[1], 0.0);
  c.job.device = DeviceKind::kCuda;
  auto gpu =
      BuildSimInput(c, BuildModelSpec(c.model), *plan, CostModelProfile(c, 1.0, 0.0, 0.0), 1, 1);
  EXPECT_DOUBLE_EQ(gpu.stages[0].compute_s, f[0]);
  EXPECT_GT(gpu.stages[2].compute_s, 3.0 * f[0] * (1.0 + 1e-6));
}

}  // namespace
}  // namespace rp::core

namespace rp::core {
namespace {

TEST(Simulator, IsolatedRoundIdleIsFillAndDrainOnly) {
  // S = v*N equal stages, M >= N: worker w starts at w*t and ends (N-1-w)*t before the end, so
  // the bubble is all fill and drain, N(N-1)/2 * t each.
  const int n = 3, v = 2, m = 4;
  const double t = 1.0;
  auto r = SimulateRoundRobin(std::vector<double>(v * n, t), n, m, 1);
  const double total = r.makespan * n;
  EXPECT_NEAR(r.fill_ratio, n * (n - 1) / 2.0 * t / total, 1e-12);
  EXPECT_NEAR(r.drain_ratio, n * (n - 1) / 2.0 * t / total, 1e-12);
  EXPECT_NEAR(r.imbalance_ratio, 0.0, 1e-12);
  EXPECT_NEAR(r.fill_ratio + r.drain_ratio + r.imbalance_ratio, r.bubble_ratio, 1e-12);
}

// One worker, two stages, two microbatches. Link 10 B/s each way. Stage 0: 20 B of weights, 1 s
// compute, 10 B in and 10 B out per microbatch. Stage 1: 40 B of weights, 2 s compute, 30 B of
// gradients.
SimInput TwoStagesByHand() {
  SimInput in;
  in.h2d_bytes_per_s = in.d2h_bytes_per_s = 10.0;
  in.microbatches = 2;
  SimStage a, b;
  a.compute_s = 1.0;
  a.in_bytes = a.out_bytes = 10.0;
  a.weight_bytes = 20.0;
  a.owners = {0};
  b.compute_s = 2.0;
  b.weight_bytes = 40.0;
  b.grad_bytes = 30.0;
  b.owners = {1};
  in.stages = {a, b};
  return in;
}

TEST(Simulator, TransfersAndPrefetchByHand) {
  SimInput in = TwoStagesByHand();
  auto r = Simulate(in);
  // Job 0: fetch [0, 2); microbatches of 1 + 1 + 1 s: [2, 5), [5, 8).
  // Job 1: prefetch starts when job 0 began (2) and the weights stream is free (2): [2, 6);
  // microbatches [8, 10), [10, 12); gradients [12, 15).
  EXPECT_DOUBLE_EQ(r.step_done[0], 15.0);
  EXPECT_DOUBLE_EQ(r.makespan, 15.0);
  EXPECT_DOUBLE_EQ(r.busy[0], 10.0);
  EXPECT_DOUBLE_EQ(r.fill_ratio, 2.0 / 15.0);
  EXPECT_DOUBLE_EQ(r.drain_ratio, 3.0 / 15.0);
}

TEST(Simulator, CrossNodeSumsLengthenTheGradientWriteBackByHand) {
  // The same two stages on 3 nodes: stage 1's 30 bytes are summed first, a ring of 2 x 2/3 x 30
  // = 40 bytes at 20 B/s (2 s) and 4 hops of 0.25 s (1 s): gradients [12, 18).
  SimInput in = TwoStagesByHand();
  in.nodes = 3;
  in.node_link_bytes_per_s = 20.0;
  in.node_hop_s = 0.25;
  EXPECT_DOUBLE_EQ(NodeSumSeconds(in, 30.0), 3.0);
  EXPECT_DOUBLE_EQ(Simulate(in).step_done[0], 18.0);
  in.nodes = 1;  // one node sums nothing
  EXPECT_DOUBLE_EQ(NodeSumSeconds(in, 30.0), 0.0);
  EXPECT_DOUBLE_EQ(Simulate(in).step_done[0], 15.0);
}

TEST(Simulator, ShardedStateGathersEachUpdateBeforeItsNextFetch) {
  // A gather of 30 bytes over 3 nodes: a ring of 2/3 x 30 = 20 bytes at 20 B/s (1 s), 2 hops
  // of 0.25 s.
  SimInput in = TwoStagesByHand();
  in.nodes = 3;
  in.node_link_bytes_per_s = 20.0;
  in.node_hop_s = 0.25;
  EXPECT_DOUBLE_EQ(NodeGatherSeconds(in, 30.0), 1.5);
  // Two steps, stage 1's layer updated in 1 s after its gradients [12, 15): the second step's
  // fetch of it waits for the update, and with a gather for that too.
  in.nodes = 1;
  in.steps = 2;
  in.update_s = {0.0, 1.0};
  const SimResult plain = Simulate(in);
  in.gather_s = {0.0, 20.0};
  const SimResult gathered = Simulate(in);
  EXPECT_DOUBLE_EQ(gathered.step_done[0], plain.step_done[0]);
  EXPECT_GT(gathered.step_done[1], plain.step_done[1]);
  // Sharded jobs: one node's share of each update (half of it on 2 nodes), and the gathers.
  auto cfg = ParseJobConfig(
      "[train]\nmicrobatches = 6\naccum_calls = 1\n[job]\ndevice = \"cpu\"\n[data]\nformat = "
      "\"random\"\n[optimizer]\nstate = \"sharded\"\n",
      "/tmp", {});
  ASSERT_TRUE(cfg.ok()) << cfg.status().message();
  JobConfig c = *cfg;
  c.nodes.count = 2;
  c.train.grad_clip = 1.0;  // every gradient held: second passes, shared like the first
  Profile profile = DefaultCostModel(c);
  profile.optimizer_params_per_s = 1e6;
  auto plan = BuildPlan(c);
  ASSERT_TRUE(plan.ok());
  const ModelSpec spec = BuildModelSpec(c.model, c.lora);
  const SimInput sharded = BuildSimInput(c, spec, *plan, profile, 2, 2);
  c.optimizer.state = OptimizerState::kReplicated;
  const SimInput replicated = BuildSimInput(c, spec, *plan, profile, 2, 2);
  ASSERT_EQ(sharded.update_s.size(), replicated.update_s.size());
  EXPECT_TRUE(replicated.gather_s.empty());
  ASSERT_EQ(sharded.gather_s.size(), replicated.update_s.size());
  for (size_t o = 0; o < sharded.update_s.size(); ++o) {
    EXPECT_DOUBLE_EQ(sharded.update_s[o], replicated.update_s[o] / 2) << "layer " << o;
    EXPECT_EQ(sharded.gather_s[o] > 0, replicated.update_s[o] > 0) << "layer " << o;
  }
  ASSERT_EQ(sharded.second_pass_s.size(), replicated.update_s.size());
  ASSERT_EQ(replicated.second_pass_s.size(), replicated.update_s.size());
  for (size_t o = 0; o < sharded.second_pass_s.size(); ++o)
    EXPECT_DOUBLE_EQ(sharded.second_pass_s[o], replicated.second_pass_s[o] / 2) << "layer " << o;
}

TEST(Simulator, SeveralNodesPlanOneNodesShareOfTheStep) {
  // rp-plan --nnodes: each node runs M / N microbatches per round, so with the FLOP cost model
  // the predicted step falls with the node count (a little less than 1/N: the sums, the fill).
  auto cfg = ParseJobConfig(
      "[train]\nmicrobatches = 6\naccum_calls = 1\n[job]\ndevice = \"cpu\"\n[data]\nformat = "
      "\"random\"\n",
      "/tmp", {});
  ASSERT_TRUE(cfg.ok()) << cfg.status().message();
  std::vector<double> steps;
  for (int nodes : {1, 2, 3}) {
    JobConfig c = *cfg;
    c.nodes.count = nodes;
    ASSERT_TRUE(CheckNodes(c).ok());
    EXPECT_EQ(Round(c).microbatches, 6 / nodes);
    EXPECT_EQ(GlobalRound(c).microbatches, 6);
    auto plan = BuildPlan(c);
    ASSERT_TRUE(plan.ok());
    steps.push_back(PredictPlan(c, *plan, DefaultCostModel(c), 2).step_seconds);
  }
  EXPECT_LT(steps[1], steps[0]);
  EXPECT_LT(steps[2], steps[1]);
  EXPECT_GT(steps[1], steps[0] / 2);
  JobConfig uneven = *cfg;
  uneven.nodes.count = 4;
  EXPECT_FALSE(CheckNodes(uneven).ok());
}

TEST(Simulator, OverlappedCopiesExposeOnlyEachJobsFirstInputByHand) {
  // The same two stages as above with copies_overlap (CUDA workers). Stage 0, microbatch 0: input
  // [2, 3), compute [3, 4), output [4, 5); microbatch 1: input [3, 4), compute [4, 5), output
  // [5, 6). Stage 1 (weights prefetched [2, 6)): microbatch 0 from 6 (weights) to 8, microbatch 1
  // [8, 10) (its input, stage 0's output, was there at 6); gradients [10, 13).
  SimInput in = TwoStagesByHand();
  in.copies_overlap = true;
  auto r = Simulate(in);
  EXPECT_DOUBLE_EQ(r.step_done[0], 13.0);
  EXPECT_DOUBLE_EQ(r.busy[0], 6.0);  // compute only: the copies ran beside it
  EXPECT_DOUBLE_EQ(r.fill_ratio, 3.0 / 13.0);

  in.copies_overlap = false;  // in series, as before: 15 s
  EXPECT_DOUBLE_EQ(Simulate(in).step_done[0], 15.0);
}

// One worker, one stage holding layer 0 with gradients, 1 s per microbatch, M = 1, an update of
// 0.5 s, exact mode, `steps` steps.
SimInput OneLayerExact(int steps) {
  SimInput in;
  SimStage s;
  s.compute_s = 1.0;
  s.grad_bytes = 1.0;  // free link: marks the stage as producing gradients
  s.owners = {0};
  in.stages = {s};
  in.steps = steps;
  in.update_s = {0.5};
  in.version_lag = 1;
  return in;
}

TEST(Simulator, ExactWaitsForTheUpdateAndStaleOneDoesNot) {
  // One worker, one stage holding layer 0 with gradients, 1 s per microbatch, M = 1; the update
  // takes 0.5 s. exact: step 2 starts after step 1's update (1.5), so steps finish at 1 and 2.5.
  // stale1: step 2 reads weights one update older and starts at once: 1 and 2.
  SimInput in = OneLayerExact(3);
  auto exact = Simulate(in);
  EXPECT_DOUBLE_EQ(exact.step_done[0], 1.0);
  EXPECT_DOUBLE_EQ(exact.step_done[1], 2.5);
  EXPECT_DOUBLE_EQ(exact.steady_step_s, 1.5);
  EXPECT_DOUBLE_EQ(exact.makespan, 4.5);  // the last update drains after the last step
  in.version_lag = 2;
  auto stale = Simulate(in);
  EXPECT_DOUBLE_EQ(stale.step_done[1], 2.0);
  EXPECT_DOUBLE_EQ(stale.steady_step_s, 1.0);
}

TEST(Simulator, SecondPassesDelayTheNextStepsFirstPassesByHand) {
  // The exact-mode job above with a first pass of 0.5 s and a second of 0.4 s. Step 0 ends at 1
  // and its update publishes at 1.5 (step 1 runs [1.5, 2.5)); its second pass holds the optimizer
  // to 1.9, before step 1's gradient is final, so steps still take 1.5 s. With a second pass of
  // 1.4 s the optimizer is free only at 2.9: step 1's update publishes at 3.4, step 2 ends at 4.4,
  // and from then on steps take 1.9 s (first pass plus second: the optimizer's time per step).
  SimInput in = OneLayerExact(4);
  in.second_pass_s = {0.4};
  auto hidden = Simulate(in);
  EXPECT_DOUBLE_EQ(hidden.step_done[1], 2.5);
  EXPECT_DOUBLE_EQ(hidden.steady_step_s, 1.5);
  in.second_pass_s = {1.4};
  auto bound = Simulate(in);
  EXPECT_DOUBLE_EQ(bound.step_done[1], 2.5);
  EXPECT_DOUBLE_EQ(bound.step_done[2], 4.4);
  EXPECT_NEAR(bound.step_done[3] - bound.step_done[2], 1.9, 1e-12);
}

TEST(Simulator, UpdatePassesArePricedFromTheTimedPassesBytes) {
  // A clipped exact job whose arena holds every slot. The profile's rate timed 1e9 parameters/s
  // of the pass that publishes; BuildSimInput prices each pass by its bytes against that.
  JobConfig c = ClippedUntiedJob();
  auto plan = MakePlan(c);
  ASSERT_TRUE(plan.ok());
  const ModelSpec spec = BuildModelSpec(c.model);
  Profile profile = CostModelProfile(c, 1e12, 1e10, 1e9);
  const UpdatePassBytes b = UpdateBytesPerParam(c, ResolveExecution(c));
  ASSERT_TRUE(ResolveExecution(c).workers_fetch_masters);
  EXPECT_DOUBLE_EQ(b.whole, 28.0);
  EXPECT_DOUBLE_EQ(b.first, 20.0);
  EXPECT_DOUBLE_EQ(b.second, 20.0);
  std::vector<double> numel(plan->num_layers, 0.0);
  for (const auto& ps : spec.params) numel[ps.owner_layer] += static_cast<double>(ps.numel);
  auto expect_costs = [&](const SimInput& in, double first_per_param, double second_per_param) {
    ASSERT_EQ(in.update_s.size(), numel.size());
    for (size_t l = 0; l < numel.size(); ++l)
      EXPECT_NEAR(in.update_s[l], numel[l] * first_per_param, 1e-12) << "layer " << l;
    if (second_per_param == 0.0) {
      EXPECT_TRUE(in.second_pass_s.empty());
      return;
    }
    ASSERT_EQ(in.second_pass_s.size(), numel.size());
    for (size_t l = 0; l < numel.size(); ++l)
      EXPECT_NEAR(in.second_pass_s[l], numel[l] * second_per_param, 1e-12) << "layer " << l;
  };
  // Unrecorded bytes (the cost model): the rate is the first pass's where two passes apply.
  expect_costs(BuildSimInput(c, spec, *plan, profile, 1, 3), 1e-9, 1e-9);
  c.optimizer.update_passes = int64_t{1};
  expect_costs(BuildSimInput(c, spec, *plan, profile, 1, 3), 28.0 / 20.0 * 1e-9, 0.0);
  // A profile that timed one whole pass: the host moves 28e9 bytes/s for updates.
  profile.optimizer_pass_bytes = 28.0;
  expect_costs(BuildSimInput(c, spec, *plan, profile, 1, 3), 1e-9, 0.0);
  c.optimizer.update_passes = int64_t{2};
  expect_costs(BuildSimInput(c, spec, *plan, profile, 1, 3), 20.0 / 28.0 * 1e-9,
               20.0 / 28.0 * 1e-9);
  // stale1 updates in one pass whatever the key says.
  c.optimizer.update_passes = kUpdatePassesAuto;
  c.optimizer.mode = OptimizerMode::kStale1;
  expect_costs(BuildSimInput(c, spec, *plan, profile, 1, 3),
               UpdateBytesPerParam(c, ResolveExecution(c)).whole / 28.0 * 1e-9, 0.0);
}

TEST(Simulator, StaleOneCommitsWaitForTheSlotsAndHoldTheirGradients) {
  // One worker, one stage: 1 s of compute, 10 B of gradients over a 10 B/s link, a 5 s update.
  // stale1: step 1 computes in [1, 2) at once, but its slot is read by step 0's update until 7,
  // so its gradients wait on the device from 2 and are copied in [7, 8).
  SimInput in;
  SimStage s;
  s.compute_s = 1.0;
  s.grad_bytes = 10.0;
  s.owners = {0};
  in.stages = {s};
  in.steps = 2;
  in.d2h_bytes_per_s = 10.0;
  in.update_s = {5.0};
  in.version_lag = 2;
  auto r = Simulate(in);
  EXPECT_DOUBLE_EQ(r.step_done[0], 2.0);
  EXPECT_DOUBLE_EQ(r.step_done[1], 8.0);
  ASSERT_EQ(r.peak_held_grad_bytes.size(), 1u);
  EXPECT_DOUBLE_EQ(r.peak_held_grad_bytes[0], 10.0);  // step 0's leave as step 1's arrive
  // Two stages whose gradients both wait: they add up.
  SimStage s2 = s;
  s2.owners = {1};
  in.stages = {s, s2};
  in.update_s = {5.0, 5.0};
  auto two = Simulate(in);
  EXPECT_DOUBLE_EQ(two.peak_held_grad_bytes[0], 20.0);
}

// One worker, exact mode, two steps of one stage over two layers (owners 0 and 1): 1 s of
// compute per microbatch, 10 B per layer over a 10 B/s link, 1 s per layer's update; the stage
// writes gradients, so the updates happen.
SimInput TwoLayersTwoSteps() {
  SimInput in;
  SimStage s;
  s.compute_s = 1.0;
  s.grad_bytes = 1.0;
  s.owners = {0, 1};
  s.weight_bytes = 20.0;
  s.fetches = {{{0}, 10.0}, {{1}, 10.0}};
  in.stages = {s};
  in.steps = 2;
  in.h2d_bytes_per_s = 10.0;
  in.update_s = {1.0, 1.0};
  return in;
}

TEST(Simulator, LayerByLayerFetchesOverlapTheStagesLaterUpdates) {
  // One worker, one stage of two layers (owners 0 and 1), 10 B each over a 10 B/s link, 1 s of
  // compute, 1 s updates, exact mode. Step 0: copies [0, 2), compute [2, 3), updates [3, 4) and
  // [4, 5). Step 1 copies layer 0 in [4, 5) while layer 1 updates, layer 1 in [5, 6), computes
  // [6, 7). One copy after both updates would take [5, 7) and end step 1 at 8.
  SimInput in = TwoLayersTwoSteps();
  auto layered = Simulate(in);
  EXPECT_DOUBLE_EQ(layered.step_done[0], 3.0);
  EXPECT_DOUBLE_EQ(layered.step_done[1], 7.0);
  in.stages[0].fetches.clear();
  auto whole = Simulate(in);
  EXPECT_DOUBLE_EQ(whole.step_done[1], 8.0);
}

TEST(Simulator, LayerMajorStagesChaseTheUpdatesByHand) {
  // One worker, one stage of two layers (owners 0 and 1) over 2 microbatches, 0.5 s per layer
  // and microbatch, 10 B per layer over a 10 B/s link, 1 s updates, exact mode, no clipping.
  // Layer-major (auto): step 0 begins once layer 0 is copied (1), layer 0 over both microbatches
  // [1, 2), layer 1 (copied at 2) [2, 3); updates [3, 4) and [4, 5); step 1 copies layer 0 in
  // [4, 5) and layer 1 in [5, 6), computes layer 0 in [5, 6) and layer 1 in [6, 7). Microbatch
  // order: step 0 computes [2, 4), updates [4, 6), step 1 copies [5, 7) and computes [7, 9).
  // (The stage's gradients only make the updates happen: the worker runs forward stages, which
  // have none, layer-major; the simulator does not ask.)
  SimInput in = TwoLayersTwoSteps();
  in.stages[0].layer_compute_s = {0.5, 0.5};
  in.microbatches = 2;
  in.layer_major = SimInput::LayerMajor::kAuto;
  auto lm = Simulate(in);
  EXPECT_DOUBLE_EQ(lm.step_done[0], 3.0);
  EXPECT_DOUBLE_EQ(lm.step_done[1], 7.0);
  EXPECT_DOUBLE_EQ(lm.busy[0], 4.0);
  in.layer_major = SimInput::LayerMajor::kNever;
  auto mb = Simulate(in);
  EXPECT_DOUBLE_EQ(mb.step_done[0], 4.0);
  EXPECT_DOUBLE_EQ(mb.step_done[1], 9.0);
  EXPECT_DOUBLE_EQ(mb.busy[0], 4.0);
  // Weights already there when the stage could begin (free copies, instant updates): auto keeps
  // the microbatch order, and so the same schedule as never.
  in.h2d_bytes_per_s = 0.0;
  in.update_s.clear();
  auto never_free = Simulate(in);
  in.layer_major = SimInput::LayerMajor::kAuto;
  auto auto_free = Simulate(in);
  EXPECT_DOUBLE_EQ(auto_free.step_done[1], never_free.step_done[1]);
  EXPECT_DOUBLE_EQ(auto_free.step_done[1], 4.0);
}

TEST(Simulator, RowsFirstPublishesTheLookupBeforeTheOtherLayersByHand) {
  // TwoLayersTwoSteps with clipping and layer 0 looked up in place: its fetch copies nothing and
  // waits for the pseudo owner 2, a quarter of layer 0's update. Step 0: layer 1 copied [0, 1),
  // compute [1, 2). Updates: the next step's rows [2, 2.25), layer 1 [2.25, 3.25), layer 0's
  // other rows [3.25, 4). Step 1: layer 1 copied [3.25, 4.25), compute [4.25, 5.25); its
  // updates end at 7.25.
  SimInput in = TwoLayersTwoSteps();
  in.updates_wait_for_norm = true;
  in.stages[0].fetches[0] = {{2}, 0.0};
  in.lookup_owner = 2;
  in.lookup_fraction = 0.25;
  auto r = Simulate(in);
  EXPECT_DOUBLE_EQ(r.step_done[0], 2.0);
  EXPECT_DOUBLE_EQ(r.step_done[1], 5.25);
  EXPECT_DOUBLE_EQ(r.makespan, 7.25);
  // Every row first (fraction 1): layer 1's update starts only at 3, its copy ends at 5.
  in.lookup_fraction = 1.0;
  EXPECT_DOUBLE_EQ(Simulate(in).step_done[1], 6.0);
  // Without clipping nothing goes first: the lookup is published with layer 0, after it.
  in.updates_wait_for_norm = false;
  in.lookup_fraction = 0.25;
  auto unclipped = Simulate(in);
  EXPECT_DOUBLE_EQ(unclipped.step_done[1], 6.0);
}

// Two stages on one worker, backward order: layer 1's gradient is final at 1, layer 0's at 2;
// updates of 1 s each.
SimInput TwoStagesBackwardOrder() {
  SimInput in;
  SimStage top, bottom;
  top.compute_s = bottom.compute_s = 1.0;
  top.grad_bytes = bottom.grad_bytes = 1.0;
  top.owners = {1};
  bottom.owners = {0};
  in.stages = {top, bottom};
  in.update_s = {1.0, 1.0};
  return in;
}

TEST(Simulator, DeviceUpdatedLayersAreFetchableAtTheNormAndUpdatedLastByHand) {
  // One worker, clipping, 10 B per layer over a 10 B/s link, 1 s of compute per stage, 1 s
  // updates. A forward stage over layers 1 and 2, then a backward stage over both. Without device
  // updates: step 0's copies [0, 2), compute [2, 3), backward copies [2, 4), compute [4, 5); the
  // norm at 5, updates of layer 1 [5, 6) and layer 2 [6, 7). Step 1's forward copies layer 1
  // [6, 7) and layer 2 [7, 8), computes [8, 9); its backward copies [8, 10), computes [10, 11).
  SimInput in;
  SimStage fwd, bwd;
  fwd.compute_s = bwd.compute_s = 1.0;
  fwd.weight_bytes = bwd.weight_bytes = 20.0;
  fwd.fetches = bwd.fetches = {{{1}, 10.0}, {{2}, 10.0}};
  fwd.owners = bwd.owners = {1, 2};
  bwd.grad_bytes = 1.0;
  in.stages = {fwd, bwd};
  in.steps = 2;
  in.h2d_bytes_per_s = 10.0;
  in.update_s = {0.0, 1.0, 1.0};
  in.updates_wait_for_norm = true;
  auto host = Simulate(in);
  EXPECT_DOUBLE_EQ(host.step_done[0], 5.0);
  EXPECT_DOUBLE_EQ(host.step_done[1], 11.0);
  // Layer 1 updated on the device (pseudo owner 3): the forward copies nothing for it and takes
  // it at the norm. Step 0: layer 2's copy [0, 1), compute [1, 2), backward [1, 3) and [3, 4);
  // the norm at 4, and the host updates layer 2 first [4, 5), then layer 1 [5, 6). Step 1's
  // forward: layer 2's copy [5, 6), compute [6, 7); the backward copies the host's layer 1 [6, 7)
  // and layer 2 [7, 8), computes [8, 9).
  in.device_blocks = 1;
  in.device_owner_base = 3;
  in.stages[0].fetches = {{{3}, 0.0}, {{2}, 10.0}};
  auto device = Simulate(in);
  EXPECT_DOUBLE_EQ(device.step_done[0], 4.0);
  EXPECT_DOUBLE_EQ(device.step_done[1], 9.0);
}

TEST(Simulator, ClippingStartsUpdatesAfterTheLastGradient) {
  // Two stages on one worker, backward order: layer 1's gradient is final at 1, layer 0's at 2.
  // Updates of 1 s each. Without clipping layer 1 updates in [1, 2) and layer 0 in [2, 3);
  // with clipping both wait for the norm: [2, 3) and [3, 4).
  SimInput in = TwoStagesBackwardOrder();
  auto free_run = Simulate(in);
  EXPECT_DOUBLE_EQ(free_run.makespan, 3.0);
  in.updates_wait_for_norm = true;
  auto clipped = Simulate(in);
  EXPECT_DOUBLE_EQ(clipped.makespan, 4.0);
}

TEST(Simulator, NormsRunBeforeTheUpdatesByHand) {
  // The two stages above, with norms of 0.25 s (layer 1) and 0.5 s (layer 0) once each gradient
  // is final: layer 1's in [1, 1.25), layer 0's in [2, 2.5). Without clipping layer 1 updates in
  // [1.25, 2.25) and layer 0 in [2.5, 3.5); with clipping both wait for the last norm: [2.5, 3.5)
  // and [3.5, 4.5).
  SimInput in = TwoStagesBackwardOrder();
  in.norm_s = {0.5, 0.25};
  EXPECT_DOUBLE_EQ(Simulate(in).makespan, 3.5);
  in.updates_wait_for_norm = true;
  EXPECT_DOUBLE_EQ(Simulate(in).makespan, 4.5);
}

TEST(Simulator, CommitsWaitingForTheNormGoLastStageFirstByHand) {
  // The two stages above with 0.5 s commits. Streamed: layer 1's commit [1, 1.5), layer 0's
  // [2, 2.5); updates [1.5, 2.5) and [2.5, 3.5). Waiting for the norm (known at 2, the last job's
  // end): layer 0's commit [2, 2.5), layer 1's [2.5, 3); updates as each lands, [2.5, 3.5) and
  // [3.5, 4.5). Layer 1's gradients stay on the device from 1 to 3, beside layer 0's.
  SimInput in = TwoStagesBackwardOrder();
  in.d2h_bytes_per_s = 2.0;
  auto streamed = Simulate(in);
  EXPECT_DOUBLE_EQ(streamed.makespan, 3.5);
  EXPECT_DOUBLE_EQ(streamed.peak_held_grad_bytes[0], 1.0);
  in.commits_wait_for_norm = true;
  auto waiting = Simulate(in);
  EXPECT_DOUBLE_EQ(waiting.step_done[0], 3.0);
  EXPECT_DOUBLE_EQ(waiting.makespan, 4.5);
  EXPECT_DOUBLE_EQ(waiting.peak_held_grad_bytes[0], 2.0);
}

TEST(Simulator, ASmallArenaMakesCommitsWaitForEarlierUpdatesByHand) {
  // The commits above, waiting for the norm, through an arena with room for one stage: layer
  // 0's commit [2, 2.5), its update [2.5, 3.5) releases its slots; layer 1's commit waits for
  // that: [3.5, 4), update [4, 5). Its gradients stay on the device from 1 to 4. With room for
  // both stages nothing waits (as without an arena).
  SimInput in = TwoStagesBackwardOrder();
  in.d2h_bytes_per_s = 2.0;
  in.commits_wait_for_norm = true;
  for (auto& st : in.stages) {
    st.arena_bytes = 1.0;
    st.owner_arena_bytes = {1.0};
  }
  in.arena_bytes = 1.0;
  auto one = Simulate(in);
  EXPECT_DOUBLE_EQ(one.step_done[0], 4.0);
  EXPECT_DOUBLE_EQ(one.makespan, 5.0);
  EXPECT_DOUBLE_EQ(one.peak_held_grad_bytes[0], 2.0);
  in.arena_bytes = 2.0;
  auto two = Simulate(in);
  EXPECT_DOUBLE_EQ(two.step_done[0], 3.0);
  EXPECT_DOUBLE_EQ(two.makespan, 4.5);
}

TEST(Simulator, AStreamedArenaIsPassedOnOnlyWhereCommitsWaitForTheNorm) {
  // BuildSimInput: gradients waiting in the workers stream through an arena of two stages (the
  // default) less the tied slots; each stage's commit places its layers' slots. Gradients waiting
  // on the host need an arena holding every slot: no room to model.
  JobConfig c = ClippedUntiedJob();
  c.schedule.backward_stages = 4;
  auto plan = MakePlan(c);
  ASSERT_TRUE(plan.ok());
  const ModelSpec spec = BuildModelSpec(c.model);
  const Profile profile = CostModelProfile(c, 1e12, 1e10, 1e9);
  EXPECT_EQ(BuildSimInput(c, spec, *plan, profile, 1, 3).arena_bytes, 0.0);
  c.optimizer.gradients_wait_in = GradientsWait::kWorkers;
  const SimInput in = BuildSimInput(c, spec, *plan, profile, 1, 3);
  auto sizing = SizeGradArena(c, ResolveExecution(c), spec, *plan);
  ASSERT_TRUE(sizing.ok());
  ASSERT_LT(sizing->chosen, sizing->all_slots);
  EXPECT_DOUBLE_EQ(in.arena_bytes, static_cast<double>(sizing->chosen - sizing->shared));
  double largest = 0.0, all = 0.0;
  for (const auto& st : in.stages) {
    ASSERT_EQ(st.owner_arena_bytes.size(), st.owners.size());
    double sum = 0.0;
    for (double b : st.owner_arena_bytes) sum += b;
    EXPECT_DOUBLE_EQ(sum, st.arena_bytes);
    EXPECT_EQ(st.arena_bytes > 0, st.grad_bytes > 0);
    largest = std::max(largest, st.arena_bytes);
    all += st.arena_bytes;
  }
  EXPECT_GE(in.arena_bytes, largest);
  EXPECT_LT(in.arena_bytes, all);
}

TEST(Simulator, GradientsWaitingInWorkersAreSimulatedSo) {
  // optimizer.gradients_wait_in = "workers": the commits wait for the norm, the updates do not
  // (each parameter is updated as its commit lands), and the host takes no norm.
  JobConfig c = ClippedUntiedJob();
  auto plan = MakePlan(c);
  ASSERT_TRUE(plan.ok());
  const ModelSpec spec = BuildModelSpec(c.model);
  const Profile profile = CostModelProfile(c, 1e12, 1e10, 1e9);
  auto host = BuildSimInput(c, spec, *plan, profile, 1, 3);
  EXPECT_TRUE(host.updates_wait_for_norm);
  EXPECT_FALSE(host.commits_wait_for_norm);
  c.optimizer.gradients_wait_in = GradientsWait::kWorkers;
  auto workers = BuildSimInput(c, spec, *plan, profile, 1, 3);
  EXPECT_FALSE(workers.updates_wait_for_norm);
  EXPECT_TRUE(workers.commits_wait_for_norm);
  for (double n : workers.norm_s) EXPECT_EQ(n, 0.0);
  double host_norms = 0.0;
  for (double n : host.norm_s) host_norms += n;
  EXPECT_GT(host_norms, 0.0);
}

TEST(Simulator, InterleavedCallsKeepUpWithTheOptimizer) {
  // One worker, exact mode with clipping, K = 2 calls of F_a F_b B_b B_a (1 s per microbatch,
  // M = 1), layers 0 and 1 updated in 2 s each after the step's last gradient.
  // Step 0 (no waits) ends at 8 either way; the updates run [8, 10) and [10, 12).
  // Call by call, step 1: F_a 10-11, F_b waits for layer 1: 12-13, B_b, B_a, then call 1's four
  // jobs: 19. Interleaved: F_a of both calls 10-12, F_b of both 12-14, then the four backward
  // jobs: 18.
  PipelinePlan plan;
  plan.stages = {{StageKind::kForward, 0, 1},
                 {StageKind::kForward, 1, 2},
                 {StageKind::kBackward, 1, 2},
                 {StageKind::kBackward, 0, 1}};
  SimInput in;
  SimStage fa, fb, bb, ba;
  fa.compute_s = fb.compute_s = bb.compute_s = ba.compute_s = 1.0;
  fa.owners = ba.owners = {0};
  fb.owners = bb.owners = {1};
  bb.grad_bytes = ba.grad_bytes = 1.0;
  in.stages = {fa, fb, bb, ba};
  in.calls = 2;
  in.steps = 2;
  in.update_s = {2.0, 2.0};
  in.updates_wait_for_norm = true;
  in.order = StepJobOrder(plan, 2, /*interleave=*/false);
  auto sequential = Simulate(in);
  EXPECT_DOUBLE_EQ(sequential.step_done[0], 8.0);
  EXPECT_DOUBLE_EQ(sequential.step_done[1], 19.0);
  in.order = StepJobOrder(plan, 2, /*interleave=*/true);
  auto interleaved = Simulate(in);
  EXPECT_DOUBLE_EQ(interleaved.step_done[0], 8.0);
  EXPECT_DOUBLE_EQ(interleaved.step_done[1], 18.0);
}

}  // namespace
}  // namespace rp::core
