// SPDX-License-Identifier: Apache-2.0
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>

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
  c.train.dtype = "bf16";
  return c;
}

TEST(Layout, ArraysAreAlignedDisjointAndInside) {
  auto cfg = SmallConfig();
  auto spec = core::BuildModelSpec(cfg.model);
  auto plan = core::MakePlan(cfg);
  ASSERT_TRUE(plan.ok());
  ArenaLayout a = ComputeLayout(cfg, spec, *plan);
  struct Range { uint64_t begin, end; std::string what; };
  std::vector<Range> ranges;
  for (size_t p = 0; p < spec.params.size(); ++p) {
    const uint64_t n = spec.params[p].numel;
    ranges.push_back({a.compute[p], a.compute[p] + n * 2, "compute " + spec.params[p].name});
    ranges.push_back({a.master[p], a.master[p] + n * 4, "master"});
    ranges.push_back({a.adam_m[p], a.adam_m[p] + n * 4, "m"});
    ranges.push_back({a.adam_v[p], a.adam_v[p] + n * 4, "v"});
    EXPECT_EQ(a.compute[p] % 256, 0u);
    EXPECT_EQ(a.master[p] % 256, 0u);
  }
  for (size_t g = 0; g < spec.grad_slots.size(); ++g)
    ranges.push_back({a.grad[g], a.grad[g] + spec.params[spec.grad_slots[g].param].numel * 4, "grad"});
  for (int par = 0; par < 2; ++par)
    for (int mb = 0; mb < a.microbatches; ++mb) {
      ranges.push_back({a.TokenSlot(par, mb), a.TokenSlot(par, mb) + a.tokens_per_mb * 8, "tokens"});
      ranges.push_back({a.LabelSlot(par, mb), a.LabelSlot(par, mb) + a.tokens_per_mb * 8, "labels"});
      for (int h = 0; h < a.num_hidden; ++h) {
        EXPECT_EQ(a.HiddenSlot(par, mb, h) % kArenaAlign, 0u);
        ranges.push_back({a.HiddenSlot(par, mb, h), a.HiddenSlot(par, mb, h) + a.act_elems * 2, "hidden"});
      }
      for (int h = 0; h < a.num_grad; ++h)
        ranges.push_back({a.InputGradSlot(par, mb, h), a.InputGradSlot(par, mb, h) + a.act_elems * 2, "igrad"});
    }
  std::sort(ranges.begin(), ranges.end(), [](auto& x, auto& y) { return x.begin < y.begin; });
  EXPECT_GE(ranges.front().begin, kHeaderBytes);
  for (size_t i = 1; i < ranges.size(); ++i)
    EXPECT_LE(ranges[i - 1].end, ranges[i].begin) << ranges[i - 1].what << " overlaps " << ranges[i].what;
  EXPECT_LE(ranges.back().end, a.total_bytes);
  // Tied embeddings: the head's use of the embedding has its own gradient slot.
  EXPECT_EQ(spec.grad_slots.size(), spec.params.size() + 1);
}

TEST(Layout, HashChangesWithTheConfig) {
  auto cfg = SmallConfig();
  auto spec = core::BuildModelSpec(cfg.model);
  auto h1 = ComputeLayout(cfg, spec, *core::MakePlan(cfg)).hash;
  cfg.schedule.forward_stages = 1;
  auto h2 = ComputeLayout(cfg, spec, *core::MakePlan(cfg)).hash;
  EXPECT_NE(h1, h2);
}

TEST(Segment, CreateOpenValidateAndUnlink) {
  const std::string name = TempShmName();
  {
    Unlinker unlink(name);
    auto seg = Segment::Create(name, 1 << 16);
    ASSERT_TRUE(seg.ok()) << seg.status().ToString();
    EXPECT_TRUE(InDevShm(name));
    auto mode = std::filesystem::status("/dev/shm/" + name).permissions();
    EXPECT_EQ(mode & std::filesystem::perms::all, std::filesystem::perms::owner_read | std::filesystem::perms::owner_write);
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
