// SPDX-License-Identifier: Apache-2.0
// rp-node-bench [--nodes N] [--port P] [--iters K]: times the workers' cross-node sum
// (nodes::NodeReduction, c10d's ProcessGroupGloo) on this machine, N ranks as threads over
// loopback, for sums from 256 bytes to 64 MiB. Prints one JSON line per size: median seconds and
// the ring's bytes per second each way (2 (N - 1) / N of the sum's bytes over its time). The
// small sizes give the per-hop cost the planner assumes (planning/simulator.cc), the large ones
// the loopback bandwidth.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/exit_codes.h"
#include "nodes/node_reduction.h"
#include "nodes/node_store.h"

int main(int argc, char** argv) {
  int nodes = 2, port = 29590, iters = 20;
  CLI::App app{"Time the workers' cross-node gradient sum over loopback"};
  app.add_option("--nodes", nodes, "ranks (threads) in the sum")->check(CLI::Range(2, 16));
  app.add_option("--port", port, "node store port")->check(CLI::Range(1, 65535));
  app.add_option("--iters", iters, "timed sums per size (after one warm-up)")
      ->check(CLI::Range(1, 1000));
  CLI11_PARSE(app, argc, argv);
  at::set_num_threads(1);
  // The sums are timed as runs do them: over the sealed store (its cost is the join's only).
  const std::string secret = "rp-node-bench";
  auto store = rp::nodes::NodeStore::Host("127.0.0.1", port, 60.0, rp::nodes::StoreSeal(secret));
  if (!store.ok()) {
    std::fprintf(stderr, "rp-node-bench: %s\n", store.status().message().c_str());
    return rp::kExitError;
  }
  const std::vector<int64_t> sizes = {256, 4096, 65536, 1 << 20, 16 << 20, 64 << 20};
  std::vector<std::vector<double>> times(sizes.size());  // rank 0's
  std::vector<std::thread> ranks;
  std::vector<std::string> errors(nodes);
  for (int r = 0; r < nodes; ++r)
    ranks.emplace_back([&, r] {
      auto group = rp::nodes::NodeReduction::Join({nodes, r, "127.0.0.1", port, 60.0, secret}, 0);
      if (!group.ok()) {
        errors[r] = group.status().message();
        return;
      }
      for (size_t s = 0; s < sizes.size(); ++s) {
        at::Tensor flat = at::ones({sizes[s] / 4}, at::kFloat);
        for (int i = 0; i <= iters; ++i) {
          const auto t0 = std::chrono::steady_clock::now();
          if (auto st = (*group)->Start(flat, at::Tensor()); !st.ok()) {
            errors[r] = st.message();
            return;
          }
          for (;;) {
            auto done = (*group)->Poll();
            if (!done.ok()) {
              errors[r] = done.status().message();
              return;
            }
            if (*done) break;
            std::this_thread::sleep_for(std::chrono::microseconds(20));  // as a worker's loop polls
          }
          if (r == 0 && i > 0)
            times[s].push_back(
                std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
        }
      }
    });
  for (auto& t : ranks) t.join();
  for (const auto& e : errors)
    if (!e.empty()) {
      std::fprintf(stderr, "rp-node-bench: %s\n", e.c_str());
      return rp::kExitError;
    }
  for (size_t s = 0; s < sizes.size(); ++s) {
    auto& v = times[s];
    std::sort(v.begin(), v.end());
    const double median = v[v.size() / 2];
    const double ring = 2.0 * (nodes - 1) / nodes * static_cast<double>(sizes[s]);
    std::printf("%s\n", nlohmann::json{{"nodes", nodes},
                                       {"bytes", sizes[s]},
                                       {"seconds_median", median},
                                       {"ring_bytes_per_s", ring / median}}
                            .dump()
                            .c_str());
  }
  return 0;
}
