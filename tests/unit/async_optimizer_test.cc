// SPDX-License-Identifier: Apache-2.0
// AsyncOptimizer driven directly, as the coordinator drives it: two steps of gradients given slot
// by slot, the second step's slots placed again as soon as the first step's update gives them
// back (in exact mode that is while its second passes still run, on one rest thread of three).
// The masters and moments must end as the synchronous OptimizerStep (rp-train-ref's) leaves them,
// bit for bit, in exact mode with and without clipping and in stale1, and with the next step's
// rows given ahead (the embedding's rows first, AsyncOptimizer's contract).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "optim/grad_arena.h"
#include "optim/async_optimizer.h"
#include "optim/optimizer_step.h"
#include "config/lr_schedule.h"
#include "planning/partitioner.h"
#include "planning/plan.h"
#include "shm/layout.h"

namespace rp::coord {
namespace {

template <typename Done>
bool WaitFor(Done done) {
  for (int i = 0; i < 20000; ++i) {
    if (done()) return true;
    std::this_thread::sleep_for(std::chrono::microseconds(500));
  }
  return false;
}

// (optimizer.mode, train.grad_clip, train.accum_calls, next step's rows given ahead): K = 2 makes
// the arena hold every slot without clipping, so exact mode runs two passes there too.
class AsyncOptimizerTest
    : public ::testing::TestWithParam<std::tuple<std::string, double, int, bool>> {};

TEST_P(AsyncOptimizerTest, TwoStepsSlotBySlotMatchTheSynchronousStep) {
  const std::string mode = std::get<0>(GetParam());
  const double clip = std::get<1>(GetParam());
  const int accum_calls = std::get<2>(GetParam());
  const bool rows_ahead = std::get<3>(GetParam());
  core::JobConfig cfg;
  cfg.model.num_layers = 3;
  // Rows ahead: a larger table, so the embedding's update splits into several tasks of row runs.
  cfg.model.vocab_size = rows_ahead ? 20000 : 300;
  cfg.train.dtype = core::TrainDtype::kFp32;
  cfg.train.grad_clip = clip;
  cfg.train.accum_calls = accum_calls;
  cfg.bench.merge_calls =
      core::Tristate::kNever;  // K calls run as K rounds, as the test reads them
  cfg.train.steps = 4;
  cfg.optimizer.mode = mode == "exact" ? core::OptimizerMode::kExact : core::OptimizerMode::kStale1;
  cfg.optimizer.weight_decay = 0.1;
  cfg.bench.optimizer_rest_threads = 1;
  const core::ModelSpec spec = core::BuildModelSpec(cfg.model);
  auto plan = core::MakePlan(cfg);
  ASSERT_TRUE(plan.ok()) << plan.status().message();
  auto layout = shm::ComputeLayout(cfg, core::ResolveExecution(cfg), spec, *plan);
  ASSERT_TRUE(layout.ok()) << layout.status().message();
  const shm::ArenaLayout& a = *layout;
  std::vector<uint64_t> state_words(a.total_bytes / 8 + 1, 0),
      optim_words(a.optim_total_bytes / 8 + 1, 0);
  auto* state = reinterpret_cast<uint8_t*>(state_words.data());
  auto* optim = reinterpret_cast<uint8_t*>(optim_words.data());
  auto f32 = [](uint8_t* base, uint64_t off) { return reinterpret_cast<float*>(base + off); };
  uint8_t* master_base = a.masters_in_state ? state : optim;

  // The reference's arrays: the same initial masters, moments at zero.
  std::mt19937 rng(21);
  std::normal_distribution<float> normal;
  const size_t P = spec.params.size();
  std::vector<std::vector<float>> ref_master(P), ref_m(P), ref_v(P), ref_grad(P);
  for (size_t p = 0; p < P; ++p) {
    const int64_t n = spec.params[p].numel;
    float* master = f32(master_base, a.master[p]);
    for (int64_t i = 0; i < n; ++i) master[i] = normal(rng) * 0.1f;
    ref_master[p].assign(master, master + n);
    ref_m[p].assign(n, 0.0f);
    ref_v[p].assign(n, 0.0f);
  }

  std::vector<int64_t> touched;  // the steps' input-token rows
  auto is_touched = [](int64_t row) { return row < 300 && row % 3 == 1; };
  for (int64_t r = 0; r < cfg.model.vocab_size; ++r)
    if (is_touched(r)) touched.push_back(r);
  EXPECT_EQ(a.compact_lookup_slot >= 0, accum_calls == 1);
  EXPECT_EQ(a.lookup_from_host, mode == "exact");
  GradArena arena(a, reinterpret_cast<std::atomic<uint64_t>*>(state + a.grad_table));
  AsyncOptimizer opt(cfg, core::ResolveExecution(cfg), spec, a, state, optim, &arena,
                     /*threads=*/3);
  ASSERT_TRUE(opt.StartAfter(0).ok());
  for (int64_t step = 0; step < 2; ++step) {
    if (step == 1 && mode == "stale1") {
      ASSERT_TRUE(WaitFor([&] { return opt.Updated(0); }));
    }
    for (size_t p = 0; p < P; ++p) ref_grad[p].assign(spec.params[p].numel, 0.0f);
    // Slots in backward order, as the coordinator finalizes them; each placed once its previous
    // step's update has given it back.
    for (int s = static_cast<int>(spec.grad_slots.size()) - 1; s >= 0; --s) {
      ASSERT_TRUE(WaitFor([&] { return !arena.IsPlaced(s); }))
          << "slot " << s << " never came back";
      ASSERT_TRUE(arena.Place({s}));
      const int p = spec.grad_slots[s].param;
      float* g = f32(state, arena.Offset(s));
      // The tied embedding's lookup slot (its owner layer's use): with one call per step it is
      // compact (core::CompactLookupRows), the touched rows packed; else at step 0 it is zero
      // outside the rows given to SetTouchedRows, as the embedding's backward leaves it, so the
      // boundary folds those rows only, and at step 1 it is dense with no rows given: every row
      // is folded.
      const int64_t cols = spec.TiedRowElems(p);
      const bool lookup = cols > 0 && spec.grad_slots[s].layer == spec.params[p].owner_layer;
      if (s == a.compact_lookup_slot) {
        ASSERT_TRUE(lookup);
        ASSERT_LE(touched.size() * cols * 4, a.grad_slot_bytes[s]);
        for (size_t k = 0; k < touched.size(); ++k)
          for (int64_t j = 0; j < cols; ++j) {
            g[k * cols + j] = normal(rng) * 0.5f;
            ref_grad[p][touched[k] * cols + j] += g[k * cols + j];
          }
        continue;
      }
      for (int64_t i = 0; i < spec.params[p].numel; ++i) {
        g[i] = (step == 0 || rows_ahead) && lookup && !is_touched(i / cols) ? 0.0f
                                                                            : normal(rng) * 0.5f;
        ref_grad[p][i] += g[i];  // tied uses fold in slot order: first slot first, here two at most
      }
    }
    // The fold adds later slots into the first; with two uses a + b == b + a, so the reference's
    // sum above (accumulated in reverse slot order) has the same bits.
    if (step == 0 || a.compact_lookup_slot >= 0) opt.SetTouchedRows(step, touched);
    // As the coordinator does with the embedding looked up from host memory: every step reads
    // the same rows here, so the rows given ahead are also the next step's touched rows.
    if (rows_ahead) opt.SetTouchedRows(step + 1, touched);
    // Step 1's updates are held, as a checkpoint's copy holds them (CheckpointWriter): its
    // gradients reach the optimizer, but masters and moments keep step 0's values until released.
    std::vector<uint8_t> optim_before;
    if (step == 1) {
      ASSERT_TRUE(WaitFor([&] { return opt.Updated(0); }));
      opt.HoldUpdatesFrom(1);
      optim_before.assign(optim, optim + a.optim_total_bytes);
    }
    for (int s = static_cast<int>(spec.grad_slots.size()) - 1; s >= 0; --s) opt.SlotFinal(step, s);
    if (step == 1) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      EXPECT_EQ(std::memcmp(optim, optim_before.data(), a.optim_total_bytes), 0)
          << "an update wrote while held";
      EXPECT_FALSE(opt.Published(1));
      opt.ReleaseUpdates();
    }
    // What a worker waits for: every layer's version at step + 1.
    auto* versions = reinterpret_cast<std::atomic<uint64_t>*>(state + a.layer_versions);
    ASSERT_TRUE(WaitFor([&] {
      for (int l = 0; l < spec.NumLayers(); ++l)
        if (versions[l].load() != static_cast<uint64_t>(step + 1)) return false;
      return true;
    })) << "step "
        << step;
    EXPECT_TRUE(opt.Published(step));
    if (a.lookup_from_host) {
      EXPECT_EQ(reinterpret_cast<std::atomic<uint64_t>*>(state + a.lookup_version)->load(),
                static_cast<uint64_t>(step + 1));
    }

    std::vector<ParamArrays> arrays(P);
    for (size_t p = 0; p < P; ++p) {
      arrays[p].master = ref_master[p].data();
      arrays[p].m = ref_m[p].data();
      arrays[p].v = ref_v[p].data();
      arrays[p].grad = ref_grad[p].data();
      arrays[p].compute = ref_master[p].data();
      arrays[p].numel = spec.params[p].numel;
      arrays[p].decay = spec.params[p].weight_decay;
      arrays[p].row_elems = spec.TiedRowElems(static_cast<int>(p));
    }
    const auto r = OptimizerStep(arrays, cfg.optimizer,
                                 core::LearningRate(cfg.optimizer, step, cfg.train.steps), step + 1,
                                 clip, ComputeDtype::kFloat32, 2);
    // The norm is complete before the last layer is published (without clipping too).
    auto norm = opt.GradNorm(step);
    ASSERT_TRUE(norm.has_value()) << "step " << step;
    EXPECT_EQ(*norm, r.grad_norm) << "step " << step;
  }
  ASSERT_TRUE(WaitFor([&] { return opt.Updated(1); }));
  for (size_t p = 0; p < P; ++p) {
    const size_t bytes = spec.params[p].numel * 4;
    EXPECT_EQ(std::memcmp(f32(master_base, a.master[p]), ref_master[p].data(), bytes), 0)
        << spec.params[p].name;
    EXPECT_EQ(std::memcmp(f32(optim, a.adam_m[p]), ref_m[p].data(), bytes), 0)
        << spec.params[p].name;
    EXPECT_EQ(std::memcmp(f32(optim, a.adam_v[p]), ref_v[p].data(), bytes), 0)
        << spec.params[p].name;
  }
  for (size_t s = 0; s < spec.grad_slots.size(); ++s)
    EXPECT_FALSE(arena.IsPlaced(static_cast<int>(s)));
}

INSTANTIATE_TEST_SUITE_P(Modes, AsyncOptimizerTest,
                         ::testing::Values(std::make_tuple(std::string("exact"), 1.0, 1, false),
                                           std::make_tuple(std::string("exact"), 0.0, 2, false),
                                           std::make_tuple(std::string("stale1"), 1.0, 1, false),
                                           std::make_tuple(std::string("exact"), 1.0, 1, true),
                                           std::make_tuple(std::string("exact"), 1.0, 2, true)));

}  // namespace
}  // namespace rp::coord
