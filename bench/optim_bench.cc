// SPDX-License-Identifier: Apache-2.0
// rp-optim-bench: throughput of the coordinator's AdamW against a memory-copy baseline with the
// same thread count and against torch::optim::AdamW on the same tensors, measured in one run.
//   rp-optim-bench [--params N] [--threads T] [--reps R]
// Prints one JSON line. Bytes per parameter and update: master, m, v, gradient read (16);
// master, m, v and the bf16 compute copy written (14) = 30. Also exact mode's two passes over
// the masters (seconds per 10^9 parameters) at a few software prefetch distances.
#include <torch/optim/adamw.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/version.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>

#include "optim/adamw.h"
#include "optim/optimizer_step.h"

namespace {
// Fastest of `reps` timed runs after a warm-up (first touch of the pages): on a shared machine
// the minimum is the figure least disturbed by neighbours, for every contender alike.
double Seconds(const std::function<void()>& f, int reps) {
  f();
  double best = 1e300;
  for (int r = 0; r < reps; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    f();
    best = std::min(best,
                    std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}
}  // namespace

int main(int argc, char** argv) {
  int64_t n = 64 << 20;
  int threads = static_cast<int>(std::thread::hardware_concurrency());
  int reps = 5;
  CLI::App app{"AdamW throughput vs memcpy and torch AdamW"};
  app.add_option("--params", n, "parameters");
  app.add_option("--threads", threads, "threads");
  app.add_option("--reps", reps, "timed repetitions");
  CLI11_PARSE(app, argc, argv);

  std::vector<float> grad(n, 1e-3f), master(n, 0.5f), m(n, 0.f), v(n, 0.f);
  std::vector<uint16_t> bf16(n);
  const int64_t chunks = (n + rp::coord::kOptimizerChunk - 1) / rp::coord::kOptimizerChunk;
  rp::coord::AdamWHyper h{1e-4, 0.9, 0.95, 1e-8, 0.1, 1};
  auto time_path = [&](rp::coord::SimdLevel level) {
    return Seconds(
        [&] {
          rp::coord::ParallelFor(chunks, threads, [&](int64_t c) {
            const int64_t b = c * rp::coord::kOptimizerChunk,
                          e = std::min(n, b + rp::coord::kOptimizerChunk);
            rp::coord::AdamWUpdateWith(level, h, 1.0f, grad.data() + b, master.data() + b,
                                       m.data() + b, v.data() + b, e - b, bf16.data() + b,
                                       rp::coord::ComputeDtype::kBFloat16);
          });
        },
        reps);
  };
  // Every implementation this CPU has; the headline figure is the one the runtime picks.
  std::string by_path;
  for (auto level : {rp::coord::SimdLevel::kScalar, rp::coord::SimdLevel::kAvx2,
                     rp::coord::SimdLevel::kAvx512}) {
    if (static_cast<int>(level) > static_cast<int>(rp::coord::BestSimdLevel())) continue;
    const double s = time_path(level);
    by_path += std::string(by_path.empty() ? "" : ", ") + "\"" + rp::coord::SimdLevelName(level) +
               "\": " + std::to_string(30.0 * static_cast<double>(n) / s / 1e9);
  }
  const double adamw_s = time_path(rp::coord::BestSimdLevel());

  // Exact mode's layout (workers fetch the fp32 master, no copy) and its two passes
  // (UpdateWrites): seconds per 10^9 parameters for one whole update and for each pass, at
  // several software prefetch distances (elements).
  std::string passes;
  for (int64_t pf : {0, 512, 2048}) {
    rp::coord::SetAdamWPrefetchDistance(pf);
    std::string row;
    for (auto [name, writes] : {std::pair{"all", rp::coord::UpdateWrites::kAll},
                                std::pair{"fetched", rp::coord::UpdateWrites::kFetched},
                                std::pair{"rest", rp::coord::UpdateWrites::kRest}}) {
      const double s = Seconds(
          [&] {
            rp::coord::ParallelFor(chunks, threads, [&](int64_t c) {
              const int64_t b = c * rp::coord::kOptimizerChunk,
                            e = std::min(n, b + rp::coord::kOptimizerChunk);
              rp::coord::AdamWUpdate(h, 1.0f, grad.data() + b, master.data() + b, m.data() + b,
                                     v.data() + b, e - b, master.data() + b,
                                     rp::coord::ComputeDtype::kFloat32, writes);
            });
          },
          reps);
      row += std::string(row.empty() ? "" : ", ") + "\"" + name +
             "\": " + std::to_string(s * 1e9 / static_cast<double>(n));
    }
    passes +=
        std::string(passes.empty() ? "" : ", ") + "\"" + std::to_string(pf) + "\": {" + row + "}";
  }
  rp::coord::SetAdamWPrefetchDistance(0);

  // Baseline: the same 30 bytes per parameter moved by memcpy (15 read + 15 written), same threads.
  const int64_t copy_bytes = n * 15;
  std::vector<char> src(copy_bytes, 1), dst(copy_bytes, 0);
  const int64_t copy_chunks = (copy_bytes + (16 << 20) - 1) / (16 << 20);
  const double copy_s = Seconds(
      [&] {
        rp::coord::ParallelFor(copy_chunks, threads, [&](int64_t c) {
          const int64_t b = c * (16 << 20), e = std::min(copy_bytes, b + (16 << 20));
          std::memcpy(dst.data() + b, src.data() + b, e - b);
        });
      },
      reps);

  at::set_num_threads(threads);
  at::Tensor p = at::full({n}, 0.5f).set_requires_grad(true);
  p.mutable_grad() = at::full({n}, 1e-3f);
  torch::optim::AdamW opt({p},
                          torch::optim::AdamWOptions(1e-4).betas({0.9, 0.95}).weight_decay(0.1));
  const double torch_s = Seconds([&] { opt.step(); }, reps);

  const double bytes = 30.0 * static_cast<double>(n);
  std::printf(
      "{\"params\": %lld, \"threads\": %d, \"adamw_s\": %.4f, \"adamw_params_per_s\": %.4g, "
      "\"adamw_gb_per_s\": %.2f, "
      "\"memcpy_gb_per_s\": %.2f, \"adamw_vs_memcpy\": %.3f, \"torch_adamw_s\": %.4f, "
      "\"adamw_speedup_vs_torch\": %.2f, \"torch_version\": \"%d.%d\", \"simd\": \"%s\", "
      "\"adamw_gb_per_s_by_path\": {%s}, \"master_layout_s_per_1e9_params_by_prefetch\": {%s}}\n",
      static_cast<long long>(n), threads, adamw_s, static_cast<double>(n) / adamw_s,
      bytes / adamw_s / 1e9, 2.0 * static_cast<double>(copy_bytes) / copy_s / 1e9, copy_s / adamw_s,
      torch_s, torch_s / adamw_s, TORCH_VERSION_MAJOR, TORCH_VERSION_MINOR,
      rp::coord::SimdLevelName(rp::coord::BestSimdLevel()), by_path.c_str(), passes.c_str());
  return 0;
}
