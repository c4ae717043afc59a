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
  // Uniform in (0, 1): never exactly 0, so log() in Normal() is finite.
  double NextUniform() { return (static_cast<double>(NextU64() >> 11) + 0.5) * 0x1.0p-53; }
  // Standard normal by Box-Muller (one value per two uniforms; simple beats fast here).
  double NextNormal() {
    double u1 = NextUniform(), u2 = NextUniform();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }
  uint64_t NextBelow(uint64_t n) { return NextU64() % n; }

 private:
  uint64_t key_;
  uint64_t i_;
};

}  // namespace rp
