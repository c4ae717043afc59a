// SPDX-License-Identifier: Apache-2.0
#include "optim/grad_arena.h"

#include <gtest/gtest.h>

#include <random>

namespace rp::coord {
namespace {

shm::ArenaLayout ArenaOf(std::vector<uint64_t> slot_bytes, uint64_t arena_bytes) {
  shm::ArenaLayout a;
  a.grad_slot_bytes = std::move(slot_bytes);
  a.grad_arena = 1 << 20;
  a.grad_arena_bytes = arena_bytes;
  uint64_t all = 0;
  for (uint64_t b : a.grad_slot_bytes) all += b;
  a.grads_streamed = arena_bytes < all;  // as shm::ComputeLayout sets it
  return a;
}

TEST(GradArena, PlacesAllOrNothingAndPublishesOffsets) {
  auto a = ArenaOf({1024, 512, 2048}, 3072);
  std::vector<std::atomic<uint64_t>> table(3);
  GradArena arena(a, table.data());
  ASSERT_TRUE(arena.Place({0, 1}));
  EXPECT_EQ(table[0].load(), a.grad_arena);  // first fit from the start
  EXPECT_EQ(table[1].load(), a.grad_arena + 1024);
  EXPECT_FALSE(arena.Place({2}));  // 1536 bytes left
  EXPECT_FALSE(arena.IsPlaced(2));
  arena.Release(0);
  EXPECT_FALSE(arena.Place({2}));  // free space is split: 1024 + 1536 around slot 1
  arena.Release(1);
  ASSERT_TRUE(arena.Place({2}));  // coalesced back to one range
  EXPECT_EQ(table[2].load(), a.grad_arena);
  EXPECT_EQ(arena.PeakBytes(), 2048u);
}

TEST(GradArena, FailedPlacementLeavesNothingBehind) {
  auto a = ArenaOf({1024, 1024, 4096}, 4096);
  std::vector<std::atomic<uint64_t>> table(3);
  GradArena arena(a, table.data());
  EXPECT_FALSE(arena.Place({0, 1, 2}));
  EXPECT_FALSE(arena.IsPlaced(0));
  EXPECT_FALSE(arena.IsPlaced(1));
  ASSERT_TRUE(arena.Place({2}));
}

// An arena that holds every slot at once gives each slot one fixed range: any order of places
// and releases succeeds (a slot not placed can always be placed), and a slot always lands where
// it did the first time.
TEST(GradArena, RoomForEverySlotMeansFixedRangesInAnyOrder) {
  std::mt19937_64 rng(9);
  std::vector<uint64_t> sizes;
  for (int s = 0; s < 10; ++s) sizes.push_back(256 * (1 + rng() % 16));
  uint64_t all = 0;
  for (uint64_t b : sizes) all += b;
  auto a = ArenaOf(sizes, all);
  std::vector<std::atomic<uint64_t>> table(sizes.size());
  GradArena arena(a, table.data());
  uint64_t expect = a.grad_arena;
  std::vector<uint64_t> fixed;
  for (uint64_t b : sizes) {
    fixed.push_back(expect);
    expect += b;
  }
  for (int op = 0; op < 500; ++op) {
    const int slot = static_cast<int>(rng() % sizes.size());
    if (arena.IsPlaced(slot)) {
      arena.Release(slot);
    } else {
      ASSERT_TRUE(arena.Place({slot})) << op;
      EXPECT_EQ(table[slot].load(), fixed[slot]);
      EXPECT_EQ(arena.Offset(slot), fixed[slot]);
    }
  }
  EXPECT_LE(arena.PeakBytes(), all);
}

// Random place/release sequences: placed ranges never overlap, stay inside the arena, and once
// everything is released the whole arena is one free range again.
TEST(GradArena, RandomSequencesNeverOverlap) {
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 50; ++trial) {
    std::vector<uint64_t> sizes;
    for (int s = 0; s < 12; ++s) sizes.push_back(256 * (1 + rng() % 16));
    auto a = ArenaOf(sizes, 256 * 40);
    std::vector<std::atomic<uint64_t>> table(sizes.size());
    GradArena arena(a, table.data());
    for (int op = 0; op < 200; ++op) {
      const int slot = static_cast<int>(rng() % sizes.size());
      if (arena.IsPlaced(slot)) {
        arena.Release(slot);
      } else if (arena.Place({slot})) {
        EXPECT_TRUE(a.GradSlotInArena(arena.Offset(slot), sizes[slot]));
      }
      for (size_t x = 0; x < sizes.size(); ++x)
        for (size_t y = x + 1; y < sizes.size(); ++y) {
          if (!arena.IsPlaced(static_cast<int>(x)) || !arena.IsPlaced(static_cast<int>(y)))
            continue;
          const uint64_t ox = arena.Offset(static_cast<int>(x)),
                         oy = arena.Offset(static_cast<int>(y));
          EXPECT_TRUE(ox + sizes[x] <= oy || oy + sizes[y] <= ox) << "slots " << x << " and " << y;
        }
    }
    for (size_t s = 0; s < sizes.size(); ++s)
      if (arena.IsPlaced(static_cast<int>(s))) arena.Release(static_cast<int>(s));
    std::vector<int> all;
    uint64_t sum = 0;
    for (size_t s = 0; s < sizes.size() && sum + sizes[s] <= a.grad_arena_bytes; ++s) {
      all.push_back(static_cast<int>(s));
      sum += sizes[s];
    }
    EXPECT_TRUE(arena.Place(all)) << "free ranges did not coalesce";
  }
}

}  // namespace
}  // namespace rp::coord
