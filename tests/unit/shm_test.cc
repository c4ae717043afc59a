// SPDX-License-Identifier: Apache-2.0
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>

#include "planning/partitioner.h"
#include "shm/layout.h"
#include "shm/segment.h"
#include "tests/testing/process_harness.h"

namespace rp::shm {
namespace {

std::string TempShmName() {
  static int n = 0;
  return "rp-test" + std::to_string(::getpid()) + "-" + std::to_string(n++) + "-state";
}

bool InDevShm(const std::string& name) { return std::filesystem::exists("/dev/shm/" + name); }

core::JobConfig SmallConfig() {
  core::JobConfig c;
  c.model.num_layers = 3;
  c.model.vocab_size = 300;
  c.train.dtype = core::TrainDtype::kBf16;
  return c;
}

class LayoutBySource : public ::testing::TestWithParam<core::WeightsSource> {};

TEST_P(LayoutBySource, ArraysAreAlignedDisjointAndInside) {
  auto cfg = SmallConfig();
  cfg.schedule.weights_source = GetParam();
  auto spec = core::BuildModelSpec(cfg.model);
  auto plan = core::MakePlan(cfg);
  ASSERT_TRUE(plan.ok());
  auto layout = ComputeLayout(cfg, core::ResolveExecution(cfg), spec, *plan);
  ASSERT_TRUE(layout.ok()) << layout.status().message();
  const ArenaLayout& a = *layout;
  EXPECT_EQ(a.masters_in_state,
            GetParam() == core::WeightsSource::kAuto);  // exact mode: the masters
  struct Range {
    uint64_t begin, end;
    std::string what;
  };
  std::vector<Range> ranges, optim;
  for (size_t p = 0; p < spec.params.size(); ++p) {
    const uint64_t n = spec.params[p].numel;
    if (a.masters_in_state) {  // the masters are what workers fetch: no compute copy
      EXPECT_EQ(a.master[p], a.compute[p]);
      ranges.push_back({a.compute[p], a.compute[p] + n * 4, "master " + spec.params[p].name});
    } else {
      ranges.push_back({a.compute[p], a.compute[p] + n * 2, "compute " + spec.params[p].name});
      optim.push_back({a.master[p], a.master[p] + n * 4, "master"});
    }
    optim.push_back({a.adam_m[p], a.adam_m[p] + n * 4, "m"});
    optim.push_back({a.adam_v[p], a.adam_v[p] + n * 4, "v"});
    EXPECT_EQ(a.compute[p] % 256, 0u);
    EXPECT_EQ(a.master[p] % 256, 0u);
  }
  ranges.push_back({a.layer_versions,
                    a.layer_versions + 8 * static_cast<uint64_t>(plan->num_layers), "versions"});
  ranges.push_back({a.lookup_version, a.lookup_version + 8, "lookup version"});
  ranges.push_back({a.grad_table, a.grad_table + 8 * spec.grad_slots.size(), "grad table"});
  ranges.push_back({a.grad_arena, a.grad_arena + a.grad_arena_bytes, "grad arena"});
  for (int par = 0; par < a.parities; ++par)
    for (int mb = 0; mb < a.microbatches; ++mb) {
      ranges.push_back(
          {a.TokenSlot(par, mb), a.TokenSlot(par, mb) + a.tokens_per_mb * 8, "tokens"});
      ranges.push_back(
          {a.LabelSlot(par, mb), a.LabelSlot(par, mb) + a.tokens_per_mb * 8, "labels"});
      for (int h = 0; h < a.num_hidden; ++h) {
        EXPECT_EQ(a.HiddenSlot(par, mb, h) % kArenaAlign, 0u);
        ranges.push_back(
            {a.HiddenSlot(par, mb, h), a.HiddenSlot(par, mb, h) + a.act_elems * 2, "hidden"});
      }
      for (int h = 0; h < a.grad_slots_per_mb; ++h)
        ranges.push_back(
            {a.InputGradSlot(par, mb, h), a.InputGradSlot(par, mb, h) + a.act_elems * 2, "igrad"});
    }
  auto check = [](std::vector<Range> r, uint64_t first, uint64_t total) {
    std::sort(r.begin(), r.end(), [](auto& x, auto& y) { return x.begin < y.begin; });
    EXPECT_GE(r.front().begin, first);
    for (size_t i = 1; i < r.size(); ++i)
      EXPECT_LE(r[i - 1].end, r[i].begin) << r[i - 1].what << " overlaps " << r[i].what;
    EXPECT_LE(r.back().end, total);
  };
  check(ranges, kHeaderBytes, a.total_bytes);
  check(optim, 0, a.optim_total_bytes);
  // Tied embeddings: the head's use of the embedding has its own gradient slot.
  EXPECT_EQ(spec.grad_slots.size(), spec.params.size() + 1);
}

INSTANTIATE_TEST_SUITE_P(Sources, LayoutBySource,
                         ::testing::Values(core::WeightsSource::kComputeCopy,
                                           core::WeightsSource::kAuto));

// Workers fetching the fp32 masters: the bf16 compute copy (2 bytes per parameter) is gone from
// host memory, the masters moved from the optimizer segment into the one workers map. stale1
// keeps its two compute buffers.
TEST(Layout, WorkersFetchingMastersHoldNoComputeCopy) {
  auto cfg = SmallConfig();
  cfg.model.hidden_size = 256;
  cfg.model.intermediate_size = 512;
  cfg.model.vocab_size = 4096;
  auto spec = core::BuildModelSpec(cfg.model);
  auto plan = core::MakePlan(cfg);
  ASSERT_TRUE(plan.ok());
  cfg.schedule.weights_source = core::WeightsSource::kComputeCopy;
  auto copy = ComputeLayout(cfg, core::ResolveExecution(cfg), spec, *plan);
  cfg.schedule.weights_source = core::WeightsSource::kAuto;  // exact mode: the masters
  auto masters = ComputeLayout(cfg, core::ResolveExecution(cfg), spec, *plan);
  ASSERT_TRUE(copy.ok() && masters.ok());
  EXPECT_FALSE(copy->masters_in_state);
  EXPECT_TRUE(masters->masters_in_state);
  EXPECT_EQ(masters->weights_elem_bytes, 4);
  EXPECT_EQ(copy->weights_elem_bytes, 2);
  EXPECT_NE(copy->hash, masters->hash);
  const double params = static_cast<double>(spec.TrainableParams());
  const double saved = static_cast<double>(copy->total_bytes + copy->optim_total_bytes) -
                       static_cast<double>(masters->total_bytes + masters->optim_total_bytes);
  EXPECT_NEAR(saved / params, 2.0, 0.1);  // the bf16 copy, give or take alignment
  EXPECT_GE(masters->compute_end - masters->compute_begin,
            4 * static_cast<uint64_t>(spec.TrainableParams()));
  EXPECT_LT(masters->compute_end - masters->compute_begin,
            2 * (copy->compute_end - copy->compute_begin));

  cfg.optimizer.mode = core::OptimizerMode::kStale1;
  auto stale = ComputeLayout(cfg, core::ResolveExecution(cfg), spec, *core::MakePlan(cfg));
  ASSERT_TRUE(stale.ok());
  EXPECT_FALSE(stale->masters_in_state);
  EXPECT_EQ(stale->compute_buffers, 2);

  // A speculative update writes the next version beside the one the step reads: two buffers of
  // what workers fetch, 4 more bytes per parameter where that is the masters.
  cfg.optimizer.mode = core::OptimizerMode::kExact;
  cfg.optimizer.speculative_update = true;
  auto speculative = ComputeLayout(cfg, core::ResolveExecution(cfg), spec, *plan);
  ASSERT_TRUE(speculative.ok());
  EXPECT_TRUE(speculative->masters_in_state);
  EXPECT_EQ(speculative->compute_buffers, 2);
  EXPECT_NE(speculative->hash, masters->hash);
  const double more =
      static_cast<double>(speculative->total_bytes) - static_cast<double>(masters->total_bytes);
  EXPECT_NEAR(more / params, 4.0, 0.1);
  EXPECT_EQ(speculative->ComputeCopy(0, 1) - speculative->ComputeCopy(0, 0),
            speculative->compute_end - speculative->compute_begin);
}

TEST(SharedMemoryRoom, ARequestLargerThanDevShmIsRefusedNamingTheFix) {
  EXPECT_TRUE(CheckSharedMemoryRoom(4096, "a page").ok());
  Status s = CheckSharedMemoryRoom(1ull << 62, "a 4 EiB job");
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  for (const char* part : {"a 4 EiB job", "/dev/shm", "GiB free", "--shm-size"})
    EXPECT_NE(s.message().find(part), std::string::npos) << part << ": " << s.message();
  EXPECT_GT(AvailableHostMemory(), 0u);  // Linux reports MemAvailable
}

TEST(Layout, HashChangesWithTheConfig) {
  auto cfg = SmallConfig();
  auto spec = core::BuildModelSpec(cfg.model);
  auto h1 = ComputeLayout(cfg, core::ResolveExecution(cfg), spec, *core::MakePlan(cfg))->hash;
  cfg.schedule.forward_stages = 1;
  auto h2 = ComputeLayout(cfg, core::ResolveExecution(cfg), spec, *core::MakePlan(cfg))->hash;
  EXPECT_NE(h1, h2);
  cfg.train.grad_clip = 0.0;  // a streamed (smaller) gradient arena
  cfg.train.accum_calls = 1;
  EXPECT_NE(ComputeLayout(cfg, core::ResolveExecution(cfg), spec, *core::MakePlan(cfg))->hash, h2);
}

// Without clipping and with one call per step, only the stages in flight hold gradients.
TEST(Layout, GradientArenaStreamsOnlyWhenNothingMustBeHeld) {
  auto cfg = SmallConfig();
  cfg.model.num_layers = 8;
  cfg.schedule.backward_stages = 4;
  cfg.train.accum_calls = 1;
  cfg.train.grad_clip = 0.0;
  auto spec = core::BuildModelSpec(cfg.model);
  auto plan = core::MakePlan(cfg);
  ASSERT_TRUE(plan.ok());
  auto sizing = core::SizeGradArena(cfg, core::ResolveExecution(cfg), spec, *plan);
  ASSERT_TRUE(sizing.ok());
  EXPECT_FALSE(sizing->must_hold_all);
  EXPECT_LT(sizing->chosen, sizing->all_slots);
  EXPECT_LE(sizing->minimum, sizing->chosen);
  EXPECT_TRUE(ComputeLayout(cfg, core::ResolveExecution(cfg), spec, *plan)->grads_streamed);

  cfg.train.grad_clip = 1.0;  // the global norm needs every gradient before any update
  sizing = core::SizeGradArena(cfg, core::ResolveExecution(cfg), spec, *plan);
  ASSERT_TRUE(sizing.ok());
  EXPECT_TRUE(sizing->must_hold_all);
  EXPECT_GE(sizing->chosen, sizing->all_slots);
  cfg.optimizer.grad_buffer_mb = 1;
  auto small = core::SizeGradArena(cfg, core::ResolveExecution(cfg), spec, *plan);
  if (sizing->all_slots > (1u << 20)) {
    ASSERT_FALSE(small.ok());
    EXPECT_NE(small.status().message().find("optimizer.grad_buffer_mb"), std::string::npos);
    EXPECT_NE(small.status().message().find("train.grad_clip"), std::string::npos);
  }
}

// Every hidden-state and input-gradient slot of a layout with host activation slots.
uint64_t ActivationSlotBytes(const ArenaLayout& l) {
  return static_cast<uint64_t>(l.parities) * l.microbatches * (l.num_hidden + l.grad_slots_per_mb) *
         l.act_slot_bytes;
}

TEST(Layout, ActivationsKeptInTheWorkerTakeNoSegmentBytes) {
  auto cfg = SmallConfig();
  auto spec = core::BuildModelSpec(cfg.model);
  auto plan = core::MakePlan(cfg);
  ASSERT_TRUE(plan.ok());
  auto host = ComputeLayout(cfg, core::ResolveExecution(cfg), spec, *plan);
  cfg.schedule.activations = core::Activations::kWorker;
  auto worker = ComputeLayout(cfg, core::ResolveExecution(cfg), spec, *plan);
  ASSERT_TRUE(host.ok() && worker.ok());
  EXPECT_NE(host->activations, core::Activations::kWorker);
  EXPECT_EQ(worker->activations, core::Activations::kWorker);
  const uint64_t slots = ActivationSlotBytes(*host);
  ASSERT_GT(slots, 0u);
  EXPECT_EQ(worker->total_bytes + slots, host->total_bytes);
  EXPECT_NE(worker->hash, host->hash);  // a worker configured otherwise refuses to attach
}

// activation_transport = "cuda_ipc": the slots move out of the segment into one pool per worker,
// laid out like the segment's slots (hidden slots, then input-gradient slots), each slot inside
// the pool and no two overlapping.
TEST(Layout, ActivationPoolsHoldTheSlotsTheSegmentDropsDisjointly) {
  auto cfg = SmallConfig();
  auto spec = core::BuildModelSpec(cfg.model);
  auto plan = core::MakePlan(cfg);
  ASSERT_TRUE(plan.ok());
  auto host = ComputeLayout(cfg, core::ResolveExecution(cfg), spec, *plan);
  cfg.schedule.activations = core::Activations::kCudaIpc;
  auto pools = ComputeLayout(cfg, core::ResolveExecution(cfg), spec, *plan);
  ASSERT_TRUE(host.ok() && pools.ok());
  EXPECT_NE(host->activations, core::Activations::kCudaIpc);
  EXPECT_EQ(host->pool_bytes, 0u);
  ASSERT_EQ(pools->activations, core::Activations::kCudaIpc);
  const uint64_t slots = ActivationSlotBytes(*host);
  ASSERT_GT(slots, 0u);
  EXPECT_EQ(pools->total_bytes + slots, host->total_bytes);
  EXPECT_EQ(pools->pool_bytes, slots);
  EXPECT_NE(pools->hash, host->hash);
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  for (int p = 0; p < pools->parities; ++p)
    for (int m = 0; m < pools->microbatches; ++m) {
      for (int i = 0; i < pools->num_hidden; ++i)
        ranges.emplace_back(pools->PoolHiddenSlot(p, m, i), pools->act_slot_bytes);
      for (int i = 0; i < pools->grad_slots_per_mb; ++i)
        ranges.emplace_back(pools->PoolInputGradSlot(p, m, i), pools->act_slot_bytes);
    }
  std::sort(ranges.begin(), ranges.end());
  for (size_t k = 0; k < ranges.size(); ++k) {
    EXPECT_LE(ranges[k].first + ranges[k].second, pools->pool_bytes) << k;
    if (k > 0) {
      EXPECT_GE(ranges[k].first, ranges[k - 1].first + ranges[k - 1].second) << k;
    }
  }
  EXPECT_EQ(ranges.size() * pools->act_slot_bytes, pools->pool_bytes);  // and nothing between them
}

TEST(Segment, CreateStampedIsWhatOpenAccepts) {
  const std::string name = TempShmName();
  Unlinker unlink(name);
  auto seg = Segment::CreateStamped(name, kHeaderBytes + 4096, 77);
  ASSERT_TRUE(seg.ok()) << seg.status().ToString();
  auto same = Segment::Open(name, 77);
  ASSERT_TRUE(same.ok()) << same.status().ToString();
  EXPECT_EQ(same->size(), kHeaderBytes + 4096);
  auto other_run = Segment::Open(name, 78);
  ASSERT_FALSE(other_run.ok());
  EXPECT_NE(other_run.status().message().find("layout hash"), std::string::npos);
  EXPECT_FALSE(Segment::CreateStamped(TempShmName(), 16, 77).ok());  // no room for the header
}

TEST(Segment, CreateOpenValidateAndUnlink) {
  const std::string name = TempShmName();
  {
    Unlinker unlink(name);
    auto seg = Segment::Create(name, 1 << 16);
    ASSERT_TRUE(seg.ok()) << seg.status().ToString();
    EXPECT_TRUE(InDevShm(name));
    auto mode = std::filesystem::status("/dev/shm/" + name).permissions();
    EXPECT_EQ(mode & std::filesystem::perms::all,
              std::filesystem::perms::owner_read | std::filesystem::perms::owner_write);
    // Second create of the same name fails instead of sharing a stale segment.
    EXPECT_FALSE(Segment::Create(name, 1 << 16).ok());
    // An uninitialized header is rejected.
    auto bad = Segment::Open(name, 42);
    ASSERT_FALSE(bad.ok());
    EXPECT_NE(bad.status().message().find("bad magic"), std::string::npos);
    SegmentHeader* h = seg->header();
    h->magic = kSegmentMagic;
    h->version = kSegmentVersion;
    h->layout_hash = 42;
    h->total_bytes = seg->size();
    EXPECT_TRUE(Segment::Open(name, 42).ok());
    auto wrong = Segment::Open(name, 43);
    ASSERT_FALSE(wrong.ok());
    EXPECT_NE(wrong.status().message().find("layout hash"), std::string::npos);
    h->version = 99;
    EXPECT_FALSE(Segment::Open(name, 42).ok());
    // Writes through one mapping are visible through another.
    h->version = kSegmentVersion;
    auto other = Segment::Open(name, 42);
    ASSERT_TRUE(other.ok());
    seg->At<int>(8192)[0] = 1234;
    EXPECT_EQ(other->At<int>(8192)[0], 1234);
  }
  EXPECT_FALSE(InDevShm(name));
  EXPECT_FALSE(Segment::Open(name, 42).ok());
}

}  // namespace
}  // namespace rp::shm
