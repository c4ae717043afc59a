// SPDX-License-Identifier: Apache-2.0
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <limits>
#include <random>
#include <vector>

#include "planning/grad_arena.h"
#include "planning/partitioner.h"
#include "planning/simulator.h"
#include "shm/layout.h"

namespace rp::core {
namespace {

double LargestRange(const std::vector<double>& c, const std::vector<int>& starts) {
  double worst = 0;
  for (size_t i = 0; i < starts.size(); ++i) {
    const int end = i + 1 < starts.size() ? starts[i + 1] : static_cast<int>(c.size());
    double s = 0;
    for (int j = starts[i]; j < end; ++j) s += c[j];
    worst = std::max(worst, s);
  }
  return worst;
}

TEST(Partitioner, MinMaxPartitionMatchesBruteForce) {
  std::mt19937 rng(11);
  for (int trial = 0; trial < 300; ++trial) {
    const int n = 1 + static_cast<int>(rng() % 8);
    const int parts = 1 + static_cast<int>(rng() % n);
    std::vector<double> c(n);
    for (auto& x : c) x = 1 + rng() % 20;
    auto starts = MinMaxPartition(c, parts);
    ASSERT_EQ(static_cast<int>(starts.size()), parts);
    EXPECT_EQ(starts[0], 0);
    for (int i = 1; i < parts; ++i) EXPECT_LT(starts[i - 1], starts[i]);
    // Brute force over every choice of parts - 1 cut positions.
    double best = 1e300;
    std::vector<int> cur = {0};
    std::function<void(int)> rec = [&](int from) {
      if (static_cast<int>(cur.size()) == parts) {
        best = std::min(best, LargestRange(c, cur));
        return;
      }
      for (int s = from; s < n; ++s) {
        cur.push_back(s);
        rec(s + 1);
        cur.pop_back();
      }
    };
    rec(1);
    EXPECT_DOUBLE_EQ(LargestRange(c, starts), best) << "n=" << n << " parts=" << parts;
  }
}

JobConfig Small(int layers) {
  JobConfig c;
  c.model.num_layers = layers;
  c.model.vocab_size = 4096;  // a head that costs several blocks, as in real models
  c.job.device = core::DeviceKind::kCpu;
  c.schedule.partition = core::Partition::kAuto;
  return c;
}

// Every equal-layer plan the planner also considers must predict no faster than its choice.
void ExpectNoEqualPlanIsFaster(const JobConfig& c, int workers, const Profile& costs,
                               const PlanChoice& choice) {
  const int layers = static_cast<int>(c.model.num_layers);
  JobConfig eq = c;
  eq.schedule.partition = core::Partition::kEqual;
  for (int tail : TailCandidates(layers, c.schedule.gpu_memory_gb > 0))
    for (int f = 1; f <= layers + 1 - tail && f <= 2 * workers + 2; ++f)
      for (int b = 1; b <= layers + 1 - tail && b <= 3 * workers + 3; ++b) {
        eq.schedule.tail_blocks = tail;
        eq.schedule.forward_stages = f;
        eq.schedule.backward_stages = b;
        auto plan = BuildPlan(eq);
        ASSERT_TRUE(plan.ok());
        auto pred = PredictPlan(eq, *plan, costs, workers);
        EXPECT_LE(choice.step_seconds, pred.step_seconds * (1 + 1e-9)) << plan->Describe();
      }
}

// Every plan with a `tail`-block fused tail and any contiguous forward and backward cuts of the
// layers before it (brute force, independent of the planner's enumeration), built from `eq`.
void ForEachContiguousPlan(
    JobConfig eq, int tail,
    const std::function<void(const JobConfig&, const PipelinePlan&)>& visit) {
  const int t = static_cast<int>(eq.model.num_layers) + 1 - tail;
  eq.schedule.tail_blocks = tail;
  for (uint32_t fm = 0; fm < (1u << (t - 1)); ++fm)
    for (uint32_t bm = 0; bm < (1u << (t - 1)); ++bm) {
      eq.schedule.forward_cuts.clear();
      eq.schedule.backward_cuts.clear();
      for (int i = 1; i < t; ++i) {
        if (fm & (1u << (i - 1))) eq.schedule.forward_cuts.push_back(i);
        if (bm & (1u << (i - 1))) eq.schedule.backward_cuts.push_back(i);
      }
      eq.schedule.forward_stages = static_cast<int64_t>(eq.schedule.forward_cuts.size()) + 1;
      eq.schedule.backward_stages = static_cast<int64_t>(eq.schedule.backward_cuts.size()) + 1;
      auto plan = BuildPlan(eq);
      ASSERT_TRUE(plan.ok()) << plan.status().ToString();
      visit(eq, *plan);
    }
}

TEST(Partitioner, AutoIsNoSlowerThanEqualSplitsAndCoversEveryLayer) {
  for (int layers : {2, 4, 6})
    for (int workers : {1, 2, 3}) {
      JobConfig c = Small(layers);
      auto choice = ChoosePlan(c, workers);
      ASSERT_TRUE(choice.ok()) << choice.status().ToString();
      auto via_make = MakePlan(c, workers);  // MakePlan verifies single coverage of every layer
      ASSERT_TRUE(via_make.ok()) << via_make.status().ToString();
      EXPECT_EQ(via_make->Describe(), choice->plan.Describe());
      ExpectNoEqualPlanIsFaster(c, workers, DefaultCostModel(c), *choice);
    }
}

TEST(Partitioner, AutoWithAMeasuredProfileIsNoSlowerThanEqualSplits) {
  // Random per-layer costs (a measured profile can be anything), with transfers and an
  // optimizer in the simulation.
  std::mt19937 rng(5);
  std::uniform_real_distribution<double> u(0.1, 3.0);
  for (int layers : {3, 5})
    for (int workers : {1, 2, 3}) {
      JobConfig c = Small(layers);
      Profile p = DefaultCostModel(c);
      for (auto& l : p.layers) {
        l.forward_s = u(rng);
        l.recompute_s = l.forward_s * 1.05;
        l.backward_s = 2 * u(rng);
      }
      p.h2d_bytes_per_s = p.d2h_bytes_per_s = 1e8;
      p.optimizer_params_per_s = 1e7;
      auto choice = ChoosePlan(c, workers, p);
      ASSERT_TRUE(choice.ok()) << choice.status().ToString();
      ExpectNoEqualPlanIsFaster(c, workers, p, *choice);
    }
}

TEST(Partitioner, SmallModelsAreSearchedExhaustively) {
  // Brute force, independent of the planner's enumeration: every tail size and every pair of
  // contiguous forward / backward splits, each predicted; the planner's choice is the minimum.
  std::mt19937 rng(17);
  std::uniform_real_distribution<double> u(0.1, 3.0);
  for (int layers : {2, 3, 5})
    for (int workers : {1, 2, 3}) {
      JobConfig c = Small(layers);
      Profile p = DefaultCostModel(c);
      for (auto& l : p.layers) {
        l.forward_s = u(rng);
        l.recompute_s = u(rng);
        l.backward_s = u(rng);
      }
      p.optimizer_params_per_s = 1e6 * u(rng);
      auto choice = ChoosePlan(c, workers, p);
      ASSERT_TRUE(choice.ok());
      double best = std::numeric_limits<double>::infinity();
      JobConfig eq = c;
      eq.schedule.partition = core::Partition::kEqual;
      for (int tail = 0; tail <= std::min(layers, 3); ++tail)
        ForEachContiguousPlan(eq, tail, [&](const JobConfig& with, const PipelinePlan& plan) {
          best = std::min(best, PredictPlan(with, plan, p, workers).step_seconds);
        });
      EXPECT_NEAR(choice->step_seconds, best, 1e-6 * best)
          << layers << " layers, " << workers << " workers";
    }
}

TEST(Partitioner, TailSizesTriedGrowWithAMemoryBudgetOnly) {
  EXPECT_EQ(TailCandidates(28, false), (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(TailCandidates(2, false), (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(TailCandidates(28, true),
            (std::vector<int>{0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 13, 17, 22, 28}));
  EXPECT_EQ(TailCandidates(5, true), (std::vector<int>{0, 1, 2, 3, 4, 5}));
  EXPECT_EQ(TailCandidates(9, true), (std::vector<int>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9}));
}

TEST(Partitioner, WithAMemoryBudgetEveryTailIsSearchedAndTheBudgetHolds) {
  // Brute force over every tail size (all blocks included) and every pair of contiguous splits,
  // keeping the plans whose estimate fits the budget: the planner's choice is their minimum.
  // Recompute is priced high so that long tails pay off, and the budget excludes some of them.
  std::mt19937 rng(23);
  std::uniform_real_distribution<double> u(0.5, 2.0);
  bool longer_tail_won = false;
  for (int layers : {3, 5})
    for (int workers : {1, 2}) {
      JobConfig c = Small(layers);
      Profile p = DefaultCostModel(c);
      for (auto& l : p.layers) {
        l.forward_s = u(rng);
        l.recompute_s = 4 * u(rng);
        l.backward_s = u(rng);
      }
      JobConfig eq = c;
      eq.schedule.partition = core::Partition::kEqual;
      struct Candidate {
        double step, peak;
        int tail;
      };
      std::vector<Candidate> all;
      for (int tail = 0; tail <= layers; ++tail)
        ForEachContiguousPlan(eq, tail, [&](const JobConfig& with, const PipelinePlan& plan) {
          const PlanChoice pred = PredictPlan(with, plan, p, workers);
          all.push_back({pred.step_seconds, pred.peak_memory_bytes, tail});
        });
      // Budgets that exclude a quarter of the plans, and none.
      std::vector<double> peaks;
      for (const auto& a : all) peaks.push_back(a.peak);
      std::sort(peaks.begin(), peaks.end());
      for (double budget : {peaks[peaks.size() * 3 / 4], peaks.back()}) {
        c.schedule.gpu_memory_gb = budget / 1e9;
        double best = std::numeric_limits<double>::infinity();
        int best_tail = -1;
        for (const auto& a : all)
          if (a.peak <= c.schedule.gpu_memory_gb * 1e9 && a.step < best) {
            best = a.step;
            best_tail = a.tail;
          }
        auto choice = ChoosePlan(c, workers, p);
        ASSERT_TRUE(choice.ok()) << choice.status().ToString();
        EXPECT_NEAR(choice->step_seconds, best, 1e-6 * best)
            << layers << " layers, " << workers << " workers";
        EXPECT_LE(choice->peak_memory_bytes, c.schedule.gpu_memory_gb * 1e9);
        longer_tail_won = longer_tail_won || best_tail > 3;
      }
    }
  EXPECT_TRUE(longer_tail_won)
      << "no case needed a tail of more than 3 blocks: the test checks nothing beyond them";
}

// A deep model with a budget and dear recompute: tails longer than 8 blocks (the sizes tried in
// steps) are searched and chosen while they pay.
TEST(Partitioner, LongerTailsAreSearchedWhileTheyPay) {
  JobConfig c = Small(16);
  c.schedule.gpu_memory_gb = 1e3;
  Profile dear = DefaultCostModel(c);
  for (auto& l : dear.layers) l.recompute_s = 10 * l.forward_s;
  auto choice = ChoosePlan(c, 1, dear);
  ASSERT_TRUE(choice.ok()) << choice.status().ToString();
  EXPECT_GT(choice->plan.num_layers - 1 - choice->plan.tail_start, 8) << choice->plan.Describe();
  // Without a budget the tail stays within 0-3 blocks.
  c.schedule.gpu_memory_gb = 0;
  auto unbounded = ChoosePlan(c, 1, dear);
  ASSERT_TRUE(unbounded.ok()) << unbounded.status().ToString();
  EXPECT_LE(unbounded->plan.num_layers - 1 - unbounded->plan.tail_start, 3)
      << unbounded->plan.Describe();
}

// A deep model under a budget that every split into the pipeline's few stages overflows (a stage's
// recompute holds all its blocks' activations at once): the planner splits finer, down to a
// block per stage if need be, and its plan fits; a budget below the one-block-per-stage plan is
// still refused, naming the smallest estimate.
TEST(Partitioner, ABudgetOnlyFineSplitsMeetIsMetBySplittingFiner) {
  JobConfig c = Small(24);
  // CUDA's fused attention keeps no scores; long microbatches and a small head: the blocks'
  // recompute activations dominate, as in a 32B-class LoRA job on a 24 GB card.
  c.job.device = core::DeviceKind::kCuda;
  c.model.vocab_size = 256;
  c.data.seq_len = 512;
  c.train.microbatch_size = 8;
  JobConfig finest = c;
  finest.schedule.partition = core::Partition::kEqual;
  finest.schedule.tail_blocks = 0;
  finest.schedule.forward_stages = 25;
  finest.schedule.backward_stages = 25;
  auto finest_plan = BuildPlan(finest);
  ASSERT_TRUE(finest_plan.ok()) << finest_plan.status().ToString();
  const double finest_peak =
      PredictPlan(finest, *finest_plan, DefaultCostModel(c), 1).peak_memory_bytes;
  // The smallest peak among the splits into at most 6 backward stages (what the coarse search
  // tries with one worker): the budget sits between it and the finest plan's.
  double coarse_smallest = std::numeric_limits<double>::infinity();
  for (int b = 1; b <= 6; ++b)
    for (int f = 1; f <= 4; ++f)
      for (int tail = 0; tail <= 8; ++tail) {
        finest.schedule.tail_blocks = tail;
        finest.schedule.forward_stages = f;
        finest.schedule.backward_stages = b;
        auto plan = BuildPlan(finest);
        ASSERT_TRUE(plan.ok());
        coarse_smallest = std::min(
            coarse_smallest, PredictPlan(finest, *plan, DefaultCostModel(c), 1).peak_memory_bytes);
      }
  ASSERT_LT(finest_peak * 1.2, coarse_smallest) << "the case does not need finer splits";
  c.schedule.gpu_memory_gb = (finest_peak + coarse_smallest) / 2 / 1e9;
  auto choice = ChoosePlan(c, 1);
  ASSERT_TRUE(choice.ok()) << choice.status().ToString();
  EXPECT_LE(choice->peak_memory_bytes, c.schedule.gpu_memory_gb * 1e9) << choice->plan.Describe();
  int backward_stages = 0;
  for (const auto& s : choice->plan.stages) backward_stages += s.kind == StageKind::kBackward;
  EXPECT_GT(backward_stages, 6) << choice->plan.Describe();
  c.schedule.gpu_memory_gb = finest_peak * 0.9 / 1e9;
  auto refused = ChoosePlan(c, 1);
  ASSERT_FALSE(refused.ok()) << refused->plan.Describe();
  EXPECT_NE(refused.status().message().find("no plan fits"), std::string::npos)
      << refused.status().ToString();
}

// Small(layers) as one forward stage, a tail of one block and one backward stage, equal cuts.
JobConfig OneStageOfEachKind(int layers) {
  JobConfig c = Small(layers);
  c.schedule.partition = core::Partition::kEqual;
  c.schedule.tail_blocks = 1;
  c.schedule.forward_stages = 1;
  c.schedule.backward_stages = 1;
  return c;
}

// CPU workers' explicit attention: fp32 scores per head and pair of positions, two alive at once
// plus every block's kept probabilities and mask in a gradient stage's graph (one block's with
// train.layer_recompute); CUDA's fused kernels keep none.
TEST(Partitioner, MemoryEstimateCountsCpuAttentionScores) {
  JobConfig c = OneStageOfEachKind(8);  // F[0,8) T[8,10) B[0,8): the backward keeps 7 blocks
  c.job.device = DeviceKind::kCpu;
  c.data.seq_len = 2048;
  auto plan = BuildPlan(c);
  ASSERT_TRUE(plan.ok());
  const MemoryEstimate m = EstimateMemory(c, *plan, 1);
  const double s = 2048.0,
               scores =
                   static_cast<double>(c.train.microbatch_size * c.model.num_heads) * s * s * 4.0;
  EXPECT_NEAR(m.attention_scores, 2.0 * scores + s * s + 7.0 * (scores + s * s), 1.0);
  c.train.layer_recompute = true;
  EXPECT_NEAR(EstimateMemory(c, *plan, 1).attention_scores, 3.0 * scores + 2.0 * s * s, 1.0);
  c.train.layer_recompute = false;
  c.job.device = DeviceKind::kCuda;
  const MemoryEstimate cuda = EstimateMemory(c, *plan, 1);
  EXPECT_EQ(cuda.attention_scores, 0.0);
  EXPECT_GE(m.total - cuda.total, m.attention_scores);  // the CPU also keeps fp32 head logits
}

// schedule.frozen_on_device: the LoRA base counts once, whole, in the memory estimate instead of
// in each job's weights, and the simulated fetches carry the trainable weights only.
TEST(Partitioner, AFrozenBaseKeptOnTheDeviceCountsOnceAndIsNotFetched) {
  JobConfig c = OneStageOfEachKind(8);
  c.lora.rank = 4;
  auto plan = BuildPlan(c);
  ASSERT_TRUE(plan.ok());
  const ModelSpec spec = BuildModelSpec(c.model, c.lora);
  const Profile profile = DefaultCostModel(c);
  const MemoryEstimate streamed = EstimateMemory(c, *plan, 1);
  const SimInput streamed_in = BuildSimInput(c, spec, *plan, profile, 1, 1);
  c.schedule.frozen_on_device = true;
  const MemoryEstimate kept = EstimateMemory(c, *plan, 1);
  const SimInput kept_in = BuildSimInput(c, spec, *plan, profile, 1, 1);
  const double elem = static_cast<double>(ComputeElemBytes(c));
  EXPECT_EQ(streamed.frozen, 0.0);
  EXPECT_DOUBLE_EQ(kept.frozen, static_cast<double>(spec.FrozenParams()) * elem);
  ASSERT_EQ(kept.stage, streamed.stage);
  const Stage& peak = plan->stages[kept.stage];
  double peak_frozen = 0.0;
  for (int l = peak.begin; l < peak.end; ++l)
    for (const auto& use : spec.layer_frozen[l])
      peak_frozen += static_cast<double>(spec.frozen[use.param].numel) * elem;
  ASSERT_GT(peak_frozen, 0.0);
  EXPECT_NEAR(streamed.weights - kept.weights, peak_frozen, 1e-9 * peak_frozen);
  EXPECT_DOUBLE_EQ(kept.gradients, streamed.gradients);
  ASSERT_EQ(kept_in.stages.size(), streamed_in.stages.size());
  for (size_t i = 0; i < kept_in.stages.size(); ++i) {
    const Stage& st = plan->stages[i];
    ASSERT_EQ(kept_in.stages[i].fetches.size(), static_cast<size_t>(st.end - st.begin));
    for (int l = st.begin; l < st.end; ++l) {
      const double trainable =
          static_cast<double>(spec.LayerWeightBytes(l, static_cast<int>(elem), 0));
      EXPECT_DOUBLE_EQ(kept_in.stages[i].fetches[l - st.begin].bytes, trainable)
          << st.Describe() << " layer " << l;
      EXPECT_GT(streamed_in.stages[i].fetches[l - st.begin].bytes, trainable)
          << st.Describe() << " layer " << l;
    }
  }
}

// rp-plan's and the dry run's suggestion: a LoRA job on CUDA workers that streams its base is
// shown the prediction with the base kept, when that is faster and fits the memory budget; never
// for CPU workers, a full fine-tune or a base already kept.
TEST(Partitioner, KeepingTheFrozenBaseIsSuggestedWhereItFitsAndIsFaster) {
  JobConfig c = Small(8);
  c.job.device = DeviceKind::kCuda;
  c.lora.rank = 4;
  c.model.hidden_size = 1024;  // a base large enough that fetching it costs time
  c.model.intermediate_size = 4096;
  c.model.num_heads = 8;
  c.model.num_kv_heads = 8;
  c.model.head_dim = 128;
  const Profile costs = DefaultCostModel(c);
  auto current = ChoosePlan(c, 1, costs);
  ASSERT_TRUE(current.ok()) << current.status().message();
  const auto alt = FrozenOnDeviceAlternative(c, 1, costs, current->step_seconds);
  ASSERT_TRUE(alt.has_value());
  EXPECT_LT(alt->step_seconds, 0.99 * current->step_seconds);
  const ModelSpec spec = BuildModelSpec(c.model, c.lora);
  EXPECT_DOUBLE_EQ(alt->memory.frozen,
                   static_cast<double>(spec.FrozenParams()) * ComputeElemBytes(c));
  // The same with the job's own plan, of stages small enough that keeping the whole base costs
  // memory over fetching each stage's share.
  JobConfig equal = c;
  equal.schedule.partition = core::Partition::kEqual;
  equal.schedule.tail_blocks = 1;
  equal.schedule.forward_stages = 4;
  equal.schedule.backward_stages = 4;
  auto plan = BuildPlan(equal);
  ASSERT_TRUE(plan.ok());
  const PlanChoice own = PredictPlan(equal, *plan, costs, 1);
  const auto own_alt = FrozenOnDeviceAlternative(equal, 1, costs, own.step_seconds);
  ASSERT_TRUE(own_alt.has_value());
  EXPECT_EQ(own_alt->plan.Describe(), plan->Describe());
  // A budget that holds the streaming plan but not the base beside it.
  ASSERT_GT(own_alt->peak_memory_bytes, own.peak_memory_bytes + 0.5 * own_alt->memory.frozen);
  JobConfig tight = equal;
  tight.schedule.gpu_memory_gb = own.peak_memory_bytes / 1e9 + 0.5 * alt->memory.frozen / 1e9;
  EXPECT_FALSE(FrozenOnDeviceAlternative(tight, 1, costs, own.step_seconds).has_value());
  tight.schedule.gpu_memory_gb = own_alt->peak_memory_bytes / 1e9 + 0.01;
  EXPECT_TRUE(FrozenOnDeviceAlternative(tight, 1, costs, own.step_seconds).has_value());
  // Never suggested where it does not apply, nor when it is predicted no faster.
  JobConfig cpu = c, kept = c, full = c;
  cpu.job.device = DeviceKind::kCpu;
  kept.schedule.frozen_on_device = true;
  full.lora.rank = 0;
  EXPECT_FALSE(FrozenOnDeviceAlternative(cpu, 1, costs, current->step_seconds).has_value());
  EXPECT_FALSE(FrozenOnDeviceAlternative(kept, 1, costs, current->step_seconds).has_value());
  EXPECT_FALSE(FrozenOnDeviceAlternative(full, 1, costs, current->step_seconds).has_value());
  EXPECT_FALSE(FrozenOnDeviceAlternative(c, 1, costs, alt->step_seconds).has_value());
}

// train.mlp_tile_tokens: a backward stage's blocks keep no MLP intermediates and no normed
// sequence (each tile is recomputed from the residual stream in the backward), and the block
// being computed holds three intermediate-sized tensors over one tile instead of one over the
// microbatch; nothing else of the estimate changes.
TEST(Partitioner, MemoryEstimateOfTiledBlocksKeepsNoMlpIntermediates) {
  JobConfig c =
      OneStageOfEachKind(24);  // B[0,24): the embedding and 23 blocks, the peak tiled or not
  c.data.seq_len = 4096;
  auto plan = BuildPlan(c);
  ASSERT_TRUE(plan.ok());
  ASSERT_EQ(plan->Describe(), "F[0,24) T[24,26) B[0,24)");
  JobConfig tiled = c;
  tiled.train.mlp_tile_tokens = 1000;
  const MemoryEstimate whole = EstimateMemory(c, *plan, 1), part = EstimateMemory(tiled, *plan, 1);
  ASSERT_EQ(plan->stages[whole.stage].Describe(), "B[0,24)");
  ASSERT_EQ(part.stage, whole.stage);
  const double tokens = static_cast<double>(c.TokensPerMicrobatch());
  const double H = static_cast<double>(c.model.hidden_size);
  const double I = static_cast<double>(c.model.intermediate_size);
  const double saved = (23.0 * tokens * (H + 3.0 * I) + (tokens - 3.0 * 1000.0) * I) * 4.0;
  EXPECT_NEAR(whole.activations - part.activations, saved, 1e-6 * saved);
  EXPECT_DOUBLE_EQ(whole.weights, part.weights);
  EXPECT_DOUBLE_EQ(whole.gradients, part.gradients);
}

// train.mlp_tile_tokens = -1: the largest tile (untiled first, then halving powers of two) whose
// plan's estimate fits schedule.gpu_memory_gb; too little memory for any tile is an error naming
// the key; any other value stays.
TEST(Partitioner, AutoMlpTileIsTheLargestThatFits) {
  JobConfig c = OneStageOfEachKind(24);
  c.data.seq_len = 4096;
  const int64_t tokens = c.TokensPerMicrobatch();
  int64_t half = 1;
  while (half * 2 < tokens) half *= 2;  // the largest tile tried
  auto estimate = [&](int64_t tile) {
    JobConfig t = c;
    t.train.mlp_tile_tokens = tile;
    auto plan = BuildPlan(t);
    auto costs = PlanningProfile(t);
    EXPECT_TRUE(plan.ok() && costs.ok());
    return PredictPlan(t, *plan, *costs, 1).peak_memory_bytes;
  };
  const double untiled = estimate(0), big = estimate(half), mid = estimate(half / 2),
               t512 = estimate(512);
  ASSERT_GT(untiled, big);
  ASSERT_GT(big, mid);
  ASSERT_GT(mid, t512);
  auto resolve = [&](JobConfig t, double limit_bytes) {
    t.train.mlp_tile_tokens = kMlpTileAuto;
    t.schedule.gpu_memory_gb = limit_bytes / 1e9;
    Status s = ResolveMlpTile(&t, 1);
    return std::make_pair(s, t);
  };
  EXPECT_EQ(resolve(c, untiled * 1.001).second.train.mlp_tile_tokens, 0);
  EXPECT_EQ(resolve(c, untiled * 0.999).second.train.mlp_tile_tokens, half);
  EXPECT_EQ(resolve(c, (big + mid) / 2).second.train.mlp_tile_tokens, half / 2);
  // Between every two neighbouring tiles' estimates, the smaller tile: what a scan from untiled
  // down chooses, found by bisection.
  for (int64_t t = half / 2; t >= 512; t /= 2) {
    const double just_fits = (estimate(t) + estimate(t * 2)) / 2;
    ASSERT_LT(just_fits, estimate(t * 2)) << t;
    EXPECT_EQ(resolve(c, just_fits).second.train.mlp_tile_tokens, t);
  }
  EXPECT_EQ(resolve(c, (t512 + estimate(1024)) / 2).second.train.mlp_tile_tokens, 512);
  auto none = resolve(c, t512 * 0.999);
  ASSERT_FALSE(none.first.ok());
  EXPECT_NE(none.first.message().find("train.mlp_tile_tokens = -1"), std::string::npos)
      << none.first.message();
  EXPECT_EQ(none.second.train.mlp_tile_tokens, kMlpTileAuto);
  // partition = "auto": the planner's search decides what fits, with the tile it gets; the tile
  // chosen fits and the next larger one (or untiled) does not.
  JobConfig a = c;
  a.schedule.partition = Partition::kAuto;
  // The least memory an untiled plan of the search needs (bisection), then limits below it.
  double lo = 0.0, hi = untiled * 2.0;
  for (int i = 0; i < 14; ++i) {
    JobConfig t = a;
    t.schedule.gpu_memory_gb = (lo + hi) / 2.0 / 1e9;
    (ChoosePlan(t, 1).ok() ? hi : lo) = (lo + hi) / 2.0;
  }
  int tiled = 0;
  for (double limit : {hi * 0.98, hi * 0.9, hi * 0.8, hi * 0.7}) {
    auto [s, r] = resolve(a, limit);
    if (!s.ok()) continue;
    const int64_t tile = r.train.mlp_tile_tokens;
    auto choice = ChoosePlan(r, 1);
    ASSERT_TRUE(choice.ok()) << choice.status().message();
    EXPECT_LE(choice->peak_memory_bytes, limit);
    if (tile == 0) continue;
    ++tiled;
    // The bisection's answer is the first fit of a scan from untiled down: no larger tile fits.
    for (int64_t t = tile * 2;; t *= 2) {
      JobConfig larger = r;
      larger.train.mlp_tile_tokens = t >= tokens ? 0 : t;
      EXPECT_FALSE(ChoosePlan(larger, 1).ok())
          << "a larger tile than " << tile << " fits " << limit << ": " << t;
      if (t >= tokens) break;
    }
  }
  EXPECT_GT(tiled, 0) << "no limit made the planner's search tile the MLPs";
  // A measured profile does not change the choice: its saved bytes were measured at one tile, and
  // a resumed run (which plans from its stored profile) must choose what its first start did.
  Profile measured = DefaultCostModel(c);
  for (auto& layer : measured.layers) layer.saved_bytes = 1.0;
  measured.source = "measured";
  const std::string path = ::testing::TempDir() + "/rp-auto-tile-profile.json";
  ASSERT_TRUE(SaveProfile(path, measured).ok());
  JobConfig profiled = c;
  profiled.schedule.profile = path;
  for (double limit : {untiled * 0.999, (big + mid) / 2}) {
    auto [s, r] = resolve(profiled, limit);
    ASSERT_TRUE(s.ok()) << s.message();
    EXPECT_EQ(r.train.mlp_tile_tokens, resolve(c, limit).second.train.mlp_tile_tokens) << limit;
  }
  std::remove(path.c_str());
  JobConfig fixed = c;
  fixed.train.mlp_tile_tokens = 777;
  ASSERT_TRUE(ResolveMlpTile(&fixed, 1).ok());
  EXPECT_EQ(fixed.train.mlp_tile_tokens, 777);
}

TEST(Partitioner, KeptBlocksAreCountedAndChosenToFitTheBudget) {
  JobConfig c = OneStageOfEachKind(12);  // F[0,12) T[12,14) B[0,12): 11 blocks before the tail
  c.job.device = DeviceKind::kCuda;
  c.data.seq_len = 1024;
  auto estimate = [&](int64_t kept) {
    JobConfig t = c;
    t.schedule.kept_blocks = kept;
    auto plan = BuildPlan(t);
    EXPECT_TRUE(plan.ok());
    return EstimateMemory(t, *plan, 1);
  };
  // Kept blocks: every microbatch's graph of each, its weights and sums, on top of the rest;
  // the backward stage fetches, recomputes and sums only the layers below them, so it holds
  // less than before.
  const MemoryEstimate none = estimate(0), three = estimate(3), four = estimate(4);
  EXPECT_EQ(none.kept, 0.0);
  EXPECT_GT(three.kept, 0.0);
  EXPECT_NEAR(four.kept / three.kept, 4.0 / 3.0, 1e-9);
  EXPECT_GT(three.total, none.total);
  EXPECT_LE(three.total - none.total, three.kept);
  {
    JobConfig t = c;
    t.schedule.kept_blocks = 3;
    auto plan = BuildPlan(t);
    ASSERT_TRUE(plan.ok());
    EXPECT_EQ(plan->kept_start, 9);
    EXPECT_TRUE(plan->KeepsGraph(9) && plan->KeepsGraph(11));
    EXPECT_FALSE(plan->KeepsGraph(8) || plan->KeepsGraph(12));
    const Profile profile = DefaultCostModel(t);
    EXPECT_LT(PredictPlan(t, *plan, profile, 1).step_seconds,
              PredictPlan(c, *BuildPlan(c), profile, 1).step_seconds);
  }
  // -1: the most that fit the budget, found by bisection: between the estimates of k and k + 1
  // kept blocks it chooses k; with several workers none.
  auto resolve = [&](double limit, int workers) {
    JobConfig t = c;
    t.schedule.kept_blocks = kKeptBlocksAuto;
    t.schedule.gpu_memory_gb = limit / 1e9;
    EXPECT_TRUE(ResolveKeptBlocks(&t, workers).ok());
    return t.schedule.kept_blocks;
  };
  for (int64_t k = 0; k < 11; ++k)
    EXPECT_EQ(resolve((estimate(k).total + estimate(k + 1).total) / 2, 1), k) << k;
  EXPECT_EQ(resolve(estimate(11).total * 1.01, 1), 11);
  EXPECT_EQ(resolve(estimate(11).total * 1.01, 2), 0);
  JobConfig fixed = c;
  fixed.schedule.kept_blocks = 5;
  ASSERT_TRUE(ResolveKeptBlocks(&fixed, 2).ok());
  EXPECT_EQ(fixed.schedule.kept_blocks, 5);  // refused later, by the launcher, naming the key
}

// schedule.keep_attention: the blocks just below the kept blocks keep their attention records;
// the estimate counts a record per block and microbatch, the simulated step loses the attention's
// share of each such block's recompute, and -1 chooses the most blocks that fit the budget (none
// with several workers).
TEST(Partitioner, KeptAttentionIsCountedAndChosenToFitTheBudget) {
  JobConfig c = OneStageOfEachKind(12);  // F[0,12) T[12,14) B[0,12): 11 blocks before the tail
  c.job.device = DeviceKind::kCuda;
  c.data.seq_len = 8192;
  c.schedule.kept_blocks = 2;  // blocks 10 and 11
  auto with = [&](int64_t keep) {
    JobConfig t = c;
    t.schedule.keep_attention = keep;
    return t;
  };
  auto estimate = [&](int64_t keep) {
    const JobConfig t = with(keep);
    return EstimateMemory(t, *BuildPlan(t), 1);
  };
  {
    const JobConfig t = with(3);
    auto plan = BuildPlan(t);
    ASSERT_TRUE(plan.ok());
    EXPECT_EQ(KeptAttentionStart(t, *plan), 7);
    EXPECT_TRUE(KeepsAttention(t, *plan, 7) && KeepsAttention(t, *plan, 9));
    EXPECT_FALSE(KeepsAttention(t, *plan, 6) || KeepsAttention(t, *plan, 10));
    EXPECT_EQ(KeptAttentionStart(with(100), *plan), 1);  // more than there are: every block
  }
  const double elem = static_cast<double>(ComputeElemBytes(c));
  const double record = static_cast<double>(c.TokensPerMicrobatch() * c.model.num_heads) *
                        (static_cast<double>(c.model.head_dim) * elem + 4.0) *
                        static_cast<double>(Round(c).microbatches);
  EXPECT_EQ(estimate(0).kept_attention, 0.0);
  EXPECT_DOUBLE_EQ(estimate(3).kept_attention, 3 * record);
  EXPECT_DOUBLE_EQ(estimate(3).total - estimate(0).total, 3 * record);
  const Profile profile = DefaultCostModel(c);
  auto step = [&](int64_t keep) {
    const JobConfig t = with(keep);
    return PredictPlan(t, *BuildPlan(t), profile, 1).step_seconds;
  };
  EXPECT_LT(step(3), step(0));
  EXPECT_LT(step(9), step(3));
  auto resolve = [&](double limit, int workers) {
    JobConfig t = with(kKeepAttentionAuto);
    t.schedule.gpu_memory_gb = limit / 1e9;
    EXPECT_TRUE(ResolveKeptAttention(&t, workers).ok());
    return t.schedule.keep_attention;
  };
  for (int64_t k = 0; k < 9; ++k)
    EXPECT_EQ(resolve((estimate(k).total + estimate(k + 1).total) / 2, 1), k) << k;
  EXPECT_EQ(resolve(estimate(9).total * 1.01, 1), 9);
  EXPECT_EQ(resolve(estimate(9).total * 1.01, 2), 0);
}

// train.mlp_tile_tokens = -1 with schedule.keep_attention = -1: where the largest tile that fits
// (untiled) leaves no room for attention records and the smallest makes room for all of them, the
// largest tile that keeps them all is taken when the records' saved attention forwards outweigh
// the tiles' second MLP forward (a long sequence), and untiled stays where they do not (a wide MLP
// over a short sequence). With a fixed count the tile is the largest that fits.
TEST(Partitioner, AnAutoTileGivesWayToAttentionRecordsOnlyWhenTheStepIsShorter) {
  auto check = [](int64_t seq, int64_t intermediate, bool tile_wins) {
    JobConfig c = OneStageOfEachKind(12);  // F[0,12) T[12,14) B[0,12): 11 recomputed blocks
    c.job.device = DeviceKind::kCuda;
    c.data.seq_len = seq;
    c.model.intermediate_size = intermediate;
    c.schedule.kept_blocks = 0;
    auto with = [&](int64_t tile, int64_t keep) {
      JobConfig t = c;
      t.train.mlp_tile_tokens = tile;
      t.schedule.keep_attention = keep;
      return t;
    };
    // As the resolution sees them: the cost model of each tile, its simulated peak.
    auto predict = [&](int64_t tile, int64_t keep) {
      const JobConfig t = with(tile, keep);
      return PredictPlan(t, *BuildPlan(t), DefaultCostModel(t), 1);
    };
    auto estimate = [&](int64_t tile, int64_t keep) {
      return predict(tile, keep).peak_memory_bytes;
    };
    auto step = [&](int64_t tile, int64_t keep) { return predict(tile, keep).step_seconds; };
    const double untiled = estimate(0, 0), record = estimate(0, 1) - untiled;
    ASSERT_GT(record, 0.0);
    c.schedule.gpu_memory_gb = (untiled + record / 2) / 1e9;
    const double limit = c.schedule.gpu_memory_gb * 1e9;
    ASSERT_LT(estimate(kSmallestAutoMlpTile, 11), limit);
    JobConfig fixed = with(kMlpTileAuto, 0);
    ASSERT_TRUE(ResolveMlpTile(&fixed, 1).ok());
    EXPECT_EQ(fixed.train.mlp_tile_tokens, 0) << seq;
    JobConfig both = with(kMlpTileAuto, kKeepAttentionAuto);
    ASSERT_TRUE(ResolveMlpTile(&both, 1).ok());
    const int64_t tile = both.train.mlp_tile_tokens;
    if (!tile_wins) {
      EXPECT_EQ(tile, 0) << seq;
      EXPECT_GT(step(kSmallestAutoMlpTile, 11), step(0, 0)) << seq;
      return;
    }
    ASSERT_GT(tile, 0) << seq;
    EXPECT_LT(step(tile, 11), step(0, 0)) << seq;
    ASSERT_TRUE(ResolveKeptAttention(&both, 1).ok());
    EXPECT_EQ(both.schedule.keep_attention, 11) << tile;
    EXPECT_LE(estimate(tile, 11), limit) << tile;
    if (2 * tile < c.TokensPerMicrobatch()) {
      EXPECT_GT(estimate(2 * tile, 11), limit) << tile;
    }
  };
  check(16384, 384, true);
  check(2048, 2048, false);
}

// The cost model charges a tiled MLP's second forward to its block's backward: one MLP forward
// per token, whatever the tile, and nothing to a block's forward.
TEST(Partitioner, TheCostModelChargesATiledMlpsSecondForward) {
  JobConfig c = OneStageOfEachKind(4);
  c.job.device = DeviceKind::kCuda;
  c.data.seq_len = 4096;
  JobConfig tiled = c, smaller = c;
  tiled.train.mlp_tile_tokens = 2048;
  smaller.train.mlp_tile_tokens = 512;
  const double rate = 1e12;
  auto model = [&](const JobConfig& t) { return CostModelProfile(t, rate, 1e10, 1e9); };
  const Profile a = model(c), b = model(tiled), d = model(smaller);
  const double mlp_s = 2.0 * 3.0 * static_cast<double>(c.model.hidden_size) *
                       static_cast<double>(c.model.intermediate_size) *
                       static_cast<double>(c.TokensPerMicrobatch()) / rate;
  for (int l = 1; l <= 4; ++l) {
    EXPECT_DOUBLE_EQ(b.layers[l].forward_s, a.layers[l].forward_s) << l;
    EXPECT_NEAR(b.layers[l].backward_s - a.layers[l].backward_s, mlp_s, 1e-9 * mlp_s) << l;
    EXPECT_DOUBLE_EQ(d.layers[l].backward_s, b.layers[l].backward_s) << l;
  }
  EXPECT_DOUBLE_EQ(b.layers[5].recompute_s, a.layers[5].recompute_s);  // the head
}

TEST(Partitioner, UpdatePassesAreChosenByTheSimulatedStep) {
  // A clipped exact job holds every gradient, so both pass counts apply. With an optimizer far
  // faster than the compute the second passes hide behind the next step and the first pass's
  // earlier start wins; with one far slower the optimizer bounds the step and two passes' extra
  // bytes lose.
  JobConfig c = OneStageOfEachKind(4);
  c.train.grad_clip = 1.0;
  auto choose = [&](double optimizer_params_per_s) {
    JobConfig t = c;
    const Profile costs = CostModelProfile(t, 1e11, 1e10, optimizer_params_per_s);
    auto choice = ResolveUpdatePasses(&t, 1, costs, *BuildPlan(t));
    EXPECT_TRUE(choice.ok()) << choice.status().ToString();
    EXPECT_TRUE(choice->chosen);
    EXPECT_GT(choice->one_pass_step_s, 0.0);
    EXPECT_GT(choice->two_pass_step_s, 0.0);
    EXPECT_EQ(choice->passes, choice->one_pass_step_s < choice->two_pass_step_s ? 1 : 2);
    // Written into the job: the run spec stores it, and the plan reads it from there.
    const ExecutionPlan x = ResolveExecution(t);
    EXPECT_FALSE(x.planner_chooses_update_passes);
    EXPECT_EQ(x.two_pass_updates, choice->passes == 2);
    return choice->passes;
  };
  EXPECT_EQ(choose(1e13), 2);
  EXPECT_EQ(choose(1e4), 1);

  // Where two passes do not apply the choice is one pass, and an explicit 2 is refused naming
  // the key; an explicit 1 stays.
  JobConfig stale = c;
  stale.optimizer.mode = OptimizerMode::kStale1;
  auto one = ResolveUpdatePasses(&stale, 1, DefaultCostModel(stale), *BuildPlan(stale));
  ASSERT_TRUE(one.ok());
  EXPECT_EQ(one->passes, 1);
  EXPECT_EQ(one->one_pass_step_s, 0.0);
  EXPECT_FALSE(ResolveExecution(stale).two_pass_updates);
  JobConfig streamed = OneStageOfEachKind(8);
  streamed.schedule.backward_stages = 6;
  streamed.train.grad_clip = 0.0;  // one call, no clipping: the arena streams
  {
    auto plan = BuildPlan(streamed);
    ASSERT_TRUE(plan.ok());
    auto sizing = SizeGradArena(streamed, ResolveExecution(streamed),
                                BuildModelSpec(streamed.model, streamed.lora), *plan);
    ASSERT_TRUE(sizing.ok());
    ASSERT_LT(sizing->chosen, sizing->all_slots);
  }
  streamed.optimizer.update_passes = int64_t{2};
  auto refused =
      ResolveUpdatePasses(&streamed, 1, DefaultCostModel(streamed), *BuildPlan(streamed));
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("optimizer.update_passes = 2"), std::string::npos)
      << refused.status().message();
  streamed.optimizer.update_passes = kUpdatePassesAuto;
  auto auto_streamed =
      ResolveUpdatePasses(&streamed, 1, DefaultCostModel(streamed), *BuildPlan(streamed));
  ASSERT_TRUE(auto_streamed.ok());
  EXPECT_EQ(auto_streamed->passes, 1);
  JobConfig fixed = c;
  fixed.optimizer.update_passes = int64_t{1};
  auto kept =
      ResolveUpdatePasses(&fixed, 1, CostModelProfile(fixed, 1e11, 1e10, 1e13), *BuildPlan(fixed));
  ASSERT_TRUE(kept.ok());
  EXPECT_FALSE(kept->chosen);
  EXPECT_EQ(kept->passes, 1);
  EXPECT_FALSE(ResolveExecution(fixed).two_pass_updates);
}

TEST(Partitioner, KeptBlocksNeverReachAMixtureOfExpertsBlock) {
  // Blocks 0-5 sparse, 6-11 dense (mlp_only_layers): the job's 1-block tail leaves 5 dense
  // blocks under it, but the auto planner's probes try longer tails, which move the kept range
  // down onto sparse blocks. The plan stops the range above the last sparse one.
  JobConfig c = OneStageOfEachKind(12);
  c.model.moe.num_experts = 4;
  c.model.moe.experts_per_token = 2;
  c.model.moe.expert_intermediate_size = 16;
  c.model.moe.dense_layers = {6, 7, 8, 9, 10, 11};
  c.schedule.kept_blocks = 5;
  for (int tail : {1, 3, 6, 9}) {
    JobConfig t = c;
    t.schedule.tail_blocks = tail;
    auto plan = BuildPlan(t);
    ASSERT_TRUE(plan.ok()) << tail;
    for (int l = 1; l < plan->tail_start; ++l)
      EXPECT_FALSE(plan->KeepsGraph(l) && SparseBlock(t.model, l - 1))
          << "tail " << tail << ", layer " << l;
    // Layer 7 is the first dense block (block 6); a tail reaching below it keeps none.
    EXPECT_EQ(plan->kept_start, std::min(plan->tail_start, std::max(7, plan->tail_start - 5)))
        << tail;
  }
}

TEST(Partitioner, LayerRecomputeKeepsBlockInputsAndOneBlocksGraph) {
  JobConfig c = OneStageOfEachKind(24);  // B[0,24): the embedding and 23 blocks
  c.data.seq_len = 4096;
  auto plan = BuildPlan(c);
  ASSERT_TRUE(plan.ok());
  JobConfig layers = c;
  layers.train.layer_recompute = true;
  const MemoryEstimate whole = EstimateMemory(c, *plan, 1), one = EstimateMemory(layers, *plan, 1);
  ASSERT_EQ(plan->stages[whole.stage].Describe(), "B[0,24)");
  // B[0,24) keeps 23 blocks' graphs (23 x per block) without it; with it 23 hidden-sized inputs and
  // one block's graph, less than the tail's one block plus the head's loss chunk, now the peak.
  const double tokens = static_cast<double>(c.TokensPerMicrobatch()),
               H = static_cast<double>(c.model.hidden_size);
  const double per_block = whole.activations / 23.0;
  EXPECT_EQ(plan->stages[one.stage].Describe(), "T[24,26)");
  EXPECT_GT(one.activations, 23.0 * tokens * H * 4.0 + per_block);
  EXPECT_LT(one.activations, whole.activations / 4.0);
  EXPECT_LT(one.total, whole.total);
  // One more forward per block of every gradient stage in the predicted step.
  const Profile profile = DefaultCostModel(c);
  const double plain = PredictPlan(c, *plan, profile, 1).step_seconds;
  const double rebuilt = PredictPlan(layers, *plan, profile, 1).step_seconds;
  EXPECT_GT(rebuilt, plain);
}

// A measured profile records what each block's graph keeps; the block being backpropagated also
// holds its working set (about six hidden-sized tensors per token and one intermediate-sized,
// three over one tile with tiled MLPs), which the estimate adds to the measured bytes as it does to
// the cost model's kept bytes. So a profile that measured exactly what the cost model assumes a
// block keeps gives the cost model's estimate, tiled or not, and measured bytes are never the
// whole of a gradient stage's activations.
TEST(Partitioner, MeasuredSavedBytesGetTheWorkingSetOfTheBlockBeingComputed) {
  for (int64_t tile : {int64_t{0}, int64_t{1000}}) {
    JobConfig c = OneStageOfEachKind(24);  // B[0,24): 23 blocks, the peak
    c.job.device = DeviceKind::kCuda;      // no explicit attention scores
    c.data.seq_len = 4096;
    c.train.mlp_tile_tokens = tile;
    auto plan = BuildPlan(c);
    ASSERT_TRUE(plan.ok());
    const MemoryEstimate model = EstimateMemory(c, *plan, 1);
    ASSERT_EQ(plan->stages[model.stage].Describe(), "B[0,24)") << tile;
    const double tokens = static_cast<double>(c.TokensPerMicrobatch()),
                 H = static_cast<double>(c.model.hidden_size),
                 I = static_cast<double>(c.model.intermediate_size), elem = 4.0;
    const double kept = tokens * (tile > 0 ? 7.5 * H : 8.5 * H + 3.0 * I) * elem;
    const double working =
        (6.0 * tokens * H + (tile > 0 ? 3.0 * static_cast<double>(tile) : tokens) * I) * elem;
    EXPECT_NEAR(model.activations, 23.0 * kept + working, 1e-9 * model.activations) << tile;
    Profile measured = DefaultCostModel(c);
    measured.source = "measured";
    for (auto& layer : measured.layers) layer.saved_bytes = kept;
    const MemoryEstimate same = EstimateMemory(c, *plan, 1, &measured);
    EXPECT_EQ(same.stage, model.stage) << tile;
    EXPECT_NEAR(same.total, model.total, 1e-9 * model.total) << tile;
    // Graphs that keep half as much: the stage counts what they keep plus the working set.
    for (auto& layer : measured.layers) layer.saved_bytes = kept / 2.0;
    const MemoryEstimate half = EstimateMemory(c, *plan, 1, &measured);
    ASSERT_EQ(plan->stages[half.stage].Describe(), "B[0,24)") << tile;
    EXPECT_NEAR(half.activations, 23.0 * kept / 2.0 + working, 1e-9 * half.activations) << tile;
  }
}

// A model with dense and sparse blocks: each part of the per-block figure is the larger of the
// two kinds', so tiling the dense MLPs lowers the estimate when the dense block is the larger,
// and never below what the sparse blocks alone need.
TEST(Partitioner, MixedDenseAndSparseBlocksTakeTheLargerOfEachPart) {
  JobConfig c = OneStageOfEachKind(24);
  c.job.device = DeviceKind::kCuda;
  c.data.seq_len = 4096;
  c.model.moe.num_experts = 4;
  c.model.moe.experts_per_token = 1;
  c.model.moe.expert_intermediate_size = 16;  // a sparse block far below the dense one
  c.model.moe.sparse_step = 2;                // blocks 1, 3, 5, ... sparse
  auto plan = BuildPlan(c);
  ASSERT_TRUE(plan.ok());
  JobConfig tiled = c;
  tiled.train.mlp_tile_tokens = 512;
  const MemoryEstimate whole = EstimateMemory(c, *plan, 1), part = EstimateMemory(tiled, *plan, 1);
  EXPECT_LT(part.total, whole.total);
  // All-sparse with the same experts: tiling changes nothing (sparse blocks are never tiled).
  JobConfig all_sparse = c;
  all_sparse.model.moe.sparse_step = 1;
  JobConfig all_sparse_tiled = all_sparse;
  all_sparse_tiled.train.mlp_tile_tokens = 512;
  EXPECT_DOUBLE_EQ(EstimateMemory(all_sparse, *plan, 1).total,
                   EstimateMemory(all_sparse_tiled, *plan, 1).total);
  EXPECT_GE(part.activations, EstimateMemory(all_sparse, *plan, 1).activations);
}

TEST(Partitioner, MemoryEstimateCountsGradientsWaitingInTheWorkersForTheNorm) {
  JobConfig c = OneStageOfEachKind(24);  // F[0,24) T[24,26) B[0,24): two gradient jobs
  c.model.tie_embeddings = false;
  c.train.accum_calls = 1;
  auto plan = BuildPlan(c);
  ASSERT_TRUE(plan.ok());
  JobConfig held = c;
  held.optimizer.gradients_wait_in = core::GradientsWait::kWorkers;
  const MemoryEstimate host = EstimateMemory(c, *plan, 1), workers = EstimateMemory(held, *plan, 1);
  EXPECT_EQ(host.held_gradients, 0.0);
  // One worker runs both gradient jobs: at the peak job it still holds the other's fp32 sums.
  const core::ModelSpec spec = core::BuildModelSpec(c.model, c.lora);
  const double all = 4.0 * static_cast<double>(spec.TrainableParams());
  ASSERT_EQ(workers.stage, host.stage);
  EXPECT_GT(workers.held_gradients, 0.0);
  EXPECT_LT(workers.held_gradients, all);
  EXPECT_DOUBLE_EQ(workers.total - host.total, workers.held_gradients);
  // Two workers split the jobs: the busiest holds only what its own other jobs keep.
  EXPECT_LT(EstimateMemory(held, *plan, 2).held_gradients, workers.held_gradients);
}

// stale1 with clipping: a step's first commits wait for the whole previous update, which starts
// after the previous step's norm, so a worker holds the sums of the gradient jobs it ran earlier
// in the step. Counted at the job they are held during, once with the gradients the simulator
// has waiting for slots (the same tensors); not in exact mode, not without clipping (the update
// then streams with the commits), not on a worker that ran no gradient job before.
TEST(Partitioner, MemoryEstimateCountsStale1GradientsWaitingForThePreviousUpdate) {
  JobConfig c = OneStageOfEachKind(24);  // F[0,24) T[24,26) B[0,24): the tail's job runs first
  c.model.tie_embeddings = false;
  c.train.accum_calls = 1;
  c.train.grad_clip = 1.0;
  auto plan = BuildPlan(c);
  ASSERT_TRUE(plan.ok());
  JobConfig stale = c;
  stale.optimizer.mode = OptimizerMode::kStale1;
  const MemoryEstimate exact = EstimateMemory(c, *plan, 1), m = EstimateMemory(stale, *plan, 1);
  EXPECT_EQ(exact.held_gradients, 0.0);
  ASSERT_EQ(plan->stages[m.stage].Describe(), "B[0,24)");
  const core::ModelSpec spec = core::BuildModelSpec(c.model, c.lora);
  double tail_sums = 0.0;
  for (int l = 24; l < 26; ++l)
    for (const auto& use : spec.layer_uses[l])
      tail_sums += 4.0 * static_cast<double>(spec.params[use.param].numel);
  EXPECT_DOUBLE_EQ(m.held_gradients, tail_sums);
  MemoryEstimate copy = m;
  EXPECT_DOUBLE_EQ(PeakMemory(stale, &copy, 0.5 * tail_sums), m.total);
  copy = m;
  EXPECT_DOUBLE_EQ(PeakMemory(stale, &copy, 2.0 * tail_sums), m.total + tail_sums);
  JobConfig unclipped = stale;
  unclipped.train.grad_clip = 0.0;
  EXPECT_EQ(EstimateMemory(unclipped, *plan, 1).held_gradients, 0.0);
  // Two workers: the tail's job runs on the other one.
  EXPECT_EQ(EstimateMemory(stale, *plan, 2).held_gradients, 0.0);
}

TEST(Partitioner, HeldGradientsKeptGraphsAndDeviceUpdatesAreCountedWhenTheyAreOnTheDeviceTogether) {
  // Gradients waiting in the workers, blocks kept before the tail, device-updated first blocks:
  // the kept graphs are whole only until the backward stages after the tail, the held gradients
  // complete and the covered blocks' state arrives at the backward's end.
  JobConfig c = OneStageOfEachKind(12);  // F[0,12) T[12,14) B[0,12)
  c.job.device = DeviceKind::kCuda;
  c.model.tie_embeddings = false;
  c.train.accum_calls = 1;
  c.train.grad_clip = 1.0;
  c.optimizer.gradients_wait_in = core::GradientsWait::kWorkers;
  c.schedule.kept_blocks = 4;  // blocks 7..10 (the tail starts at 12 with one block)
  c.schedule.backward_cuts = {3, 7};
  auto plan = BuildPlan(c);
  ASSERT_TRUE(plan.ok());
  MemoryEstimate m = EstimateMemory(c, *plan, 1);
  ASSERT_GT(m.kept, 0.0);
  ASSERT_GT(m.held_gradients, 0.0);
  ASSERT_TRUE(m.kept_apart);
  ASSERT_GT(m.held_with_kept, 0.0);
  EXPECT_LT(m.held_with_kept, m.held_gradients);
  const double common =
      m.weights + m.next_weights + m.gradients + m.activations + m.resident + m.staging + m.frozen;
  EXPECT_DOUBLE_EQ(m.total, common + std::max(m.kept + m.held_with_kept, m.held_gradients));
  EXPECT_DOUBLE_EQ(m.total + m.not_at_once, common + m.kept + m.held_gradients);
  // The simulator's gradients waiting for slots are the held ones again: counted once, the larger.
  const double simulated = 1.5 * m.held_gradients;
  EXPECT_DOUBLE_EQ(PeakMemory(c, &m, simulated),
                   common + std::max(m.kept + m.held_with_kept, simulated));
  EXPECT_DOUBLE_EQ(PeakMemory(c, &m, 0.5 * m.held_gradients), m.total);

  // Blocks 1..3 updated on the device: their state (12 bytes per parameter; their gradients are
  // among the held ones) at the backward's end, their weights at both ends, and their fp32
  // gradients of the previous step (committed last) while the kept graphs fill.
  JobConfig u = c;
  u.optimizer.device_update_blocks = 3;
  MemoryEstimate d = EstimateMemory(u, *plan, 1);
  const core::ModelSpec spec = core::BuildModelSpec(u.model, u.lora);
  double covered = 0.0;
  for (const auto& p : spec.params)
    if (ResolveExecution(u).DeviceUpdatesLayer(p.owner_layer))
      covered += static_cast<double>(p.numel);
  ASSERT_GT(covered, 0.0);
  const double elem = static_cast<double>(core::ComputeElemBytes(u));
  EXPECT_DOUBLE_EQ(d.device_update, covered * (12.0 + elem));
  EXPECT_DOUBLE_EQ(d.device_update_weights, covered * elem);
  EXPECT_DOUBLE_EQ(d.held_with_kept, m.held_with_kept);
  EXPECT_DOUBLE_EQ(d.covered_waiting, covered * 4.0);
  const double forward_end =
      d.kept + d.held_with_kept + d.covered_waiting + d.device_update_weights;
  // Here the forward's end is the peak, the previous step's covered gradients in it.
  ASSERT_GT(forward_end, d.held_gradients + d.device_update);
  EXPECT_DOUBLE_EQ(d.total, common + forward_end);
  // A covered block that is also kept: no order to rely on, everything at once.
  JobConfig overlap = u;
  overlap.optimizer.device_update_blocks = 8;
  MemoryEstimate o = EstimateMemory(overlap, *plan, 1);
  EXPECT_FALSE(o.kept_apart);
  EXPECT_DOUBLE_EQ(o.not_at_once, 0.0);
  // Gradients waiting on the host: the parts add up, as before.
  JobConfig host = c;
  host.optimizer.gradients_wait_in = core::GradientsWait::kHost;
  MemoryEstimate h = EstimateMemory(host, *plan, 1);
  EXPECT_DOUBLE_EQ(h.not_at_once, 0.0);
  EXPECT_DOUBLE_EQ(PeakMemory(host, &h, 1e9), h.total + 1e9);
}

TEST(Partitioner, MemoryEstimatePairsAJobWithTheWeightsItsWorkerPrefetchesNext) {
  // F[0,6) T[6,8) B[0,6), one call per step, one worker: while B runs, its worker's next job is
  // the next step's F. In exact mode with clipping F's weights wait for this step's update, which
  // needs B's gradients committed, so they are not on the device while B computes; without
  // clipping they may be. B (with the embedding's gradient) is the worst stage here.
  JobConfig c = OneStageOfEachKind(6);
  c.train.accum_calls = 1;
  c.data.seq_len = 4096;  // the blocks' activations (CPU attention scores among them) above the
                          // head's loss chunk
  auto plan = BuildPlan(c);
  ASSERT_TRUE(plan.ok());
  ASSERT_EQ(plan->Describe(), "F[0,6) T[6,8) B[0,6)");
  ASSERT_EQ(ResolveExecution(c).weight_version_lag, 0);  // exact mode
  ASSERT_GT(c.train.grad_clip, 0.0);
  JobConfig unclipped = c;
  unclipped.train.grad_clip = 0.0;
  const double clipped = EstimatePeakMemory(c, *plan, 1);
  EXPECT_LT(clipped, EstimatePeakMemory(unclipped, *plan, 1));
  // The parts rp-plan prints: the peak is B's job, with nothing prefetched in exact mode and F's
  // weights without clipping; they add up to the total.
  const MemoryEstimate m = EstimateMemory(c, *plan, 1), u = EstimateMemory(unclipped, *plan, 1);
  ASSERT_GE(m.stage, 0);
  EXPECT_EQ(plan->stages[m.stage].Describe(), "B[0,6)");
  EXPECT_EQ(m.next_weights, 0.0);
  EXPECT_NEAR(m.weights + m.next_weights + m.gradients + m.activations + m.resident + m.staging,
              clipped, 1e-9 * clipped);
  EXPECT_EQ(plan->stages[u.stage].Describe(), "B[0,6)");
  EXPECT_GT(u.next_weights, 0.0);
  EXPECT_DOUBLE_EQ(u.total - m.total, u.next_weights);
  // Two calls per step, interleaved (exact mode's order: F c0, F c1, T c0, B c0, T c1, B c1):
  // the first call's B is followed by the second call's T, same step, so paired with T's
  // weights; in the plain order (F c0, T c0, B c0, F c1, ...) with the second call's F, whose
  // weights are those the one-call run pairs without clipping.
  JobConfig two_calls = c;
  two_calls.train.accum_calls = 2;
  two_calls.bench.merge_calls = Tristate::kNever;  // two calls run as two rounds
  const MemoryEstimate interleaved = EstimateMemory(two_calls, *plan, 1);
  EXPECT_EQ(plan->stages[interleaved.stage].Describe(), "B[0,6)");
  EXPECT_GT(interleaved.next_weights, 0.0);
  EXPECT_NE(interleaved.next_weights, u.next_weights);
  two_calls.bench.interleave_calls = false;
  EXPECT_DOUBLE_EQ(EstimateMemory(two_calls, *plan, 1).next_weights, u.next_weights);
  // CUDA workers with the fused kernels sum the projections' weight gradients into fp32 sinks:
  // no per-microbatch gradient in the compute dtype for those.
  JobConfig cuda = c;
  cuda.job.device = core::DeviceKind::kCuda;
  JobConfig unfused = cuda;
  unfused.bench.fused_kernels = false;
  const ModelSpec spec = BuildModelSpec(c.model);
  double sinkable = 0.0;
  for (int l = 0; l < 6; ++l)
    for (const auto& use : spec.layer_uses[l])
      if (SinkableRole(use.role)) sinkable += static_cast<double>(spec.params[use.param].numel);
  const MemoryEstimate fused = EstimateMemory(cuda, *plan, 1),
                       plain = EstimateMemory(unfused, *plan, 1);
  ASSERT_EQ(plan->stages[fused.stage].Describe(), "B[0,6)");
  ASSERT_EQ(plan->stages[plain.stage].Describe(), "B[0,6)");
  EXPECT_GT(sinkable, 0.0);
  EXPECT_DOUBLE_EQ(plain.gradients - fused.gradients,
                   sinkable * (c.train.dtype == core::TrainDtype::kBf16 ? 2.0 : 4.0));
  // Three workers: every job's next job on its worker is the same stage of the next step, so
  // with clipping only F, which may run layer-major and then reserves its next job's weights,
  // is paired; B, the worst, is not.
  const MemoryEstimate three = EstimateMemory(c, *plan, 3);
  EXPECT_EQ(plan->stages[three.stage].Describe(), "B[0,6)");
  EXPECT_EQ(three.next_weights, 0.0);
  EXPECT_LT(three.total, EstimatePeakMemory(unclipped, *plan, 3));
}

TEST(Partitioner, RespectsTheMemoryLimit) {
  JobConfig c = Small(6);
  c.train.microbatch_size = 8;
  c.data.seq_len = 512;
  auto free_choice = ChoosePlan(c, 2);
  ASSERT_TRUE(free_choice.ok());
  c.schedule.gpu_memory_gb = free_choice->peak_memory_bytes / 1e9 * 0.6;
  auto limited = ChoosePlan(c, 2);
  if (limited.ok()) {
    EXPECT_LE(limited->peak_memory_bytes, c.schedule.gpu_memory_gb * 1e9);
    EXPECT_LE(EstimatePeakMemory(c, limited->plan, 2), c.schedule.gpu_memory_gb * 1e9);
  }
  c.schedule.gpu_memory_gb = 1e-6;
  auto impossible = ChoosePlan(c, 2);
  ASSERT_FALSE(impossible.ok());
  EXPECT_EQ(impossible.status().message().rfind("schedule.gpu_memory_gb", 0), 0u);
}

// Twelve small blocks, one sequence of 16,384 tokens per step on one CUDA worker, planned by
// partition = "auto": long enough that where checkpoints live decides what fits.
JobConfig OneLongSequenceOnCuda() {
  JobConfig c = Small(12);
  c.job.device = DeviceKind::kCuda;
  c.data.seq_len = 16384;
  c.train.microbatches = 1;
  c.train.accum_calls = 1;
  c.train.microbatch_size = 1;
  c.schedule.partition = Partition::kAuto;
  return c;
}

// schedule.host_memory_gb: the fastest plan whose shared memory fits. A backward stage's first
// block keeps its checkpoint in a host slot, so a limit just under the unlimited plan's shared
// memory takes a plan with fewer slots and a step predicted no shorter; a limit under every plan
// is an error naming the key and the smallest plan's bytes; the limit without a count is refused.
// schedule.keep_attention = -1 under a host limit: the records are counted against plans that fit
// the host as well, since a plan with fewer checkpoint slots needs more device memory for its
// working set. Chosen by the device alone, the count can leave no plan that fits both.
TEST(Partitioner, KeptAttentionIsChosenUnderBothMemories) {
  JobConfig c = OneLongSequenceOnCuda();
  const SharedBytesOf shared = shm::SharedBytesFor(1);
  const Profile costs = DefaultCostModel(c);
  // The host limit: just under the shared memory of the plan a tight device budget gets (a
  // backward stage per block, every checkpoint in a host slot).
  JobConfig fine = c;
  fine.schedule.gpu_memory_gb = 0.3;
  auto finest = ChoosePlan(fine, 1, costs, shared);
  ASSERT_TRUE(finest.ok()) << finest.status().message();
  auto finest_bytes = shared(fine, finest->plan);
  ASSERT_TRUE(finest_bytes.ok());
  int fitting = 0, differ = 0;
  for (double gb = 0.3; gb < 0.8; gb += 0.05) {
    JobConfig t = c;
    t.schedule.gpu_memory_gb = gb;
    t.schedule.host_memory_gb = (static_cast<double>(*finest_bytes) - 1.0) / 1e9;
    if (!ChoosePlan(t, 1, costs, shared).ok()) continue;  // nothing fits both even without records
    ++fitting;
    t.schedule.keep_attention = kKeepAttentionAuto;
    JobConfig blind = t;
    ASSERT_TRUE(ResolveKeptAttention(&t, 1, shared).ok());
    ASSERT_TRUE(ResolveKeptAttention(&blind, 1).ok());
    EXPECT_TRUE(ChoosePlan(t, 1, costs, shared).ok())
        << gb << " GB: " << t.schedule.keep_attention << " blocks";
    EXPECT_LE(t.schedule.keep_attention, blind.schedule.keep_attention) << gb;
    differ += !ChoosePlan(blind, 1, costs, shared).ok();
  }
  EXPECT_GT(fitting, 0);
  EXPECT_GT(differ, 0) << "no budget where the device alone chooses too many";
}

// train.mlp_tile_tokens = -1 under a host limit: the tile is chosen against plans that fit the
// host as well. A larger tile that fits the device may do so only with a backward stage per
// block, every checkpoint in a host slot; a smaller one leaves room for plans that keep more
// checkpoints on the device. Chosen by the device alone, the tile can leave no plan that fits
// both.
TEST(Partitioner, AnAutoMlpTileIsChosenUnderBothMemories) {
  JobConfig c = OneLongSequenceOnCuda();
  const SharedBytesOf shared = shm::SharedBytesFor(1);
  auto size = [&](const JobConfig& t) {
    return t.train.mlp_tile_tokens == 0 ? t.TokensPerMicrobatch() : t.train.mlp_tile_tokens;
  };
  int fitting = 0, differ = 0;
  for (double gb : {0.2, 0.3, 0.6}) {
    for (double host_share : {0.5, 0.9}) {
      JobConfig t = c;
      t.schedule.gpu_memory_gb = gb;
      t.train.mlp_tile_tokens = kMlpTileAuto;
      JobConfig blind = t;
      if (!ResolveMlpTile(&blind, 1).ok()) continue;
      const Profile blind_costs = DefaultCostModel(blind);
      auto device_only = ChoosePlan(blind, 1, blind_costs, shared);
      if (!device_only.ok()) continue;
      auto bytes = shared(blind, device_only->plan);
      ASSERT_TRUE(bytes.ok());
      t.schedule.host_memory_gb = blind.schedule.host_memory_gb =
          host_share * static_cast<double>(*bytes) / 1e9;
      if (!ResolveMlpTile(&t, 1, shared).ok()) continue;  // no tile fits both
      ++fitting;
      EXPECT_TRUE(ChoosePlan(t, 1, DefaultCostModel(t), shared).ok()) << gb << " GB";
      EXPECT_LE(size(t), size(blind)) << gb << " GB";
      differ += !ChoosePlan(blind, 1, blind_costs, shared).ok();
    }
  }
  EXPECT_GT(fitting, 0);
  EXPECT_GT(differ, 0) << "no budget where the device alone chooses a tile that fits no host plan";
  // No tile fits the host: the error names the host limit as well as the key.
  JobConfig none = c;
  none.schedule.gpu_memory_gb = 1.0;
  none.schedule.host_memory_gb = 1e-6;
  none.train.mlp_tile_tokens = kMlpTileAuto;
  const Status refused = ResolveMlpTile(&none, 1, shared);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.message().find("train.mlp_tile_tokens"), std::string::npos)
      << refused.message();
  EXPECT_NE(refused.message().find("schedule.host_memory_gb"), std::string::npos)
      << refused.message();
}

TEST(Partitioner, HostMemoryLimitTradesCheckpointSlotsForRecompute) {
  // Two workers: the fastest plan without a limit splits the backward to keep both busy.
  JobConfig c = Small(12);
  c.job.device = DeviceKind::kCuda;
  c.data.seq_len = 16384;
  const int workers = 2;
  const SharedBytesOf shared = shm::SharedBytesFor(workers);
  auto costs = PlanningProfile(c);
  ASSERT_TRUE(costs.ok());
  auto free_choice = ChoosePlan(c, workers, *costs, shared);
  ASSERT_TRUE(free_choice.ok()) << free_choice.status().message();
  auto free_bytes = shared(c, free_choice->plan);
  ASSERT_TRUE(free_bytes.ok());
  const size_t free_slots = free_choice->plan.hidden_boundaries.size();
  ASSERT_GT(free_slots, 1u) << free_choice->plan.Describe();

  JobConfig limited = c;
  limited.schedule.host_memory_gb = (static_cast<double>(*free_bytes) - 1.0) / 1e9;
  auto tight = ChoosePlan(limited, workers, *costs, shared);
  ASSERT_TRUE(tight.ok()) << tight.status().message();
  auto tight_bytes = shared(limited, tight->plan);
  ASSERT_TRUE(tight_bytes.ok());
  EXPECT_LE(static_cast<double>(*tight_bytes), limited.schedule.host_memory_gb * 1e9);
  EXPECT_LT(tight->plan.hidden_boundaries.size(), free_slots)
      << free_choice->plan.Describe() << " -> " << tight->plan.Describe();
  EXPECT_GE(tight->step_seconds, free_choice->step_seconds * (1.0 - 1e-9));
  // MakePlan (what ResolveRun runs) applies the same limit.
  auto made = MakePlan(limited, workers, shared);
  ASSERT_TRUE(made.ok()) << made.status().message();
  EXPECT_EQ(made->Describe(), tight->plan.Describe());

  limited.schedule.host_memory_gb = 1e-6;
  auto none = ChoosePlan(limited, workers, *costs, shared);
  ASSERT_FALSE(none.ok());
  EXPECT_NE(none.status().message().find("schedule.host_memory_gb"), std::string::npos)
      << none.status().message();
  EXPECT_NE(none.status().message().find("the smallest takes"), std::string::npos)
      << none.status().message();
  auto uncounted = ChoosePlan(limited, workers, *costs);
  ASSERT_FALSE(uncounted.ok());
  EXPECT_EQ(uncounted.status().code(), StatusCode::kInternal);
}

}  // namespace
}  // namespace rp::core
