// SPDX-License-Identifier: Apache-2.0
// Deterministic, torch-free random numbers keyed by coordinates.
//
// Why: every random draw (init, data order) must be reproducible from (seed, step, microbatch,
// layer, ...) alone, independent of which process or thread makes it, so that the pipelined run
// and rp-train-ref agree exactly. A counter-based generator (SplitMix64 over a hashed key) gives
// that without shared generator state.
#pragma once

#include <cmath>
#include <cstdint>
#include <initializer_list>

namespace rp {

inline uint64_t SplitMix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

inline uint64_t HashKey(std::initializer_list<uint64_t> parts) {
  uint64_t h = 0x243F6A8885A308D3ull;
  for (uint64_t p : parts) h = SplitMix64(h ^ SplitMix64(p));
  return h;
}

// Stream of draws for one key; draw i is a pure function of (key, i).
class CounterRng {
 public:
  explicit CounterRng(uint64_t key, uint64_t start = 0) : key_(key), i_(start) {}
  uint64_t NextU64() { return SplitMix64(key_ ^ SplitMix64(i_++)); }
  // Uniform in (0, 1): never exactly 0.
  double NextUniform() { return (static_cast<double>(NextU64() >> 11) + 0.5) * 0x1.0p-53; }
  // Two independent standard normals from one draw, by Box-Muller in float: two 24-bit uniforms
  // in (0, 1), so log() is finite and |value| < 5.9. Seeding a large model's weights is most of its
  // start-up: one double-precision draw per value took about 60 ns on one core of a 2-core CI-class
  // machine, this about 18 ns per value.
  void NextNormalPair(float* first, float* second) {
    const uint64_t bits = NextU64();
    const float u1 = (static_cast<float>(bits >> 40) + 0.5f) * 0x1.0p-24f;
    const float u2 = (static_cast<float>((bits >> 16) & 0xFFFFFFu) + 0.5f) * 0x1.0p-24f;
    const float radius = std::sqrt(-2.0f * std::log(u1));
    const float angle = 6.28318531f * u2;
    *first = radius * std::cos(angle);
    *second = radius * std::sin(angle);
  }
  uint64_t NextBelow(uint64_t n) { return NextU64() % n; }

 private:
  uint64_t key_;
  uint64_t i_;
};

}  // namespace rp
