// SPDX-License-Identifier: Apache-2.0
// Pins LibTorch to one intra-op thread in the unit-test process: CI has 2 cores, and tests that
// compare floating-point results must not depend on how many threads split a reduction.
#include <ATen/Parallel.h>

namespace {
const bool kPinnedToOneThread = [] {
  at::set_num_threads(1);
  return true;
}();
}  // namespace
