// SPDX-License-Identifier: Apache-2.0
#include "common/parallel.h"

#include <algorithm>
#include <atomic>
#include <thread>
#include <vector>

namespace rp {

void ParallelFor(int64_t n, int threads, const std::function<void(int64_t)>& fn) {
  if (threads <= 1 || n <= 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  std::atomic<int64_t> next{0};
  auto body = [&] {
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) fn(i);
  };
  std::vector<std::thread> pool;
  const int t = static_cast<int>(std::min<int64_t>(threads, n));
  for (int i = 1; i < t; ++i) pool.emplace_back(body);
  body();
  for (auto& th : pool) th.join();
}

}  // namespace rp
